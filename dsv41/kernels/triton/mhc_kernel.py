"""Triton fused mHC step (docs/model.md §2 items 3-6): twin of `dsv41.kernels.mhc_ref.mhc_fused_ref` (same signature).

Legend: N tokens (all leading dims), S = 4 streams, D width, M = 24 coefficients (padded to MP = 32), BT tokens per
program, BD channels per tile, NC chunks of D.

Per token the step reads the 4 residual streams and f and computes
  y_k  = post_k * f + sum_j comb[j,k] * x_j        fp32 in the reference's order, stored as bf16 (hc_post),
  sum of y_k^2 (the mixes' RMS statistic, over all S*D values of the bf16 y),
  mix  = y @ fn^T, the 24-row projection in fp32,
  h    = sum_k pre_lag_k * y_k (fp32, the reference's order), stored as bf16, and its sum of squares;
then mixes = mix * rsqrt(mean y^2 + norm_eps), the Sinkhorn split (pre, post, comb), and the RMSNorm of h:
h * rsqrt(mean h^2 + eps) * w. Multiply-adds are not fused (enable_fp_fusion=False), as the reference's separate
torch ops round.

Both paths split D into chunks, one program per (tokens, chunk) writing y, the unnormalised h and the chunk's fp32
partials (projection, sums of squares); `_mhc_split_finish_kernel` then sums the partials in chunk order (the
same bits whatever the scheduling), computes the coefficients and applies the RMSNorm to h:
  "split" (up to CONFIG["split_max_tokens"] tokens, a decode step): a program per (token, chunk), the projection
     in fp32 (exact products summed in registers);
  "tiles" (more tokens): a program per (block of 64 tokens, chunk of 256 channels) walking its chunk in tiles,
     the loop software-pipelined through shared memory, the projection on the tensor cores (wgmma: 64 tokens =
     one warpgroup's M): y's 4 streams interleaved along K against fn with its columns permuted likewise, fn read
     in fp32 and split into bf16 terms hi + mid + lo in registers (y is exact in bf16 and every product exact in
     fp32: the fp32 projection up to summation order).
`hc_mixes_triton` is the mixes alone (`mhc_math.hc_mixes`, where no fused step precedes a sub-layer: block 0 and
the blocks after an Engram layer): a program per token, the fp32 projection and sum of squares BK values at a time,
then `_coefs` (the reference is ~130 torch kernels, the Sinkhorn loop's).
HBM traffic of the tiled path: the lower bound (x and f read once, y and h written once, (2S + 2) * D bf16 values
per token, plus 48 fp32 coefficients) plus a second pass over h (~20%) and the fp32 partials (32 per token and
chunk). It is bound by issue and latency rather than bytes: y's arithmetic (7 unfused operations per stream and
element, as the reference rounds) and the bf16 <-> fp32 conversions are most of its instructions.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from dsv41.kernels.triton.common import DOT_BF16, INTERPRET, LAST, aligned_rows

__all__ = ["mhc_fused_triton", "hc_mixes_triton", "CONFIG"]

# Picked by benchmarks/kernels.py on the H200 (tuning history: benchmarks/results/README.md). split_*: the few-token
# path's chunk; tiles_*: the tiled path's token block, tile width, warps, channels per program and pipeline depth;
# nsplit: bf16 terms of fn (3 carry its 24 bits); finish_*: the finishing kernel's tokens and channels per step.
CONFIG = {"split_max_tokens": 64, "split_block_d": 256, "tiles_block_t": 64, "tiles_block_d": 32, "tiles_num_warps": 4,
          "tiles_chunk": 256, "tiles_num_stages": 2, "nsplit": 3, "finish_block_t": 4, "finish_block_d": 256}
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
def _norm_rows(h_ptr, nw_ptr, t, tm, hr, D, BLOCK_D: tl.constexpr):
    """The RMSNorm of rows t of h in place, given their rsqrt statistics hr: w * (h * hr), rounded to bf16."""
    dd = tl.arange(0, BLOCK_D)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=1):
        d = d0 + dd
        dm = d < D
        m2 = tm[:, None] & dm[None, :]
        hv = tl.load(h_ptr + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        wv = tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(h_ptr + t[:, None] * D + d[None, :], (wv[None, :] * (hv * hr[:, None])).to(tl.bfloat16), mask=m2)


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
def _tile_stream(x0, x1, x2, x3, fv, pk, c0, c1, c2, c3, lk, yp, m2, sq, hacc, DOT_BF16: tl.constexpr):
    """Stream k of a [BLOCK_T, BLOCK_D] tile: y_k = post_k f + sum_j comb[j,k] x_j (the reference's order, fp32),
    stored bf16 at yp; its squares into sq, pre_lag_k y_k into hacc. Returns them and the bf16 y_k."""
    acc = c0[:, None] * x0
    acc = acc + c1[:, None] * x1
    acc = acc + c2[:, None] * x2
    acc = acc + c3[:, None] * x3
    yv = pk[:, None] * fv + acc
    # y is rounded by an opaque instruction (two values per instruction, round to nearest even as .to(bf16)):
    # computed once, in the tile's layout, and only then converted for the dot (else Triton recomputes y from x and
    # f in the dot operand's layout). The interpreter runs no PTX: .to(bf16) there.
    if DOT_BF16:
        yb = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [yv], dtype=tl.bfloat16,
                                       is_pure=False, pack=2)
    else:
        yb = yv.to(tl.bfloat16)
    tl.store(yp, yb, mask=m2)
    yf = yb.to(tl.float32)
    sq += tl.sum(yf * yf, 1)
    hacc = hacc + lk[:, None] * yf
    return sq, hacc, yb


@triton.jit
def _project(yb, yf, wp, wmask, mix, NSPLIT: tl.constexpr, DOT_BF16: tl.constexpr):
    """mix += y @ w on the tensor cores for the [K, 32] fp32 fn tile at wp, split here into NSPLIT bf16 terms (each
    the bf16 rounding of the remainder: hi + mid + lo carry fn's 24 bits at NSPLIT = 3)."""
    rest = tl.load(wp, mask=wmask, other=0.0)
    for sp in tl.static_range(NSPLIT):                 # unrolled: the chunk loop stays innermost (pipelined)
        wt = rest.to(tl.bfloat16)
        if sp < NSPLIT - 1:
            rest = rest - wt.to(tl.float32)             # exact: the remainder of a bf16 rounding
        if DOT_BF16:
            mix += tl.dot(yb, wt)
        else:
            mix += tl.dot(yf, wt.to(tl.float32))
    return mix


@triton.jit
def _mhc_tiles_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr,
                      y_ptr, h_ptr, ws_ptr, N, D, M: tl.constexpr, NSPLIT: tl.constexpr, NC: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
                      DOT_BF16: tl.constexpr):
    """Many tokens: program (token block, chunk c of CHUNK channels; chunk fastest in the 1-D grid) walks its chunk
    in tiles of BLOCK_D channels, the loop software-pipelined STAGES deep (its loads are asynchronous copies into
    shared memory, STAGES - 1 tiles ahead): y and the unnormalised h stored, the squares summed, and one projection
    per tile on the tensor cores, y's 4 streams interleaved along K (column 4 d + k) against fn with its columns
    permuted likewise (`_fn_by_channel`), NSPLIT dots of K = 4 BLOCK_D; then writes the chunk's partials to
    ws[t, c, :] (mix 0..M-1, sum y^2 at 30, sum h^2 at 31) for `_mhc_split_finish_kernel`. The per-token
    coefficients are loaded once per program."""
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
        hacc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        sq, hacc, y0 = _tile_stream(x0, x1, x2, x3, fv, p0, c00, c10, c20, c30, l0, yp, m2, sq, hacc, DOT_BF16)
        sq, hacc, y1 = _tile_stream(x0, x1, x2, x3, fv, p1, c01, c11, c21, c31, l1, yp + D, m2, sq, hacc, DOT_BF16)
        sq, hacc, y2 = _tile_stream(x0, x1, x2, x3, fv, p2, c02, c12, c22, c32, l2, yp + 2 * D, m2, sq, hacc,
                                    DOT_BF16)
        sq, hacc, y3 = _tile_stream(x0, x1, x2, x3, fv, p3, c03, c13, c23, c33, l3, yp + 3 * D, m2, sq, hacc,
                                    DOT_BF16)
        # one projection per tile, K = 4 BLOCK_D: column 4 d + k of ya is y_k[:, d] (join's new axis is the minor
        # one), against fn's rows 4 d + k of the permuted copy
        ya = tl.reshape(tl.join(tl.join(y0, y2), tl.join(y1, y3)), (BLOCK_T, 4 * BLOCK_D))
        r = 4 * i * BLOCK_D + tl.arange(0, 4 * BLOCK_D)
        wpc = w_ptr + mc[None, :] * SD + 4 * d_lo + r[:, None]
        wmc = (4 * d_lo + r < SD)[:, None] & (mc < M)[None, :]
        mix = _project(ya, ya.to(tl.float32), wpc, wmc, mix, NSPLIT, DOT_BF16)
        hb = hacc.to(tl.bfloat16)
        tl.store(h_ptr + t[:, None] * D + d[None, :], hb, mask=m2)
        hf = hb.to(tl.float32)
        hq += tl.sum(hf * hf, 1)
    part = tl.where(mc[None, :] == MPAD - 2, sq[:, None], tl.where(mc[None, :] == MPAD - 1, hq[:, None], mix))
    tl.store(ws_ptr + (t[:, None] * NC + c) * MPAD + mc[None, :], part, mask=tm[:, None])


@triton.jit
def _mhc_split_finish_kernel(ws_ptr, scale_ptr, base_ptr, nw_ptr, h_ptr, coef_ptr, N, D, eps, norm_eps, rms_eps,
                             M: tl.constexpr, ITERS: tl.constexpr, NC: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """Rows t of a block of BLOCK_T tokens: sum the NC chunks' partials ws[t, c, :] in chunk order, the coefficients
    (`_coefs`), and the RMSNorm of h in place (`_norm_rows`)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < N
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
    _norm_rows(h_ptr, nw_ptr, t, tm, hr, D, BLOCK_D)



_FN_CACHE: dict = {}


def _fn_by_channel(fn: torch.Tensor) -> torch.Tensor:
    """fn [M, S*D] as fp32 with its columns in d-major order (column 4 d + k = fn's k D + d, S = 4): the tiled
    kernel's one projection per tile. Cached per tensor (held weakly, so a new tensor that reuses a freed one's
    memory or id never hits its entry) and version (in-place updates redo it)."""
    key = id(fn)
    hit = _FN_CACHE.get(key)
    if hit is not None and hit[0]() is fn and hit[1] == fn._version:
        return hit[2]
    w = fn.detach().float().unflatten(1, (4, -1)).transpose(1, 2).flatten(1).contiguous()
    if len(_FN_CACHE) > 256:
        _FN_CACHE.clear()
    _FN_CACHE[key] = (weakref.ref(fn), fn._version, w)
    return w


def mhc_fused_triton(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     pre_lag: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     norm_weight: torch.Tensor, iters: int, eps: float, norm_eps: float, rms_eps: float):
    """Triton twin of `mhc_fused_ref` (bf16 f and residual, S = 4) -> (y, h, pre, post, comb): the split path up to
    CONFIG["split_max_tokens"] tokens, the tiled path above (module docstring), then the finishing kernel."""
    S, D = residual.size(-2), residual.size(-1)
    M = (2 + S) * S
    if S != 4:
        raise ValueError(f"mhc_fused (triton): the kernel is written for 4 streams, got {S}")
    if f.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16:
        raise ValueError(f"mhc_fused (triton): f and residual must be bfloat16, got {f.dtype}, {residual.dtype}")
    if fn.shape != (M, S * D):
        raise ValueError(f"mhc_fused (triton): fn must be [{M}, {S * D}], got {tuple(fn.shape)}")
    lead = residual.shape[:-2]
    N = residual[..., 0, 0].numel()
    y = torch.empty(*lead, S, D, dtype=torch.bfloat16, device=f.device)
    h = torch.empty(*lead, D, dtype=torch.bfloat16, device=f.device)
    coef = torch.empty(*lead, M, dtype=torch.float32, device=f.device)
    if N:
        streams = (f.contiguous(), residual.contiguous(), post.float().contiguous(), comb.float().contiguous(),
                   pre_lag.float().contiguous())
        if N <= CONFIG["split_max_tokens"]:
            BD = CONFIG["split_block_d"]
            NC = triton.cdiv(D, BD)
            ws = torch.empty(N, NC, MP, dtype=torch.float32, device=f.device)
            LAST['mhc'] = LAST['mhc_split'] = _mhc_split_partial_kernel[(N, NC)](
                *streams, fn.float().contiguous(), y, h, ws, D, NC, M=M, BLOCK_D=BD, num_warps=4,
                enable_fp_fusion=False)
        else:
            BT, BD = CONFIG["tiles_block_t"], CONFIG["tiles_block_d"]
            chunk = triton.cdiv(CONFIG["tiles_chunk"], BD) * BD                # channels per program, whole tiles
            NC = triton.cdiv(D, chunk)
            ws = torch.empty(N, NC, MP, dtype=torch.float32, device=f.device)
            LAST['mhc'] = LAST['mhc_tiles'] = _mhc_tiles_kernel[(triton.cdiv(N, BT) * NC,)](
                *streams, _fn_by_channel(fn), y, h, ws, N, D, M=M, NSPLIT=CONFIG["nsplit"], NC=NC, BLOCK_T=BT,
                BLOCK_D=BD, CHUNK=chunk, STAGES=CONFIG["tiles_num_stages"], DOT_BF16=DOT_BF16,
                num_warps=CONFIG["tiles_num_warps"], enable_fp_fusion=False)
        BT = CONFIG["finish_block_t"]
        _mhc_split_finish_kernel[(triton.cdiv(N, BT),)](
            ws, scale.float().contiguous(), base.float().contiguous(), norm_weight.contiguous(), h, coef, N, D,
            float(eps), float(norm_eps), float(rms_eps), M=M, ITERS=int(iters), NC=NC, BLOCK_T=BT,
            BLOCK_D=CONFIG["finish_block_d"], num_warps=4, enable_fp_fusion=False)
    return y, h, coef[..., :S], coef[..., S:2 * S], coef[..., 2 * S:].unflatten(-1, (S, S))


@triton.jit
def _hc_mixes_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, coef_ptr, SD, eps, norm_eps, M: tl.constexpr,
                     ITERS: tl.constexpr, BK: tl.constexpr):
    """Token t: mix = x_t @ fn^T and sum x_t^2 over the S*D stream values (fp32, BK at a time), then `_coefs`."""
    t = tl.program_id(0).to(tl.int64)
    MPAD: tl.constexpr = 32                                           # M padded (as `_coefs`)
    mc = tl.arange(0, MPAD)
    k = tl.arange(0, BK)
    mix = tl.zeros([MPAD], tl.float32)
    sq = tl.zeros([BK], tl.float32)
    for k0 in range(0, SD, BK):
        km = k0 + k < SD
        xv = tl.load(x_ptr + t * SD + k0 + k, mask=km, other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + mc[:, None] * SD + k0 + k[None, :], mask=(mc < M)[:, None] & km[None, :], other=0.0)
        mix += tl.sum(w * xv[None, :], 1)
        sq += xv * xv
    coef = _coefs(mix[None, :], tl.sum(sq, 0)[None], SD, norm_eps, scale_ptr, base_ptr, eps, M, ITERS, 1)
    tl.store(coef_ptr + t * M + mc[None, :], coef, mask=(mc < M)[None, :])


def hc_mixes_triton(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, iters: int,
                    eps: float, norm_eps: float):
    """Twin of `mhc_math.hc_mixes` (same arguments; S = 4): x [B, T, S, D] -> (pre [B,T,S], post [B,T,S],
    comb [B,T,S,S]) fp32."""
    M = (2 + S) * S
    if S != 4 or x.size(-2) != S or fn.shape != (M, S * x.size(-1)):
        raise ValueError(f"hc_mixes (triton): 4 streams and fn [{M}, S*D], got x {tuple(x.shape)}, fn {tuple(fn.shape)}")
    lead = x.shape[:-2]
    a = aligned_rows(x, S * x.size(-1))                     # one compiled variant: one summation order
    coef = torch.empty(a.size(0), M, dtype=torch.float32, device=x.device)
    if a.size(0):
        LAST["hc_mixes"] = _hc_mixes_kernel[(a.size(0),)](
            a, fn.detach().float().contiguous(), scale.detach().float().contiguous(), base.detach().float().contiguous(),
            coef, a.size(1), float(eps), float(norm_eps), M=M, ITERS=int(iters), BK=256, num_warps=4,
            enable_fp_fusion=False)
    coef = coef.view(*lead, M)
    return coef[..., :S], coef[..., S:2 * S], coef[..., 2 * S:].unflatten(-1, (S, S))



# ------------------------------------------------------------------------------------------ hc_post alone
# Where no fused step follows a block (the last block of a run, one before an Engram, and every block of the CED
# encoder, which runs unfused): y_k = post_k * f + sum_j comb[j,k] * x_j, a program per (token, BD channels), the
# reference's operations in its order without fused multiply-adds, so the bits are `mhc_math.hc_post`'s. HBM:
# f and the 4 streams read once, the 4 outputs written once ((2S + 1) D bf16 values per token), against the
# reference's ~10 torch kernels over [N, S, D] fp32 intermediates.

@triton.jit
def _to_bf16(y, BITS: tl.constexpr):
    """fp32 -> bf16, round to nearest even: the hardware conversion, or (BITS: the interpreter, which truncates)
    the same rounding on the bits (finite values)."""
    if BITS:
        b = y.to(tl.int32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return y.to(tl.bfloat16)


@triton.jit
def _hc_post_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, D, BLOCK_D: tl.constexpr, BITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = d < D
    fv = tl.load(f_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    x0 = tl.load(x_ptr + (t * 4 + 0) * D + d, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + (t * 4 + 1) * D + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + (t * 4 + 2) * D + d, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(x_ptr + (t * 4 + 3) * D + d, mask=m, other=0.0).to(tl.float32)
    for k in tl.static_range(4):
        acc = tl.load(comb_ptr + t * 16 + k) * x0                 # comb[j, k] at j * 4 + k; j in index order
        acc = acc + tl.load(comb_ptr + t * 16 + 4 + k) * x1
        acc = acc + tl.load(comb_ptr + t * 16 + 8 + k) * x2
        acc = acc + tl.load(comb_ptr + t * 16 + 12 + k) * x3
        y = tl.load(post_ptr + t * 4 + k) * fv + acc
        tl.store(y_ptr + (t * 4 + k) * D + d, _to_bf16(y, BITS), mask=m)


def hc_post_triton(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Triton twin of `mhc_math.hc_post` (4 streams): f [..., D], residual [..., 4, D], post [..., 4], comb
    [..., 4, 4] -> [..., 4, D] in f's dtype, bit-identical to the reference."""
    S, D = residual.size(-2), residual.size(-1)
    if S != 4:
        raise ValueError(f"hc_post (triton): the kernel is written for 4 streams, got {S}")
    if f.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16:
        raise ValueError(f"hc_post (triton): f and residual must be bfloat16, got {f.dtype}, {residual.dtype}")
    lead = residual.shape[:-2]
    y = torch.empty(*lead, S, D, dtype=f.dtype, device=f.device)
    N = residual[..., 0, 0].numel()
    if N:
        BD = min(1024, triton.next_power_of_2(D))
        _hc_post_kernel[(N, triton.cdiv(D, BD))](f.contiguous(), residual.contiguous(), post.float().contiguous(),
                                                comb.float().contiguous(), y, D, BLOCK_D=BD, BITS=INTERPRET,
                                                num_warps=4, enable_fp_fusion=False)
    return y
