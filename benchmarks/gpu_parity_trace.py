"""Where the GPU departs from the CPU inside the teacher-forced gate 1 (golden case A, fp32): every module's output
and every top-k, in call order, GPU against CPU.

    python benchmarks/gpu_parity_trace.py [--storage dense|packed] [--layers 0-12] [--threshold 1e-6]

Both runs feed the golden block inputs (`run_teacher_forced`) with the official tie order ("official-cpu"); the
forward hooks record each module's first tensor output, a wrapper records each `torch.topk` / `Tensor.topk` (values
and indices). Printed: per recorded call, the largest relative error per row and the rows above the threshold
(float outputs), or the number of differing indices (top-k); the first call of each kind that departs is the one
to read. `gpu_parity.py` gives the gate's verdict; this says which computation flips.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file  # noqa: E402

from dsv41.model.attention import set_tie_break  # noqa: E402
from dsv41.model.loading import load_model  # noqa: E402
from dsv41.model.runner import run_teacher_forced  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def traced_run(storage: str, layers: set[int], blocks: dict, device: str) -> list[tuple[str, object]]:
    """[(name, tensor or (values, indices))] in call order, on `device`, everything moved to the CPU."""
    model = load_model(GOLDEN / "case-a", storage=storage)[0].to(device)
    set_tie_break(model, "official-cpu")
    rec: list[tuple[str, object]] = []
    where = {"layer": -1}
    hooks = []
    for L, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, L=L: where.__setitem__("layer", L)))
        if L not in layers:
            continue
        for name, mod in layer.named_modules():
            def hook(m, a, out, name=f"{L}.{name or 'block'}"):
                t = _first_tensor(out)
                if t is not None:
                    rec.append((name, t.detach().float().cpu()))
            hooks.append(mod.register_forward_hook(hook))
    real_fn, real_method = torch.topk, torch.Tensor.topk

    def record_topk(res):
        if where["layer"] in layers:
            rec.append((f"{where['layer']}.topk", (res[0].detach().float().cpu(), res[1].detach().cpu())))
        return res

    torch.topk = lambda *a, **k: record_topk(real_fn(*a, **k))
    torch.Tensor.topk = lambda self, *a, **k: record_topk(real_method(self, *a, **k))
    try:
        with torch.no_grad():
            run_teacher_forced(model, {k: v.to(device) for k, v in blocks.items()})
    finally:
        torch.topk, torch.Tensor.topk = real_fn, real_method
        for h in hooks:
            h.remove()
    return rec


def rel_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per row, rows = every index but the last axis's."""
    a, b = a.float().reshape(-1, a.size(-1) if a.dim() else 1), b.float().reshape(-1, b.size(-1) if b.dim() else 1)
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


def compare(gpu: list, cpu: list, threshold: float) -> list[dict]:
    if [n for n, _ in gpu] != [n for n, _ in cpu]:
        raise SystemExit(f"call sequences differ: {len(gpu)} GPU calls vs {len(cpu)} CPU calls")
    rows = []
    for k, ((name, g), (_, c)) in enumerate(zip(gpu, cpu)):
        if isinstance(g, tuple):
            diff = int((g[1] != c[1]).sum())
            vals = rel_last(g[0], c[0])
            rows.append({"call": k, "name": name, "shape": list(g[1].shape), "indices_differ": diff,
                         "values_max_rel": float(vals.max())})
        elif g.shape != c.shape:
            rows.append({"call": k, "name": name, "shape_gpu": list(g.shape), "shape_cpu": list(c.shape)})
        else:
            r = rel_last(g, c)
            rows.append({"call": k, "name": name, "shape": list(g.shape), "max_rel": float(r.max()),
                         "rows_over": int((r > threshold).sum()), "worst_row": int(r.argmax())})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storage", default="dense", choices=("dense", "packed"))
    ap.add_argument("--layers", default="0-12", help="a range a-b or a comma list")
    ap.add_argument("--threshold", type=float, default=1e-6)
    ap.add_argument("--device", default="cuda", help="cpu: the CPU against itself (every error 0)")
    ap.add_argument("--out", default=None, help="write every call's row as JSON here")
    args = ap.parse_args(argv)
    if "-" in args.layers:
        lo, hi = map(int, args.layers.split("-"))
        layers = set(range(lo, hi + 1))
    else:
        layers = {int(x) for x in args.layers.split(",")}
    blocks = load_file(GOLDEN / "a.fp32.fix.blocks-seq0.safetensors")
    gpu = traced_run(args.storage, layers, blocks, args.device)
    cpu = traced_run(args.storage, layers, blocks, "cpu")
    rows = compare(gpu, cpu, args.threshold)
    seen = set()
    for r in rows:
        bad = r.get("indices_differ", 0) or r.get("rows_over", 0) or "shape_gpu" in r
        if bad and (r["name"], "first") not in seen:
            seen.add((r["name"], "first"))
            print("FIRST departure of", json.dumps(r))
    print(f"{len(rows)} calls compared; departing calls: "
          f"{sum(1 for r in rows if r.get('indices_differ', 0) or r.get('rows_over', 0))}")
    for r in rows:
        if r.get("indices_differ", 0) or r.get("rows_over", 0) or r.get("max_rel", 0) > 1e-4:
            print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
