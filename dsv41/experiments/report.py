"""What every study writes under runs/experiments/NAME/: report.json (everything measured), report.md (the command,
the definitions and a markdown table) and plot.png."""

from __future__ import annotations

import json
from pathlib import Path


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]) + "\n"


def write_report(out: str | Path, title: str, command: str, notes: str, table: str, data: dict, plot=None) -> Path:
    """Writes the three files; plot(ax) draws the figure (optional). Returns the directory."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"title": title, "command": command, **data}, indent=2) + "\n")
    md = f"# {title}\n\n`{command}`\n\n{notes.strip()}\n\n{table}"
    if plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        plot(ax)
        fig.tight_layout()
        fig.savefig(out / "plot.png", dpi=110)
        plt.close(fig)
        md += "\n![plot](plot.png)\n"
    (out / "report.md").write_text(md)
    return out
