"""Guards the reference model's dataflow: random models are sane at every preset, decode and chunked prefill
equal one-shot prefill (with the FP8/FP4 QDQs switched to identities and the deterministic top-k tie rule,
since the quantizers make the model piecewise constant), chunked prefill equals one-shot block by block with
quantization on (teacher forced), and checkpoints round-trip through the official layout and our own."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.config import load_config
from dsv41.model.attention import set_tie_break
from dsv41.model.cache import DenseCache
from dsv41.model.common import set_quantization
from dsv41.model.init import random_model
from tests.conftest import continuous_model, rel
from dsv41.model.loading import load_model, read_tensors, representable, save_checkpoint, write_official
from dsv41.model.runner import captures_from_record, compare_captures, run_teacher_forced
from dsv41.model.step import ForwardOptions
from dsv41.model.transformer import Transformer




def tokens(cfg, B, T, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["debug", "tiny"])
def test_random_model_logits_are_sane(name):
    cfg = load_config(name)
    m = random_model(cfg, seed=3)
    with torch.no_grad():
        out = m(tokens(cfg, 2, 40), DenseCache(cfg, 2, torch.float32))
    assert torch.isfinite(out.logits).all()
    assert 0.1 < out.logits.std() < 10
    assert (out.logits.argmax(-1) != out.logits.argmax(-1)[0, 0]).any()   # not degenerate


@pytest.mark.parametrize("name", ["debug", "tiny"])
def test_analytic_parameter_count_matches_the_model(name):
    """The analysis calculator (pure config arithmetic) counts exactly the parameters the model allocates."""
    from dsv41.analysis.params import params_report
    cfg = load_config(name)
    m = Transformer(cfg)
    rep = params_report(cfg)
    n = sum(p.numel() for p in m.parameters())
    assert rep["backbone"] + rep["engram"] + rep["dspark"] + rep["vision"] == n


@pytest.mark.parametrize("name,T,K", [("debug", 21, 6), ("tiny", 130, 4)])
def test_decode_equals_prefill(name, T, K):
    """Prefill of T then K single-token steps == prefill of T+K (crosses compression groups and the window)."""
    cfg, m = continuous_model(name)
    ids = tokens(cfg, 2, T + K)
    with torch.no_grad():
        full = m(ids, DenseCache(cfg, 2, torch.float32)).logits
        c = DenseCache(cfg, 2, torch.float32)
        parts = [m(ids[:, :T], c).logits] + [m(ids[:, T + k:T + k + 1], c).logits for k in range(K)]
    assert rel(torch.cat(parts, 1), full) < 1e-5


@pytest.mark.parametrize("chunks", [[1, 1, 1, 30], [7, 13, 20], [16, 9, 1, 14], [33, 7]])
def test_chunked_prefill_equals_one_shot(chunks):
    cfg, m = continuous_model("debug")
    ids = tokens(cfg, 2, sum(chunks))
    with torch.no_grad():
        full = m(ids, DenseCache(cfg, 2, torch.float32))
        c = DenseCache(cfg, 2, torch.float32)
        outs, lo = [], 0
        for n in chunks:
            outs.append(m(ids[:, lo:lo + n], c))
            lo += n
        # the DSpark taps agree as well
    assert rel(torch.cat([o.logits for o in outs], 1), full.logits) < 1e-5
    assert rel(torch.cat([o.main_hidden for o in outs], 1), full.main_hidden) < 1e-5


def test_chunked_prefill_teacher_forced_with_quantization():
    """Quantization on: feed each block the one-shot run's input stream; chunked prefill must reproduce every
    block output (per-row 1e-5, an isolated rounding-midpoint flip allowed per tensor, as gate 1)."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=5)
    set_tie_break(m, "recent")
    ids = tokens(cfg, 1, 40, seed=2)
    rec = {}
    with torch.no_grad():
        out = m(ids, DenseCache(cfg, 1, torch.float32), opts=ForwardOptions(record=rec))
    ref = captures_from_record(rec, m, ids, out.logits)
    ours = run_teacher_forced(m, ref, prompt_chunks=[9, 1, 17, 13])
    rep = compare_captures(ours, ref)
    assert rep and all(v["ok"] for v in rep.values()), {k: v for k, v in rep.items() if not v["ok"]}


def test_official_layout_round_trip(tmp_path):
    cfg = load_config("debug")
    m = random_model(cfg, seed=7)
    representable(m, cfg)
    write_official(m, cfg, tmp_path / "ck", shards=3)
    assert len(list((tmp_path / "ck").glob("*.safetensors"))) == 3
    m2, cfg2 = load_model(tmp_path / "ck")
    assert cfg2 == cfg
    sd1, sd2 = m.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    t = read_tensors(tmp_path / "ck")
    assert t["layers.2.ffn.experts.0.w1.weight"].dtype == torch.int8          # fp4 packed two per byte
    assert t["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.1.engram.embed.scale"].shape[1] == cfg.engram_head_dim // 32
    # our own format round-trips exactly too
    save_checkpoint(m2, cfg, tmp_path / "own")
    m3, _ = load_model(tmp_path / "own")
    for k, v in m3.state_dict().items():
        assert torch.equal(v, sd1[k]), k


def _corrupt(src, dst, fn):
    tensors = read_tensors(src)
    fn(tensors)
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.mark.parametrize("what,match", [
    ("missing", "missing tensor 'layers.3.attn.wkv.weight'"),
    ("missing_scale", "missing tensor 'layers.3.attn.wkv.scale'"),
    ("unexpected", "unexpected tensor 'layers.3.attn.bogus'"),
    ("shape", "tensor 'layers.0.attn_norm.weight': got shape"),
    ("dtype", "tensor 'layers.2.ffn.experts.1.w2.weight': got torch.float32"),
])
def test_bad_official_checkpoints(tmp_path, what, match):
    cfg = load_config("debug")
    m = random_model(cfg, seed=1)
    write_official(m, cfg, tmp_path / "ok")

    def fn(t):
        if what == "missing":
            del t["layers.3.attn.wkv.weight"]
        elif what == "missing_scale":
            del t["layers.3.attn.wkv.scale"]
        elif what == "unexpected":
            t["layers.3.attn.bogus"] = torch.zeros(3)
        elif what == "shape":
            t["layers.0.attn_norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
        else:
            t["layers.2.ffn.experts.1.w2.weight"] = torch.zeros(t["layers.2.ffn.experts.1.w2.weight"].shape)
    _corrupt(tmp_path / "ok", tmp_path / "bad", fn)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path / "bad")


def test_logits_cli_on_random_official_checkpoint(tmp_path):
    cfg = load_config("debug")
    m = random_model(cfg, seed=2)
    write_official(m, cfg, tmp_path / "ck")
    (tmp_path / "t.json").write_text(json.dumps(tokens(cfg, 2, 30).tolist()))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", "logits", "--checkpoint", str(tmp_path / "ck"),
                        "--tokens", str(tmp_path / "t.json"), "--decode-steps", "3", "--out",
                        str(tmp_path / "o.safetensors")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t0 < 60
    o = load_file(tmp_path / "o.safetensors")
    assert o["prefill_logits"].shape == (2, 30, cfg.vocab_size) and o["decode_tokens"].shape == (2, 3)
    assert o["dspark_tokens"].shape == (2, 3, cfg.dspark_block_size + 1)
    assert {"topk.2", "topk.4", "topk.6", "candidates.4", "experts.0", "expert_weights.7"} <= set(o)
    bad = subprocess.run([sys.executable, "-m", "dsv41.cli", "logits", "--checkpoint", str(tmp_path / "ck"),
                          "--tokens", str(tmp_path / "t.json"), "--decode-steps", "-1", "--out", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "decode-steps" in bad.stderr


def test_batched_decode_at_different_positions_equals_one_at_a_time():
    """Continuous batching: rows at different positions (different compression phases) decode together."""
    cfg, m = continuous_model("debug")
    lens = [13, 26, 9]
    seqs = [tokens(cfg, 1, n + 4, seed=s) for s, n in enumerate(lens)]
    alone, caches = [], []
    with torch.no_grad():
        for s, n in zip(seqs, lens):
            c = DenseCache(cfg, 1, torch.float32)
            m(s[:, :n], c)
            caches.append(c)
            c2 = DenseCache(cfg, 1, torch.float32)
            m(s[:, :n], c2)
            alone.append(torch.cat([m(s[:, n + k:n + k + 1], c2).logits for k in range(4)], 1))
        batch = DenseCache.stack(caches)
        steps = []
        for k in range(4):
            ids = torch.cat([s[:, n + k:n + k + 1] for s, n in zip(seqs, lens)])
            steps.append(m(ids, batch).logits)
    together = torch.cat(steps, 1)
    assert rel(together, torch.cat(alone)) < 1e-5
