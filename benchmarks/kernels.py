"""Kernel benchmarks on one GPU: each Triton kernel next to its torch reference, on the same GPU in the same run.

    python benchmarks/kernels.py [--out results.json] [--quick]

Per kernel and shape: median time of the Triton kernel replayed from a CUDA graph (triton.testing.do_bench_cudagraph:
no Python launch cost; the decode attention's packed KV, 14 MB at B=64, then stays in the L2, the indexer's 72 MB
and the mHC's 420 MB do not), the reference's with triton.testing.do_bench (L2 cleared), achieved TFLOP/s and
GB/s, their fraction of the H200's limits (4.8 TB/s HBM, ~790 TFLOP/s dense bf16 as measured here), the
reference's time and the speed-up, and the relative error ||out - ref|| / ||ref|| against the reference. Small
configuration sweeps pick each kernel's best launch parameters per shape (all of them are listed in the JSON).
Prints a table, then one JSON line.

Counting. Attention: 4*H*D FLOPs per (query, selected entry) (q.k and p.v), bytes = the packed records read (528
per window row, 288 per compressed entry) + q and out in bf16 + the int32 index lists. Indexer: 2*J*I FLOPs per
(row, entry); bytes = the 68-byte key records + the fp32 scores written. mHC: the lower bound (2S+2)*D bf16 values
per token (streams and f read, streams and h written) + 48 fp32 coefficients; FLOPs = the 24-row projection.

Inputs are random packed bytes built on the GPU (valid codes: no E4M3 NaN, scales in the range real data takes),
never zeros.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

LIMITS = {"hbm_TBps": 4.8, "bf16_TFLOPs": 790.0}
DEV = os.environ.get("DSV41_BENCH_DEVICE", "cuda")      # "cpu" only for dry runs under TRITON_INTERPRET=1


def bench(fn, rep: int = 100) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e-3


def bench_graph(fn, rep: int = 100) -> float:
    """Median time of fn replayed from a CUDA graph (no Python launch cost between calls; the L2 is not cleared,
    which matters only for inputs that fit in it); falls back to `bench` when fn cannot be captured."""
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e-3
    except Exception as e:  # capture needs no host syncs inside fn
        say(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing with do_bench)")
        return bench(fn, rep)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def ceilings() -> dict:
    """The two ceilings of METHOD.md, measured once: a device copy (bytes read + written), a bf16 matmul."""
    x = torch.empty(2 ** 28, dtype=torch.float32, device=DEV).uniform_()
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    tm = bench(lambda: a @ b)
    return {"copy_TBps": 2 * x.numel() * 4 / t / 1e12, "matmul_bf16_TFLOPs": 2 * 8192 ** 3 / tm / 1e12}


# ------------------------------------------------------------------------------------------ inputs (GPU, random)

def rand_e4m3(shape, lo=0, hi=0x7E):
    """Random E4M3 bytes with magnitudes in [lo, hi] (no NaN) and random signs."""
    mag = torch.randint(lo, hi + 1, shape, device=DEV, dtype=torch.int32)
    return (mag | (torch.randint(0, 2, shape, device=DEV, dtype=torch.int32) << 7)).to(torch.uint8)


def packed_attn_inputs(B, H=64, D=512, W=128, K=512, P=64, n=8192, seed=0):
    """Decode at a context of 2n tokens (m = 2): every row has n compressed entries on shuffled pages, its ring is
    full, and its top-k holds K distinct entries."""
    torch.manual_seed(seed)
    ring = torch.cat([rand_e4m3((B, W, D)),
                      torch.randint(118, 125, (B, W, D // 32), device=DEV, dtype=torch.uint8)], dim=-1)
    n_pages = B * (-(-n // P))
    pages = torch.cat([torch.randint(0, 256, (n_pages, P, D // 2), device=DEV, dtype=torch.uint8),
                       rand_e4m3((n_pages, P, D // 16), 0x28, 0x38)], dim=-1)
    table = torch.randperm(n_pages, device=DEV).int().view(B, -1)
    topk = torch.rand(B, n, device=DEV).topk(K, dim=-1).indices.sort(dim=-1).values.int()
    from dsv41.kernels import decode_window_rows
    win = decode_window_rows(torch.full((B,), 2 * n, device=DEV), W)
    q = torch.randn(B, H, D, device=DEV).bfloat16()
    sink = torch.randn(H, device=DEV)
    slots = torch.randperm(B, device=DEV).int()
    return (q, ring, slots, win, pages, table, topk, sink, D ** -0.5)


def index_inputs(B, N, J=32, I=128, P=64, seed=0):
    from dsv41.codecs import qdq_index_q
    torch.manual_seed(seed)
    n_pages = B * (-(-N // P))
    pages = torch.cat([torch.randint(0, 256, (n_pages, P, I // 2), device=DEV, dtype=torch.uint8),
                       torch.randint(122, 130, (n_pages, P, I // 32), device=DEV, dtype=torch.uint8)], dim=-1)
    table = torch.randperm(n_pages, device=DEV).int().view(B, -1)
    q = qdq_index_q(torch.randn(B, J, I, device=DEV)).bfloat16()
    w = (torch.randn(B, J, device=DEV) / 8).bfloat16()
    return q, w, pages, table, torch.full((B,), N, device=DEV, dtype=torch.int32)


# ------------------------------------------------------------------------------------------ rows

CHECKPOINT: dict = {}      # the record so far and --out: rewritten after every row (a run cut short keeps its rows)


def checkpoint(rows, sweeps) -> None:
    if CHECKPOINT.get("path"):
        with open(CHECKPOINT["path"], "w") as f:
            json.dump({**CHECKPOINT["rec"], "rows": rows, "sweeps": sweeps, "partial": True}, f, indent=1)


def row(kernel, shape, t, t_ref, flops, nbytes, err, cfg):
    say(f"ROW {kernel} {shape}: {t * 1e6:.1f} us, ref {None if t_ref is None else round(t_ref * 1e6, 1)} us, "
        f"{flops / t / 1e12:.1f} TFLOP/s, {nbytes / t / 1e9:.0f} GB/s, err {err}, {cfg}")
    return {"kernel": kernel, "shape": shape, "time_us": t * 1e6, "ref_time_us": None if t_ref is None else t_ref * 1e6,
            "speedup": None if t_ref is None else t_ref / t, "TFLOPs": flops / t / 1e12, "GBps": nbytes / t / 1e9,
            "pct_flops": 100 * flops / t / 1e12 / LIMITS["bf16_TFLOPs"],
            "pct_hbm": 100 * nbytes / t / 1e12 / LIMITS["hbm_TBps"], "rel_err": err, "config": cfg}


def say(*a) -> None:
    print(*a, flush=True)


def sweep(name, fn, ref_out, configs, sweep_log, which, err_fn=None, timer=None):
    """Time fn(**cfg) for each config (compile failures recorded, not fatal) -> (best time, best cfg, its error).
    which: the launcher's key in LAST (registers and spills of the compiled kernel are recorded); err_fn(out, ref)
    the error measure (default rel_err); timer: bench_graph (default) or bench."""
    from dsv41.kernels.triton.common import LAST
    best = (float("inf"), None, None)
    err_fn = err_fn or rel_err
    timer = timer or bench_graph
    for cfg in configs:
        try:
            LAST.pop(which, None)
            out = fn(**cfg)
            torch.cuda.synchronize()
            k = LAST.get(which)
            regs = {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None)}
            err = err_fn(out, ref_out) if ref_out is not None else None
            t = timer(lambda: fn(**cfg))
            sweep_log.append({"kernel": name, "config": cfg, "time_us": t * 1e6, "rel_err": err, **regs})
            say(f"  sweep {name} {cfg}: {t * 1e6:.1f} us err {err} {regs}")
            if (err is None or err < 2e-2) and t < best[0]:
                best = (t, cfg, err)
        except Exception as e:  # a config that does not compile or fits no SM is skipped, and listed
            sweep_log.append({"kernel": name, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            say(f"  sweep {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return best


# Launch-parameter sweeps of each kernel (its CONFIG is the best of earlier runs; benchmarks/results/README.md).
# Attention: the dense kernel's tiles behind the packed decode's staging kernel.
ATTN_CONFIGS = [dict(block_h=16, block_n=64, num_warps=4, num_stages=2),
                dict(block_h=32, block_n=64, num_warps=4, num_stages=2),
                dict(block_h=64, block_n=64, num_warps=8, num_stages=2),
                dict(block_h=32, block_n=64, num_warps=4, num_stages=2, num_splits=2)]
STAGE_CONFIGS = [dict(block_n=bn, num_warps=nw) for bn, nw in ((32, 4), (16, 4), (64, 8), (32, 8))]
DENSE_CONFIGS = [dict(block_h=16, block_n=64, num_warps=4, num_stages=2), dict(block_h=64, block_n=32, num_warps=8)]
# indexer (the v3 kernel at these shapes): tiles_per_program None = the launcher's choice (one wave of 4 programs
# per SM).
INDEX_CONFIGS = [dict(block_n=64, num_warps=4), dict(block_n=64, num_warps=4, tiles_per_program=16),
                 dict(block_n=128, num_warps=8, tiles_per_program=16)]


def mhc_inputs(T, D=5120, S=4, seed=0):
    torch.manual_seed(seed)
    M = (2 + S) * S
    comb = torch.rand(1, T, S, S, device=DEV)
    return (torch.randn(1, T, D, device=DEV).bfloat16(), torch.randn(1, T, S, D, device=DEV).bfloat16(),
            2 * torch.rand(1, T, S, device=DEV), comb / comb.sum(-2, keepdim=True),
            torch.rand(1, T, S, device=DEV), torch.randn(M, S * D, device=DEV) / (S * D) ** 0.5,
            torch.rand(3, device=DEV) + 0.5, torch.randn(M, device=DEV) * 0.5,
            (1 + 0.1 * torch.randn(D, device=DEV)).bfloat16(), 20, 1e-6, 1e-20, 1e-20)


def mhc_err(out, ref) -> float:
    """Worst of the five outputs' relative errors."""
    return max(rel_err(o, r) for o, r in zip(out, ref))


SECTIONS = ("attn", "indexer", "mhc", "dense", "quant", "moe")
MOE_CONFIGS = [dict(), dict(up_block_f=64), dict(down_block_d=64), dict(up_block_d=256, down_block_f=256),
               dict(num_warps=8, up_block_f=64, down_block_d=64)]


def moe_rows(rows, sweeps, Ns=(1, 16, 64), D=5120, F=2304, E=16, K=6):
    """The MoE layer's experts at the v41-geometry shape (D 5120, F 2304, 16 routed experts, 6 active + shared):
    the fused op (moe_experts_triton, graph-timed) against the model's module loop (what ran before: cuBLAS
    GEMMs and the Triton QDQ / SwiGLU per active expert, one host sync per layer; timed eagerly)."""
    import dataclasses
    from dsv41.config import load_config
    from dsv41.kernels.triton import moe_experts_triton
    from dsv41.model.moe import MoE
    cfg = dataclasses.replace(load_config("v41-geometry"), dim=D, moe_inter_dim=F, n_routed_experts=E,
                              n_activated_experts=K)
    torch.manual_seed(0)
    moe = MoE(cfg, layer_id=5, dtype=torch.bfloat16).to(DEV).requires_grad_(False)
    for p in moe.parameters():                          # random weights (quantization flags on, as the model)
        torch.nn.init.normal_(p, std=D ** -0.5) if p.dim() == 2 else torch.nn.init.normal_(p, std=0.1)
    w = moe.fused_weights()
    for N in Ns:
        x = torch.randn(N, D, device=DEV).bfloat16() * 3
        with torch.no_grad():
            weights, indices, _ = moe.gate(x)
            ref = moe.module_loop(x, indices, weights)
            t_ref = bench(lambda: moe.module_loop(x, indices, weights), rep=30)
            t, cfg, err = sweep(f"moe_experts N={N}", lambda **c: moe_experts_triton(
                x, indices, weights, *w[:3], moe.shared_experts.limit, *w[3:], **c), ref, MOE_CONFIGS, sweeps,
                'moe_up')
        n_exp = int(indices.unique().numel()) + 1
        nbytes = n_exp * 3 * D * F * 2
        flops = 2 * 3 * D * F * N * (K + 1)
        rows.append(row("moe_experts (routed + shared)", f"N={N} D={D} F={F} E={E} K={K} ({n_exp} experts read)", t,
                        t_ref, flops, nbytes, err, cfg))
        checkpoint(rows, sweeps)


def quant_rows(rows, sweeps) -> None:
    """FP8 quantizers (memory-bound): activation QDQ at a decode row and a prefill chunk, SWA-KV row packing."""
    from dsv41.codecs import pack_swa_kv, qdq_fp8
    from dsv41.kernels.triton import pack_swa_kv_triton, qdq_fp8_triton
    for T in (1, 4096):
        x = torch.randn(T, 5120, device=DEV).bfloat16()
        same = bool(torch.equal(qdq_fp8_triton(x), qdq_fp8(x)))
        t, t_ref = bench_graph(lambda: qdq_fp8_triton(x)), bench(lambda: qdq_fp8(x), rep=50)
        rows.append(row("qdq_fp8", f"T={T} K=5120 bf16", t, t_ref, 0, T * 5120 * 4, 0.0 if same else None,
                        {"bit_identical": same}))
        kv = torch.randn(T, 512, device=DEV).bfloat16()
        same = bool(torch.equal(pack_swa_kv_triton(kv), pack_swa_kv(kv, check_finite=False)))
        t = bench_graph(lambda: pack_swa_kv_triton(kv))
        t_ref = bench(lambda: pack_swa_kv(kv, check_finite=False), rep=50)
        rows.append(row("pack_swa_kv", f"T={T} d=512 bf16", t, t_ref, 0, T * (512 * 2 + 528), 0.0 if same else None,
                        {"bit_identical": same}))
        checkpoint(rows, sweeps)


def attn_rows(rows, sweeps) -> None:
    """Sparse attention decode over the packed store (the model's decode shape: 64 heads x 512, 128 + 512
    indices), and its first stage alone."""
    from dsv41.kernels import sparse_attn_packed_ref
    from dsv41.kernels.triton import sparse_attn_packed_triton
    from dsv41.kernels.triton.packed_staged import stage_packed_rows
    for B in (1, 16, 64, 128):
        args = packed_attn_inputs(B)
        H, D, KW, K = 64, 512, args[3].size(1), args[6].size(1)
        ref = sparse_attn_packed_ref(*args)
        t_ref = bench(lambda: sparse_attn_packed_ref(*args), rep=50)
        t, cfg, err = sweep(f"sparse_attn_packed B={B}", lambda **c: sparse_attn_packed_triton(*args, **c), ref,
                            ATTN_CONFIGS, sweeps, 'packed')
        flops = 4 * B * H * D * (KW + K)
        nbytes = B * (KW * 528 + K * 288 + 2 * H * D * 2 + (KW + K) * 4)
        rows.append(row("sparse_attn_packed (decode)", f"B={B} H={H} D={D} window={KW} topk={K}", t, t_ref, flops,
                        nbytes, err, cfg))
        want = stage_packed_rows(*args[1:7])[0]
        t_stage, stage_cfg, _ = sweep(f"stage_packed_rows B={B}", lambda **c: stage_packed_rows(*args[1:7], **c),
                                      want, STAGE_CONFIGS, sweeps, 'stage',
                                      err_fn=lambda o, r: float((o[0] != r).sum()))
        rows.append(row("  staged path: stage 1 (decode rows)", f"B={B} rows of {KW + K}x{D}", t_stage, None, 0,
                        B * (KW * 528 + K * 288 + (KW + K) * (2 * D + 4)), None, stage_cfg))
        checkpoint(rows, sweeps)
        del args, ref


def indexer_op_rows(rows, q, w, pages, table, n_vis, N) -> None:
    """The whole decode indexer op of the three layer kinds (full, candidate source, Reindex) at N entries."""
    from dsv41.kernels import indexer_topk_packed_ref
    from dsv41.kernels.triton import indexer_topk_packed_triton
    for label, kw in (("full", {}), ("candidate source (pool 2048x8)", dict(pool_blocks=2048)),
                      ("reindex (pool 16384 entries)", None)):
        if kw is None:
            _, pool = indexer_topk_packed_triton(q, w, pages, table, n_vis, 512, pool_blocks=2048, n_max=N)
            kw = dict(cand_blocks=pool)
        fr = lambda: indexer_topk_packed_ref(q, w, pages, table, n_vis, 512, n_max=N, **kw)       # noqa: E731
        ft = lambda: indexer_topk_packed_triton(q, w, pages, table, n_vis, 512, n_max=N, **kw)    # noqa: E731
        got, want = ft()[0], fr()[0]
        same = float((got.sort(-1).values == want.sort(-1).values).float().mean())
        t_op, t_op_ref = bench_graph(ft, rep=50), bench(fr, rep=30)
        n_scored = 16384 if "cand_blocks" in kw else N
        rows.append(row(f"indexer_topk {label}", f"B=1 N={N} topk=512", t_op, t_op_ref,
                        2 * n_scored * 32 * 128, n_scored * 72, None, {"same_ids_frac": same}))


def indexer_rows(rows, sweeps, quick: bool) -> None:
    """Indexer scores over packed MXFP4 keys (32 heads x 128), whole visible context."""
    from dsv41.kernels import indexer_scores_packed_ref
    from dsv41.kernels.triton import indexer_scores_packed_triton
    for B, N in ((1, 65536), (1, 1 << 20)) + (() if quick else ((4, 262144),)):
        q, w, pages, table, n_vis = index_inputs(B, N)
        ref = indexer_scores_packed_ref(q, w, pages, table, n_vis, None, N)
        t_ref = bench(lambda: indexer_scores_packed_ref(q, w, pages, table, n_vis, None, N), rep=50)
        t, cfg, _ = sweep(f"indexer_scores B={B} N={N}",
                          lambda **c: indexer_scores_packed_triton(q, w, pages, table, n_vis, None, N, **c), ref,
                          INDEX_CONFIGS, sweeps, 'indexer', err_fn=lambda o, r: float((o - r).abs().max()
                                                                                       / r.abs().max()))
        out = indexer_scores_packed_triton(q, w, pages, table, n_vis, None, N, **(cfg or {}))
        d = (out - ref).abs()
        err = float(d.max() / ref.abs().max())
        mism = float((d > 0).float().mean())
        rows.append(row("indexer_scores (packed)", f"B={B} N={N} J=32 I=128", t, t_ref, 2 * B * N * 32 * 128,
                        B * N * (68 + 4), err, {**(cfg or {}), "bf16_ulp_mismatch_frac": mism}))
        checkpoint(rows, sweeps)
        if B == 1 and N == 1 << 20:
            indexer_op_rows(rows, q, w, pages, table, n_vis, N)
        del q, w, pages, table, ref


def mhc_rows(rows, sweeps) -> None:
    """Fused mHC step (4 streams x 5120, 20 Sinkhorn iterations): bytes (2S+2)*D bf16 + 48 fp32 coefficients per
    token."""
    from dsv41.kernels import mhc_fused_ref
    from dsv41.kernels.triton import mhc_fused_triton
    for T in (4096, 16384):
        args = mhc_inputs(T)
        ref = mhc_fused_ref(*args)
        t_ref = bench(lambda: mhc_fused_ref(*args), rep=50)
        t, cfg, err = sweep(f"mhc_fused T={T}", lambda **c: mhc_fused_triton(*args), ref, [{}], sweeps, 'mhc',
                            err_fn=mhc_err)
        D, S = 5120, 4
        rows.append(row("mhc_fused", f"T={T} S={S} D={D}", t, t_ref, T * 2 * 24 * S * D,
                        T * ((2 * S + 2) * D * 2 + 48 * 4), err, cfg))
        checkpoint(rows, sweeps)
        del args, ref
        torch.cuda.empty_cache()


def dense_rows(rows, sweeps) -> None:
    """Dense-KV sparse attention: a prefill chunk and a decode batch."""
    from dsv41.kernels import sparse_attn_ref
    from dsv41.kernels.triton import sparse_attn_triton
    for B, T, N in ((1, 4096, 6144), (64, 1, 4096)):
        H, D, K = 64, 512, 640
        torch.manual_seed(1)
        q = torch.randn(B, T, H, D, device=DEV).bfloat16()
        kv = torch.randn(B, N, D, device=DEV).bfloat16()
        idx = torch.randint(0, N, (B, T, K), device=DEV).int()
        sink = torch.randn(H, device=DEV)
        ref = sparse_attn_ref(q, kv, sink, idx, D ** -0.5)
        t_ref = bench(lambda: sparse_attn_ref(q, kv, sink, idx, D ** -0.5), rep=50)
        t, cfg, err = sweep(f"sparse_attn B={B} T={T}",
                            lambda **c: sparse_attn_triton(q, kv, sink, idx, D ** -0.5, **c), ref,
                            DENSE_CONFIGS[1:] if T > 1 else DENSE_CONFIGS[:1], sweeps, 'dense')
        flops = 4 * B * T * H * D * K
        nbytes = B * T * (K * D * 2 + 2 * H * D * 2 + K * 4)      # gathered rows (each query re-reads its K rows)
        rows.append(row("sparse_attn (dense KV)", f"B={B} T={T} H={H} D={D} N={N} K={K}", t, t_ref, flops, nbytes,
                        err, cfg))
        del q, kv, idx, ref


def run(quick: bool, only: tuple = SECTIONS) -> dict:
    rows, sweeps = [], []
    for name, section in (("moe", lambda: moe_rows(rows, sweeps)), ("quant", lambda: quant_rows(rows, sweeps)),
                          ("attn", lambda: attn_rows(rows, sweeps)),
                          ("indexer", lambda: indexer_rows(rows, sweeps, quick)),
                          ("mhc", lambda: mhc_rows(rows, sweeps)), ("dense", lambda: dense_rows(rows, sweeps))):
        if name in only:
            section()
    return {"rows": rows, "sweeps": sweeps}


def git_commit() -> str:
    if os.environ.get("DSV41_GIT_COMMIT"):
        return os.environ["DSV41_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:
        return os.environ.get("DSV41_GIT_COMMIT", "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON record here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="these kernels only")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    import triton
    t0 = time.time()
    rec = {"benchmark": "kernels", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(),
           "command": " ".join(["python"] + sys.argv), "git_commit": git_commit(), "limits": LIMITS,
           "measured": ceilings()}
    CHECKPOINT.update(path=a.out, rec=dict(rec))
    rec.update(run(a.quick, tuple(a.only)))
    rec["wall_s"] = time.time() - t0
    print(f"\n{'kernel':<40} {'shape':<44} {'time us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'%flop':>6} {'%hbm':>5} "
          f"{'ref us':>9} {'speedup':>7} {'rel err':>8}")
    for r in rec["rows"]:
        ref = "-" if r["ref_time_us"] is None else f"{r['ref_time_us']:.1f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        er = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"{r['kernel']:<40} {r['shape']:<44} {r['time_us']:>9.1f} {r['TFLOPs']:>8.1f} {r['GBps']:>7.0f} "
              f"{r['pct_flops']:>5.1f}% {r['pct_hbm']:>4.0f}% {ref:>9} {sp:>7} {er:>8}")
    print(f"measured ceilings: copy {rec['measured']['copy_TBps']:.2f} TB/s, bf16 matmul "
          f"{rec['measured']['matmul_bf16_TFLOPs']:.0f} TFLOP/s; {rec['gpu']}, torch {rec['torch']}, "
          f"triton {rec['triton']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
