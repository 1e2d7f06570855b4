"""The `--speculative` flag: which speculation runs (`Speculation`), and what `auto` means for a checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsv41.engine.speculative.profile import PROFILE_FILE, StepProfile, profile_step


@dataclass(frozen=True)
class Speculation:
    """`off`, `fixed:N` (verify N drafts every step), `dspark` (the confidence scheduler of docs/system.md §5 on the
    confidence head's raw a_r,k and the profiled T(n)) or `dspark:online` (the same scheduler with both inputs
    corrected online by what the engine measures: `AcceptanceCalibration`, `MeasuredCost`; what `auto` runs: on the
    trained tiny model with its self-distilled drafter (CPU, deterministic, median of 3 rounds) x1.94 / x1.24 /
    x0.92 of off at batch 1 / 8 / 32 where `dspark` gave x1.96 / x1.11 / x0.80, its raw head predicting 445
    tokens for 376 emitted at batch 8, the calibrated one 354; benchmarks/results/speculative-cpu-tiny-2026-12-06e.json;
    with closed-batch scheduling and the longer-trained drafter x1.96 / x1.27 / x0.96, best fixed x1.87 / x1.27 /
    x1.06, on a machine loaded ~3 on 2 cores: benchmarks/results/speculative-cpu-tiny-2026-12-07.json.gz)."""
    mode: str = "off"
    n: int = 0
    online: bool = False

    @classmethod
    def parse(cls, text: "str | Speculation | None") -> "Speculation":
        if isinstance(text, Speculation):
            return text
        t = (text or "off").strip().lower()
        if t in ("off", "dspark"):
            return cls(t)
        if t == "dspark:online":
            return cls("dspark", online=True)
        if t.startswith("fixed:"):
            try:
                n = int(t.split(":", 1)[1])
            except ValueError:
                n = -1
            if n >= 0:
                return cls("fixed", n)
        raise ValueError(f"speculative must be off, fixed:N (N >= 0), dspark or dspark:online, got {text!r}")

    def __str__(self) -> str:
        if self.mode == "fixed":
            return f"fixed:{self.n}"
        return "dspark:online" if self.mode == "dspark" and self.online else self.mode


def has_trained_drafter(checkpoint) -> bool:
    """Whether a checkpoint directory holds a drafter trained by the DSpark stage (`dsv41 train --stage dspark`
    writes summary.json with stage "dspark")."""
    if checkpoint is None:
        return False
    try:
        return json.loads((Path(checkpoint) / "summary.json").read_text()).get("stage") == "dspark"
    except (OSError, ValueError, AttributeError):
        return False


def resolve_speculation(model, checkpoint, flag: str = "auto", profile_path=None, max_batch: int = 8,
                        device="cpu", log=print) -> tuple[Speculation, StepProfile | None]:
    """The `--speculative` flag of `generate` / `serve`: auto = the online-corrected confidence scheduler
    (`dspark:online`) when the checkpoint has a trained drafter, else off. The scheduler's T(n) comes from --step-profile, else the checkpoint's
    step_profile.json (`dsv41 profile-step`), else a quick profile measured now (logged)."""
    if flag == "auto":
        flag = "dspark:online" if has_trained_drafter(checkpoint) and model.cfg.dspark_enabled else "off"
    spec = Speculation.parse(flag)
    if spec.mode == "off":
        return spec, None
    if not has_trained_drafter(checkpoint):
        log(f"speculative {spec}: this checkpoint's drafter was not trained by the DSpark stage; outputs are "
            "exact, acceptance will be low")
    if spec.mode != "dspark":
        return spec, None
    path = Path(profile_path) if profile_path else (Path(checkpoint) / PROFILE_FILE if checkpoint else None)
    if path is not None and path.exists():
        prof = StepProfile.load(path)
        if prof.meta.get("path") != "engine.step":
            log(f"speculative dspark: {path} was measured over the verify forward only (an older profile-step); "
                "re-run `dsv41 profile-step` so that T holds the engine's whole step (drafter, per-row accept and "
                "emit work)")
        return spec, prof
    log("speculative dspark: no step profile found (run `dsv41 profile-step --checkpoint ...` to store one); "
        "measuring a quick one now")
    return spec, profile_step(model, batches=sorted({1, max(1, max_batch)}), context=256, repeats=3, device=device,
                              log=lambda *a: None)
