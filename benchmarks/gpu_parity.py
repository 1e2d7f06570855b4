"""The whole model on the GPU against the CPU reference, block by block (golden case A, teacher-forced gate 1).

    python benchmarks/gpu_parity.py [--json]        # writes benchmarks/results/gpu_parity_h200.json

fp32: the golden blocks' inputs through every block on the GPU, each output against the official capture: the
gate is 1e-5 relative L2 per row with at most one row above it per tensor (docs/golden.md §4), for the dense and
the packed weight storage (the packed one reading the checkpoint bytes in the GPU kernels where they exist), with
the official order among exact top-k ties and the row statistics in the CPU's summation order
(`use_official_cpu`; CUDA's own topk order and reductions are reported beside it: ties alone fail the gate).
The deterministic mode (exact 32-wide block sums, fixed reduction orders, the "recent" tie rule, which is not the
official one) against the same mode on the CPU, per block.
bf16: the same teacher-forced run in bf16 on the GPU and on the CPU (our reference), per block the largest and the
median relative error per row of GPU vs CPU: the GPU's bf16 tolerance, measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file  # noqa: E402

from dsv41.kernels import deterministic  # noqa: E402
from dsv41.kernels.invariant import set_cpu_order  # noqa: E402
from dsv41.model.attention import set_tie_break, use_official_cpu  # noqa: E402
from dsv41.model.loading import load_model  # noqa: E402
from dsv41.model.runner import compare_captures, rel_rows, run_teacher_forced  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"


def teacher_forced(model, blocks: dict, device: str) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = run_teacher_forced(model.to(device), {k: v.to(device) for k, v in blocks.items()})
    return {k: v.cpu() for k, v in out.items()}


def gate1(ours: dict, blocks: dict) -> dict:
    rep = compare_captures(ours, blocks, 1e-5)
    return {"max_rel": max(v["max"] for v in rep.values()),
            "rows_over_1e-5": sum(v["outliers"] for v in rep.values()),
            "tensors_failing": sorted(k for k, v in rep.items() if not v["ok"]), "tensors": len(rep),
            "passes": all(v["ok"] for v in rep.values())}


def per_block(gpu: dict, cpu: dict) -> dict[str, dict]:
    out = {}
    for name, t in gpu.items():
        if name.startswith(("block_out", "engram_out", "final_hidden")) and name in cpu:
            r = rel_rows(t, cpu[name])
            out[name] = {"max": float(r.max()), "median": float(r.median())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: the script's own check (the CPU against itself)")
    args = ap.parse_args(argv)
    dev = args.device
    case = GOLDEN / "case-a"
    blocks = load_file(GOLDEN / "a.fp32.fix.blocks-seq0.safetensors")
    res: dict = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "torch": torch.__version__}
    for storage in ("dense", "packed"):
        for ties in ("official-cpu", "official"):
            m = load_model(case, storage=storage)[0]
            if ties == "official-cpu":
                use_official_cpu(m)          # and the row statistics in the CPU's summation order
            else:
                set_tie_break(m, ties)
            res[f"fp32_{storage}" + ("" if ties == "official-cpu" else "_device_ties")] = gate1(
                teacher_forced(m, blocks, dev), blocks)
            set_cpu_order(False)
    with deterministic():                 # exact 32-wide block sums, fixed reduction orders (docs/system.md §10)
        runs = {}
        for d in (dev, "cpu"):
            m = load_model(case)[0]
            set_tie_break(m, "recent")
            runs[d] = teacher_forced(m, blocks, d)
        pb = per_block(runs[dev], runs["cpu"])
        res["fp32_deterministic_vs_cpu"] = {"max_rel": max(v["max"] for v in pb.values()),
                                            "bitwise_equal": all(torch.equal(runs[dev][k], runs["cpu"][k])
                                                                 for k in runs["cpu"])}
    for storage in ("dense", "packed"):
        cpu = teacher_forced(load_model(case, dtype=torch.bfloat16, storage=storage)[0], blocks, "cpu")
        gpu = teacher_forced(load_model(case, dtype=torch.bfloat16, storage=storage)[0], blocks, dev)
        pb = per_block(gpu, cpu)
        res[f"bf16_{storage}"] = {"max_rel": max(v["max"] for v in pb.values()),
                                  "median_of_medians": sorted(v["median"] for v in pb.values())[len(pb) // 2],
                                  "blocks": pb}
    if not args.json:
        d = res["fp32_deterministic_vs_cpu"]
        print(f"fp32 deterministic mode, GPU vs CPU per block: max rel {d['max_rel']:.2e}, bitwise equal "
              f"{d['bitwise_equal']}")
        for storage in ("dense", "packed", "dense_device_ties", "packed_device_ties"):
            g = res[f"fp32_{storage}"]
            print(f"fp32 {storage:18s} gate 1: max rel {g['max_rel']:.2e} over {g['tensors']} captures, rows > 1e-5: "
                  f"{g['rows_over_1e-5']}, failing: {g['tensors_failing'] or 'none'} -> "
                  f"{'PASS' if g['passes'] else 'FAIL'}")
        for storage in ("dense", "packed"):
            b = res[f"bf16_{storage}"]
            print(f"bf16 {storage:6s} GPU vs CPU per block: max rel {b['max_rel']:.2e}, median block median "
                  f"{b['median_of_medians']:.2e}")
            for name, v in b["blocks"].items():
                print(f"    {name:24s} max {v['max']:.2e}  median {v['median']:.2e}")
    if dev == "cuda":
        (Path(__file__).parent / "results" / "gpu_parity_h200.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: (v if not isinstance(v, dict) or "blocks" not in v else {kk: vv for kk, vv in v.items()
                                                                                  if kk != "blocks"})
                      for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
