"""Guards the one-launch row ops of the decode step (`dsv41.kernels.triton.norm_rope`) against their references
(`rms_norm_ref`, `apply_rope_ref`): widths that are and are not powers of two, bf16 and fp32, one row and many,
3-D and 4-D RoPE inputs, freqs per batch row or shared, the inverse rotation, a non-contiguous input. The kernels
run on a GPU (marked gpu) or on this CPU under Triton's interpreter (TRITON_INTERPRET=1 with triton installed).

Tolerance: the same fp32 operations, the row sum in another order (and rsqrt's rounding on a GPU): fp32 outputs
within 1e-5 relative, bf16 outputs within one rounding (2^-7 relative) of the reference's."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dsv41.kernels import rms_norm, rope
from dsv41.kernels.ref import apply_rope_ref, rms_norm_ref

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] + (["cpu"] if INTERPRETER else [])


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    rel = 2 ** -7 if want.dtype == torch.bfloat16 else 1e-5
    return bool(((g - w).abs() <= w.abs() * rel + 1e-30).all())


def test_dispatch_on_cpu_is_the_reference():
    x, w = torch.randn(3, 96).bfloat16(), torch.randn(96)
    f = torch.polar(torch.ones(1, 3, 8), torch.randn(1, 3, 8))
    assert torch.equal(rms_norm(x.unsqueeze(0), w, 1e-6), rms_norm_ref(x.unsqueeze(0), w, 1e-6))
    assert torch.equal(rope(x.unsqueeze(0), f), apply_rope_ref(x.unsqueeze(0), f))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,dim", [(1, 512), (7, 1280), (3, 100), (2, 5120)])
def test_rms_norm_kernel(device, dtype, rows, dim):
    from dsv41.kernels.triton import rms_norm_triton
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(1, rows, dim, generator=g) * 3).to(device, dtype)
    for w in (torch.rand(dim, generator=g).to(device, dtype), torch.rand(dim, generator=g).to(device)):
        assert close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(dim + 1, device=device), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,r", [((2, 3, 64), 16), ((2, 3, 4, 72), 64), ((1, 5, 8, 512), 64), ((3, 1, 64, 512), 64)])
def test_rope_kernel(device, dtype, shape, r):
    from dsv41.kernels.triton import rope_triton
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).to(device, dtype)
    B, T = shape[:2]
    for fb in (1, B):
        f = torch.polar(torch.ones(fb, T, r // 2), torch.randn(fb, T, r // 2, generator=g) * 10).to(device)
        for inverse in (False, True):
            assert close(rope_triton(x, f, inverse), apply_rope_ref(x, f, inverse)), (fb, inverse)
    xs = torch.randn(B, T, *shape[2:-1], shape[-1] + 32, generator=g).to(device, dtype)[..., 32:]  # not contiguous
    f = torch.polar(torch.ones(1, T, r // 2), torch.randn(1, T, r // 2, generator=g)).to(device)
    assert close(rope_triton(xs, f), apply_rope_ref(xs, f))
    with pytest.raises(ValueError, match="freqs"):
        rope_triton(x, f[:, :0])
