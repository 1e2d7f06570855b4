"""Kernel table of the GEMMs over packed weight bytes on the GPU, against the bf16 path, side by side in one run.

For each v41-geometry weight shape (attention and shared-expert fp8 Linears, a routed expert's fp4 w1 / w2) at
decode sizes (M = 1, 8, 32, 64) and a prefill size (M = 4096): the GPU time of `packed_linear_triton` (20 calls
captured in a CUDA graph and replayed: no host launch overhead; median of 5 replays), of the bf16 path it replaces (`x @ W_bf16^T`, the dense holding) and of dequantize-then-matmul
(what a packed model did before); bytes/s on the bytes the kernel must read (weight codes + scales; x and y at
prefill) as a share of the device-to-device copy bandwidth measured in this run, and TFLOP/s as a share of the bf16
GEMM rate measured in this run (8192 x 5120 x 5120).

    python benchmarks/packed_gemm.py          # writes benchmarks/results/packed_gemm_h200.json
    python benchmarks/packed_gemm.py --sweep  # first picks the decode tiles (DECODE_CONFIG) on two shapes
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.codecs import qdq_fp8  # noqa: E402
from dsv41.codecs.weights import PackedWeight, pack_weight  # noqa: E402
from dsv41.kernels.triton import packed_gemm  # noqa: E402
from dsv41.kernels.triton.packed_gemm import packed_linear_triton  # noqa: E402

# (name, kind, N, K): v41-geometry (dim 5120, q_lora 1280, 64 heads x 512, o_groups 8 x o_lora 1024, moe_inter 2304)
SHAPES = [("wq_b", "fp8", 64 * 512, 1280), ("wkv", "fp8", 512, 5120), ("wo_b", "fp8", 5120, 8 * 1024),
          ("shared w1", "fp8", 2304, 5120),
          ("shared w2", "fp8", 5120, 2304), ("expert w1", "fp4", 2304, 5120), ("expert w2", "fp4", 5120, 2304)]
ROWS = [1, 8, 32, 64, 4096]


def cuda_time(fn, reps: int = 20) -> float:
    """GPU seconds per call: `reps` calls captured in one CUDA graph, replayed (the host's launch overhead, which
    dominates a decode-size call run eagerly, is not in it: a decode step replays its kernels from graphs too)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def sweep(dev: str) -> dict:
    """The decode tiles with the least summed GPU time over an fp8 (wq_b, M = 1) and an fp4 (expert w1, M = 8)
    call; sets `packed_gemm.DECODE_CONFIG` and returns the table."""
    cases = []
    for kind, N, K, M in (("fp8", 64 * 512, 1280, 1), ("fp4", 2304, 5120, 8)):
        codes, scale = pack_weight(torch.randn(N, K, device=dev) * K ** -0.5, kind)
        cases.append((PackedWeight(codes, scale, kind, (N, K), torch.bfloat16),
                      qdq_fp8(torch.randn(M, K, device=dev, dtype=torch.bfloat16))))
    table = []
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            for warps in (4, 8):
                packed_gemm.DECODE_CONFIG.update(block_n=bn, block_k=bk, num_warps=warps)
                t = sum(cuda_time(lambda: packed_linear_triton(x, w)) for w, x in cases)
                table.append({"block_n": bn, "block_k": bk, "num_warps": warps, "seconds": t})
                print(f"sweep BN {bn:3d} BK {bk:3d} warps {warps}: {t * 1e6:7.1f} us", flush=True)
    best = min(table, key=lambda r: r["seconds"])
    packed_gemm.DECODE_CONFIG.update({k: best[k] for k in ("block_n", "block_k", "num_warps")})
    print(f"decode tiles: {packed_gemm.DECODE_CONFIG}")
    return {"sweep": table, "decode_config": dict(packed_gemm.DECODE_CONFIG)}


def main() -> None:
    dev = "cuda"
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / cuda_time(lambda: dst.copy_(src), 5)
    src = dst = None
    a, b = (torch.randn(8192, 5120, device=dev, dtype=torch.bfloat16) for _ in range(2))
    rate = 2 * 8192 * 5120 * 5120 / cuda_time(lambda: a @ b.T, 5)
    a = b = None
    res = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": bw, "bf16_gemm_rate": rate, "rows": []}
    if "--sweep" in sys.argv:
        res.update(sweep(dev))
    res["decode_config"] = dict(packed_gemm.DECODE_CONFIG)
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    print(f"{'weight':11s}{'kind':>5}{'M':>6}{'packed us':>11}{'bf16 us':>9}{'deq+mm us':>10}{'x bf16':>8}"
          f"{'TB/s':>7}{'%bw':>6}{'TFLOP/s':>9}{'%mma':>6}")
    for name, kind, N, K in SHAPES:
        w = torch.randn(N, K, device=dev) * K ** -0.5
        codes, scale = pack_weight(w, kind)
        pw = PackedWeight(codes, scale, kind, (N, K), torch.bfloat16)
        wb = pw.dequant()
        for M in ROWS:
            x = qdq_fp8(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
            t_p = cuda_time(lambda: packed_linear_triton(x, pw))
            t_b = cuda_time(lambda: x @ wb.T)
            t_d = cuda_time(lambda: x @ pw.dequant().T)
            nbytes = pw.nbytes + (2 * M * (K + N) if M > 64 else 0)
            row = {"weight": name, "kind": kind, "N": N, "K": K, "M": M, "packed_s": t_p, "bf16_s": t_b,
                   "dequant_matmul_s": t_d, "speedup_vs_bf16": t_b / t_p, "bytes": nbytes,
                   "bytes_per_s": nbytes / t_p, "share_of_copy_bw": nbytes / t_p / bw,
                   "flops_per_s": 2 * M * N * K / t_p, "share_of_bf16_rate": 2 * M * N * K / t_p / rate}
            res["rows"].append(row)
            print(f"{name:11s}{kind:>5}{M:>6}{t_p * 1e6:>11.1f}{t_b * 1e6:>9.1f}{t_d * 1e6:>10.1f}"
                  f"{row['speedup_vs_bf16']:>8.2f}{row['bytes_per_s'] / 1e12:>7.2f}{row['share_of_copy_bw'] * 100:>6.0f}"
                  f"{row['flops_per_s'] / 1e12:>9.1f}{row['share_of_bf16_rate'] * 100:>6.0f}", flush=True)
    out = Path(__file__).parent / "results" / "packed_gemm_h200.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
