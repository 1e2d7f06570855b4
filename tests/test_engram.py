"""Engram (docs/model.md §6): token map, primes, multipliers, hashing, and golden parity on case A.

Golden data: tests/data/golden/case-a (checkpoint + tokenizer) and a.fp32.fix.blocks-seq0.safetensors
(`engram_out.{L}` = block_out.{L-1} + Engram, prefill and 8 decode steps of sequence 0).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from dsv41.codecs import qdq_fp8
from dsv41.config import ModelConfig
from dsv41.model.common import warm_up_transcendentals
from dsv41.model.engram import (
    DEAD,
    Engram,
    NgramHasher,
    build_compressed_token_map,
    check_engram_tables,
    engram_primes,
    hash_multipliers,
    identity_token_map,
)

GOLDEN = Path(__file__).parent / "data" / "golden"
CASE_A = GOLDEN / "case-a"
BLOCKS = GOLDEN / "a.fp32.fix.blocks-seq0.safetensors"
TOL = 1e-5

pytestmark = pytest.mark.skipif(not (CASE_A / "config.json").is_file() or not BLOCKS.is_file(),
                                reason="golden case-a data missing under tests/data/golden")

warm_up_transcendentals()


# ------------------------------------------------------------------------------------------------ fixtures

@lru_cache(maxsize=1)
def case_cfg() -> ModelConfig:
    return ModelConfig.from_json(CASE_A / "config.json")


@lru_cache(maxsize=1)
def case_map() -> tuple[torch.Tensor, int]:
    from tokenizers import Tokenizer
    return build_compressed_token_map(Tokenizer.from_file(str(CASE_A / "tokenizer.json")))


@lru_cache(maxsize=1)
def golden() -> dict[str, torch.Tensor]:
    with safe_open(str(BLOCKS), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()
                if "engram" in k or k in ("tokens", "decode_tokens", "block_out.0", "block_out.3",
                                          "decode_block_out.0", "decode_block_out.3")}


def _e8m0(t: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) as fp32."""
    b = t.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(torch.ones(b.shape), b)


@lru_cache(maxsize=1)
def case_weights() -> dict[str, torch.Tensor]:
    index = json.loads((CASE_A / "model.safetensors.index.json").read_text())["weight_map"]
    raw: dict[str, torch.Tensor] = {}
    for name, shard in index.items():
        if ".engram." in name:
            with safe_open(str(CASE_A / shard), "pt") as f:
                raw[name] = f.get_tensor(name)
    out = {}
    for L in case_cfg().engram_layer_ids:
        p = f"layers.{L}.engram."
        emb, es = raw[p + "embed.weight"].float(), _e8m0(raw[p + "embed.scale"])       # [R, W], [R, W/32]
        out[p + "embed.weight"] = (emb.unflatten(-1, (-1, 32)) * es.unsqueeze(-1)).flatten(-2)
        w, ws = raw[p + "wkv.weight"].float(), _e8m0(raw[p + "wkv.scale"])              # per 32x32 tile
        full = ws.repeat_interleave(32, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1]]
        out[p + "wkv.weight"] = w * full
        out[p + "q_weight"] = raw[p + "q_weight"].float()
        out[p + "k_weight"] = raw[p + "k_weight"].float()
    return out


@lru_cache(maxsize=4)
def case_engram(layer_id: int) -> Engram:
    m = Engram(case_cfg(), layer_id, dtype=torch.float32)
    p = f"layers.{layer_id}.engram."
    sd = {k[len(p):]: v for k, v in case_weights().items() if k.startswith(p)}
    m.load_state_dict(sd, strict=True)
    return m.eval()


def rel_rows(ours: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """||ours - gold|| / ||gold|| per token row (over streams and width)."""
    d = (ours.double() - gold.double()).flatten(2).norm(dim=-1)
    return d / gold.double().flatten(2).norm(dim=-1)


def engram_errors(hasher: NgramHasher) -> dict[str, float]:
    """Max rel-L2 per row of both engram layers vs golden, prefill (one shot) and the 8 decode steps."""
    g = golden()
    errs = {}
    hist0 = hasher.init_history(1)
    with torch.no_grad():
        ids, hist = hasher(g["tokens"], hist0)
        dec = []
        for k in range(g["decode_tokens"].shape[1]):
            d, hist = hasher(g["decode_tokens"][:, k:k + 1], hist)
            dec.append(d)
        for L in case_cfg().engram_layer_ids:
            m = case_engram(L)
            e = m.layer_index
            out = m(g[f"block_out.{L - 1}"], ids[:, :, e])
            errs[f"prefill.{L}"] = rel_rows(out, g[f"engram_out.{L}"]).max().item()
            worst = 0.0
            for k, d in enumerate(dec):
                out = m(g[f"decode_block_out.{L - 1}"][:, k:k + 1], d[:, :, e])
                worst = max(worst, rel_rows(out, g[f"decode_engram_out.{L}"][:, k:k + 1]).max().item())
            errs[f"decode.{L}"] = worst
    return errs


# ------------------------------------------------------------------------------------------------ 6.1, 6.2 constants

def test_token_map_case_a():
    tmap, n = case_map()
    assert n == 873 == case_cfg().engram_compressed_vocab_size
    assert tmap.shape == (1024,) and tmap.dtype == torch.long
    assert int(tmap.max()) == n - 1 and int(tmap[0]) == 0
    # first-seen order: every new compressed id appears right after the largest so far
    running = torch.cummax(tmap, 0).values
    assert bool(((tmap == running) | (tmap < running)).all())
    assert torch.equal(torch.unique(tmap), torch.arange(n))


def test_identity_map():
    tmap, n = identity_token_map(7)
    assert n == 7 and torch.equal(tmap, torch.arange(7))


def test_primes_case_a_and_released():
    p = engram_primes(case_cfg())
    assert [sum(map(sum, layer)) for layer in p] == [6568, 7464]
    assert p[0][0][0] == 503                      # first prime >= engram_vocab_size 500
    r = engram_primes(ModelConfig())
    assert [sum(map(sum, layer)) for layer in r] == [384006168, 384016682]
    assert r[0][0] == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183]
    assert r[0][1][0] == 16000189 and r[0][1][-1] == 16000321
    assert r[0][2][0] == 16000339 and r[0][2][-1] == 16000463
    assert r[1][0][0] == 16000477 and r[1][2][-1] == 16000889
    flat = [q for layer in r for ng in layer for q in ng]
    assert len(set(flat)) == 48 and flat == sorted(flat)
    check_engram_tables(ModelConfig())
    check_engram_tables(case_cfg())


def test_released_multipliers():
    cfg = ModelConfig()
    assert hash_multipliers(cfg, 1).tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert hash_multipliers(cfg, 14).tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def test_mismatched_num_embeddings_raises():
    bad = case_cfg().replace(engram_num_embeddings=(6568, 7465))
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        check_engram_tables(bad)
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        Engram(bad, 4)
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        NgramHasher(bad, case_map())


def test_mismatched_compressed_vocab_raises():
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher(case_cfg(), identity_token_map(1024))


# ------------------------------------------------------------------------------------------------ 6.3 golden parity

def test_golden_engram_parity():
    errs = engram_errors(NgramHasher(case_cfg(), case_map()))
    print("engram max rel-L2 per row:", errs)
    assert all(v <= TOL for v in errs.values()), errs


def test_negative_control_multiplier():
    h = NgramHasher(case_cfg(), case_map())
    h.multipliers[0, 2] += 2                      # one multiplier of layer 1 (still odd)
    errs = engram_errors(h)
    assert errs["prefill.1"] > 1e-2 and errs["decode.1"] > 1e-2
    assert errs["prefill.4"] <= TOL               # the other layer is untouched


def test_negative_control_pad():
    h = NgramHasher(case_cfg(), case_map())
    assert h.pad_id == 2
    h.pad_id = 0                                  # e.g. BOS's compressed id instead of map[engram_pad_id]
    errs = engram_errors(h)
    assert errs["prefill.1"] > 1e-2 and errs["prefill.4"] > 1e-2
    assert errs["decode.1"] <= TOL                # decode positions >= 201 never look back past the start


def test_ids_past_a_small_tokenizer_hash_as_pad():
    """A model whose vocabulary exceeds its tokenizer's (a small trained tokenizer) can still emit the ids past
    it (an untrained model's argmax): they hash as the pad token, the tokenizer's ids as before."""
    tmap, size = case_map()
    small = tmap[:200]
    h = NgramHasher(case_cfg(), (small, size))
    assert h.token_map.numel() == case_cfg().vocab_size
    assert torch.equal(h.compress(torch.arange(200).view(1, -1)), small.view(1, -1))
    assert bool((h.compress(torch.tensor([[200, case_cfg().vocab_size - 1]])) == h.pad_id).all())
    with pytest.raises(IndexError):
        h.compress(torch.tensor([[case_cfg().vocab_size]]))


# ------------------------------------------------------------------------------------------------ hashing dataflow

@lru_cache(maxsize=1)
def case_hasher() -> NgramHasher:
    return NgramHasher(case_cfg(), case_map())


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_chunked_equals_one_shot(data):
    h = case_hasher()
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(0, 1024, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > data.draw(st.sampled_from([0.0, 0.2, 0.5]))
    use_mask = data.draw(st.booleans())
    m = mask if use_mask else None
    ref, ref_hist = h(ids, h.init_history(B), m)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=6))) - {T})
    hist, parts = h.init_history(B), []
    for a, b in zip([0] + cuts, cuts + [T]):
        out, hist = h(ids[:, a:b], hist, None if m is None else m[:, a:b])
        parts.append(out)
    assert torch.equal(torch.cat(parts, 1), ref)
    assert torch.equal(hist, ref_hist)
    # one token at a time (decode)
    hist, steps = h.init_history(B), []
    for t in range(T):
        out, hist = h(ids[:, t:t + 1], hist, None if m is None else m[:, t:t + 1])
        steps.append(out)
    assert torch.equal(torch.cat(steps, 1), ref)


def test_history_semantics():
    h = case_hasher()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out, hist = h(ids)
    tmap = case_map()[0]
    assert hist.tolist() == [tmap[[7, 8, 9]].tolist()]
    short, hist2 = h(ids[:, :1])
    assert hist2.tolist() == [[DEAD, DEAD, int(tmap[5])]]
    assert torch.equal(short, out[:, :1])


def test_image_positions_dead_and_gate_zero():
    h = case_hasher()
    ids = torch.tensor([[0, 11, 12, 1022, 1022, 1022, 13, 14, 15, 16]])
    mask = ids != 1022
    out, hist = h(ids, None, mask)
    # a masked position blocks everything: all its columns are the all-pad n-grams
    pad_only, _ = h(torch.full((1, 1), case_cfg().engram_pad_id), None)
    for p in (3, 4, 5):
        assert torch.equal(out[:, p], pad_only[:, 0])
    # right after the image span the look-back is blocked just like at the sequence start
    restart, _ = h(ids[:, 6:], None)
    assert torch.equal(out[:, 6:], restart)
    # the history carries DEAD for image positions
    _, hist_img = h(ids[:, :5], None, mask[:, :5])
    assert hist_img[0].tolist() == [int(case_map()[0][12]), DEAD, DEAD]
    # Engram: masked positions pass through unchanged, the others change
    eng = case_engram(1)
    x = torch.randn(1, ids.shape[1], case_cfg().hc_mult, case_cfg().dim)
    with torch.no_grad():
        y = eng(x, out[:, :, eng.layer_index], mask)
    assert torch.equal(y[:, ~mask[0]], x[:, ~mask[0]])
    assert bool((y[:, mask[0]] != x[:, mask[0]]).any(-1).all())


def test_zero_dot_gate_and_dtype():
    """A zero stream gives dot = 0 -> gate sigmoid(+1e-3); bf16 input gives bf16 output."""
    cfg = case_cfg()
    eng = case_engram(1)
    ids, _ = case_hasher()(torch.tensor([[3, 4, 5]]))
    x = torch.zeros(1, 3, cfg.hc_mult, cfg.dim)
    with torch.no_grad():
        y = eng(x, ids[:, :, 0])
        rows = eng.embed(ids[:, :, 0]).flatten(-2)
        value = eng.wkv(rows)[..., cfg.hc_mult * cfg.dim:]
        g = torch.sigmoid(torch.tensor(1e-3))
        assert torch.allclose(y, (g * value).unsqueeze(-2).expand_as(y), rtol=0, atol=0)
        yb = eng(x.bfloat16(), ids[:, :, 0])
    assert yb.dtype == torch.bfloat16


def _qdq_fp8_tiles(w: torch.Tensor, tile: int = 32) -> torch.Tensor:
    """Round a weight [O, I] to e4m3 values with one power-of-two scale per tile x tile block (the checkpoint's
    fp8 Linear storage, docs/model.md §9): scale = 2^ceil(log2(amax * fp32(1/448))), amax >= 1e-4, RNE to e4m3.
    Used to give random weights checkpoint-representable values."""
    O, I = w.shape
    po, pi = -O % tile, -I % tile
    g = F.pad(w.float(), (0, pi, 0, po)).reshape((O + po) // tile, tile, (I + pi) // tile, tile)
    amax = g.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-4)
    mant, expo = torch.frexp(amax * torch.tensor(1.0 / 448.0, dtype=torch.float32))   # y = mant * 2^expo
    scale = torch.ldexp(torch.ones_like(amax), expo - (mant == 0.5).to(expo.dtype))      # 2^ceil(log2 y)
    q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(O + po, I + pi)[:O, :I].to(w.dtype)


@torch.no_grad()
def reset_engram(eng: Engram, generator: torch.Generator | None = None) -> None:
    """Random weights with checkpoint-like statistics, every value representable in the checkpoint format:
    table ~ N(0, 1) rounded to e4m3 with a ue8m0 scale per 32, wkv ~ N(0, 1/in) rounded to fp8 per 32x32
    tile, q/k ~ 1 + 0.1 N(0, 1) rounded to bf16 (the case-a checkpoint measures 1.0 +- 0.1)."""
    def randn(shape):
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    e = eng.embed.weight
    e.copy_(qdq_fp8(randn(e.shape)).to(e.dtype))
    w = eng.wkv.weight
    w.copy_(_qdq_fp8_tiles(randn(w.shape) * w.shape[1] ** -0.5).to(w.dtype))
    for p in (eng.q_weight, eng.k_weight):
        p.copy_((1 + 0.1 * randn(p.shape)).to(torch.bfloat16).to(p.dtype))


def test_reset_parameters_statistics():
    cfg = case_cfg()
    eng = Engram(cfg, 4, dtype=torch.float32)
    reset_engram(eng, torch.Generator().manual_seed(0))
    e = eng.embed.weight
    assert abs(e.std().item() - 1) < 0.05 and torch.equal(e, e.bfloat16().float())
    w = eng.wkv.weight
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1) < 0.05 and torch.equal(w, w.bfloat16().float())
    assert abs(eng.q_weight.mean().item() - 1) < 0.02
    names = {k for k, _ in eng.named_parameters()}
    assert names == {"embed.weight", "wkv.weight", "q_weight", "k_weight"}
