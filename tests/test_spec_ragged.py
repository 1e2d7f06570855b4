"""Guards ragged verification (issue 28, item 1): a verify forward where each row runs its own 1 + v_r tokens
(`ForwardOptions.lengths`, `dsv41.model.step.Ragged`) computes for every row what that row computes alone; the
verify journal rolls rows of mixed lengths (v_r = 0 among them) back to any kept prefix with no trace; the engine's
per-row verify lengths keep greedy outputs those of no speculation (the deterministic mode: log-probs bit for bit)."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.speculative.drafter import Proposal
from dsv41.engine.speculative.rollback import VerifyJournal
from dsv41.engine.store import make_pool
from dsv41.model.attention import use_deterministic
from dsv41.model.init import random_model
from dsv41.model.step import ForwardOptions, Ragged
from tests.conftest import continuous_model
from tests.test_speculative import OracleDrafter, _equal, _prompts, _snapshot
from tests.test_spec_never_slower import batch_profile


@pytest.fixture(scope="module")
def debug_model():
    return continuous_model("debug")


def _quantized_deterministic():
    """The packed store (quantization on) in the deterministic mode: every row's arithmetic its own, bit for bit."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=2)
    use_deterministic(m)
    return cfg, m


def _prefilled(m, prompts):
    """A pool holding one sequence per prompt (each prefilled alone) -> (pool, sids)."""
    pool = make_pool(m)
    sids = []
    for p in prompts:
        sid = pool.new_sequence()
        view = pool.bind([sid])
        m(torch.tensor([p]), view)
        pool.release(view, [sid])
        sids.append(sid)
    return pool, sids


def test_ragged_layout():
    r = Ragged(torch.tensor([1, 3, 2]), 3, "cpu")
    assert r.cu_seqlens.tolist() == [0, 1, 4, 6] and r.n == 6
    x = torch.arange(9.0).view(3, 3)
    assert r.pack(x).tolist() == [[0.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    assert r.unpack(r.pack(x)).tolist() == [[0.0, 0.0, 0.0], [3.0, 4.0, 5.0], [6.0, 7.0, 0.0]]
    for bad in ([0, 1, 1], [1, 4, 1]):
        with pytest.raises(ValueError):
            Ragged(torch.tensor(bad), 3, "cpu")


@pytest.mark.parametrize("quantized", [False, True], ids=["continuous", "packed-deterministic"])
@torch.no_grad()
def test_ragged_forward_equals_rows_alone(debug_model, quantized, one_thread):
    """Rows at different positions (compression groups closing inside the step, windows wrapping) with lengths
    1, 4, 2, G + 1: each row's logits and drafter taps over its own tokens are those of the row run alone with
    exactly those tokens (continuous model: to float rounding; packed store in the deterministic mode: bit for
    bit); the padding's are zero."""
    cfg, m = _quantized_deterministic() if quantized else debug_model
    G = cfg.dspark_block_size
    W = cfg.window_size
    prompts = _prompts(cfg.vocab_size, (5, W + 3, 2 * W + 4, 40), seed=7)
    lengths = [1, 4, 2, G + 1]
    T = max(lengths)
    ids = torch.randint(0, cfg.vocab_size, (len(prompts), T), generator=torch.Generator().manual_seed(8))
    pool, sids = _prefilled(m, prompts)
    out = m(ids, pool.bind(sids), opts=ForwardOptions(lengths=torch.tensor(lengths)))
    assert out.logits.shape[:2] == (len(prompts), T)
    for b, (p, n) in enumerate(zip(prompts, lengths)):
        alone_pool, (sid,) = _prefilled(m, [p])
        ref = m(ids[b:b + 1, :n], alone_pool.bind([sid]))
        for got, want in ((out.logits[b, :n], ref.logits[0]), (out.main_hidden[b, :n], ref.main_hidden[0])):
            if quantized:
                assert torch.equal(got, want), b
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert not out.logits[b, n:].any()


@torch.no_grad()
def test_ragged_rollback_with_mixed_lengths_leaves_no_trace(one_thread):
    """Packed store, deterministic mode: a ragged verify of lengths 1 (v = 0), 3, G + 1, 2 rolled back to kept
    prefixes 1, 2, G + 1, 1 leaves every row exactly (ring rows, global entries, compressor carry, Engram history,
    position) as a row that ran only its kept tokens, and the next decode step computes the same logits."""
    cfg, m = _quantized_deterministic()
    G, W = cfg.dspark_block_size, cfg.window_size
    prompts = _prompts(cfg.vocab_size, (W + 3, 2 * W + 4, 2 * W + 5, 9), seed=9)
    lengths, keep = [1, 3, G + 1, 2], [1, 2, G + 1, 1]
    T = max(lengths)
    ids = torch.randint(0, cfg.vocab_size, (len(prompts), T), generator=torch.Generator().manual_seed(10))
    pool, sids = _prefilled(m, prompts)
    view = pool.bind(sids)
    j = VerifyJournal(m, view, view.pos.clone(), T)
    m(ids, view, opts=ForwardOptions(journal=j.model_journal, lengths=torch.tensor(lengths)))
    j.rollback(m, view, ids, torch.tensor(keep))
    pool.release(view, sids)
    states = [_snapshot(pool, sid) for sid in sids]
    nxt = torch.tensor([[3], [4], [5], [6]])
    after = m(nxt, pool.bind(sids)).logits
    for b, (p, k) in enumerate(zip(prompts, keep)):
        ref_pool, (sid,) = _prefilled(m, [p])
        v = ref_pool.bind([sid])
        m(ids[b:b + 1, :k], v)
        ref_pool.release(v, [sid])
        got, want = states[b], _snapshot(ref_pool, sid)
        assert got[0] == want[0] == len(p) + k
        assert _equal(got, want), b
        assert torch.equal(after[b], m(nxt[b:b + 1], ref_pool.bind([sid])).logits[0]), b


class SplitConfidenceDrafter(OracleDrafter):
    """The oracle's drafts with a confidence that splits the rows: rows of even index report a_k = 0.97, odd ones
    0.05, so the confidence scheduler verifies long drafts on some rows and none (v_r = 0) on others in the same
    step. Records the lengths of every verify forward it precedes."""

    def propose(self, view, seqs, pos) -> Proposal:
        prop = super().propose(view, seqs, pos)
        a = torch.tensor([0.97 if int(s.request_id.split("-")[1]) % 2 == 0 else 0.05 for s in seqs])
        return Proposal(prop.tokens, prop.q, a.view(-1, 1).expand(-1, self.G).clone())


def _forward_lengths(m, log):
    """Wrap the model's forward to log the per-row lengths of every ragged call."""
    real = m.forward

    def forward(ids, cache, *args, **kw):
        opts = kw.get("opts")
        if opts is not None and opts.lengths is not None:
            log.append(opts.lengths.tolist())
        return real(ids, cache, *args, **kw)
    return forward


def test_engine_mixed_verify_lengths_greedy_identity(one_thread, monkeypatch):
    """The scheduler gives rows of one step different lengths (v_r = 0 beside long ones, requests near their
    max_tokens capped) and fixed:G (every draft right) caps rows by their remaining tokens: outputs and log-probs bit for bit off's
    (deterministic mode, packed store), and the forwards really were ragged."""
    cfg, m = _quantized_deterministic()
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17, 40, 23), seed=11)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0) for n in (14, 9, 12, 7)]

    def result(cs):
        return [(c.output_ids, [lp["logprob"] for lp in c.logprobs]) for c in cs]
    plain = Engine(m, prefill_mode="full", max_seq_len=256, deterministic=True).generate(prompts, params)
    want = result(plain)
    futures = {f"req-{i}": c.output_ids for i, c in enumerate(plain)}
    pays = batch_profile((1, 2, 3, 4), G, 0.001, 0.01, 0.01)
    log: list = []
    monkeypatch.setattr(m, "forward", _forward_lengths(m, log))
    for spec, drafter in (("dspark", SplitConfidenceDrafter), (f"fixed:{G}", OracleDrafter)):
        log.clear()
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=pays,
                     deterministic=True)
        eng.drafter = drafter(futures, G, cfg.vocab_size, wrong=3 if spec == "dspark" else 1000)
        got = eng.generate(prompts, params)
        assert result(got) == want, spec
        assert any(len(set(ls)) > 1 for ls in log), (spec, log)          # rows of one forward, different lengths
        if spec == "dspark":
            assert any(1 in ls and max(ls) > 2 for ls in log), log           # v_r = 0 beside a long verify
            st = [c.stats["speculative"] for c in got]
            assert st[1]["drafted_tokens"] < st[0]["drafted_tokens"]
