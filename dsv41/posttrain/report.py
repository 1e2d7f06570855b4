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
    from dsv41.posttrain.rl import band_means, level_bands
    per = [(h["step"], {int(b): v for b, v in h["levels"].items()}) for h in history]   # JSON keys are strings
    bands = level_bands({b for _, lv in per for b in lv})     # each level, or bands of b over a dense grid
    for key, ax in zip(("reward", "accuracy", "length"), axes):
        for band in bands:
            pts = [(step, m) for step, lv in per for bb, m in band_means(lv, [band], key)]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            sm = [sum(ys[max(0, i - 4):i + 1]) / len(ys[max(0, i - 4):i + 1]) for i in range(len(ys))]
            ax.plot(xs, sm, lw=1.5, label=f"b={band[0]}" if band[0] == band[1] else f"b={band[0]}-{band[1]}")
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


def adjacent_levels(report: dict) -> list[dict]:
    """Adjacent effort levels of an eval report (sorted by b): the two mean reasoning lengths, whether the mean
    increases, and whether their 95% bootstrap intervals are apart (the upper level's interval entirely above the
    lower one's)."""
    lv = sorted(report["levels"], key=float)
    out = []
    for a, b in zip(lv, lv[1:]):
        la, lb = report["levels"][a], report["levels"][b]
        out.append({"from": float(a), "to": float(b), "mean_from": la["mean_length"], "mean_to": lb["mean_length"],
                    "increasing": lb["mean_length"] > la["mean_length"],
                    "ci_apart": lb["length_ci95"][0] > la["length_ci95"][1]})
    return out


def equal_tokens(rl_history: list[dict], opd_history: list[dict], tail: int = 5) -> dict:
    """Distillation vs RL at an equal number of student-sampled tokens: OPD's total, the RL step at which RL had
    sampled as many, and each run's sampled (T = 1, training prompts, not held out) accuracy over its last `tail`
    steps up to that count. RL's accuracy mixes the effort levels its steps drew; OPD's likewise."""
    n = sum(h["sampled_tokens"] for h in opd_history)
    cum, upto = 0, []
    for h in rl_history:
        if cum >= n:
            break
        cum += h["sampled_tokens"]
        upto.append(h)

    def acc(h):
        if "accuracy" in h:
            return h["accuracy"]
        lv = h["levels"].values()
        return sum(v["accuracy"] for v in lv) / len(lv)
    mean = lambda hs: sum(acc(h) for h in hs) / len(hs) if hs else None   # noqa: E731
    return {"opd_tokens": n, "opd_steps": len(opd_history), "rl_steps_to_equal_tokens": len(upto),
            "rl_tokens": cum, "rl_reached": cum >= n,
            "opd_sampled_accuracy_tail": mean(opd_history[-tail:]), "rl_sampled_accuracy_tail": mean(upto[-tail:]),
            "opd_sampled_accuracy_first": mean(opd_history[:tail]), "rl_sampled_accuracy_first": mean(upto[:tail])}


def _read(path: Path):
    import json
    return json.loads(path.read_text()) if path.is_file() else None


def closing(runs: str | Path, occupancy_runs: dict[str, str | Path] | None = None) -> dict:
    """The closing numbers of a post-training run directory (runs/post-{sft,rl,opd,dspark}): the held-out eval
    reports (each checkpoint's eval.json; paired against its baseline), length vs b per level (adjacent levels'
    intervals), the per-difficulty fit, OPD's student as % of teacher (opd.json), distillation vs RL at equal
    sampled tokens, the dispatcher's slot occupancy (each RL run's posttrain.json; occupancy_runs: granularity ->
    directory of extra runs) and DSpark's acceptance per draft position (dspark.json)."""
    runs = Path(runs)
    out: dict = {"runs": str(runs), "stages": {}}
    for st in ("sft", "rl", "opd", "dspark"):
        meta = _read(runs / f"post-{st}" / "posttrain.json")
        if meta:
            hist = meta.get("history", [])
            out["stages"][st] = {"steps": meta.get("step"),
                                 "elapsed_s": hist[-1].get("elapsed") if hist and "elapsed" in hist[-1] else None,
                                 "sampled_tokens": sum(h.get("sampled_tokens", 0) for h in hist) or None}
    out["eval"] = {}
    for st in ("sft", "rl", "opd"):
        rep = _read(runs / f"post-{st}" / "eval.json")
        if rep:
            e = {"levels": {b: {k: v[k] for k in ("accuracy", "mean_length", "length_ci95", "n")}
                            for b, v in rep["levels"].items()},
                 "accuracy_by_family": rep.get("accuracy_by_family"),
                 "fit_by_difficulty": rep["fit_by_difficulty"], "adjacent_levels": adjacent_levels(rep)}
            if "baseline" in rep:
                e["baseline"] = rep["baseline"]["checkpoint"]
                e["paired"], e["paired_by_problem"] = rep["paired"], rep["paired_by_problem"]
                e["baseline_accuracy"] = {b: v["accuracy"] for b, v in rep["baseline"]["levels"].items()}
                e["baseline_mean_length"] = {b: v["mean_length"] for b, v in rep["baseline"]["levels"].items()}
                e["baseline_accuracy_by_family"] = rep["baseline"].get("accuracy_by_family")
            out["eval"][st] = e
    out["opd_vs_teacher"] = _read(runs / "post-opd" / "opd.json")
    rl, opd = _read(runs / "post-rl" / "posttrain.json"), _read(runs / "post-opd" / "posttrain.json")
    if rl and opd:
        out["opd_vs_rl_equal_tokens"] = equal_tokens(rl["history"], opd["history"])
    occ = {}
    extra = {d.name[len("post-rl-"):]: d for d in sorted(runs.glob("post-rl-*")) if d.is_dir()}
    for name, d in {"main": runs / "post-rl", **extra, **(occupancy_runs or {})}.items():
        meta = _read(Path(d) / "posttrain.json")
        if meta and "dispatch" in meta:
            occ[name] = {**meta["dispatch"], "steps": meta["step"],
                         "elapsed_s": meta["history"][-1]["elapsed"] if meta["history"] else None}
    out["occupancy"] = occ
    ds = _read(runs / "post-dspark" / "dspark.json")
    if ds:
        out["dspark"] = {k: ds[k] for k in ("checkpoint", "steps", "held_out", "pool", "backbone_unchanged")}
        for key in ("acceptance_before", "acceptance_after"):
            out["dspark"][key] = ds[key]["all"]
    return out


def closing_markdown(c: dict) -> str:
    """closing() as a short markdown table set."""
    f3 = lambda x: "-" if x is None else f"{x:.3f}"   # noqa: E731
    lines = [f"# Post-training closing numbers ({c['runs']})", ""]
    if c["stages"]:
        lines += ["| stage | steps | seconds | sampled tokens |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['steps']} | {f3(v['elapsed_s']) if v['elapsed_s'] else '-'} | {v['sampled_tokens'] or '-'} |"
                  for k, v in c["stages"].items()] + [""]
    for st, e in c["eval"].items():
        lines += [f"## held-out eval: post-{st}" + (f" (paired against {e['baseline']})" if "baseline" in e else ""),
                  "", "| b | accuracy | baseline accuracy | mean reasoning tokens | 95% bootstrap | baseline mean "
                  "reasoning tokens | n |", "|---|---|---|---|---|---|---|"]
        for b, v in sorted(e["levels"].items(), key=lambda kv: float(kv[0])):
            base = e.get("baseline_accuracy", {}).get(b)
            lines.append(f"| {b} | {f3(v['accuracy'])} | {f3(base)} | {f3(v['mean_length'])} | "
                         f"[{v['length_ci95'][0]:.3f}, {v['length_ci95'][1]:.3f}] | "
                         f"{f3(e.get('baseline_mean_length', {}).get(b))} | {v['n']} |")
        lines.append("")
        if "paired" in e:
            p, q = e["paired"], e["paired_by_problem"]
            lines.append(f"paired (problem, level): {p['improved']} improved, {p['worsened']} worsened, one-sided p "
                         f"{p['p_one_sided']:.3g}; per problem: {q['improved']} / {q['worsened']}, p "
                         f"{q['p_one_sided']:.3g}")
        if e.get("accuracy_by_family"):
            lines.append("accuracy by family: " + ", ".join(f"{k} {v:.3f}" for k, v in e["accuracy_by_family"].items())
                         + ("; baseline: " + ", ".join(f"{k} {v:.3f}" for k, v in e["baseline_accuracy_by_family"].items())
                            if e.get("baseline_accuracy_by_family") else ""))
        adj = e["adjacent_levels"]
        lines.append(f"adjacent levels with increasing mean length: {sum(a['increasing'] for a in adj)}/{len(adj)}; "
                     f"with 95% intervals apart: {sum(a['ci_apart'] for a in adj)}/{len(adj)}")
        lines.append("affine fit of mean length in b per difficulty: " + "; ".join(
            f"d={d}: slope {v['slope']:.4f}, " + ("flat (R^2 undefined)" if v.get("flat") else f"R^2 {v['r2']:.2f}")
            for d, v in e["fit_by_difficulty"].items()))
        lines.append("")
    if c.get("opd_vs_teacher"):
        o = c["opd_vs_teacher"]
        lines += [f"## OPD: student vs teacher ({o['problems']} held-out problems x levels {o['levels']}, greedy)", "",
                  "| family | teacher | teacher accuracy | student accuracy | % of teacher |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['teacher']} | {f3(v['teacher_accuracy'])} | {f3(v['student_accuracy'])} | "
                  f"{'-' if v['student_pct_of_teacher'] is None else format(v['student_pct_of_teacher'], '.1f')} |"
                  for k, v in o["families"].items()] + [""]
    if c.get("opd_vs_rl_equal_tokens"):
        q = c["opd_vs_rl_equal_tokens"]
        lines += [f"OPD vs RL at equal student-sampled tokens ({q['opd_tokens']} OPD tokens, RL reached "
                  f"{q['rl_tokens']} in {q['rl_steps_to_equal_tokens']} steps): sampled accuracy first/last steps "
                  f"OPD {f3(q['opd_sampled_accuracy_first'])} -> {f3(q['opd_sampled_accuracy_tail'])}, RL "
                  f"{f3(q['rl_sampled_accuracy_first'])} -> {f3(q['rl_sampled_accuracy_tail'])} (training samples, "
                  f"T = 1, not held out)", ""]
    if c["occupancy"]:
        lines += ["## dispatcher: generation-slot occupancy", "", "| run | granularity | steps | occupancy | seconds |",
                  "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['granularity']} | {v['steps']} | {f3(v['occupancy'])} | "
                  f"{'-' if v['elapsed_s'] is None else format(v['elapsed_s'], '.0f')} |"
                  for k, v in c["occupancy"].items()] + [""]
    if c.get("dspark"):
        d = c["dspark"]
        lines += [f"## DSpark drafter on {d['checkpoint']} ({d['steps']} steps, {d['held_out']} held-out greedy "
                  f"responses, backbone unchanged: {d['backbone_unchanged']})", "",
                  "| | acceptance per draft position | tokens per step |", "|---|---|---|"]
        for k in ("acceptance_before", "acceptance_after"):
            lines.append(f"| {k.split('_')[1]} | {' '.join(f'{x:.3f}' for x in d[k]['acceptance'])} | "
                         f"{d[k]['tokens_per_step']:.3f} |")
        lines.append("")
    return "\n".join(lines)
