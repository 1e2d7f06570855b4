"""Guards the deterministic mode (dsv41.kernels.invariant, docs/system.md §10) with quantization on: a request's
tokens and log-probs are the same bits alone or in a batch of 8, with one-shot, chunked or CED-exact prefill, with
speculative decoding (fixed:N and the scheduler) or without, resumed from the prefix cache (swa-hit) or cold; and
the engine's log-probs of the sampled tokens equal those of the training forward RL uses (train/logprobs.py).
The primitives are checked row by row against the other rows and the batch size."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.kernels import deterministic
from dsv41.kernels.invariant import (canonical_lists, cpu_order_sum, exact_block_linear, index_scores, rsqrt,
                                     tiled_linear)
from dsv41.codecs import qdq_fp8, qdq_index_k
from dsv41.model.init import random_model
from dsv41.train.logprobs import token_logprobs
from tests.test_speculative import FLAT, OracleDrafter

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model():
    cfg = load_config("debug")
    assert cfg.window_size <= 16 and 2 in cfg.compress_ratios           # prompts below span several windows
    return random_model(cfg, seed=2)                                     # quantization on


@pytest.fixture(scope="module")
def prompts(model):
    W, V = model.cfg.window_size, model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (3 * W + 5, 2 * W + 7, W + 3, 9, 4 * W + 1,
                                                                         17, 5 * W, 2 * W)]


def outputs(completions):
    return [(c.output_ids, [lp["logprob"] for lp in c.logprobs]) for c in completions]


def run(model, prompts, drafter_futures=None, **kw):
    eng = Engine(model, max_seq_len=512, deterministic=True, **kw)
    if drafter_futures is not None:
        eng.drafter = OracleDrafter(drafter_futures, model.cfg.dspark_block_size, model.cfg.vocab_size)
    return eng.generate(prompts, PARAMS)


@pytest.fixture(scope="module")
def alone(model, prompts):
    return [outputs(run(model, [p], prefill_mode="full"))[0] for p in prompts]


# ------------------------------------------------------------------------------------------------ primitives

def test_gemms_are_row_invariant():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    x = torch.randn(300, 256, generator=g)
    wq = qdq_fp8(w)                                   # quantized-kind operands: exact block sums
    xq = qdq_fp8(x)
    for fn, a, b in ((tiled_linear, x, w), (exact_block_linear, xq, wq)):
        ref = torch.cat([fn(a[i:i + 1], b) for i in range(40)])
        for M in (2, 7, 16, 17, 40, 300):
            assert torch.equal(fn(a[:M], b)[:min(M, 40)], ref[:min(M, 40)]), (fn.__name__, M)
        assert torch.equal(fn(a[:40].flip(0), b).flip(0), ref)              # a row's position in the batch
    # the exact block sums: one fp32 rounding of each 32-wide block's exact sum, added in K order
    want = sum((xq[:5, k:k + 32].double() @ wq[:, k:k + 32].double().T).float() for k in range(0, 256, 32))
    assert torch.equal(exact_block_linear(xq[:5], wq), want)


def test_cpu_rsqrt_is_ieee_reciprocal_sqrt():
    """The model's RMSNorm statistics (`invariant.rsqrt`) are the IEEE square root, rounded, then an IEEE division:
    what torch.rsqrt computes on a CPU (under this run's dispatch and the dispatch run's), and what the CUDA path
    computes instead of the approximate rsqrtf. torch.sqrt itself is not always the IEEE root on a CPU (MKL on
    AVX-512 rounds some values one ulp off), so the reference root here is float64's, rounded once."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(1 << 16, generator=g) * 10 + 1e-3, torch.rand(1 << 12, generator=g) * 1e6,
                   torch.rand(1 << 12, generator=g) * 1e-6 + 1e-30, torch.tensor([1.0, 4.0, 2.0, 1e-38])])
    ieee = 1.0 / torch.sqrt(x.double()).float()                  # a float64 root rounded once is the IEEE fp32 root
    assert torch.equal(torch.rsqrt(x), ieee)
    assert torch.equal(rsqrt(x), ieee)
    assert not torch.equal(ieee, (x.double().rsqrt()).float())   # not the correctly rounded 1 / sqrt: two roundings


def test_cpu_order_sum_is_the_cpus_sum():
    """`cpu_order_sum` (what a GPU runs for the row statistics under `set_cpu_order`, gate 1 on a GPU) adds in the
    order of torch's CPU sum kernel: bit-equal to x.sum(-1), and divided by n to x.mean(-1), under this run's
    dispatch and the dispatch run's, for widths below one vector, with leftover vectors and scalar tails, the
    model's widths and cascades of several levels; rows summed one at a time or many at once."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 5, 7, 8, 9, 15, 31, 33, 64, 100, 257, 1024, 2048, 4000, 4096, 5120, 7168, 30000):
        x = (torch.rand(5, 3, n, generator=g) + 0.25) * torch.exp(torch.randn(5, 3, n, generator=g))
        s = cpu_order_sum(x)
        assert torch.equal(s, x.sum(-1)), n
        assert torch.equal(s / torch.full_like(s, n), x.mean(-1)), n
        assert torch.equal(cpu_order_sum(x[0, :1]), x[0, :1].sum(-1)), n
    x = torch.rand(4, 1024, generator=g)
    assert not torch.equal(cpu_order_sum(x), x.cumsum(-1)[:, -1])    # another order (left to right) differs here


def test_index_scores_are_row_invariant():
    g = torch.Generator().manual_seed(1)
    q = qdq_index_k(torch.randn(2, 30, 4, 64, generator=g))
    keys = qdq_index_k(torch.randn(2, 50, 64, generator=g))
    w = torch.randn(2, 30, 4, generator=g)
    full = index_scores(q, keys.unsqueeze(1), w)
    for t in (0, 7, 29):
        assert torch.equal(index_scores(q[:, t], keys, w[:, t]), full[:, t])
    assert torch.equal(index_scores(q[:, :3], keys[:, :20].unsqueeze(1), w[:, :3]), full[:, :3, :20])


def test_canonical_lists_layout():
    win = torch.tensor([[-1, -1, 5, 6, 7], [4, 5, 6, -1, -1]])             # decode (leading -1) / prefill lists
    comp = torch.tensor([[9, 11, -1], [-1, 2, 3]])
    out = canonical_lists(win, comp, 6, 4)
    assert out.tolist() == [[5, 6, 7, -1, -1, -1, 9, 11, -1, -1], [4, 5, 6, -1, -1, -1, 2, 3, -1, -1]]


# ------------------------------------------------------------------------------------------------ the engine

def test_batch_of_8_and_chunking_change_nothing(model, prompts, alone):
    assert outputs(run(model, prompts, prefill_mode="full")) == alone
    for chunk in (5, 13):
        assert outputs(run(model, prompts, prefill_mode="full", chunk_size=chunk)) == alone, chunk
    assert outputs(run(model, prompts, prefill_mode="ced-exact", chunk_size=13)) == alone
    eng = Engine(model, max_seq_len=512, deterministic=True)          # ced-bounded asked: exact prefill instead
    assert eng.prefill_mode == "ced-exact"


def test_speculation_changes_nothing(model, prompts, alone):
    futures = {f"req-{i}": a[0] for i, a in enumerate(alone)}
    G = model.cfg.dspark_block_size
    for spec in ("fixed:1", f"fixed:{G}", "dspark"):
        got = run(model, prompts, futures, prefill_mode="full", speculative=spec, step_profile=FLAT)
        assert outputs(got) == alone, spec
        assert sum(c.stats["speculative"]["accepted_tokens"] for c in got) > 0, spec
    # the model's own drafter (random: mostly rejected), chunked CED-exact prefill
    assert outputs(run(model, prompts, speculative=f"fixed:{G}", chunk_size=13)) == alone


def test_prefix_cache_resume_changes_nothing(model, prompts, alone, tmp_path):
    long = prompts[4]
    eng = Engine(model, max_seq_len=512, deterministic=True, cache_dir=tmp_path, swa_pool="memory",
                 cache_interval=16)
    cold = eng.generate([long], PARAMS)[0]
    warm = eng.generate([long], PARAMS)[0]
    assert (cold.stats["cache_path"], warm.stats["cache_path"]) == ("cold", "swa-hit")
    assert outputs([warm]) == outputs([cold]) == [alone[4]]
    turn2 = long + cold.output_ids + prompts[3]                              # resumes from the end-of-output unit
    resumed = eng.generate([turn2], PARAMS)[0]
    assert resumed.stats["cache_path"] == "swa-hit" and resumed.stats["cached_tokens"] > len(long)
    assert outputs([resumed]) == outputs(run(model, [turn2], prefill_mode="full"))
    # no SWA snapshot (a new process's engine): no approximate replay in this mode, a cold exact prefill
    other = Engine(model, max_seq_len=512, deterministic=True, cache_dir=tmp_path, cache_interval=16)
    again = other.generate([long], PARAMS)[0]
    assert again.stats["cache_path"] == "cold" and outputs([again]) == [alone[4]]


def test_engine_logprobs_equal_the_training_forward(model, prompts, alone):
    G = model.cfg.dspark_block_size
    got = run(model, prompts, speculative=f"fixed:{G}", chunk_size=13)       # batched, chunked, speculative
    rows = [c.prompt_ids + c.output_ids for c in got]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])               # right padding
    model.train()
    try:
        lp = token_logprobs(model, ids)
        for b, c in enumerate(got):
            n = len(c.prompt_ids)
            trainer = lp[b, n - 1:n - 1 + len(c.output_ids)].tolist()
            assert trainer == [x["logprob"] for x in c.logprobs], b
        (-lp.sum()).backward()                                               # and it trains
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_mode_is_process_wide_and_scoped():
    from dsv41.kernels import is_deterministic
    assert not is_deterministic()
    with deterministic():
        assert is_deterministic()
    assert not is_deterministic()


def test_replayed_routing(model, prompts):
    """The training forward can replay a recorded expert routing (RL across weight versions): the recorded routing
    gives the same bits; another routing gives other log-probs; the gate still gets its gradient."""
    ids = torch.tensor([prompts[0][:24], prompts[4][:24]])
    with deterministic():
        log = {}
        base = token_logprobs(model, ids, route_log=log)
        assert log and all(r.shape[:2] == ids.shape for r in log.values())
        assert torch.equal(token_logprobs(model, ids, routes=log), base)
        L = min(log)
        other = {**log, L: (log[L] + 1) % model.layers[L].ffn.n_experts}       # distinct ids, other experts
        assert not torch.equal(token_logprobs(model, ids, routes=other), base)
        model.train()
        try:
            token_logprobs(model, ids, routes=log).sum().backward()
            assert model.layers[L].ffn.gate.weight.grad.abs().sum() > 0
        finally:
            model.zero_grad(set_to_none=True)
            model.eval()
    with pytest.raises(ValueError, match="replayed routing"):
        token_logprobs(model, ids, routes={L: log[L][..., :1]})


def test_quantized_training_forward_trains_every_layer(model, prompts):
    """With quantization on (the RL setting) the FP8 roundings pass gradients straight through: every parameter
    that gets a gradient with quantization off gets one with it on (the cast's own backward rounded gradients to
    E4M3, flushing the small ones to zero)."""
    from dsv41.model.common import set_quantization
    ids = torch.tensor([prompts[0][:24]])
    model.train()
    try:
        got = {}
        for q in (False, True):
            set_quantization(model, q)
            (-token_logprobs(model, ids).sum()).backward()
            got[q] = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
            model.zero_grad(set_to_none=True)
        assert got[False] and got[True] == got[False], sorted(got[False] - got[True])[:5]
    finally:
        set_quantization(model, True)
        model.zero_grad(set_to_none=True)
        model.eval()


def test_bfloat16_batch_and_chunks_change_nothing():
    """The official precision too (bf16 weights and activations): batched and chunked equal alone, bit for bit."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=2, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    W = cfg.window_size
    ps = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3 * W + 5, W + 3, 2 * W)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)

    def go(batch, **kw):
        return outputs(Engine(m, max_seq_len=256, deterministic=True, **kw).generate(batch, params))
    alone = [go([p], prefill_mode="full")[0] for p in ps]
    assert go(ps, prefill_mode="full") == alone
    assert go(ps, chunk_size=7) == alone
