"""Guards `dsv41.devices.h2d`: values and placement unchanged on the host, and (marked gpu) an asynchronous copy of a
pageable tensor keeps the values it had at the call, even when the source is overwritten right after."""

from __future__ import annotations

import pytest
import torch

from dsv41.devices import h2d


def test_h2d_on_the_host_is_to():
    t = torch.arange(10)
    assert h2d(t, "cpu") is t
    assert torch.equal(h2d(t.float(), torch.device("cpu")), t.float())


@pytest.mark.gpu
def test_h2d_pageable_source_overwritten_after_the_call():
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):                                   # keep the stream busy so the copy is queued behind work
        big = big @ big / 64
    src = torch.arange(1 << 20, dtype=torch.int64)
    want = src.clone()
    dst = h2d(src, "cuda")
    src.fill_(-1)                                         # the host writes the source before the copy ran
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)


@pytest.mark.gpu
def test_h2d_pinned_source_stays_synchronous():
    src = torch.arange(1 << 20, dtype=torch.int64).pin_memory()
    want = src.clone()
    dst = h2d(src, "cuda")
    src.fill_(-1)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)
