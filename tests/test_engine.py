"""Guards the engine: CED prefill modes (ced-exact == full, chunked == one-shot, decoder rows really skipped,
ced-bounded's deviation measured), continuous batching == one request at a time, sampling and stop rules, and
bad input. Exactness is asserted with the FP8/FP4 QDQs off and the deterministic tie rule (the quantizers make
the model piecewise constant, docs/golden.md §4); packed-store equality with quantization on is in
tests/test_kv_paged.py."""

from __future__ import annotations

import pytest
import torch

from dsv41.engine.engine import Engine
from dsv41.engine.prefill import decoder_rows, prefill
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.store import DensePool
from tests.conftest import continuous_model, rel


def run(m, ids, mode, chunk=None, decode=3):
    pool = DensePool(m.cfg, torch.float32)
    sid = pool.new_sequence()
    c = pool.bind([sid])
    N = ids.size(1) - decode
    out = prefill(m, ids[:, :N], c, mode, chunk)
    with torch.no_grad():
        steps = [m(ids[:, N + k:N + k + 1], c).logits[:, -1] for k in range(decode)]
    return torch.stack([out.logits] + steps, 1), out


@pytest.mark.parametrize("name,N", [("debug", 60), ("tiny", 450)])
def test_ced_exact_equals_full_and_skips_rows(name, N):
    cfg, m = continuous_model(name)
    ids = torch.randint(0, cfg.vocab_size, (1, N + 3), generator=torch.Generator().manual_seed(0))
    full, fo = run(m, ids, "full")
    exact, eo = run(m, ids, "ced-exact")
    assert rel(exact, full) < 1e-5
    split = min(cfg.kv_source_layers[-1:])
    rows = [eo.rows[L] for L in range(split, cfg.n_layers)]
    assert rows == decoder_rows(cfg, "ced-exact", N) and max(rows) < N       # decoder layers skip rows
    assert all(eo.rows[L] == N for L in range(split))
    _, bo = run(m, ids, "ced-bounded")
    assert all(bo.rows[L] == cfg.window_size for L in range(split, cfg.n_layers))


@pytest.mark.parametrize("mode", ["full", "ced-exact", "ced-bounded"])
def test_chunked_prefill_equals_one_shot_per_mode(mode):
    cfg, m = continuous_model()
    ids = torch.randint(0, cfg.vocab_size, (1, 53), generator=torch.Generator().manual_seed(1))
    one, _ = run(m, ids, mode)
    for chunk in (1, 7, 16):
        chunked, _ = run(m, ids, mode, chunk)
        assert rel(chunked, one) < 1e-5, chunk


def test_ced_bounded_deviation_is_measured_and_bounded():
    """Metric: relative L2 of the last prompt position's logits, ced-bounded vs full. It must be well below the
    change caused by replacing every prompt token before the replay window (what the decoder would lose if the
    encoder's global KV carried nothing); on this random debug model the ratio is ~0.2."""
    cfg, m = continuous_model()
    N = 64
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (1, N + 1), generator=g)
    other = ids.clone()
    other[:, : N - cfg.window_size] = torch.randint(0, cfg.vocab_size, (1, N - cfg.window_size), generator=g)
    full, _ = run(m, ids, "full", decode=1)
    bounded, _ = run(m, ids, "ced-bounded", decode=1)
    changed, _ = run(m, other, "full", decode=1)
    dev = rel(bounded[:, 0], full[:, 0])
    context_effect = rel(changed[:, 0], full[:, 0])
    assert 0 < dev < 0.5 * context_effect, (dev, context_effect)


def test_continuous_batching_equals_one_at_a_time():
    cfg, m = continuous_model()
    prompts = ["hello world", "a much longer prompt with quite a few more bytes in it", "x", "def f(x):\n  return"]
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    together = Engine(m, prefill_mode="ced-exact", max_batch=3).generate(prompts, p)
    for prompt, t in zip(prompts, together):
        alone = Engine(m, prefill_mode="ced-exact", max_batch=1).generate([prompt], p)[0]
        assert alone.output_ids == t.output_ids
        assert len(t.output_ids) == 10 and t.finish_reason == "length"


def test_sampling_seeded_and_greedy_equivalences():
    cfg, m = continuous_model()
    eng = Engine(m, prefill_mode="full", max_batch=4)
    s = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, top_k=40, seed=11, ignore_eos=True)
    a, b = eng.generate(["seed", "seed"], [s, s])
    assert a.output_ids == b.output_ids
    c = eng.generate(["seed"], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, top_k=40, seed=12,
                                              ignore_eos=True))[0]
    assert c.output_ids != a.output_ids
    greedy = eng.generate(["seed"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    top1 = eng.generate(["seed"], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3, ignore_eos=True))[0]
    assert greedy.output_ids == top1.output_ids


def test_stop_strings_tokens_and_streaming():
    cfg, m = continuous_model()
    eng = Engine(m, prefill_mode="full")
    base = eng.generate(["abc"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(base.text) >= 3
    stop = base.text[2:4]
    cut = eng.generate(["abc"], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[:base.text.find(stop)]
    tok = base.output_ids[3]
    st = eng.generate(["abc"], SamplingParams(max_tokens=12, stop_token_ids=[tok], ignore_eos=True))[0]
    assert st.output_ids == base.output_ids[:base.output_ids.index(tok)] and st.finish_reason == "stop"
    streamed = "".join(o.new_text for o in eng.stream("abc", SamplingParams(max_tokens=12, ignore_eos=True)))
    assert streamed == base.text


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "empty prompt"),
    ("x" * 5000, SamplingParams(), "exceeds the maximum context"),
    ("ok", SamplingParams(temperature=-1), "temperature"),
    ("ok", SamplingParams(top_p=0), "top_p"),
    ("ok", SamplingParams(max_tokens=0), "max_tokens"),
    ("ok", SamplingParams(top_k=-2), "top_k"),
    ("ok", SamplingParams(stop=[""]), "stop"),
    ([1, 2, 99999], SamplingParams(), "token ids outside"),
])
def test_bad_requests_are_rejected_without_disturbing_others(prompt, params, match):
    cfg, m = continuous_model()
    eng = Engine(m, prefill_mode="full", max_seq_len=4096)
    good = eng.add_request("fine", SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=match):
        eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
    assert len(eng.completion(good).output_ids) == 4


def test_engine_rejects_unknown_mode():
    cfg, m = continuous_model()
    with pytest.raises(ValueError, match="prefill mode"):
        Engine(m, prefill_mode="fast")


@pytest.mark.parametrize("split_at", [5, 40])
def test_ced_exact_continuation_equals_full(split_at):
    """A prefill that continues a stored sequence (multi-turn, or an exact swa-hit resume) uses the decoder's
    valid windows: in ced-exact it still equals the full computation."""
    cfg, m = continuous_model()
    ids = torch.randint(0, cfg.vocab_size, (1, 50), generator=torch.Generator().manual_seed(4))
    full, _ = run(m, ids, "full", decode=1)
    pool = DensePool(cfg, torch.float32)
    c = pool.bind([pool.new_sequence()])
    prefill(m, ids[:, :split_at], c, "ced-exact")
    out = prefill(m, ids[:, split_at:49], c, "ced-exact")
    with torch.no_grad():
        last = m(ids[:, 49:50], c).logits[:, -1]
    assert rel(torch.stack([out.logits, last], 1), full) < 1e-5
