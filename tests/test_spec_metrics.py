"""Guards issue 28's speculative metrics: each completion's stats carry the verify lengths the engine chose (0: a
step decoded without drafts) and the tokens the scheduler predicted vs those emitted, and the server's /metrics
exports them (dsv41_speculative_*)."""

from __future__ import annotations

import urllib.request

import pytest

from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.server.metrics import ServerMetrics
from tests.conftest import continuous_model
from tests.test_spec_never_slower import batch_profile
from tests.test_speculative import OracleDrafter, _prompts


def test_completion_stats_and_metrics_of_the_verify_lengths(one_thread):
    cfg, m = continuous_model("debug")
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative="dspark",
                 step_profile=batch_profile((1, 2), G, 0.001, 0.01, 0.01))
    eng.drafter = OracleDrafter({f"req-{i}": w for i, w in enumerate(want)}, G, cfg.vocab_size)
    got = eng.generate(prompts, params)
    assert [c.output_ids for c in got] == want
    metrics = ServerMetrics()
    for c in got:
        sp = c.stats["speculative"]
        lengths = sp["verify_lengths"]
        assert sum(lengths.values()) == sp["target_forwards"]                     # one length per row-step
        assert sum(v * n for v, n in lengths.items()) == sp["drafted_tokens"]
        assert sp["realised_tokens"] == len(c.output_ids) - 1                # the first token came from prefill
        assert sp["predicted_tokens"] >= sp["target_forwards"]                # >= 1 token a row-step
        metrics.observe_completion(c)
    text = metrics.render().decode()
    total = {}
    for c in got:
        for v, n in c.stats["speculative"]["verify_lengths"].items():
            total[v] = total.get(v, 0) + n
    for v, n in total.items():
        assert f'dsv41_speculative_verify_length_total{{length="{v}"}} {float(n)}' in text
    pred = sum(c.stats["speculative"]["predicted_tokens"] for c in got)
    real = sum(c.stats["speculative"]["realised_tokens"] for c in got)
    assert f"dsv41_speculative_realised_tokens_total {float(real)}" in text
    line = next(x for x in text.splitlines() if x.startswith("dsv41_speculative_predicted_tokens_total "))
    assert float(line.split()[-1]) == pytest.approx(pred)
    off = ServerMetrics()
    off.observe_completion(Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts[:1], params)[0])
    assert "dsv41_speculative_verify_length_total{" not in off.render().decode()


def test_server_exports_speculative_metrics(tmp_path):
    pytest.importorskip("openai")
    from tests.test_server_fixtures import make_checkpoint, openai_client, running_server
    ckpt = make_checkpoint(tmp_path / "ckpt")
    with running_server(ckpt, speculative="fixed:2") as (handle, app):
        openai_client(handle).completions.create(model="dbg", prompt="def f(x):", max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})
        text = urllib.request.urlopen(handle.url.rstrip("/") + "/metrics").read().decode()
    assert 'dsv41_speculative_verify_length_total{length="2"}' in text
    for name in ("predicted", "realised", "drafted", "accepted"):
        assert f"dsv41_speculative_{name}_tokens_total" in text


def test_step_cost_predicted_vs_realised(one_thread):
    """The engine times each decode step against its cost model (the seconds T predicted for the step's shape vs
    those it took; nothing without a cost model) and the server exports both sums."""
    cfg, m = continuous_model("debug")
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prof = batch_profile((1, 2), G, 0.001, 0.01, 0.01)
    eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative="dspark", step_profile=prof)
    seen = []
    inner = eng._decode

    def decode(seqs, join, drafts, outs):
        inner(seqs, join, drafts, outs)
        if eng.last_step_cost is not None:
            seen.append(eng.last_step_cost)
    eng._decode = decode
    eng.generate(prompts, params)
    sc = eng.spec_counts
    assert sc["timed_steps"] == len(seen) > 0
    assert sc["predicted_s"] == pytest.approx(sum(p for p, _ in seen))
    assert sc["realised_s"] == pytest.approx(sum(r for _, r in seen))
    assert all(p >= 0.01 for p, _ in seen)                  # at least the profile's cheapest step (plain, B = 1)
    fixed = Engine(m, prefill_mode="full", max_seq_len=256, speculative="fixed:2")
    fixed.generate(prompts, params)
    assert fixed.spec_counts["timed_steps"] == 0 and fixed.last_step_cost is None
    metrics = ServerMetrics()
    metrics.observe_step(2, (0.25, 0.5))
    metrics.observe_step(2, None)
    text = metrics.render().decode()
    assert "dsv41_speculative_timed_steps_total 1.0" in text
    assert "dsv41_speculative_step_predicted_seconds_total 0.25" in text
    assert "dsv41_speculative_step_realised_seconds_total 0.5" in text
