"""Prefix units and keys (`dsv41.kv.prefix`): the chained SHA-256 over little-endian int32 ids, namespaced by the
fingerprint; keys depend only on (fingerprint, ids[:U]); boundaries."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv41.config import load_config
from dsv41.kv.prefix import (chain_keys, encode_ids, fingerprint, prefix_key, ratio_align, root_key,
                             unit_boundaries)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fp():
    return fingerprint(load_config("debug"), "weights-a", "tok-a", 1)


def test_key_formula_by_hand(fp):
    ids = [5, 70000, -3, 2 ** 31 - 1, 9]
    le = lambda xs: b"".join(int(x).to_bytes(4, "little", signed=True) for x in xs)
    c0 = hashlib.sha256(fp.encode("ascii")).digest()
    c1 = hashlib.sha256(c0 + le(ids[:2])).digest()
    c2 = hashlib.sha256(c1 + le(ids[2:4])).digest()
    assert root_key(fp) == c0 and chain_keys(fp, ids, 2) == [c0, c1, c2]
    assert prefix_key(fp, ids, 4, interval=2) == c2.hex()
    assert prefix_key(fp, ids, 5, interval=2) == hashlib.sha256(c2 + le(ids[4:5])).hexdigest()
    assert prefix_key(fp, ids, 3, interval=2) == hashlib.sha256(c1 + le(ids[2:3])).hexdigest()
    assert prefix_key(fp, ids, 0, interval=2) == c0.hex()


def test_encodings_agree_and_reject_bad_ids():
    a = [1, 2, 3]
    ref = encode_ids(a)
    assert ref.dtype == np.dtype("<i4") and ref.tobytes() == b"\1\0\0\0\2\0\0\0\3\0\0\0"
    for x in (np.array(a, dtype=np.int64), torch.tensor(a), torch.tensor([a]), tuple(a)):
        assert encode_ids(x).tobytes() == ref.tobytes()
    assert encode_ids([]).size == 0
    for bad in ([2 ** 31], [1.5], [[1, 2], [3, 4]]):
        with pytest.raises(ValueError):
            encode_ids(bad)


def test_fingerprint_covers_every_input():
    cfg = load_config("debug")
    base = fingerprint(cfg, "w", "t", 1)
    assert base == fingerprint(load_config("debug"), "w", "t", 1) == fingerprint(cfg.to_dict(), "w", "t", 1)
    variants = [fingerprint(dataclasses.replace(cfg, window_size=16), "w", "t", 1), fingerprint(cfg, "w2", "t", 1),
                fingerprint(cfg, "w", "t2", 1), fingerprint(cfg, "w", "t", 2)]
    assert len({base, *variants}) == 5
    assert len(base) == 64 and int(base, 16) >= 0


def test_keys_are_stable_across_processes(fp):
    """No Python hash(): another interpreter with another hash seed derives the same fingerprint and keys."""
    code = ("import json; from dsv41.config import load_config; from dsv41.kv.prefix import fingerprint, prefix_key;"
            "f = fingerprint(load_config('debug'), 'weights-a', 'tok-a', 1);"
            "print(json.dumps([f, prefix_key(f, list(range(100)), 77, interval=16)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [fp, prefix_key(fp, list(range(100)), 77, interval=16)]


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 5), min_size=1, max_size=24), b=st.lists(st.integers(0, 5), min_size=1, max_size=24),
       u=st.integers(1, 24), interval=st.sampled_from([2, 4, 8]))
def test_equal_keys_iff_equal_prefixes(fp, a, b, u, interval):
    u = min(u, len(a), len(b))
    ka, kb = prefix_key(fp, a, u, interval), prefix_key(fp, b, u, interval)
    assert (ka == kb) == (a[:u] == b[:u])
    # a key does not depend on tokens after the boundary, nor on boundaries other than its own
    assert prefix_key(fp, a[:u], u, interval) == ka
    if u < len(a):
        assert prefix_key(fp, a, u + 1, interval) != ka


def test_other_fingerprint_other_keys(fp):
    other = fingerprint(load_config("debug"), "weights-b", "tok-a", 1)
    assert prefix_key(fp, [1, 2, 3], 3, 2) != prefix_key(other, [1, 2, 3], 3, 2)


def test_unit_boundaries():
    assert unit_boundaries(100, 32) == [32, 64, 96]
    assert unit_boundaries(100, 32, extra=(100, 40, 64)) == [32, 40, 64, 96, 100]
    assert unit_boundaries(31, 32, extra=(31,)) == [31]
    with pytest.raises(ValueError):
        unit_boundaries(100, 30, align=4)                   # interval not aligned to the compression ratios
    with pytest.raises(ValueError):
        unit_boundaries(100, 32, extra=(101,))
    assert ratio_align(load_config("v41-flash")) == 2
    assert ratio_align(load_config("debug")) == 2
