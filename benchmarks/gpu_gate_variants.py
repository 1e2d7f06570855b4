"""Gate 1 (golden case A, fp32, teacher-forced) on a GPU under variants of the row statistics that parted the GPU
from the CPU in `gpu_parity_trace.py`: layer 10's q_norm (1.7e-7 from the CPU) put an FP8 QDQ on the other side of a
rounding midpoint. The CPU's torch.rsqrt is exactly the IEEE root then an IEEE division; CUDA's rsqrtf is an
approximation, so `dsv41.kernels.invariant.rsqrt` computes 1 / sqrt on CUDA (tests/test_deterministic.py). Variants:
  base       the official-cpu tie rule alone (1 / sqrt on CUDA, CUDA's row means)
  cpu-order  `use_official_cpu`: and the row means in the CPU's summation order on the GPU (`cpu_order_sum`),
             what tests/test_golden.py::test_gate1_teacher_forced_fp32_on_the_gpu runs
  rsqrtf     CUDA's torch.rsqrt (DSV41_GPU_RSQRT=approx), the statistics before 2026-12-07
  f64-mean   the row means summed in float64, rounded once
  cpu-stats  the row means and rsqrt of CUDA tensors computed on the CPU (bit-equal RMSNorm statistics; a probe of
             whether the statistics are the whole cause, not a serving path)
  cpu-stats+cpu-sqrt  and torch.sqrt / Tensor.sqrt of CUDA tensors (the MoE gate's sqrt(softplus), Engram's gate)
             on the CPU: torch 2.13's CPU sqrt goes through MKL, which on AVX-512 rounds ~0.7% of fp32 values one
             ulp away from the IEEE root (exact under MKL_ENABLE_INSTRUCTIONS=AVX2), so a golden file computed on an
             AVX-512 machine carries those roundings and a GPU's IEEE sqrt does not (docs/golden.md §6)

    python benchmarks/gpu_gate_variants.py      # prints each variant's failing tensors, writes nothing
    VARIANTS=cpu-stats,f64-mean python benchmarks/gpu_gate_variants.py     # only these
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file  # noqa: E402

import dsv41.kernels.mhc_math as mhc_math  # noqa: E402
import dsv41.kernels.ref as ref  # noqa: E402
import dsv41.model.engram as engram  # noqa: E402
from dsv41.kernels.invariant import set_cpu_order  # noqa: E402
from dsv41.model.attention import set_tie_break  # noqa: E402
from dsv41.model.loading import load_model  # noqa: E402
from dsv41.model.runner import compare_captures, run_teacher_forced  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"


def main() -> int:
    blocks = load_file(GOLDEN / "a.fp32.fix.blocks-seq0.safetensors")
    real_rsqrt, real_mean = torch.rsqrt, ref.row_mean
    real_sqrt, real_tsqrt = torch.sqrt, torch.Tensor.sqrt
    users = (ref, mhc_math, engram)
    out = {}
    names = os.environ.get("VARIANTS", "base,cpu-order,rsqrtf,f64-mean,cpu-stats,cpu-stats+cpu-sqrt").split(",")
    for name in names:
        if name.startswith("cpu-stats"):
            torch.rsqrt = lambda v, *a, **k: (real_rsqrt(v.cpu()).to(v.device) if v.is_cuda
                                              else real_rsqrt(v, *a, **k))
            for mod in users:
                mod.row_mean = lambda x, keepdim=False: (real_mean(x.cpu(), keepdim).to(x.device) if x.is_cuda
                                                         else real_mean(x, keepdim))
            os.environ["DSV41_GPU_RSQRT"] = "approx"           # so that invariant.rsqrt calls the patched rsqrt
        elif name == "rsqrtf":
            os.environ["DSV41_GPU_RSQRT"] = "approx"
        if name.endswith("cpu-sqrt"):
            torch.sqrt = lambda v, *a, **k: real_sqrt(v.cpu()).to(v.device) if v.is_cuda else real_sqrt(v, *a, **k)
            torch.Tensor.sqrt = lambda t: real_tsqrt(t.cpu()).to(t.device) if t.is_cuda else real_tsqrt(t)
        set_cpu_order(name == "cpu-order")
        if name.endswith("f64-mean"):
            for mod in users:
                mod.row_mean = lambda x, keepdim=False: (x.double().mean(-1, keepdim=keepdim).float() if x.is_cuda
                                                         else real_mean(x, keepdim))
        try:
            for storage in ("dense", "packed"):
                m = load_model(GOLDEN / "case-a", storage=storage)[0].cuda()
                set_tie_break(m, "official-cpu")
                with torch.no_grad():
                    ours = run_teacher_forced(m, {k: v.cuda() for k, v in blocks.items()})
                rep = compare_captures({k: v.cpu() for k, v in ours.items()}, blocks, 1e-5)
                out[f"{name}/{storage}"] = {
                    "failing": {k: (v["outliers"], v["max"]) for k, v in rep.items() if not v["ok"]},
                    "rows_over": sum(v["outliers"] for v in rep.values()), "max": max(v["max"] for v in rep.values())}
                print(name, storage, json.dumps(out[f"{name}/{storage}"]), flush=True)
        finally:
            torch.rsqrt, torch.sqrt, torch.Tensor.sqrt = real_rsqrt, real_sqrt, real_tsqrt
            set_cpu_order(False)
            os.environ.pop("DSV41_GPU_RSQRT", None)
            for mod in users:
                mod.row_mean = real_mean
    return 0


if __name__ == "__main__":
    sys.exit(main())
