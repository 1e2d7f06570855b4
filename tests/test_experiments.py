"""The experiments' exact counterparts (`dsv41.experiments.counterparts`), each its own code path, checked
against its approximation driven to the exact limit: own top-k vs index reuse at top-k = every entry, full
scoring vs the candidate pool when the pool holds every block, ced-exact vs ced-bounded on a prompt within one
window, fixed vs stale index keys when every owner compresses at ratio 1; replay error vanishing past the
decoder's dependency halo; the long-context task's documents and answer spans; the study runner end to end."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import load_config
from dsv41.experiments import approximations, replay
from dsv41.experiments.counterparts import EXACT, alone, compare, own_topk, run_variant
from dsv41.model.common import set_quantization
from dsv41.model.init import init_weights
from dsv41.model.transformer import Transformer
from dsv41.train.data import Document, train_tokenizer
from dsv41.train.tasks_longctx import encode_tasks, retrieval_accuracy, task_documents


pytestmark = pytest.mark.usefixtures("one_thread")         # tests/conftest.py


def _model(**fields):
    cfg = load_config("debug")
    if fields:
        cfg = cfg.replace(**fields)
    m = Transformer(cfg, dtype=torch.float32)
    init_weights(m, 0)
    return m.eval()


def _ids(T=40, B=2, seed=0):
    return torch.randint(3, 500, (B, T), generator=torch.Generator().manual_seed(seed))


def _gap(m, ids, P, name) -> float:
    return compare(run_variant(m, ids, P, EXACT), run_variant(m, ids, P, alone(name)))["kl_max"]


@pytest.mark.parametrize("name,limit", [
    ("reuse", {"index_topk": 64}),                                       # top-k = every entry: nothing to choose
    ("pool", {"candidate_topk_blocks": 16}),                             # the pool holds every block
    ("decode", {"compress_ratios": [0, 0, 1, 1, 1, 1, 1, 1, 0]}),        # owners publish keys on every step
])
def test_counterpart_meets_approximation_at_exact_limit(name, limit):
    ids = _ids()
    assert _gap(_model(**limit), ids, 24, name) < 1e-10
    assert _gap(_model(), ids, 24, name) > 1e-7                          # below the limit they differ


def test_ced_exact_meets_ced_bounded_within_one_window():
    m, ids = _model(), _ids()
    W = m.cfg.window_size
    assert _gap(m, ids[:, :W + 6], W, "prefill") < 1e-10                # decoder rows min(W, P) = P: no replay
    assert _gap(m, ids, 30, "prefill") > 1e-7


def test_fp4_main_kv_stores_the_codes_of_the_bf16_entries():
    """The two stores differ only in what they keep: the first KV source (identical inputs both ways) holds the
    FP4 QDQ of the bf16 entries; and the change reaches the logits."""
    from dsv41.codecs import qdq_main_kv
    from dsv41.train.qat import TrainCache
    m, ids = _model(), _ids()
    set_quantization(m, False)                                           # as run_variant runs it
    first = m.cfg.kv_source_layers[0]
    stores = [TrainCache(m.cfg, 2, m.dtype, kv_qat=q) for q in (False, True)]
    with torch.no_grad():
        for c in stores:
            m(ids, c, 0)
    n = torch.full((2,), ids.size(1) // m.cfg.compress_ratios[first])
    exact, fp4 = (c.compressed(first, n) for c in stores)
    assert torch.equal(fp4, qdq_main_kv(exact)) and not torch.equal(fp4, exact)
    assert _gap(m, ids, 24, "kv") > 1e-9


def test_own_topk_is_the_attention_top_k():
    """Own selection at K = the visible count lists every visible entry, ascending, -1 for none."""
    m = _model(index_topk=64)
    from dsv41.model.step import StepContext
    from dsv41.train.qat import TrainCache
    attn = m.layers[3].attn                                              # a Reuse layer of the debug preset
    cache = TrainCache(m.cfg, 1, m.dtype)
    with torch.no_grad():
        m(_ids(12, 1), cache, 0)
        ctx = StepContext(torch.zeros(1, dtype=torch.long), 12, cache)
        ids = own_topk(attn, torch.randn(1, 12, m.cfg.dim), ctx)
    m_ = attn.role.ratio
    for t in range(12):
        want = list(range((t + 1) // m_))
        got = [i for i in ids[0, t].tolist() if i >= 0]
        assert got == want and all(i == -1 for i in ids[0, t, len(want):].tolist())


def test_decoder_replay_error_vanishes_past_the_halo():
    m = _model()
    W, D = m.cfg.window_size, m.cfg.n_layers - 4                          # debug: split 4
    ids = _ids(W + m.cfg.n_layers * W, 2)
    dec = replay.replay_errors(m, ids, W, "decoder")
    assert max(e["kl_max"] for e in dec[:W]) > 1e-7
    assert max(e["kl_max"] for e in dec[D * (W - 1):]) < 1e-9
    enc = replay.replay_errors(m, ids, W, "encoder")
    assert enc[0]["kl_max"] > 1e-7
    with pytest.raises(ValueError, match="recovery point"):
        replay.replay_errors(m, ids, 2, "decoder")


def test_task_documents_and_spans():
    docs = task_documents("kv-retrieval", 3, 0, 12, 3)
    for d in docs:
        for (lo, hi), src in zip(d.answers, d.sources):
            key = d.text[lo - 4:lo - 1]
            assert d.text[src:src + 7] == f"{key} {d.text[lo:hi]}"
    assert task_documents("kv-retrieval", 3, 0, 12, 3)[0].text == docs[0].text
    needle = task_documents("needle", 2, 0, 10)
    assert all(len(d.answers) == 1 for d in needle)
    with pytest.raises(ValueError, match="unknown task"):
        task_documents("haystack", 1, 0, 10)


def test_study_runner_end_to_end():
    docs = task_documents("kv-retrieval", 2, 1, 8, 2)
    tok = train_tokenizer([Document(str(i), d.text) for i, d in enumerate(task_documents("kv-retrieval", 40, 0,
                                                                                          8, 2))], 512)
    enc = encode_tasks(tok, docs)
    for doc, answers in zip(docs, enc.answers):
        for (lo, hi), toks in zip(doc.answers, answers):
            assert toks and doc.text[lo:hi] in tok.decode(enc.ids[docs.index(doc), toks].tolist())
    m = _model(vocab_size=512)
    res = approximations.approximation_study(m, tok, docs)
    assert res["rows"][0]["kl"] == 0.0 and res["rows"][0]["top1"] == 1.0
    assert all(0 <= r["accuracy"] <= 1 for r in res["rows"]) and res["rows"][-1]["kl"] > 0
    assert 0.0 <= retrieval_accuracy(m, tok, docs) <= 1.0
    assert "all stacked" in approximations.table(res)
