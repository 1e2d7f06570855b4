"""The deterministic mode's primitives: reductions whose order depends on nothing but the row they compute
(docs/system.md §10).

A result of the normal mode can change in its last bit with the number of rows of a GEMM (the math library picks
another kernel or thread split for 1-7 rows than for 512), with the width of an index list (the blocks of the
online softmax move), or with the width of the indexer's score matrix. With quantization on, the FP8 activation
quantizers turn such last-bit noise into other codes now and then, so greedy output can depend on the batch, the
chunking, speculation or a cache resume. Under `set_deterministic(True)` (process-wide, like a kernel backend)
the model and the kernels take these forms instead:

  exact_block_linear  weights of a quantized kind (fp8 / fp4, the activation FP8 QDQ'd): each 32-wide K block of
                      products is summed EXACTLY (float64: a product of two e4m3 / e2m1 codes has at most 8
                      significant bits, a block's 32 products span at most ~48 bits) and rounded to fp32 once;
                      the block partials are added in fp32 in K order, as the official GEMM adds them. The
                      official block structure with the one within-block order that does not depend on the
                      rows (nor on the CPU): the exact sum. The official order itself is not batch-invariant
                      (measured by `benchmarks/deterministic.py`), so it cannot be the mode's order.
  tiled_linear        every other GEMM (bf16 / fp32 weights: gate, head, mHC, compressor, indexer weights, wo_a):
                      rows padded to tiles of ROW_TILE and computed as one batched matmul of identical
                      [ROW_TILE, K] x [K, N] problems, fp32 accumulation, so a row's sum has the same order
                      whatever the other rows are (vLLM's and SGLang's batch-invariant mode fixes the GEMM tile
                      in the same way). On CUDA the tiles go in calls of CUDA_TILE_GROUP (zero tiles pad the
                      last), since cuBLAS also chooses its kernel by the batch count.
  index_scores        the indexer's I[t] = sum_j w_j ReLU(q_j . k_t) with exact 32-wide blocks (MXFP4 q and
                      keys make them exact), blocks then heads added in a fixed order.
  canonical_lists     attention index lists in one layout per query (the window's valid entries oldest first,
                      then -1 to the window's width; the selected entries ascending, then -1 to top-k), so the
                      online softmax sees the same blocks in prefill, decode, chunks and verification.
  sparse attention    (`dsv41.kernels.ref.sparse_attn_ref`) dot products and P.V as products summed along a
                      fixed last axis instead of batched GEMMs.
  row_sum, row_mean,  sums along an axis in a shape-independent order: a last axis in blocks of 32 (each block,
  small_sum           then the blocks, summed by reductions of at most 32 values), a short axis (mHC streams,
                      routed experts) as sequential adds. CUDA's reduction kernels otherwise choose how many
                      threads and blocks share one row from the whole tensor's shape (few rows: a row is split
                      further), so a row's order changed with the batch; the CPU's are row-invariant already,
                      and take the same forms in this mode.
  sigmoid, silu,      written with exp / log1p: torch's own kernels compute the elements of a vector loop's tail
  softplus            with a scalar formula that differs in the last bit from the vector one (measured: ~5% of
                      elements), so an element's value depended on the tensor's size; exp and log1p take one
                      path for every element.

Elementwise ops, per-row softmax / RMSNorm statistics and reductions over a fixed last axis are already
row-invariant on the CPU and are left as they are. Autograd: both linears differentiate (the backward is the
ordinary one: only the forward's bits matter for the equality of engine and trainer log-probs).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

__all__ = ["ROW_TILE", "set_deterministic", "is_deterministic", "deterministic", "exact_block_linear",
           "tiled_linear", "linear", "index_scores", "canonical_lists", "rsqrt", "sigmoid", "silu", "softplus",
           "row_sum", "row_mean", "small_sum", "set_cpu_order", "cpu_order_sum"]

ROW_TILE = 16                 # rows per GEMM problem of `tiled_linear` (a decode batch of up to 16 is one problem)
CUDA_TILE_GROUP = 8           # tiles per batched GEMM call on CUDA (one batch count: one cuBLAS kernel choice)
EXACT_BLOCK = 32              # K block of the quantized GEMMs (the checkpoint's scale block)
_EXACT_ROWS = 256             # rows per float64 pass of exact_block_linear (bounds the [K/32, rows, N] partials)

_state = {"on": False, "cpu_order": False}


def set_deterministic(enabled: bool) -> None:
    """Switch the deterministic mode on or off for the whole process (the engine and the trainer read it)."""
    _state["on"] = bool(enabled)


def is_deterministic() -> bool:
    return _state["on"]


def set_cpu_order(enabled: bool) -> None:
    """Process-wide: a GPU computes the row statistics (`row_mean`: RMSNorm, mHC, Engram) in the CPU's summation
    order (`cpu_order_sum`), so that they equal the CPU reference's bits; for gate 1 on a GPU (docs/golden.md §4),
    with the `official-cpu` tie rule (`dsv41.model.attention.use_official_cpu`). Off by default (slow)."""
    _state["cpu_order"] = bool(enabled)


@contextlib.contextmanager
def deterministic(enabled: bool = True):
    """`with deterministic():` the mode on inside the block, the previous setting restored after it."""
    prev = _state["on"]
    _state["on"] = bool(enabled)
    try:
        yield
    finally:
        _state["on"] = prev


# ------------------------------------------------------------------------------------------------ GEMMs

def _exact_partials(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Sum over 32-wide K blocks in K order of the exact block products: a [M,K] (fp32), w [N,K] -> fp32 [M,N]."""
    M, K = a.shape
    nb = K // EXACT_BLOCK
    wb = w.double().view(-1, nb, EXACT_BLOCK).permute(1, 2, 0)                  # [nb, 32, N]
    out = []
    for r0 in range(0, M, _EXACT_ROWS):
        ab = a[r0:r0 + _EXACT_ROWS].double().view(-1, nb, EXACT_BLOCK).transpose(0, 1)   # [nb, rows, 32]
        part = torch.bmm(ab, wb).float()                                        # exact sums, rounded once
        acc = part[0].clone()
        for b in range(1, nb):
            acc += part[b]                                                      # fp32, in K order
        out.append(acc)
    return torch.cat(out) if len(out) > 1 else out[0]


class _ExactBlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _exact_partials(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.to(weight.dtype)
        return (g @ weight).to(x.dtype), (g.T @ x.to(weight.dtype)).to(weight.dtype)


def exact_block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for a quantized-kind weight, exact per 32-wide K block (see the module docstring).
    x [..., K] already FP8 QDQ'd, weight [N, K] dequantized (a packed checkpoint-storage weight,
    `dsv41.codecs.weights.PackedWeight`, is dequantized first: exact sums do not depend on how); the result in the
    weight's dtype."""
    if not isinstance(weight, torch.Tensor):
        weight = weight.dequant()
    K, N = x.size(-1), weight.size(0)
    if K % EXACT_BLOCK:
        raise ValueError(f"block-scaled GEMM needs K divisible by {EXACT_BLOCK}, got {K}")
    y = _ExactBlockLinear.apply(x.reshape(-1, K), weight).to(weight.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], N)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) as F.linear computes it (x cast to the weight's dtype, fp32 accumulation, result in the
    weight's dtype), row-invariant: rows zero-padded to tiles of ROW_TILE, one batched matmul of equal problems."""
    K, N = x.size(-1), weight.size(0)
    a = x.reshape(-1, K).to(weight.dtype)
    M = a.size(0)
    # CUDA: cuBLAS picks its kernel by the batch count too, so the tiles go in calls of a fixed count
    group = CUDA_TILE_GROUP if a.is_cuda else 1
    tiles = F.pad(a, (0, 0, 0, -M % (ROW_TILE * group))).float().view(-1, ROW_TILE, K)
    step = CUDA_TILE_GROUP if a.is_cuda else tiles.size(0)
    wt = weight.float().T.unsqueeze(0).expand(step, K, N)
    y = torch.cat([torch.bmm(tiles[i:i + step], wt) for i in range(0, tiles.size(0), step)])
    y = y.view(-1, N)[:M].to(weight.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The unquantized GEMM of every module: F.linear (x cast to the weight's dtype), `tiled_linear` in the
    deterministic mode."""
    if _state["on"]:
        return tiled_linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias)


# ------------------------------------------------------------------------------------------------ reductions

_SUM_BLOCK = 32


def _blocked_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis: zero-padded to blocks of 32, each block summed, then the block sums (recursively)."""
    while x.size(-1) > _SUM_BLOCK:
        x = F.pad(x, (0, -x.size(-1) % _SUM_BLOCK)).unflatten(-1, (-1, _SUM_BLOCK)).sum(-1)
    return x.sum(-1)


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """x.sum(-1), in a shape-independent order in the deterministic mode."""
    if not _state["on"]:
        return x.sum(-1, keepdim=keepdim)
    s = _blocked_sum(x)
    return s.unsqueeze(-1) if keepdim else s


def row_mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """x.mean(-1); the deterministic mode's row_sum / n; on a GPU under `set_cpu_order(True)` the CPU's own sum
    (`cpu_order_sum`) then an IEEE division, bit-equal to x.mean(-1) on a CPU."""
    if _state["on"]:
        return row_sum(x, keepdim) / x.size(-1)
    if _state["cpu_order"] and x.device.type != "cpu":
        s = cpu_order_sum(x)
        s = s / torch.full_like(s, x.size(-1))        # a tensor divisor: CUDA takes a scalar's reciprocal instead
        return s.unsqueeze(-1) if keepdim else s
    return x.mean(-1, keepdim=keepdim)


# The CPU's float sum along a contiguous last axis (ATen's cascade sum, aten/src/ATen/native/cpu/SumKernel.cpp):
# the row is read as vectors of _CPU_SUM_LANES floats, 4 vectors at a time (4 accumulators), the accumulators'
# adds cascaded over 4 levels of chunks; then the leftover vectors, the 4 accumulators in order, the scalar tail
# and the lanes in order; a row shorter than one vector is summed as scalars the same way. The width is 8 lanes at
# every dispatch level of torch 2.13's CPU build (default, AVX2 and AVX-512 alike: measured,
# tests/test_deterministic.py::test_cpu_order_sum_is_the_cpus_sum), which is why the CPU results do not depend on
# the CPU. A GPU reproduces it with these few hundred small adds: for parity runs, not serving.
_CPU_SUM_LANES = 8
_CPU_SUM_ILP = 4
_CPU_SUM_LEVELS = 4


def _cascade(v: torch.Tensor) -> torch.Tensor:
    """ATen's multi_row_sum: v [..., size, 4, L] summed over `size` in its chunked order -> [..., 4, L]."""
    size = v.size(-3)
    power = max(4, (size - 1).bit_length() // _CPU_SUM_LEVELS)        # ATen: max(4, CeilLog2(size) / 4)
    step, mask = 1 << power, (1 << power) - 1
    acc = [v.new_zeros(v.shape[:-3] + v.shape[-2:]) for _ in range(_CPU_SUM_LEVELS)]
    i = 0
    while i + step <= size:
        for _ in range(step):
            acc[0] = acc[0] + v[..., i, :, :]
            i += 1
        for j in range(1, _CPU_SUM_LEVELS):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = torch.zeros_like(acc[j - 1])
            if i & (mask << (j * power)):
                break
    for k in range(i, size):
        acc[0] = acc[0] + v[..., k, :, :]
    for j in range(1, _CPU_SUM_LEVELS):
        acc[0] = acc[0] + acc[j]
    return acc[0]


def _ilp_sum(v: torch.Tensor) -> torch.Tensor:
    """ATen's row_sum over axis -2 of v [..., n, L]: groups of 4 cascaded, the leftovers, then the 4 partials."""
    n, size = v.size(-2), v.size(-2) // _CPU_SUM_ILP
    part = _cascade(v[..., :size * _CPU_SUM_ILP, :].unflatten(-2, (size, _CPU_SUM_ILP)))
    out = part[..., 0, :]
    for k in range(size * _CPU_SUM_ILP, n):
        out = out + v[..., k, :]
    for k in range(1, _CPU_SUM_ILP):
        out = out + part[..., k, :]
    return out


def cpu_order_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1) of a float32 tensor in the order torch's CPU kernel adds it, on any device (see above)."""
    n = x.size(-1)
    if n < _CPU_SUM_LANES:
        return _ilp_sum(x.unsqueeze(-1))[..., 0]
    nvec = n // _CPU_SUM_LANES
    lanes = _ilp_sum(x[..., :nvec * _CPU_SUM_LANES].unflatten(-1, (nvec, _CPU_SUM_LANES)))
    out = torch.zeros_like(x[..., 0])
    for k in range(nvec * _CPU_SUM_LANES, n):
        out = out + x[..., k]
    for k in range(_CPU_SUM_LANES):
        out = out + lanes[..., k]
    return out


def small_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """x.sum(dim) over a short axis; in the deterministic mode x[0] + x[1] + ... in index order."""
    if not _state["on"]:
        return x.sum(dim=dim, keepdim=keepdim)
    parts = x.unbind(dim)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out.unsqueeze(dim) if keepdim else out


# ------------------------------------------------------------------------------------------------ elementwise

def rsqrt(v: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(v) as the CPU reference computes it: torch.rsqrt on a CPU, which is exactly the IEEE square root
    then an IEEE division, each rounded to nearest (bit-equal to that at every ATEN_CPU_CAPABILITY and
    MKL_ENABLE_INSTRUCTIONS level, `tests/test_deterministic.py::test_cpu_rsqrt_is_ieee_reciprocal_sqrt`); on a CUDA
    tensor the same two IEEE operations, since CUDA's rsqrtf is an approximation (docs/golden.md §4).
    DSV41_GPU_RSQRT=approx keeps torch.rsqrt on CUDA (the approximation; `benchmarks/gpu_gate_variants.py`)."""
    if v.is_cuda and os.environ.get("DSV41_GPU_RSQRT") != "approx":
        return 1.0 / torch.sqrt(v)
    return torch.rsqrt(v)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x)) if _state["on"] else torch.sigmoid(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x)) if _state["on"] else F.silu(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), x itself above 20 (F.softplus's threshold)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x))) if _state["on"] else F.softplus(x)


# ------------------------------------------------------------------------------------------------ indexer

def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """I[..., t] = sum_j w[..., j] * ReLU(q[..., j, :] . keys[..., t, :]) in fp32, row-invariant.

    q [..., J, I], keys [..., N, I] (leading dims broadcast), w [..., J] -> [..., N]. Each 32-wide block of a
    dot product summed in float64 (exact for MXFP4-QDQ'd q and keys) and rounded once, blocks added in order,
    heads added in order 0..J-1."""
    I = q.size(-1)
    kt = keys.double().transpose(-1, -2)                                       # [..., I, N]
    dots = None
    for i0 in range(0, I, EXACT_BLOCK):
        part = (q[..., i0:i0 + EXACT_BLOCK].double() @ kt[..., i0:i0 + EXACT_BLOCK, :]).float()   # [..., J, N]
        dots = part if dots is None else dots + part
    wf = w.float()
    out = dots[..., 0, :].relu() * wf[..., 0:1]
    for j in range(1, dots.size(-2)):
        out = out + dots[..., j, :].relu() * wf[..., j:j + 1]
    return out


# ------------------------------------------------------------------------------------------------ attention

def _valid_first(idx: torch.Tensor, width: int) -> torch.Tensor:
    """idx [..., k] -> [..., width]: the entries >= 0 in their order, then -1 (stable partition, padded)."""
    if idx.size(-1) < width:
        idx = F.pad(idx, (0, width - idx.size(-1)), value=-1)
    order = torch.sort((idx < 0).to(torch.uint8), dim=-1, stable=True).indices
    return idx.gather(-1, order)[..., :width]          # a list never holds more valid entries than its width


def canonical_lists(win_idx: torch.Tensor, comp_idx: torch.Tensor | None, window: int, topk: int) -> torch.Tensor:
    """One attention list layout per query: [window part (width `window`) || compressed part (width `topk`)],
    each part's valid entries first in their order (window oldest first, compressed ascending), then -1.

    win_idx [..., Kw], comp_idx [..., Kc] or None (a window-only layer: no compressed part)."""
    win = _valid_first(win_idx, window)
    if comp_idx is None:
        return win
    return torch.cat([win, _valid_first(comp_idx.to(win.dtype), topk)], dim=-1)
