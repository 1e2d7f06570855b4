"""Prefix units and their keys (docs/system.md §4).

A prefix unit is a complete prefix ending at a unit boundary: every multiple of `interval` tokens (which must be a
multiple of every compression ratio, so that no compressor group is open there) and the extra boundaries the engine
saves at (end of prompt, end of output).

Keys (never pickle, never Python `hash()`):

    C_0 = sha256(fingerprint)                               (the fingerprint's hex string, ASCII)
        = sha256(fingerprint || 0x00 || salt)               with a cache salt (UTF-8): a request's own namespace
    C_j = sha256(C_{j-1} || ids[(j-1)I : jI])               interval unit j, I = interval
    key(U) = C_{U/I}                                        when U is a multiple of I
           = sha256(C_{floor(U/I)} || ids[floor(U/I)I : U])  otherwise (a tail unit hanging off C_{floor(U/I)})

where `ids[a:b]` is the canonical encoding of those token ids (little-endian int32, 4 bytes each). This is the
chain key_k = sha256(key_{k-1} || ids of unit k) over the units 0..I, I..2I, ..., with the last unit ending at U.
A key is a function of the fingerprint, the salt, U and ids[:U] only (not of which other boundaries exist), so a lookup
computes the keys of a new request's prefixes in one pass over its tokens. Distinct (ids[:U], U) give distinct
keys up to SHA-256 collisions: messages are parent (32 bytes) || 4-byte ids, so equal messages mean equal parents.

Keys are 64-character lowercase hex strings.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Iterable

import numpy as np

from dsv41.kv.state_format import GLOBAL_LAYOUT_VERSION

DEFAULT_INTERVAL = 4096
KEY_SCHEME = "dsv41-prefix-v1"          # bump when the key derivation changes (folded into the fingerprint)
_INT32 = np.dtype("<i4")


def check_key(key: str) -> str:
    """`key` if it is 64 lowercase hex characters (a SHA-256), else ValueError."""
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"a prefix key is 64 lowercase hex characters, got {key!r}")
    return key


def fingerprint(cfg, weights_id: str, tokenizer_id: str, layout_version: int = GLOBAL_LAYOUT_VERSION) -> str:
    """Hex SHA-256 namespacing every key: the model config (a `ModelConfig` or its dict), the weights' identity
    (e.g. a checkpoint digest), the tokenizer's identity and the KV layout version (default: the pool's
    `GLOBAL_LAYOUT_VERSION`). Canonical JSON (sorted keys, no whitespace) of those, so equal inputs give equal
    fingerprints in every process and Python version."""
    conf = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    doc = {"scheme": KEY_SCHEME, "config": conf, "weights": str(weights_id), "tokenizer": str(tokenizer_id),
           "kv_layout": int(layout_version)}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def encode_ids(token_ids) -> np.ndarray:
    """Token ids (list, numpy array, tensor; 1-D or [1, T]) as a little-endian int32 array, the canonical
    encoding; ValueError for anything else or ids outside int32."""
    a = token_ids.detach().cpu().numpy() if hasattr(token_ids, "detach") else np.asarray(token_ids)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise ValueError("token ids must be one sequence (1-D, or [1, T])")
    if a.size == 0:
        return np.zeros(0, dtype=_INT32)
    if a.dtype.kind not in "iu" or int(a.min()) < -(1 << 31) or int(a.max()) >= (1 << 31):
        raise ValueError("token ids must be integers within int32")
    return np.ascontiguousarray(a, dtype=_INT32)


def root_key(fp: str, salt: str | None = None) -> bytes:
    """C_0 = sha256(fingerprint hex, ASCII [|| 0x00 || salt, UTF-8]). Requests with different salts (vLLM's
    `cache_salt`) share no key, so no entry of any tier."""
    check_key(fp)
    return hashlib.sha256(fp.encode("ascii") + (b"" if salt is None else b"\x00" + salt.encode("utf-8"))).digest()


def chain_keys(fp: str, ids, interval: int, upto: int | None = None, salt: str | None = None) -> list[bytes]:
    """[C_0, C_1, ..., C_J] (raw 32-byte digests), J = upto // interval (upto defaults to len(ids))."""
    ids = encode_ids(ids)
    upto = len(ids) if upto is None else int(upto)
    if interval <= 0 or not 0 <= upto <= len(ids):
        raise ValueError(f"chain_keys: need interval > 0 and 0 <= upto <= {len(ids)}")
    keys = [root_key(fp, salt)]
    raw = ids.tobytes()
    step = 4 * interval
    for j in range(upto // interval):
        keys.append(hashlib.sha256(keys[-1] + raw[j * step:(j + 1) * step]).digest())
    return keys


def tail_key(parent: bytes, tail_ids) -> bytes:
    """sha256(parent || ids); the parent itself for an empty tail."""
    tail = encode_ids(tail_ids)
    return parent if tail.size == 0 else hashlib.sha256(parent + tail.tobytes()).digest()


def prefix_key(fp: str, token_ids, upto: int, interval: int = DEFAULT_INTERVAL, salt: str | None = None) -> str:
    """Hex key of the unit ending at `upto` (the prefix token_ids[:upto])."""
    ids = encode_ids(token_ids)
    if not 0 <= upto <= len(ids):
        raise ValueError(f"prefix_key: upto {upto} outside 0..{len(ids)}")
    chain = chain_keys(fp, ids, interval, upto, salt)
    j = upto // interval
    return tail_key(chain[j], ids[j * interval:upto]).hex()


def ratio_align(cfg) -> int:
    """The least common multiple of the config's compression ratios > 0: intervals must be multiples of it."""
    ratios = [int(r) for r in getattr(cfg, "compress_ratios", ()) if int(r) > 0]
    return math.lcm(*ratios) if ratios else 1


def unit_boundaries(n_tokens: int, interval: int, extra: Iterable[int] = (), align: int = 1) -> list[int]:
    """Sorted unit boundaries within 1..n_tokens: every multiple of `interval` plus the `extra` ones (end of
    prompt, end of output). `interval` must be a positive multiple of `align` (the largest compression ratio, or
    `ratio_align(cfg)`); ValueError otherwise or for an extra boundary outside 1..n_tokens."""
    if interval <= 0 or align <= 0 or interval % align:
        raise ValueError(f"interval {interval} must be a positive multiple of {align} (the compression ratios)")
    out = set(range(interval, n_tokens + 1, interval))
    for e in extra:
        e = int(e)
        if not 1 <= e <= n_tokens:
            raise ValueError(f"extra boundary {e} outside 1..{n_tokens}")
        out.add(e)
    return sorted(out)


def engram_history_at(hasher, token_ids, upto: int):
    """The Engram n-gram history a sequence holds after its first `upto` tokens (text only): the compressed ids of
    positions upto-k..upto-1, DEAD (-1) before the start, as `NgramHasher` keeps it (k = max n-gram - 1). For
    `PackedKVPool.import_global` / `export_global` when a state carries none. Returns int64 [k] (CPU)."""
    import torch

    from dsv41.model.engram import DEAD

    k = hasher.max_ngram - 1
    ids = torch.as_tensor(encode_ids(token_ids)[:upto].astype(np.int64))
    hist = torch.full((k,), DEAD, dtype=torch.long)
    if k and upto:
        take = ids[max(0, upto - k):upto]
        hist[k - take.numel():] = hasher.compress(take.to(hasher.token_map.device).unsqueeze(0))[0].cpu()
    return hist

