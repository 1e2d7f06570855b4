"""Where do a packed bf16 model's logits on the GPU part from the dense model's? The golden checkpoint
(tests/data/golden/case-a), 2 rows of 24 random ids: a prefill of 21 tokens, then 3 decode steps (DenseCache).

Variants: the CPU in fp32 (the reference) and in bf16 (the bf16 noise floor of the same model), the GPU held dense
(cuBLAS over dequantized weights) and held packed with each FP8 tensor-core route on or off:
  packed          the defaults (fp8_decode.FP8_DECODE_FROM, moe_kernel.CONFIG["packed_fp8_mma"])
  packed-nofp8    decode GEMMs on the bf16-decode kernel (FP8_DECODE_FROM = 65), MoE fp8 MMA off
  packed-gemm     only the decode GEMMs' FP8 route off
  packed-moe      only the MoE op's FP8 route off
For each: the median and max row relative error of the logits against the CPU fp32 reference and against the GPU
dense model. Then, per packed GEMM call of the default run, the FP8 decode kernel's output against the same GEMM in
fp32 (x and the dequantized weight), beside the bf16-decode kernel's: a wrong shape shows as an outlier.

    python benchmarks/packed_parity.py [--out benchmarks/results/packed_parity_<gpu>.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.kernels import set_backend  # noqa: E402
from dsv41.model.cache import DenseCache  # noqa: E402
from dsv41.model.loading import load_model  # noqa: E402

GOLDEN = ROOT / "tests" / "data" / "golden" / "case-a"


def run(device: str, dtype: torch.dtype, storage: str) -> torch.Tensor:
    model, cfg = load_model(GOLDEN, dtype=dtype, storage=storage)
    model = model.to(device)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    cache = DenseCache(cfg, 2, dtype, device=device)
    with torch.no_grad():
        pre = model(ids[:, :-3], cache).logits
        dec = [model(ids[:, t:t + 1], cache).logits for t in range(ids.size(1) - 3, ids.size(1))]
    return torch.cat([pre, *dec], dim=1).float().cpu()


def rel(a: torch.Tensor, b: torch.Tensor) -> dict:
    r = (a - b).norm(dim=-1) / b.norm(dim=-1)
    return {"median": float(r.median()), "max": float(r.max()), "decode_median": float(r[:, -3:].median())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import dsv41.model.common as common
    from dsv41.kernels.triton import fp8_decode, moe_kernel
    from dsv41.kernels.triton.packed_gemm import packed_linear_triton

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
    ref = run("cpu", torch.float32, "dense")
    res["variants"]["cpu-bf16"] = {"vs_fp32": rel(run("cpu", torch.bfloat16, "dense"), ref)}
    set_backend("triton")
    dense = run("cuda", torch.bfloat16, "dense")
    res["variants"]["gpu-dense"] = {"vs_fp32": rel(dense, ref)}
    gemm_from, mma_from = dict(fp8_decode.FP8_DECODE_FROM), moe_kernel.CONFIG["packed_fp8_mma"]
    for name, g_off, m_off in (("packed", False, False), ("packed-nofp8", True, True),
                               ("packed-gemm", True, False), ("packed-moe", False, True)):
        fp8_decode.FP8_DECODE_FROM.update({k: 65 for k in gemm_from} if g_off else gemm_from)
        moe_kernel.CONFIG["packed_fp8_mma"] = 0 if m_off else mma_from
        out = run("cuda", torch.bfloat16, "packed")
        res["variants"][name] = {"vs_fp32": rel(out, ref), "vs_gpu_dense": rel(out, dense)}
    fp8_decode.FP8_DECODE_FROM.update(gemm_from)
    moe_kernel.CONFIG["packed_fp8_mma"] = mma_from

    calls = defaultdict(list)                      # per GEMM call: (shape, kind, M) -> errors of both kernels
    inner = common.packed_linear

    def probe(x, w, bias=None):
        y = inner(x, w, bias)
        a = x.reshape(-1, w.shape[1])
        if a.size(0) <= 64:
            exact = torch.nn.functional.linear(a.float(), w.dequant().float(), None if bias is None else bias.float())
            f8 = fp8_decode.fp8_decode_triton(a.contiguous(), w, bias).float()
            saved = dict(fp8_decode.FP8_DECODE_FROM)
            fp8_decode.FP8_DECODE_FROM.update({k: 65 for k in saved})
            bf = packed_linear_triton(a, w, bias).float()
            fp8_decode.FP8_DECODE_FROM.update(saved)
            n = exact.norm(dim=-1).clamp_min(1e-30)
            calls[(tuple(w.shape), w.kind, a.size(0))].append(
                (float(((f8 - exact).norm(dim=-1) / n).max()), float(((bf - exact).norm(dim=-1) / n).max()),
                 float((f8 - exact).abs().max()), float(exact.abs().max())))
        return y

    common.packed_linear = probe
    try:
        run("cuda", torch.bfloat16, "packed")
    finally:
        common.packed_linear = inner
    res["gemm_calls"] = [{"shape": list(k[0]), "kind": k[1], "rows": k[2], "calls": len(v),
                          "fp8_row_rel_max": max(e[0] for e in v), "bf16_row_rel_max": max(e[1] for e in v),
                          "fp8_abs_max": max(e[2] for e in v), "out_abs_max": max(e[3] for e in v)}
                         for k, v in sorted(calls.items())]
    for name, v in res["variants"].items():
        print(f"{name:14s} " + "  ".join(f"{k}: median {e['median']:.2e} max {e['max']:.2e} decode {e['decode_median']:.2e}"
                                         for k, e in v.items()))
    print("per GEMM call (rows <= 64): shape kind rows calls | fp8 row rel max | bf16-decode row rel max")
    for c in res["gemm_calls"]:
        print(f"  {c['shape']} {c['kind']} M={c['rows']} x{c['calls']} | {c['fp8_row_rel_max']:.2e} | "
              f"{c['bf16_row_rel_max']:.2e}  (fp8 abs {c['fp8_abs_max']:.2e} of {c['out_abs_max']:.2e})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
