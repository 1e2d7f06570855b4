"""What the post-training stages show: a progress bar per stage, and plots of reward, accuracy and mean reasoning
length per effort level b (during RL, per step; at evaluation, against b with the bootstrap intervals)."""

from __future__ import annotations

from pathlib import Path


class Progress:
    """A tqdm bar over a stage's steps (`quiet` turns it off); `note` prints a line above it."""

    def __init__(self, stage: str, total: int, initial: int = 0, quiet: bool = False):
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, desc=stage, unit="step", dynamic_ncols=True, disable=quiet,
                        mininterval=1.0)

    def update(self, postfix: str) -> None:
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(1)

    def note(self, line: str) -> None:
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rl(history: list[dict], path: str | Path, title: str = "RL with controllable effort") -> Path:
    """Reward, accuracy and mean reasoning length of the sampled rollouts per level b against the RL step (a
    5-step moving mean over the raw per-step values)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    per = [(h["step"], {int(b): v for b, v in h["levels"].items()}) for h in history]   # JSON keys are strings
    levels = sorted({b for _, lv in per for b in lv})
    for key, ax in zip(("reward", "accuracy", "length"), axes):
        for b in levels:
            pts = [(step, lv[b][key]) for step, lv in per if b in lv]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            sm = [sum(ys[max(0, i - 4):i + 1]) / len(ys[max(0, i - 4):i + 1]) for i in range(len(ys))]
            ax.plot(xs, sm, lw=1.5, label=f"b={b}")
        ax.set(xlabel="RL step", ylabel="mean reasoning tokens" if key == "length" else key, title=key)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_eval(report: dict, path: str | Path) -> Path:
    """Held-out accuracy and mean reasoning length (95% bootstrap intervals) against b, for the checkpoint and,
    when the report has one, its baseline."""
    plt = _pyplot()
    fig, (ax_a, ax_l) = plt.subplots(1, 2, figsize=(10, 3.8))
    runs = [("checkpoint", report)] + ([("baseline", report["baseline"])] if "baseline" in report else [])
    for label, r in runs:
        lv = sorted(r["levels"], key=float)
        bs = [float(b) for b in lv]
        name = f"{label}: {Path(r.get('checkpoint', '')).name}"
        ax_a.plot(bs, [r["levels"][b]["accuracy"] for b in lv], "o-", label=name)
        mean = [r["levels"][b]["mean_length"] for b in lv]
        lo = [m - r["levels"][b]["length_ci95"][0] for m, b in zip(mean, lv)]
        hi = [r["levels"][b]["length_ci95"][1] - m for m, b in zip(mean, lv)]
        ax_l.errorbar(bs, mean, yerr=[lo, hi], fmt="o-", capsize=3, label=name)
    ax_a.set(xlabel="effort b", ylabel="greedy accuracy (held out)", title="accuracy")
    ax_l.set(xlabel="effort b", ylabel="mean reasoning tokens", title="reasoning length (95% bootstrap)")
    for ax in (ax_a, ax_l):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_dspark(result: dict, history: list[dict], path: str | Path) -> Path:
    """The drafter stage: held-out acceptance per draft position before and after (all levels), and the training
    match rate of the drafter's greedy drafts against the backbone's per step."""
    plt = _pyplot()
    fig, (ax_a, ax_m) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, key in (("before", "acceptance_before"), ("after", "acceptance_after")):
        acc = result[key]["all"]["acceptance"]
        ax_a.plot(range(1, len(acc) + 1), acc, "o-",
                  label=f"{label} ({result[key]['all']['tokens_per_step']:.3f} tokens/step)")
    ax_a.set(xlabel="draft position i", ylabel="conditional acceptance a_i", title="held-out greedy responses")
    if history:
        ax_m.plot([h["step"] for h in history], [h["draft_match"] for h in history], lw=1.5)
    ax_m.set(xlabel="drafter step", ylabel="draft = target argmax", title="training minibatches")
    for ax in (ax_a, ax_m):
        ax.grid(alpha=0.3)
    ax_a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
