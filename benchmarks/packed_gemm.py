"""Kernel table of the GEMMs over packed weight bytes on the GPU, against the bf16 path, side by side in one run.

For each v41-geometry weight shape (attention and shared-expert fp8 Linears, a routed expert's fp4 w1 / w2) at
decode sizes (M = 1, 8, 32, 64) and a prefill size (M = 4096): the GPU time of `packed_linear_triton` (20 calls
captured in a CUDA graph and replayed: no host launch overhead; median of 5 replays), of the bf16 path it replaces
(`x @ W_bf16^T`, the dense holding; each captured call reads its own copy of the weight, up to 256 MB of copies, so
that the weights come from HBM and not from L2) and of dequantize-then-matmul (what a packed model did before);
bytes/s on the bytes the kernel must read (weight codes + scales; x and y at prefill) as a share of the device-to-
device copy bandwidth measured in this run, and TFLOP/s as a share of the bf16 GEMM rate measured in this run (8192
x 5120 x 5120; and of torch's per-tensor FP8 GEMM, the FP8 tensor cores' rate: a prefill-size call over an fp8
weight runs on them, `dsv41.kernels.triton.fp8_gemm`, fp4 weights decode once and run the bf16 GEMM). Then the MoE
op of a decode step (B = 1, 8, 32, 64 tokens x top-6 of v41-geometry's 16 fp4 routed experts + the fp8 shared
expert) over packed and over dense bf16 experts.

    python benchmarks/packed_gemm.py          # writes benchmarks/results/packed_gemm_h200.json
    python benchmarks/packed_gemm.py --sweep-fp8-decode  # the FP8 tensor-core decode kernel's tiles and from how
                                              # many rows bf16 models take it, per weight kind
                                              # (fp8_decode.FP8_DECODE_FROM)
    python benchmarks/packed_gemm.py --sweep  # the same, then picks the decode tiles (DECODE_CONFIG) on two shapes,
                                              # those of the 32- and 64-row buckets (DECODE_CONFIGS), the MoE
                                              # kernels' packed tiles, and the prefill tiles of the FP8 tensor-core GEMM
                                              # (fp8_gemm.PREFILL_CONFIG; --no-prefill-sweep skips them)
    python benchmarks/packed_gemm.py --sweep-prefill  # only the FP8 tensor-core GEMM's prefill tiles
    python benchmarks/packed_gemm.py --moe-only  # only the MoE op rows (fused vs torch routing, FP8 MMA vs bf16 decode)
    python benchmarks/packed_gemm.py --sweep-gate  # only the MoE gate kernel's K block and warps (GATE_CONFIG) at 1 and
                                                   # 32 tokens, v41-geometry's 16 experts over D 5120; prints, no file
Env: RESULT (the result file). The result's decode_configs / moe_config are what `benchmarks/gpu_weights.py` applies
with TUNING=that file.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.codecs import qdq_fp8  # noqa: E402
from dsv41.codecs.weights import PackedWeight, pack_weight  # noqa: E402
from dsv41.kernels.triton import fp8_decode, fp8_gemm, moe_kernel, packed_gemm  # noqa: E402
from dsv41.kernels.triton.moe_kernel import moe_experts_triton  # noqa: E402
from dsv41.kernels.triton.packed_gemm import packed_linear_triton  # noqa: E402

# (name, kind, N, K): v41-geometry (dim 5120, q_lora 1280, 64 heads x 512, o_groups 8 x o_lora 1024, moe_inter 2304)
SHAPES = [("wq_b", "fp8", 64 * 512, 1280), ("wkv", "fp8", 512, 5120), ("wo_b", "fp8", 5120, 8 * 1024),
          ("shared w1", "fp8", 2304, 5120),
          ("shared w2", "fp8", 5120, 2304), ("expert w1", "fp4", 2304, 5120), ("expert w2", "fp4", 5120, 2304)]
ROWS = [1, 8, 32, 64, 4096]
EXPERTS, TOPK, DIM, INTER = 16, 6, 5120, 2304          # v41-geometry's routed experts (+ 1 shared), top-6
TOKENS = [1, 8, 32, 64]


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


ROTATE_BYTES = 1 << 28          # each timed call reads its own copy of the weight until this many bytes: not from L2


def rotating(make, nbytes: int) -> list:
    """Copies of a weight (`make()` each) that together hold about ROTATE_BYTES (at most 20: the calls per graph),
    so that the 20 captured calls read HBM as a model's layers do, not the L2 cache."""
    return [make() for _ in range(max(1, min(20, -(-ROTATE_BYTES // nbytes))))]


def cycling(fn, items: list):
    """A callable that calls fn on the next item each time (the captured calls walk the copies)."""
    state = {"i": 0}

    def call():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return fn(item)
    return call


def sweep(dev: str) -> dict:
    """The decode tiles with the least summed GPU time over an fp8 (wq_b, M = 1) and an fp4 (expert w1, M = 8)
    call; sets `packed_gemm.DECODE_CONFIG` and returns the table."""
    cases = []
    for kind, N, K, M in (("fp8", 64 * 512, 1280, 1), ("fp4", 2304, 5120, 8)):
        codes, scale = pack_weight(torch.randn(N, K, device=dev) * K ** -0.5, kind)
        pws = rotating(lambda: PackedWeight(codes.clone(), scale.clone(), kind, (N, K), torch.bfloat16),
                       codes.numel() + scale.numel())
        cases.append((pws, qdq_fp8(torch.randn(M, K, device=dev, dtype=torch.bfloat16))))
    table = []
    for bn in (64, 128, 256):
        for unroll in (1, 2, 4):
            for warps in (4, 8):
                packed_gemm.DECODE_CONFIG.update(block_n=bn, unroll=unroll, num_warps=warps)
                t = sum(cuda_time(cycling(lambda w: packed_linear_triton(x, w), pws)) for pws, x in cases)
                table.append({"block_n": bn, "unroll": unroll, "num_warps": warps, "seconds": t})
                print(f"sweep BN {bn:3d} U {unroll} warps {warps}: {t * 1e6:7.1f} us", flush=True)
    best = min(table, key=lambda r: r["seconds"])
    packed_gemm.DECODE_CONFIG.update({k: best[k] for k in ("block_n", "unroll", "num_warps")})
    print(f"decode tiles: {packed_gemm.DECODE_CONFIG}")
    return {"sweep": table, "decode_config": dict(packed_gemm.DECODE_CONFIG)}


def sweep_buckets(dev: str) -> dict:
    """The tiles of the 32- and 64-row buckets (`packed_gemm.DECODE_CONFIGS`): least summed GPU time over an fp8
    (wo_b) and an fp4 (expert w1) call of that many rows; sets the buckets and returns the table."""
    table = []
    for M in (32, 64):
        cases = []
        for kind, N, K in (("fp8", 5120, 8192), ("fp4", 2304, 5120)):
            codes, scale = pack_weight(torch.randn(N, K, device=dev) * K ** -0.5, kind)
            pws = rotating(lambda: PackedWeight(codes.clone(), scale.clone(), kind, (N, K), torch.bfloat16),
                           codes.numel() + scale.numel())
            cases.append((pws, qdq_fp8(torch.randn(M, K, device=dev, dtype=torch.bfloat16))))
        cfg = packed_gemm.DECODE_CONFIGS[M]
        rows = []
        for bm in sorted({16, 32, M}):
            for bn in (64, 128, 256):
                for unroll in (1, 2):
                    for warps in (4, 8):
                        cfg.update(block_m=bm, block_n=bn, unroll=unroll, num_warps=warps)
                        try:
                            t = sum(cuda_time(cycling(lambda w: packed_linear_triton(x, w), pws)) for pws, x in cases)
                        except Exception as e:   # a tile that does not compile (registers, shared memory)
                            print(f"sweep M {M} BM {bm} BN {bn} U {unroll} warps {warps}: {type(e).__name__}")
                            continue
                        rows.append({"M": M, "block_m": bm, "block_n": bn, "unroll": unroll, "num_warps": warps,
                                     "seconds": t})
                        print(f"sweep M {M} BM {bm:3d} BN {bn:3d} U {unroll} warps {warps}: {t * 1e6:7.1f} us",
                              flush=True)
        best = min(rows, key=lambda r: r["seconds"])
        cfg.update({k: best[k] for k in ("block_m", "block_n", "unroll", "num_warps")})
        print(f"decode tiles, {M} rows: {cfg}")
        table += rows
    return {"sweep_buckets": table, "decode_configs": {str(k): dict(v) for k, v in packed_gemm.DECODE_CONFIGS.items()}}


def sweep_fp8_decode(dev: str) -> dict:
    """The FP8 tensor-core decode kernel (`fp8_decode.FP8_DECODE_CONFIG`): least summed GPU time over wq_b (fp8, 1
    row), wo_b (fp8, 32 rows) and an expert's w1 (fp4, 8 rows); then, at 1 to 64 rows, every decode shape on it
    against the path packed_linear_triton takes without it, which sets `FP8_DECODE_FROM` per weight kind (the
    fewest rows from which it wins, summed over the kind's shapes, at that and every larger row count)."""
    cases = {}
    for name, kind, N, K in SHAPES:
        codes, scale = pack_weight(torch.randn(N, K, device=dev) * K ** -0.5, kind)
        cases[name] = rotating(lambda: PackedWeight(codes.clone(), scale.clone(), kind, (N, K), torch.bfloat16),
                               codes.numel() + scale.numel())
    counts = (1, 2, 4, 8, 16, 32, 64)
    xs = {(name, M): qdq_fp8(torch.randn(M, pws[0].shape[1], device=dev, dtype=torch.bfloat16))
          for name, pws in cases.items() for M in counts}
    cfg = fp8_decode.FP8_DECODE_CONFIG
    table = []
    for bn in (64, 128, 256):
        for warps in (4,):
            for stages in (3, 5):
                for per_sm in (1, 2, 4):
                    cfg.update(block_n=bn, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
                    try:
                        t = sum(cuda_time(cycling(lambda w: fp8_decode.fp8_decode_triton(xs[n, M], w), cases[n]))
                                for n, M in (("wq_b", 1), ("wo_b", 32), ("expert w1", 8)))
                    except Exception as e:   # registers / shared memory
                        print(f"sweep fp8 decode BN {bn} warps {warps} stages {stages}: {type(e).__name__}")
                        continue
                    table.append({"block_n": bn, "num_warps": warps, "num_stages": stages,
                                  "programs_per_sm": per_sm, "seconds": t})
                    print(f"sweep fp8 decode BN {bn:3d} warps {warps} stages {stages} per SM {per_sm}: "
                          f"{t * 1e6:7.1f} us", flush=True)
    best = min(table, key=lambda r: r["seconds"])
    cfg.update({k: v for k, v in best.items() if k != "seconds"})
    print(f"fp8 decode tiles: {cfg}")
    rows, wins = [], {}
    fp8_decode.FP8_DECODE_FROM.update(fp8=65, fp4=65)                  # the other decode kernel
    for M in counts:
        t_other = {n: cuda_time(cycling(lambda w: packed_linear_triton(xs[n, M], w), pws)) for n, pws in cases.items()}
        t_fp8 = {n: cuda_time(cycling(lambda w: fp8_decode.fp8_decode_triton(xs[n, M], w), pws))
                 for n, pws in cases.items()}
        for n in cases:
            rows.append({"M": M, "weight": n, "fp8_decode_s": t_fp8[n], "other_s": t_other[n]})
            print(f"fp8 decode vs the other kernels M {M:2d} {n:11s}: {t_fp8[n] * 1e6:7.1f} vs "
                  f"{t_other[n] * 1e6:7.1f} us", flush=True)
        for kind in ("fp8", "fp4"):
            names = [n for n, k, _, _ in SHAPES if k == kind]
            wins[kind, M] = sum(t_fp8[n] for n in names) < sum(t_other[n] for n in names)
    start = {}
    for kind in ("fp8", "fp4"):                # the fewest rows from which it wins at every larger count
        start[kind] = 65
        for M in reversed(counts):
            if not wins[kind, M]:
                break
            start[kind] = M
    fp8_decode.FP8_DECODE_FROM.update(start)
    print(f"FP8_DECODE_FROM = {fp8_decode.FP8_DECODE_FROM}")
    return {"sweep_fp8_decode": table, "fp8_decode_vs_other": rows, "fp8_decode_config": dict(cfg),
            "fp8_decode_from": dict(fp8_decode.FP8_DECODE_FROM)}


def moe_weights(dev: str, g: torch.Generator) -> dict:
    """v41-geometry's routed experts (fp4) and shared expert (fp8) held packed: {"w1": [...], "w3": [...], ...}."""
    ws = {n: [] for n in ("w1", "w3", "w2")}
    for e in range(EXPERTS + 1):
        kind = "fp8" if e == EXPERTS else "fp4"
        for n, shape in (("w1", (INTER, DIM)), ("w3", (INTER, DIM)), ("w2", (DIM, INTER))):
            codes, scale = pack_weight(torch.randn(*shape, device=dev, generator=g) * shape[1] ** -0.5, kind)
            ws[n].append(PackedWeight(codes, scale, kind, shape, torch.bfloat16))
    return ws


def sweep_moe(dev: str) -> dict:
    """The MoE kernels' tiles over packed experts (`moe_kernel.CONFIG`'s packed_* keys): least summed GPU time of
    the decode op at 1 and 32 tokens; sets them and returns the table."""
    g = torch.Generator(device=dev).manual_seed(1)
    ws = moe_weights(dev, g)
    cases = []
    for B in (1, 32):
        x = torch.randn(B, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        idx = torch.rand(B, EXPERTS, device=dev, generator=g).argsort(1)[:, :TOPK]
        cases.append((x, idx, torch.rand(B, TOPK, device=dev, generator=g)))
    table = []
    for bf in (32, 64, 128):
        for bd in (32, 64, 128):
            for unroll in (2, 4):
                for warps in (4, 8):
                    over = {"packed_block_f": bf, "packed_down_block_d": bd, "packed_unroll": unroll,
                            "packed_num_warps": warps}
                    try:
                        t = sum(cuda_time(lambda: moe_experts_triton(x, idx, wts, ws["w1"], ws["w3"], ws["w2"], 10.0,
                                                                     True, True, **over)) for x, idx, wts in cases)
                    except Exception as e:
                        print(f"sweep MoE {over}: {type(e).__name__}")
                        continue
                    table.append({**over, "seconds": t})
                    print(f"sweep MoE BF {bf:3d} BD {bd:3d} U {unroll} warps {warps}: {t * 1e6:7.1f} us", flush=True)
    best = min(table, key=lambda r: r["seconds"])
    moe_kernel.CONFIG.update({k: v for k, v in best.items() if k != "seconds"})
    split_table = []
    for split in (1, 2, 4, 8, 16):
        for per_sm in (2, 4, 8):
            over = {"packed_split": split, "packed_programs_per_sm": per_sm}
            t = sum(cuda_time(lambda: moe_experts_triton(x, idx, wts, ws["w1"], ws["w3"], ws["w2"], 10.0, True, True,
                                                         **over)) for x, idx, wts in cases)
            split_table.append({**over, "seconds": t})
            print(f"sweep MoE split {split:2d} programs/SM {per_sm}: {t * 1e6:7.1f} us", flush=True)
    best = min(split_table, key=lambda r: r["seconds"])
    moe_kernel.CONFIG.update({k: v for k, v in best.items() if k != "seconds"})
    print(f"MoE packed tiles: {moe_kernel.CONFIG}")
    return {"sweep_moe": table, "sweep_moe_split": split_table}


def sweep_prefill(dev: str) -> dict:
    """The prefill tiles of the FP8 tensor-core GEMM with the least summed GPU time over two M = 4096 calls (wq_b's
    and a shared expert's w1 shapes); sets `fp8_gemm.PREFILL_CONFIG` and returns the table."""
    cases = []
    for N, K in ((64 * 512, 1280), (2304, 5120)):
        codes, scale = pack_weight(torch.randn(N, K, device=dev) * K ** -0.5, "fp8")
        cases.append((PackedWeight(codes, scale, "fp8", (N, K), torch.bfloat16),
                      qdq_fp8(torch.randn(4096, K, device=dev, dtype=torch.bfloat16))))
    table = []
    for bm, bn, warps in ((64, 128, 4), (128, 128, 8), (128, 256, 8), (64, 256, 4)):
        for stages in (3, 5):
            for blocks in (1, 2):
                fp8_gemm.PREFILL_CONFIG.update(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                                               blocks=blocks)
                try:
                    t = sum(cuda_time(lambda: fp8_gemm.fp8_linear_triton(x, w)) for w, x in cases)
                except Exception as e:              # a tile that does not fit the SM's shared memory
                    print(f"sweep prefill BM {bm} BN {bn} warps {warps} stages {stages} blocks {blocks}: "
                          f"{type(e).__name__}")
                    continue
                table.append({"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages,
                              "blocks": blocks, "seconds": t})
                print(f"sweep prefill BM {bm:3d} BN {bn:3d} warps {warps} stages {stages} blocks {blocks}: "
                      f"{t * 1e6:7.1f} us", flush=True)
    best = min(table, key=lambda r: r["seconds"])
    fp8_gemm.PREFILL_CONFIG.update({k: best[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "blocks")})
    print(f"prefill tiles: {fp8_gemm.PREFILL_CONFIG}")
    return {"sweep_prefill": table, "prefill_config": dict(fp8_gemm.PREFILL_CONFIG)}


def fp8_rate(dev: str) -> float | None:
    """torch's per-tensor FP8 GEMM (`torch._scaled_mm`) at 8192 x 5120 x 5120: the FP8 tensor cores' rate here."""
    try:
        a = torch.randn(8192, 5120, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(5120, 5120, device=dev).to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        return 2 * 8192 * 5120 * 5120 / cuda_time(lambda: torch._scaled_mm(a, b.T, one, one,
                                                                            out_dtype=torch.bfloat16), 5)
    except Exception as e:  # pragma: no cover - a torch without it
        print(f"no FP8 reference rate: {type(e).__name__}: {e}")
        return None


def moe_rows(dev: str, bw: float) -> list[dict]:
    """The MoE op of one decode step over B tokens (top-6 of 16 fp4 routed experts + the fp8 shared expert, held
    packed) against the same op over the dense bf16 twins: GPU time, and bytes/s on the packed bytes of the experts
    the step touches (w1, w3, w2 of each)."""
    g = torch.Generator(device=dev).manual_seed(0)
    ws = moe_weights(dev, g)
    dense = {n: [w.dequant() for w in v] for n, v in ws.items()}
    rows = []
    for B in TOKENS:
        x = torch.randn(B, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        idx = torch.rand(B, EXPERTS, device=dev, generator=g).argsort(1)[:, :TOPK]
        wts = torch.rand(B, TOPK, device=dev, generator=g)
        touched = sorted(set(idx.flatten().tolist())) + [EXPERTS]
        nbytes = sum(ws[n][e].nbytes for n in ws for e in touched)
        t_p = cuda_time(lambda: moe_experts_triton(x, idx, wts, ws["w1"], ws["w3"], ws["w2"], 10.0, True, True))
        t_8 = cuda_time(lambda: moe_experts_triton(x, idx, wts, ws["w1"], ws["w3"], ws["w2"], 10.0, True, True,
                                                   packed_fp8_mma=1))                  # the FP8 tensor cores
        t_d = cuda_time(lambda: moe_experts_triton(x, idx, wts, ws["w1"], ws["w3"], ws["w2"], 10.0, True, True,
                                                   packed_fp8_mma=0))                  # the bf16-decode kernels
        t_b = cuda_time(lambda: moe_experts_triton(x, idx, wts, dense["w1"], dense["w3"], dense["w2"], 10.0, True,
                                                   True))
        route_max, moe_kernel.ROUTE_MAX_PAIRS = moe_kernel.ROUTE_MAX_PAIRS, 0     # the torch routing (~14 kernels)
        t_r = cuda_time(lambda: moe_experts_triton(x, idx, wts, ws["w1"], ws["w3"], ws["w2"], 10.0, True, True))
        moe_kernel.ROUTE_MAX_PAIRS = route_max
        rows.append({"tokens": B, "experts_touched": len(touched), "packed_s": t_p, "packed_fp8_mma_s": t_8,
                     "packed_bf16_decode_s": t_d, "packed_torch_routing_s": t_r,
                     "bf16_s": t_b,
                     "speedup_vs_bf16": t_b / t_p, "bytes": nbytes, "bytes_per_s": nbytes / t_p,
                     "share_of_copy_bw": nbytes / t_p / bw})
        print(f"MoE B {B:3d}: {len(touched):2d} experts, packed {t_p * 1e6:7.1f} us, bf16 {t_b * 1e6:7.1f} us, "
              f"x {t_b / t_p:.2f}, {nbytes / t_p / 1e12:.2f} TB/s ({nbytes / t_p / bw * 100:.0f}% of copy); FP8 tensor "
              f"cores {t_8 * 1e6:7.1f} us, bf16 decode {t_d * 1e6:7.1f} us, torch routing {t_r * 1e6:7.1f} us",
              flush=True)
    return rows


def sweep_gate(dev: str) -> dict:
    """The MoE gate kernel (a program per token: the [E, D] fp32 GEMV, scores, top-K) per GATE_CONFIG setting, GPU
    time at 1 and 32 tokens, beside the torch reference (~11 kernels)."""
    from dsv41.kernels.moe_ref import moe_gate_ref
    g = torch.Generator(device=dev).manual_seed(2)
    w = torch.randn(EXPERTS, DIM, device=dev, generator=g) * DIM ** -0.5
    bias = torch.randn(EXPERTS, device=dev, generator=g) * 0.01
    table = []
    for n in (1, 32):
        x = torch.randn(n, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        args = (x, w, bias, TOPK, "sqrtsoftplus", 1.0, True, 1.5)
        ref_t = cuda_time(lambda: moe_gate_ref(*args))
        ref = moe_gate_ref(*args)
        for bk in (0, 512, 1024, 2048):
            for warps in (4, 8, 16):
                over = {"block_k": bk, "num_warps": warps}
                t = cuda_time(lambda: moe_kernel.moe_gate_triton(*args, **over))
                out = moe_kernel.moe_gate_triton(*args, **over)
                same = bool(torch.equal(out[1], ref[1]))
                err = float((out[2] - ref[2]).abs().max())
                table.append({"tokens": n, **over, "seconds": t, "torch_seconds": ref_t, "indices_equal": same,
                              "scores_max_abs_err": err})
                print(f"gate N {n:2d} BK {bk:4d} warps {warps:2d}: {t * 1e6:6.1f} us (torch {ref_t * 1e6:6.1f}), "
                      f"indices equal {same}, scores err {err:.1e}", flush=True)
    return {"sweep_gate": table}


def main() -> None:
    dev = "cuda"
    if "--sweep-gate" in sys.argv:
        print(json.dumps(sweep_gate(dev)))
        return
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / cuda_time(lambda: dst.copy_(src), 5)
    src = dst = None
    a, b = (torch.randn(8192, 5120, device=dev, dtype=torch.bfloat16) for _ in range(2))
    rate = 2 * 8192 * 5120 * 5120 / cuda_time(lambda: a @ b.T, 5)
    a = b = None
    rate8 = fp8_rate(dev)
    res = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": bw, "bf16_gemm_rate": rate,
           "fp8_gemm_rate_per_tensor": rate8, "rows": [], "command": " ".join(["python"] + sys.argv),
           "commit": os.environ.get("COMMIT", "")}
    if "--sweep-fp8-decode" in sys.argv or "--sweep" in sys.argv:
        res.update(sweep_fp8_decode(dev))
    if "--sweep" in sys.argv:
        res.update(sweep(dev))
        res.update(sweep_buckets(dev))
        res.update(sweep_moe(dev))
    if ("--sweep" in sys.argv and "--no-prefill-sweep" not in sys.argv) or "--sweep-prefill" in sys.argv:
        res.update(sweep_prefill(dev))
    res["decode_config"] = dict(packed_gemm.DECODE_CONFIG)
    res["fp8_decode_config"] = dict(fp8_decode.FP8_DECODE_CONFIG)
    res["fp8_decode_from"] = dict(fp8_decode.FP8_DECODE_FROM)
    res["decode_configs"] = {str(k): dict(v) for k, v in packed_gemm.DECODE_CONFIGS.items()}
    res["moe_config"] = dict(moe_kernel.CONFIG)
    res["prefill_config"] = dict(fp8_gemm.PREFILL_CONFIG)
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s, FP8 (per-tensor, torch) "
          f"{(rate8 or 0) / 1e12:.0f} TFLOP/s")
    print(f"{'weight':11s}{'kind':>5}{'M':>6}{'packed us':>11}{'bf16 us':>9}{'deq+mm us':>10}{'x bf16':>8}"
          f"{'TB/s':>7}{'%bw':>6}{'TFLOP/s':>9}{'%mma':>6}")
    for name, kind, N, K in ([] if "--moe-only" in sys.argv else SHAPES):
        w = torch.randn(N, K, device=dev) * K ** -0.5
        codes, scale = pack_weight(w, kind)
        pw = PackedWeight(codes, scale, kind, (N, K), torch.bfloat16)
        pws = rotating(lambda: PackedWeight(codes.clone(), scale.clone(), kind, (N, K), torch.bfloat16), pw.nbytes)
        wbs = rotating(pw.dequant, 2 * N * K)
        for M in ROWS:
            x = qdq_fp8(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
            t_p = cuda_time(cycling(lambda w: packed_linear_triton(x, w), pws))
            t_b = cuda_time(cycling(lambda w: x @ w.T, wbs))
            t_d = cuda_time(cycling(lambda w: x @ w.dequant().T, pws))
            t_f = (cuda_time(cycling(lambda w: fp8_gemm.fp8_linear_triton(x, w), pws))
                   if kind == "fp8" and M > packed_gemm.DECODE_ROWS else None)      # the FP8 tensor-core GEMM
            nbytes = pw.nbytes + (2 * M * (K + N) if M > 64 else 0)
            row = {"weight": name, "kind": kind, "N": N, "K": K, "M": M, "packed_s": t_p, "bf16_s": t_b,
                   "dequant_matmul_s": t_d, "speedup_vs_bf16": t_b / t_p, "bytes": nbytes,
                   "bytes_per_s": nbytes / t_p, "share_of_copy_bw": nbytes / t_p / bw,
                   "flops_per_s": 2 * M * N * K / t_p, "share_of_bf16_rate": 2 * M * N * K / t_p / rate,
                   "share_of_fp8_rate": 2 * M * N * K / t_p / rate8 if rate8 else None, "fp8_tensor_core_s": t_f}
            res["rows"].append(row)
            print(f"{name:11s}{kind:>5}{M:>6}{t_p * 1e6:>11.1f}{t_b * 1e6:>9.1f}{t_d * 1e6:>10.1f}"
                  f"{row['speedup_vs_bf16']:>8.2f}{row['bytes_per_s'] / 1e12:>7.2f}"
                  f"{row['share_of_copy_bw'] * 100:>6.0f}"
                  f"{row['flops_per_s'] / 1e12:>9.1f}{row['share_of_bf16_rate'] * 100:>6.0f}"
                  + (f"  fp8 tensor cores {t_f * 1e6:.1f} us (x {t_b / t_f:.2f} bf16)" if t_f else ""), flush=True)
    res["moe_decode"] = moe_rows(dev, bw)
    out = Path(os.environ.get("RESULT") or Path(__file__).parent / "results" / "packed_gemm_h200.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
