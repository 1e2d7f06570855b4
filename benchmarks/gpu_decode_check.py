"""GPU check of the model's packed decode path (dsv41.model.packed_decode) and a profile of one decode step.

    python benchmarks/gpu_decode_check.py [--config tiny] [--profile-config v41-geometry] [--out FILE]

1. Decode logits of the packed path with the Triton kernels, the packed path with the torch references, and the
   dense path (whole history unpacked), on one packed store, bf16, deterministic ties: max relative error per step.
2. Op by op on the first decode step: every layer's `sparse_attn_packed` and `indexer_topk_packed` inputs are
   captured and run through both backends: attention relative error, top-k selections equal.
3. torch.profiler over one decode step of --profile-config at a 4K context (synthetic fill): the ops that dominate.
Prints and writes one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max())


def decode_logits(m, cfg, ids, packed: bool, backend: str, capture=None) -> torch.Tensor:
    """Logits of 10 decode steps after a 290-token prefill on one packed store; capture(True / False) brackets the
    first decode step."""
    import dsv41.kernels as K
    from dsv41.kernels.choice import set_packed_decode
    from dsv41.kv import PackedKVPool
    set_packed_decode(packed)
    K.set_backend(backend)
    pool = PackedKVPool(cfg, device="cuda", dtype=torch.bfloat16)
    sids = [pool.new_sequence(), pool.new_sequence()]
    with torch.no_grad():
        m(ids[:, :290], pool.bind(sids))
        out = []
        for k in range(290, 300):
            if capture is not None and k == 290:
                capture(True)
            out.append(m(ids[:, k:k + 1], pool.bind(sids)).logits)
            if capture is not None and k == 290:
                capture(False)
    set_packed_decode(True)
    K.set_backend("auto")
    return torch.cat(out, 1)


def triton_decode_with_captured_ops(m, cfg, ids):
    """The packed path's logits on the Triton kernels, and the inputs of every `sparse_attn_packed` /
    `indexer_topk_packed` call of its first decode step."""
    from dsv41.model import packed_decode
    calls = {"attn": [], "idx": []}
    orig_attn, orig_idx = packed_decode.sparse_attn_packed, packed_decode.indexer_topk_packed
    state = {"on": False}

    def cap_attn(*a):
        if state["on"]:
            calls["attn"].append([x.clone() if isinstance(x, torch.Tensor) else x for x in a])
        return orig_attn(*a)

    def cap_idx(*a, **kw):
        if state["on"]:
            calls["idx"].append(([x.clone() if isinstance(x, torch.Tensor) else x for x in a], dict(kw)))
        return orig_idx(*a, **kw)

    packed_decode.sparse_attn_packed, packed_decode.indexer_topk_packed = cap_attn, cap_idx
    try:
        tri = decode_logits(m, cfg, ids, True, "auto", capture=lambda on: state.update(on=on))
    finally:
        packed_decode.sparse_attn_packed, packed_decode.indexer_topk_packed = orig_attn, orig_idx
    return tri, calls


def op_checks(calls: dict) -> dict:
    """Each captured op through both backends: attention relative error per layer, top-k selections equal."""
    import dsv41.kernels as K
    from dsv41.kernels.triton import indexer_topk_packed_triton, sparse_attn_packed_triton
    with torch.no_grad():
        attn = [round(rel(sparse_attn_packed_triton(*a), K.sparse_attn_packed_ref(*a)), 6) for a in calls["attn"]]
        sel = [bool(torch.equal(K.indexer_topk_packed_ref(*a, **kw)[0], indexer_topk_packed_triton(*a, **kw)[0]))
               for a, kw in calls["idx"]]
    return {"attn_triton_vs_ref_per_layer": attn, "indexer_topk_equal_per_layer": sel}


def profile_decode_step(config: str) -> dict:
    """torch.profiler over one decode step of `config` at a 4K context (synthetic fill): the ops that dominate."""
    from dsv41.config import load_config
    from dsv41.kv import PackedKVPool
    from dsv41.kv.accounting import fill_random
    from dsv41.model.init import random_model
    from torch.profiler import ProfilerActivity, profile
    pcfg = load_config(config)
    pm = random_model(pcfg, dtype=torch.bfloat16, device="cuda")
    pool = PackedKVPool(pcfg, device="cuda", dtype=torch.bfloat16)
    sid = pool.new_sequence()
    fill_random(pool, sid, 4096, seed=0)
    tok = torch.tensor([[5]], device="cuda")
    with torch.no_grad():
        for _ in range(2):
            v = pool.bind([sid])
            p0 = v.pos.clone()
            pm(tok, v)
            v.pos = p0
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            v = pool.bind([sid])
            pm(tok, v)
            torch.cuda.synchronize()
    ka = prof.key_averages()
    top_cuda = sorted(ka, key=lambda e: -e.device_time_total)[:18]
    top_cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:18]
    return {"profile_cuda_ms": [(e.key, round(e.device_time_total / 1e3, 2), e.count) for e in top_cuda],
            "profile_self_cpu_ms": [(e.key, round(e.self_cpu_time_total / 1e3, 2), e.count) for e in top_cpu],
            "profile_total_cuda_ms": round(sum(e.self_device_time_total for e in ka) / 1e3, 2),
            "profile_total_cpu_ms": round(sum(e.self_cpu_time_total for e in ka) / 1e3, 2)}


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--profile-config", default="v41-geometry")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from dsv41.config import load_config
    from dsv41.model.attention import set_tie_break
    from dsv41.model.init import random_model

    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "commit": os.environ.get("DSV41_GIT_COMMIT")}
    cfg = load_config(args.config)
    m = random_model(cfg, dtype=torch.bfloat16, seed=1, device="cuda")
    set_tie_break(m, "recent")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (2, 300), generator=g).cuda()
    dense = decode_logits(m, cfg, ids, False, "auto")
    ref = decode_logits(m, cfg, ids, True, "torch")
    tri, calls = triton_decode_with_captured_ops(m, cfg, ids)
    step = lambda a, b: [round(rel(a[:, s], b[:, s]), 6) for s in range(a.size(1))]     # noqa: E731
    res["packed_ref_vs_dense"] = step(ref, dense)
    res["packed_triton_vs_dense"] = step(tri, dense)
    res["packed_triton_vs_packed_ref"] = step(tri, ref)
    res.update(op_checks(calls))
    print(json.dumps(res), flush=True)
    del m
    torch.cuda.empty_cache()
    res.update(profile_decode_step(args.profile_config))
    line = json.dumps(res)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
