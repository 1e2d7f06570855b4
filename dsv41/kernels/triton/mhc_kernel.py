"""Triton fused mHC step (MODEL.md 2 items 3-6): twin of `dsv41.kernels.mhc_ref.mhc_fused_ref` (same signature).

Legend: N tokens (all leading dims), S = 4 streams, D width, M = 24 coefficients (padded to MP = 32), BT tokens per
program, BD channels per chunk.

One program per BT tokens walks D in chunks of BD and, per chunk, reads the 4 residual streams and f once:
  y_k  = post_k * f + sum_j comb[j,k] * x_j        fp32 in the reference's order, stored as bf16 (hc_post),
  sum of y_k^2 (the mixes' RMS statistic, over all S*D values of the bf16 y),
  mix += y_k @ fn_k^T on the tensor cores, fn split into bf16 terms hi + mid + lo (fn = hi + mid + lo to ~2^-24,
         y is exact in bf16 and every product exact in fp32: the fp32 projection up to summation order),
  h    = sum_k pre_lag_k * y_k (fp32, the reference's order), stored as bf16, and its sum of squares.
Then mixes = mix * rsqrt(mean y^2 + norm_eps), the Sinkhorn split (pre, post, comb) in registers, and a second
walk over the program's own h (just written: L2 hits, not HBM) applies the RMSNorm: h * rsqrt(mean h^2 + eps) * w.
HBM traffic: x and f read once, y and h written once, (2S + 2) * D bf16 values per token, plus 48 fp32
coefficients per token; fn is read from L2 by every program (S*D*M*2*NSPLIT bytes per BT tokens). Multiply-adds
are not fused (enable_fp_fusion=False), as the reference's separate torch ops round.

Few tokens (a decode step) leave that design with one program on one SM walking all of D (~435 us per call at one
token on the H200). There the "split" path runs a program per (token, BD-chunk) computing y, the unnormalised h and
the chunk's partial projections (fp32 fn, fp32 products) and squares, and a finishing kernel sums the partials in
chunk order, computes the coefficients and applies the RMSNorm to h. Many tokens (the default above 64): the
"tiles" path does the same with a block of 64 tokens per program and 256 channels (16 tiles of 16, the loop
software-pipelined 3 deep through shared memory), the projections on the tensor cores (wgmma: 64 tokens = one
warpgroup's M) against fn read in fp32 and split into hi + mid + lo in registers (the bf16 terms are the ones
`split_weights` makes: the same results, 2/3 of the bytes from the L2), so blocks x chunks programs fill the GPU. Its
HBM traffic is the lower bound plus a second pass over h (read + write, ~20%) and the fp32 partials (32 per token
and chunk, 2.5 KB per token at D = 5120). H200, 4096 tokens, D = 5120 (results/kernels-mhc-2026-12-03b.json): 254 us
= 1652 GB/s = 34% of the 4.8 TB/s (lower-bound bytes), 18x the reference; 16384 tokens: 892 us, 1885 GB/s, 39%. Of
the 254 us, ~25 us are the finishing pass (timed alone). The tiled kernel is bound by issue and latency rather than
bytes: ~980 instructions per 64 x 16 tile and 152 registers (3 programs of 4 warps per SM); y's arithmetic (7
unfused operations per stream and element, as the reference rounds) and the bf16 <-> fp32 conversions are most of it.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from dsv41.kernels.triton.sparse_attn_kernel import _DOT_BF16, LAST

__all__ = ["mhc_fused_triton", "split_weights", "CONFIG"]

# Fused path: block_t 32 / block_d 64 / 8 warps (176 registers, no spills). Tiled path (the default above
# split_max_tokens; its present CONFIG, cat + cvt below, takes 220.4 us at 4096 tokens and 834.8 us at 16384,
# results/kernels-mhc-2026-12-04.json). Its first tile: 64 tokens x 16 channels per tile, 4 warps, 256 channels per
# program (tiles_chunk), loop pipelined 3 deep (tiles_num_stages), fn split in registers (tiles_wf32): 254 us at 4096 tokens, 892 us at 16384 (152
# registers, no spills; results/kernels-mhc-2026-12-03b.json) against 353 / 1356 us for the previous tiled kernel (one
# 16 x 128 tile per program, pre-split bf16 fn; 255 registers and spills compiled for sm_90 by Triton 3.9 here) and
# 519 us for the best fused config. Measured there and slower at 4096 tokens: 512 (268 us) or 1024 (267 us) channels
# per program (fewer waves of programs), and at 512: 2 stages (393 us) or 4 (272 us), the pre-split bf16 fn (318 us,
# 1.5x its bytes), 128 registers (384 us: spills), 128 tokens x 8 warps (325 us: one program per SM), 64 x 32 tiles
# of 8 warps (395 us), 32 x 32 tiles (350 us: mma v2, each warp recomputing), and the block's last program finishing
# the step in the same launch (an acq_rel counter per token block; 321 us: 188 registers, and one program then
# normalised 64 x D of h; removed).
# The finishing pass alone: 28 us (4 x 256 tiles), 23 us with 4 x 1024 (tiles_fin_block_d; not yet timed in the op).
# tiles_cat / tiles_cvt (one projection per tile over the 4 streams interleaved along K; y rounded two values per
# instruction): compiled for sm_90 here (Triton 3.9) they take 902 instead of 980 instructions per tile, 6 barriers
# instead of 24 and 128 registers (4 programs per SM). Timed on the H200 at 4096 tokens
# (results/kernels-2026-12-03c.json, the same outputs as the default there): 231 us, 226 us with 128-channel chunks
# and 4 stages, 221 us with 64 x 32 tiles and 2 stages (12 bytes of spills), against 257 us for the default in that
# run. Their ragged-shape GPU tests (tests/test_kernels_mhc.py, every MHC_TILES_VARIANTS entry at 4 shapes) passed
# on the H200 in session 5 (results/gpu_tests-2026-12-04.txt), so the fastest of them, cat + cvt on 64 x 32 tiles
# with 2 stages, is now the default; the earlier default (16-channel tiles, 3 stages, neither) stays a tested variant.
# The "wrong coefficients" that earlier GPU test runs showed for some non-default configs (in some runs, never y or h)
# were a stale `split_weights` cache entry: it was keyed by data_ptr, which a test's fresh fn could share with a
# freed one of the previous test. The cache now holds the tensor weakly and checks identity.
CONFIG = {"block_t": 32, "block_d": 64, "num_warps": 8, "num_stages": 1, "nsplit": 3, "split_max_tokens": 64,
          "split_block_d": 256, "large_impl": "tiles", "tiles_block_t": 64, "tiles_block_d": 32, "tiles_num_warps": 4,
          "tiles_chunk": 256, "tiles_num_stages": 2, "tiles_wf32": True, "tiles_cat": True, "tiles_cvt": True,
          "tiles_fin_block_t": 4, "tiles_fin_block_d": 256, "tiles_fin_stages": 1, "tiles_maxnreg": None}
MP = 32


@triton.jit
def _coefs(mix, sq, SD, norm_eps, scale_ptr, base_ptr, eps, M: tl.constexpr, ITERS: tl.constexpr,
           BLOCK_T: tl.constexpr):
    """[BLOCK_T, 32] projections (unnormalised) and sums of squares over the S*D stream values -> the coefficients
    [BLOCK_T, 32]: (pre | post | comb row-major | padding), the RMS statistic then `hc_split_sinkhorn`."""
    S: tl.constexpr = 4
    MPAD: tl.constexpr = 32
    mc = tl.arange(0, MPAD)
    rstd = 1.0 / tl.sqrt(sq / SD + norm_eps)
    mixes = mix * rstd[:, None]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    bs = tl.load(base_ptr + mc, mask=mc < M, other=0.0)
    smul = tl.where(mc < S, s0, tl.where(mc < 2 * S, s1, s2))
    z = mixes * smul[None, :] + bs[None, :]
    z3 = tl.reshape(z, (BLOCK_T, MPAD // S, S))                                           # row r = mixes 4r..4r+3
    r3 = tl.arange(0, MPAD // S)[None, :, None]
    cm = (r3 >= 2) & (r3 < 2 + S)                                                         # the comb rows j = r - 2
    zc = tl.where(cm, z3, 0.0)
    ex = tl.exp(zc - tl.max(zc, 2)[:, :, None])                                           # softmax over k
    C = tl.where(cm, ex / tl.sum(ex, 2)[:, :, None] + eps, 0.0)
    C = C / (tl.sum(C, 1)[:, None, :] + eps)                                              # column normalisation
    for _ in range(ITERS - 1):
        C = C / (tl.sum(C, 2)[:, :, None] + eps)                                          # rows
        C = C / (tl.sum(C, 1)[:, None, :] + eps)                                          # columns
    sg = tl.sigmoid(z)
    coef = tl.where(mc[None, :] < S, sg + eps, tl.where(mc[None, :] < 2 * S, 2 * sg, tl.reshape(C, (BLOCK_T, MPAD))))
    return coef


@triton.jit
def _norm_rows(h_ptr, nw_ptr, t, tm, hr, D, BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    """The RMSNorm of rows t of h in place, given their rsqrt statistics hr: w * (h * hr), rounded to bf16. STAGES:
    the loop's software-pipelining depth."""
    dd = tl.arange(0, BLOCK_D)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        d = d0 + dd
        dm = d < D
        m2 = tm[:, None] & dm[None, :]
        hv = tl.load(h_ptr + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        wv = tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(h_ptr + t[:, None] * D + d[None, :], (wv[None, :] * (hv * hr[:, None])).to(tl.bfloat16), mask=m2)


@triton.jit
def _mhc_fused_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, w3_ptr, scale_ptr, base_ptr, nw_ptr,
                      y_ptr, h_ptr, coef_ptr, N, D, eps, norm_eps, rms_eps,
                      M: tl.constexpr, ITERS: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_D: tl.constexpr, DOT_BF16: tl.constexpr):
    S: tl.constexpr = 4
    MPAD: tl.constexpr = 32
    pid = tl.program_id(0)
    t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < N
    dd = tl.arange(0, BLOCK_D)
    mc = tl.arange(0, MPAD)
    SD = S * D
    sq = tl.zeros([BLOCK_T], tl.float32)
    hq = tl.zeros([BLOCK_T], tl.float32)
    mix = tl.zeros([BLOCK_T, MPAD], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        dm = d < D
        m2 = tm[:, None] & dm[None, :]
        fv = tl.load(f_ptr + t[:, None] * D + d[None, :], mask=m2, other=0.0)
        xb = x_ptr + t[:, None] * SD + d[None, :]
        x0 = tl.load(xb, mask=m2, other=0.0)
        x1 = tl.load(xb + D, mask=m2, other=0.0)
        x2 = tl.load(xb + 2 * D, mask=m2, other=0.0)
        x3 = tl.load(xb + 3 * D, mask=m2, other=0.0)
        hacc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for k in tl.static_range(S):
            pk = tl.load(post_ptr + t * S + k, mask=tm, other=0.0)
            c0 = tl.load(comb_ptr + t * (S * S) + k, mask=tm, other=0.0)             # comb[j, k], j = 0..3
            c1 = tl.load(comb_ptr + t * (S * S) + S + k, mask=tm, other=0.0)
            c2 = tl.load(comb_ptr + t * (S * S) + 2 * S + k, mask=tm, other=0.0)
            c3 = tl.load(comb_ptr + t * (S * S) + 3 * S + k, mask=tm, other=0.0)
            acc = c0[:, None] * x0.to(tl.float32)
            acc = acc + c1[:, None] * x1.to(tl.float32)
            acc = acc + c2[:, None] * x2.to(tl.float32)
            acc = acc + c3[:, None] * x3.to(tl.float32)
            yb = (pk[:, None] * fv.to(tl.float32) + acc).to(tl.bfloat16)
            tl.store(y_ptr + t[:, None] * SD + k * D + d[None, :], yb, mask=m2)
            yf = yb.to(tl.float32)
            sq += tl.sum(yf * yf, 1)
            lk = tl.load(pre_ptr + t * S + k, mask=tm, other=0.0)
            hacc = hacc + lk[:, None] * yf
            for sp in range(NSPLIT):                                                   # not unrolled: one tile live
                wt = tl.load(w3_ptr + (sp * MPAD + mc[None, :]) * SD + k * D + d[:, None],
                             mask=dm[:, None] & (mc < M)[None, :], other=0.0)              # [BD, MP] bf16
                if DOT_BF16:                      # a fresh accumulator per chunk, summed in IEEE fp32 (the
                    mix += tl.dot(yb, wt)             # tensor cores' truncating accumulation stays within BD terms)
                else:
                    mix += tl.dot(yf, wt.to(tl.float32))
        hb = hacc.to(tl.bfloat16)
        tl.store(h_ptr + t[:, None] * D + d[None, :], hb, mask=m2)
        hf = hb.to(tl.float32)
        hq += tl.sum(hf * hf, 1)
    coef = _coefs(mix, sq, SD, norm_eps, scale_ptr, base_ptr, eps, M, ITERS, BLOCK_T)
    tl.store(coef_ptr + t[:, None] * M + mc[None, :], coef, mask=tm[:, None] & (mc < M)[None, :])
    # the pre-norm of the lagged collapse, over the h this program wrote
    hr = 1.0 / tl.sqrt(hq / D + rms_eps)
    tl.debug_barrier()
    _norm_rows(h_ptr, nw_ptr, t, tm, hr, D, BLOCK_D, 1)


@triton.jit
def _mhc_split_partial_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, fn_ptr, y_ptr, h_ptr, ws_ptr, D, NC,
                              M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Few tokens (decode): program (token t, chunk c) of BLOCK_D channels: y and the unnormalised h of the chunk
    (stored), and the chunk's partial projections (fp32 fn, exact fp32 products summed in registers) and sums of
    squares into ws[t, c, :] = (mix 0..M-1, sum y^2 at 30, sum h^2 at 31)."""
    S: tl.constexpr = 4
    MPAD: tl.constexpr = 32
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    mc = tl.arange(0, MPAD)
    SD = S * D
    fv = tl.load(f_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    x0 = tl.load(x_ptr + t * SD + d, mask=dm, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + t * SD + D + d, mask=dm, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + t * SD + 2 * D + d, mask=dm, other=0.0).to(tl.float32)
    x3 = tl.load(x_ptr + t * SD + 3 * D + d, mask=dm, other=0.0).to(tl.float32)
    sq = 0.0
    hacc = tl.zeros([BLOCK_D], tl.float32)
    mix = tl.zeros([MPAD], tl.float32)
    for k in tl.static_range(S):
        acc = tl.load(comb_ptr + t * (S * S) + k) * x0                                # comb[j, k], j = 0..3
        acc = acc + tl.load(comb_ptr + t * (S * S) + S + k) * x1
        acc = acc + tl.load(comb_ptr + t * (S * S) + 2 * S + k) * x2
        acc = acc + tl.load(comb_ptr + t * (S * S) + 3 * S + k) * x3
        yb = (tl.load(post_ptr + t * S + k) * fv + acc).to(tl.bfloat16)
        tl.store(y_ptr + t * SD + k * D + d, yb, mask=dm)
        yf = yb.to(tl.float32)
        sq += tl.sum(yf * yf, 0)
        hacc = hacc + tl.load(pre_ptr + t * S + k) * yf
        w = tl.load(fn_ptr + mc[:, None] * SD + k * D + d[None, :], mask=(mc < M)[:, None] & dm[None, :], other=0.0)
        mix += tl.sum(w * yf[None, :], 1)
    hb = hacc.to(tl.bfloat16)
    tl.store(h_ptr + t * D + d, hb, mask=dm)
    hf = hb.to(tl.float32)
    hq = tl.sum(hf * hf, 0)
    part = tl.where(mc == MPAD - 2, sq, tl.where(mc == MPAD - 1, hq, mix))
    tl.store(ws_ptr + (t * NC + c) * MPAD + mc, part)


@triton.jit
def _load4(ptr, tm, step):
    """Four per-token coefficients ptr[0], ptr[step], ptr[2 step], ptr[3 step] ([BLOCK_T] each)."""
    a = tl.load(ptr, mask=tm, other=0.0)
    b = tl.load(ptr + step, mask=tm, other=0.0)
    c = tl.load(ptr + 2 * step, mask=tm, other=0.0)
    d = tl.load(ptr + 3 * step, mask=tm, other=0.0)
    return a, b, c, d


@triton.jit
def _tile_stream(x0, x1, x2, x3, fv, pk, c0, c1, c2, c3, lk, yp, m2, wp, wmask, wstride, sq, hacc, mix,
                 NSPLIT: tl.constexpr, WF32: tl.constexpr, DOT_BF16: tl.constexpr, PROJ: tl.constexpr,
                 CVT: tl.constexpr):
    """Stream k of a [BLOCK_T, BLOCK_D] tile: y_k = post_k f + sum_j comb[j,k] x_j (the reference's order, fp32),
    stored bf16 at yp; its squares into sq, pre_lag_k y_k into hacc and, PROJ, y_k @ fn_k^T into mix (`_project`,
    fn_k's [BLOCK_D, 32] tile at wp). Returns them and the bf16 y_k."""
    acc = c0[:, None] * x0
    acc = acc + c1[:, None] * x1
    acc = acc + c2[:, None] * x2
    acc = acc + c3[:, None] * x3
    yv = pk[:, None] * fv + acc
    # y is rounded by an opaque instruction: computed once, in the tile's layout, and only then converted for the
    # dot (else Triton recomputes y from x and f in the dot operand's layout). CVT: the packed rounding (two values
    # per instruction, round to nearest even as .to(bf16)); else a copy, then .to(bf16).
    if DOT_BF16 and CVT:
        yb = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [yv], dtype=tl.bfloat16,
                                       is_pure=False, pack=2)
    else:
        if DOT_BF16:
            yv = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [yv], dtype=tl.float32, is_pure=False, pack=1)
        yb = yv.to(tl.bfloat16)
    tl.store(yp, yb, mask=m2)
    yf = yb.to(tl.float32)
    sq += tl.sum(yf * yf, 1)
    hacc = hacc + lk[:, None] * yf
    if PROJ:
        mix = _project(yb, yf, wp, wmask, wstride, mix, NSPLIT, WF32, DOT_BF16)
    return sq, hacc, mix, yb


@triton.jit
def _project(yb, yf, wp, wmask, wstride, mix, NSPLIT: tl.constexpr, WF32: tl.constexpr, DOT_BF16: tl.constexpr):
    """mix += y @ w on the tensor cores for the [K, 32] fn tile at wp: WF32, fp32, split here into NSPLIT bf16 terms
    (each the bf16 rounding of the remainder, as `split_weights`); else the NSPLIT pre-split bf16 terms at
    wp + sp * wstride."""
    if WF32:
        rest = tl.load(wp, mask=wmask, other=0.0)
    for sp in tl.static_range(NSPLIT):                 # unrolled: the chunk loop stays innermost (pipelined)
        if WF32:
            wt = rest.to(tl.bfloat16)
            if sp < NSPLIT - 1:
                rest = rest - wt.to(tl.float32)             # exact: the remainder of a bf16 rounding
        else:
            wt = tl.load(wp + sp * wstride, mask=wmask, other=0.0)
        if DOT_BF16:
            mix += tl.dot(yb, wt)
        else:
            mix += tl.dot(yf, wt.to(tl.float32))
    return mix


@triton.jit
def _finish_rows(ws_ptr, scale_ptr, base_ptr, nw_ptr, h_ptr, coef_ptr, t, tm, D, eps, norm_eps, rms_eps,
                 M: tl.constexpr, ITERS: tl.constexpr, NC: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    """Rows t: sum the NC chunks' partials ws[t, c, :] in chunk order, the coefficients (`_coefs`), and the RMSNorm
    of h in place (`_norm_rows`, STAGES deep)."""
    S: tl.constexpr = 4
    MPAD: tl.constexpr = 32
    mc = tl.arange(0, MPAD)
    tot = tl.zeros([BLOCK_T, MPAD], tl.float32)
    for c in range(NC):
        tot += tl.load(ws_ptr + (t[:, None] * NC + c) * MPAD + mc[None, :], mask=tm[:, None], other=0.0)
    sq = tl.sum(tl.where(mc[None, :] == MPAD - 2, tot, 0.0), 1)
    hq = tl.sum(tl.where(mc[None, :] == MPAD - 1, tot, 0.0), 1)
    mix = tl.where(mc[None, :] < M, tot, 0.0)
    coef = _coefs(mix, sq, S * D, norm_eps, scale_ptr, base_ptr, eps, M, ITERS, BLOCK_T)
    tl.store(coef_ptr + t[:, None] * M + mc[None, :], coef, mask=tm[:, None] & (mc < M)[None, :])
    hr = 1.0 / tl.sqrt(hq / D + rms_eps)
    _norm_rows(h_ptr, nw_ptr, t, tm, hr, D, BLOCK_D, STAGES)


@triton.jit
def _mhc_tiles_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr,
                      y_ptr, h_ptr, ws_ptr, N, D, M: tl.constexpr, NSPLIT: tl.constexpr, NC: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
                      WF32: tl.constexpr, CAT: tl.constexpr, CVT: tl.constexpr, DOT_BF16: tl.constexpr):
    """Many tokens: program (token block, chunk c of CHUNK channels; chunk fastest in the 1-D grid) walks its chunk
    in tiles of BLOCK_D channels, the loop software-pipelined STAGES deep (its loads are asynchronous copies into
    shared memory, STAGES - 1 tiles ahead), doing the fused kernel's per-tile work: y and the unnormalised h stored,
    the squares summed, the projections on the tensor cores; then writes the chunk's partials to ws[t, c, :] (mix
    0..M-1, sum y^2 at 30, sum h^2 at 31) for `_mhc_split_finish_kernel`. The projection: per stream against fn's
    [BLOCK_D, 32] tile (3 dots of K = BLOCK_D each), or CAT: one per tile, y's 4 streams interleaved along K
    (column 4 d + k) against fn with its columns permuted likewise (`split_weights(cat=True)`), 3 dots of K =
    4 BLOCK_D. The per-token coefficients are loaded once per program."""
    S: tl.constexpr = 4
    MPAD: tl.constexpr = 32
    pid = tl.program_id(0)
    c = pid % NC
    tb = pid // NC
    t = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < N
    dd = tl.arange(0, BLOCK_D)
    mc = tl.arange(0, MPAD)
    SD = S * D
    p0, p1, p2, p3 = _load4(post_ptr + t * S, tm, 1)
    l0, l1, l2, l3 = _load4(pre_ptr + t * S, tm, 1)
    c00, c10, c20, c30 = _load4(comb_ptr + t * (S * S), tm, S)                          # comb[j, 0], j = 0..3
    c01, c11, c21, c31 = _load4(comb_ptr + t * (S * S) + 1, tm, S)
    c02, c12, c22, c32 = _load4(comb_ptr + t * (S * S) + 2, tm, S)
    c03, c13, c23, c33 = _load4(comb_ptr + t * (S * S) + 3, tm, S)
    sq = tl.zeros([BLOCK_T], tl.float32)
    hq = tl.zeros([BLOCK_T], tl.float32)
    mix = tl.zeros([BLOCK_T, MPAD], tl.float32)
    wstride = MPAD * SD                                   # between the pre-split terms
    d_lo = c * CHUNK
    n_it = tl.cdiv(tl.minimum(D - d_lo, CHUNK), BLOCK_D)
    for i in tl.range(0, n_it, num_stages=STAGES):
        d = d_lo + i * BLOCK_D + dd
        dm = d < D
        m2 = tm[:, None] & dm[None, :]
        fv = tl.load(f_ptr + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        xb = x_ptr + t[:, None] * SD + d[None, :]
        x0 = tl.load(xb, mask=m2, other=0.0).to(tl.float32)
        x1 = tl.load(xb + D, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(xb + 2 * D, mask=m2, other=0.0).to(tl.float32)
        x3 = tl.load(xb + 3 * D, mask=m2, other=0.0).to(tl.float32)
        yp = y_ptr + t[:, None] * SD + d[None, :]
        wp = w_ptr + mc[None, :] * SD + d[:, None]                                          # [BD, MP]
        wmask = dm[:, None] & (mc < M)[None, :]
        hacc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        P: tl.constexpr = not CAT
        sq, hacc, mix, y0 = _tile_stream(x0, x1, x2, x3, fv, p0, c00, c10, c20, c30, l0, yp, m2, wp, wmask, wstride,
                                         sq, hacc, mix, NSPLIT, WF32, DOT_BF16, P, CVT)
        sq, hacc, mix, y1 = _tile_stream(x0, x1, x2, x3, fv, p1, c01, c11, c21, c31, l1, yp + D, m2, wp + D, wmask,
                                         wstride, sq, hacc, mix, NSPLIT, WF32, DOT_BF16, P, CVT)
        sq, hacc, mix, y2 = _tile_stream(x0, x1, x2, x3, fv, p2, c02, c12, c22, c32, l2, yp + 2 * D, m2,
                                         wp + 2 * D, wmask, wstride, sq, hacc, mix, NSPLIT, WF32, DOT_BF16, P, CVT)
        sq, hacc, mix, y3 = _tile_stream(x0, x1, x2, x3, fv, p3, c03, c13, c23, c33, l3, yp + 3 * D, m2,
                                         wp + 3 * D, wmask, wstride, sq, hacc, mix, NSPLIT, WF32, DOT_BF16, P, CVT)
        if CAT:     # one projection per tile, K = 4 BLOCK_D: column 4 d + k of ya is y_k[:, d] (join's new axis
            ya = tl.reshape(tl.join(tl.join(y0, y2), tl.join(y1, y3)), (BLOCK_T, 4 * BLOCK_D))    # is the minor
            r = 4 * i * BLOCK_D + tl.arange(0, 4 * BLOCK_D)      # one), against fn's rows 4 d + k of the permuted
            wpc = w_ptr + mc[None, :] * SD + 4 * d_lo + r[:, None]                             # copy
            wmc = (4 * d_lo + r < SD)[:, None] & (mc < M)[None, :]
            mix = _project(ya, ya.to(tl.float32), wpc, wmc, wstride, mix, NSPLIT, WF32, DOT_BF16)
        hb = hacc.to(tl.bfloat16)
        tl.store(h_ptr + t[:, None] * D + d[None, :], hb, mask=m2)
        hf = hb.to(tl.float32)
        hq += tl.sum(hf * hf, 1)
    part = tl.where(mc[None, :] == MPAD - 2, sq[:, None], tl.where(mc[None, :] == MPAD - 1, hq[:, None], mix))
    tl.store(ws_ptr + (t[:, None] * NC + c) * MPAD + mc[None, :], part, mask=tm[:, None])


@triton.jit
def _mhc_split_finish_kernel(ws_ptr, scale_ptr, base_ptr, nw_ptr, h_ptr, coef_ptr, N, D, eps, norm_eps, rms_eps,
                             M: tl.constexpr, ITERS: tl.constexpr, NC: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    """Sum the chunks' partials (in chunk order), the coefficients (`_coefs`), and the RMSNorm of h in place."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    _finish_rows(ws_ptr, scale_ptr, base_ptr, nw_ptr, h_ptr, coef_ptr, t, t < N, D, eps, norm_eps, rms_eps, M, ITERS,
                 NC, BLOCK_T, BLOCK_D, STAGES)


_W_CACHE: dict = {}


def split_weights(fn: torch.Tensor, nsplit: int, cat: bool = False) -> torch.Tensor:
    """fn [M, S*D] fp32 -> [nsplit, 32, S*D] bf16 with fn = hi + mid + lo (each the bf16 rounding of the remainder;
    3 terms carry fn's 24 bits), rows past M zero; nsplit 0: fn itself in fp32 [M, S*D]. cat: the columns permuted
    to d-major order (column 4 d + k = fn's k D + d, S = 4), the tiled kernel's one projection per tile. Cached per
    tensor (held weakly, so a new tensor that reuses a freed one's memory or id never hits its entry) and version
    (in-place updates re-split)."""
    if nsplit == 0 and not cat:
        return fn.detach().float().contiguous()
    key = (id(fn), nsplit, cat)
    hit = _W_CACHE.get(key)
    w = hit[2] if hit is not None and hit[0]() is fn and hit[1] == fn._version else None
    if w is None:
        rest = fn.detach().float()
        if cat:
            rest = rest.unflatten(1, (4, -1)).transpose(1, 2).flatten(1).contiguous()
        if nsplit == 0:
            w = rest
        else:
            terms = []
            for _ in range(nsplit):
                t = rest.bfloat16()
                terms.append(t)
                rest = rest - t.float()
            w = torch.zeros(nsplit, MP, fn.size(1), dtype=torch.bfloat16, device=fn.device)
            w[:, :fn.size(0)] = torch.stack(terms)
        if len(_W_CACHE) > 256:
            _W_CACHE.clear()
        _W_CACHE[key] = (weakref.ref(fn), fn._version, w)
    return w


def mhc_fused_triton(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     pre_lag: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     norm_weight: torch.Tensor, iters: int, eps: float, norm_eps: float, rms_eps: float, *,
                     block_t: int | None = None, block_d: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, nsplit: int | None = None, impl: str | None = None):
    """Triton twin of `mhc_fused_ref` (bf16 f and residual, S = 4) -> (y, h, pre, post, comb); the keywords
    override `CONFIG` (nsplit: bf16 terms of fn, 3 = the fp32 projection, 2 = fn to ~2^-16). impl: "fused" (one
    program per block_t tokens walks all of D), "split" (programs per token and D chunk, then a finishing kernel),
    "tiles" (programs per token block and D chunk on the tensor cores, then the same finishing kernel; block_t,
    block_d, num_warps, num_stages then set its tile and pipelining depth, CONFIG's tiles_* keys the rest). Default:
    split up to CONFIG["split_max_tokens"] tokens (a decode step: 1 token took ~435 us fused), CONFIG["large_impl"]
    above."""
    S, D = residual.size(-2), residual.size(-1)
    M = (2 + S) * S
    if S != 4:
        raise ValueError(f"mhc_fused (triton): the kernel is written for 4 streams, got {S}")
    if f.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16:
        raise ValueError(f"mhc_fused (triton): f and residual must be bfloat16, got {f.dtype}, {residual.dtype}")
    if fn.shape != (M, S * D):
        raise ValueError(f"mhc_fused (triton): fn must be [{M}, {S * D}], got {tuple(fn.shape)}")
    cfg = {**CONFIG, **{k: v for k, v in dict(block_t=block_t, block_d=block_d, num_warps=num_warps,
                                              num_stages=num_stages, nsplit=nsplit).items() if v is not None}}
    lead = residual.shape[:-2]
    N = residual[..., 0, 0].numel()
    y = torch.empty(*lead, S, D, dtype=torch.bfloat16, device=f.device)
    h = torch.empty(*lead, D, dtype=torch.bfloat16, device=f.device)
    coef = torch.empty(*lead, M, dtype=torch.float32, device=f.device)
    if impl not in (None, "fused", "split", "tiles"):
        raise ValueError(f"mhc_fused (triton): impl must be 'fused', 'split' or 'tiles', got {impl!r}")
    if impl is None:
        impl = "split" if N <= cfg["split_max_tokens"] else cfg["large_impl"]
    if N and impl in ("split", "tiles"):
        f_, x_ = f.contiguous(), residual.contiguous()
        post_, comb_, pre_ = post.float().contiguous(), comb.float().contiguous(), pre_lag.float().contiguous()
        scale_, base_, nw_ = scale.float().contiguous(), base.float().contiguous(), norm_weight.contiguous()
        if impl == "split":
            BD = cfg["split_block_d"]
            NC = triton.cdiv(D, BD)
            ws = torch.empty(N, NC, MP, dtype=torch.float32, device=f.device)
            LAST['mhc'] = LAST['mhc_split'] = _mhc_split_partial_kernel[(N, NC)](
                f_, x_, post_, comb_, pre_, fn.float().contiguous(), y, h, ws, D, NC, M=M, BLOCK_D=BD, num_warps=4,
                enable_fp_fusion=False)
            BT, FBD, FST = 4, 256, 1
        else:
            BT = cfg["tiles_block_t"] if block_t is None else block_t
            BD = cfg["tiles_block_d"] if block_d is None else block_d
            chunk = triton.cdiv(cfg["tiles_chunk"], BD) * BD                # channels per program, whole tiles
            NC = triton.cdiv(D, chunk)
            wf32, cat = bool(cfg["tiles_wf32"]), bool(cfg["tiles_cat"])
            ws = torch.empty(N, NC, MP, dtype=torch.float32, device=f.device)
            LAST['mhc'] = LAST['mhc_tiles'] = _mhc_tiles_kernel[(triton.cdiv(N, BT) * NC,)](
                f_, x_, post_, comb_, pre_, split_weights(fn, 0 if wf32 else cfg["nsplit"], cat), y, h, ws, N, D,
                M=M, NSPLIT=cfg["nsplit"], NC=NC, BLOCK_T=BT, BLOCK_D=BD, CHUNK=chunk,
                STAGES=cfg["tiles_num_stages"] if num_stages is None else num_stages, WF32=wf32, CAT=cat,
                CVT=bool(cfg["tiles_cvt"]), DOT_BF16=_DOT_BF16,
                num_warps=cfg["tiles_num_warps"] if num_warps is None else num_warps, enable_fp_fusion=False,
                **({} if cfg["tiles_maxnreg"] is None else {"maxnreg": cfg["tiles_maxnreg"]}))
            BT, FBD, FST = cfg["tiles_fin_block_t"], cfg["tiles_fin_block_d"], cfg["tiles_fin_stages"]
        _mhc_split_finish_kernel[(triton.cdiv(N, BT),)](
            ws, scale_, base_, nw_, h, coef, N, D, float(eps), float(norm_eps), float(rms_eps), M=M,
            ITERS=int(iters), NC=NC, BLOCK_T=BT, BLOCK_D=FBD, STAGES=FST, num_warps=4, enable_fp_fusion=False)
    elif N:
        BT = cfg["block_t"]
        LAST['mhc'] = _mhc_fused_kernel[(triton.cdiv(N, BT),)](
            f.contiguous(), residual.contiguous(), post.float().contiguous(), comb.float().contiguous(),
            pre_lag.float().contiguous(), split_weights(fn, cfg["nsplit"]), scale.float().contiguous(),
            base.float().contiguous(), norm_weight.contiguous(), y, h, coef, N, D, float(eps), float(norm_eps),
            float(rms_eps), M=M, ITERS=int(iters), NSPLIT=cfg["nsplit"], BLOCK_T=BT, BLOCK_D=cfg["block_d"],
            DOT_BF16=_DOT_BF16, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False)
    return y, h, coef[..., :S], coef[..., S:2 * S], coef[..., 2 * S:].unflatten(-1, (S, S))
