"""What a training run shows: a line per evaluation, and at its end the loss curve (`loss_curve.png`) and the
summary text."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: Path, title: str) -> Path:
    """Training loss per step (raw and a debiased EMA) and the validation metric against tokens seen."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h for h in history if "loss" in h]
    evals = [h for h in history if "val_loss" in h or "val_draft_ce" in h]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if steps:
        x = [h["tokens"] for h in steps]
        y = [h["loss"] for h in steps]
        ax.plot(x, y, lw=0.8, alpha=0.45, label="train loss (step)")
        ema, sm = 0.0, []
        for i, v in enumerate(y, start=1):
            ema = 0.9 * ema + 0.1 * v
            sm.append(ema / (1 - 0.9 ** i))                   # bias-corrected: no lag from the first value
        ax.plot(x, sm, lw=1.6, label="train loss (EMA 0.9, debiased)")
    if evals:
        key = "val_loss" if "val_loss" in evals[0] else "val_draft_ce"
        ax.plot([h["tokens"] for h in evals], [h[key] for h in evals], "o-", lw=1.4, label=key.replace("_", " "))
    ax.set(xlabel="tokens", ylabel="nats / token", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_eval(step: int, ev: dict) -> str:
    """One line for the progress bar: a pretraining evaluation (val_loss) or a drafter one."""
    if "val_loss" in ev:
        return f"step {step}: val loss {ev['val_loss']:.4f}, {ev['val_bpb']:.4f} bits/byte"
    acc = ", ".join(f"{a:.2f}" for a in ev["val_acceptance"])
    return (f"step {step}: drafter val CE {ev['val_draft_ce']:.4f}, acceptance [{acc}], "
            f"{ev['val_tokens_per_step']:.2f} tokens/step")


def format_summary(s: dict) -> str:
    lines = [f"done: {s['steps']} steps, {s['tokens']:,} tokens in {s['wall_s'] / 60:.1f} min"
             + (f", {s['tok_per_s']:.0f} tokens/s while training" if s.get("tok_per_s") else "")]
    if "val_loss" in s:
        lines.append(f"validation: loss {s['val_loss']:.4f} nats/token, {s['val_bpb']:.4f} bits/byte"
                     + (f"; with FP8/FP4 QDQ on: loss {s['val_loss_qdq']:.4f}" if "val_loss_qdq" in s else ""))
    for key, what in (("val", "teacher-forced validation"), ("greedy", "greedy self-generated")):
        if f"{key}_acceptance" in s:
            rates = ", ".join(f"{a:.3f}" for a in s[f"{key}_acceptance"])
            lines.append(f"drafter ({what}): acceptance per position {rates}; "
                         f"{s[f'{key}_tokens_per_step']:.2f} tokens per verification step")
    lines.append(f"loss curve: {s['loss_curve']}; checkpoint: {s['out']}")
    if "sample" in s:
        lines.append("sample (greedy):\n" + s["sample_prompt"] + s["sample"])
    return "\n".join(lines)
