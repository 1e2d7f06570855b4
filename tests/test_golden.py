"""Parity with the official code on the bundled golden data (tests/data/golden; docs/golden.md §4).

The golden files were computed on one machine; the official code itself, run on another CPU, departs from them
after some position (a ~1e-7 difference in a transcendental or a GEMM lands an FP8 activation on the other side of
a rounding midpoint and the flip cascades). So every assertion here holds on any x86-64 CPU and dispatch level:
Gate 1 (the real parity test): every block, fed the golden input stream, returns the golden output within 1e-5
relative per row (at most one outlier row per tensor: an isolated flip), prefill and every decode step.
Gate 2 (end to end): in every sequence at most one of the first 16 prompt positions above 1e-5 (the same isolated-flip
allowance; a real error cascades, see the end-to-end negative control), the top-k / candidate / expert sets equal on
the rows before the first divergence, and tokens equal wherever the logits they are chosen from agree.
The official decode artifact: localised block by block against the golden captures (gate 1), and end to end
against our own fixed run (the same code path, so bit-identity is legitimate there).
bf16: teacher-forced against the golden fp32 captures within bf16's own distance (docs/golden.md §4: bf16 and fp32
differ by a median 0.25 per row end to end); the bf16 golden file is not asserted (machine-specific, the official
bf16 code itself is 0.14 off it on an AMD EPYC). `python benchmarks/parity.py` prints the figures.
Negative controls show each mechanism matters.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import dsv41.model.attention as attention
from dsv41.kernels.invariant import set_cpu_order
from dsv41.kernels.mhc_math import hc_post, hc_pre
from dsv41.model.attention import Attention
from dsv41.model.loading import load_model
from dsv41.model.runner import compare_captures, first_divergent, rel_rows, run_logits, run_teacher_forced
from dsv41.model.transformer import Block
from tests.conftest import GOLDEN

CASE_A = GOLDEN / "case-a"


@pytest.fixture(scope="module")
def model_fp32():
    return load_model(CASE_A)[0]


@pytest.fixture(scope="module")
def blocks():
    return load_file(GOLDEN / "a.fp32.fix.blocks-seq0.safetensors")


def gate1_failures(ours, gold, threshold=1e-5):
    rep = compare_captures(ours, gold, threshold)
    assert rep, "nothing compared"
    return {k: v for k, v in rep.items() if not v["ok"]}, rep


def test_gate1_teacher_forced_fp32_fix(model_fp32, blocks):
    ours = run_teacher_forced(model_fp32, blocks)
    bad, rep = gate1_failures(ours, blocks)
    assert not bad, bad
    assert sum(k.startswith("decode_block_out") for k in rep) == 13
    # the head on the golden final stream reproduces the golden logits
    assert rel_rows(ours["decode_logits"], blocks["decode_logits"]).max() < 1e-5


def test_gate1_official_artifact_is_localised(model_fp32, blocks):
    """With the stale index-key pointer, layers 2-5 see layer 6's keys on even start_pos steps only."""
    ours = run_teacher_forced(model_fp32, blocks, official_decode_artifact=True)
    for L in range(2, 6):
        r = rel_rows(ours[f"decode_block_out.{L}"], blocks[f"decode_block_out.{L}"])[0]
        even = torch.tensor([(201 + k) % 2 == 0 for k in range(8)])
        assert (r[even] > 1e-3).all(), (L, r)
        assert (r[~even] < 1e-5).all(), (L, r)
    bad, _ = gate1_failures({k: v for k, v in ours.items() if not k.startswith("decode_")}, blocks)
    assert not bad


def set_rows_equal(ours, gold, rows_ok):
    """Per (b, t) row where rows_ok: the index sets (ignoring -1) are equal."""
    for b in range(ours.size(0)):
        for t in range(ours.size(1)):
            if rows_ok[b, t]:
                a = set(ours[b, t].flatten().tolist()) - {-1}
                g = set(gold[b, t].flatten().tolist()) - {-1}
                assert a == g, (b, t, sorted(a), sorted(g))


def early_rows_ok(ours, gold, n=16, threshold=1e-5):
    """Gate 2 per sequence: at most one of the first n positions above threshold (an isolated flip)."""
    r = rel_rows(ours, gold)[:, :n]
    return [int((r[b] > threshold).sum()) <= 1 for b in range(r.size(0))], r


def tokens_where_logits_agree(tokens, logits, gold_tokens, gold_logits, threshold=1e-5):
    """Where our logits row agrees with the golden one, the token chosen from it is the golden token."""
    agree = rel_rows(logits, gold_logits) <= threshold
    assert torch.equal(tokens[agree], gold_tokens[agree])
    return int(agree.sum())


def test_gate2_end_to_end_fp32_fix(model_fp32):
    gold = load_file(GOLDEN / "a.fp32.fix.safetensors")
    ours = run_logits(model_fp32, gold["tokens"], decode_steps=8)
    ok, r = early_rows_ok(ours["prefill_logits"], gold["prefill_logits"])
    assert all(ok), r
    div = first_divergent(ours["prefill_logits"], gold["prefill_logits"])
    T = gold["tokens"].size(1)
    clean = torch.arange(T).unsqueeze(0) < torch.tensor(div).unsqueeze(1)        # rows before the first flip
    for name in gold:
        if name.startswith(("topk.", "experts.")):
            set_rows_equal(ours[name], gold[name], clean)
        if name.startswith("candidates."):
            eq = (ours[name] == gold[name]).all(-1)
            assert eq[clean].all()
    # greedy decisions: the next token after the prompt, then each decode / DSpark step while the run agrees
    tokens_where_logits_agree(ours["decode_tokens"], torch.cat([ours["prefill_logits"][:, -1:],
                                                                ours["decode_logits"][:, :-1]], 1),
                              gold["decode_tokens"], torch.cat([gold["prefill_logits"][:, -1:],
                                                                gold["decode_logits"][:, :-1]], 1))
    tokens_where_logits_agree(ours["dspark_tokens"][..., 1:].flatten(1), ours["dspark_logits"].flatten(1, 2),
                              gold["dspark_tokens"][..., 1:].flatten(1), gold["dspark_logits"].flatten(1, 2))


def test_gate2_rejects_a_real_error(monkeypatch):
    """The end-to-end gate is not blind: one attention sink 0.1% off (docs/golden.md §5) fails it."""
    model = load_model(CASE_A)[0]
    with torch.no_grad():
        model.layers[5].attn.attn_sink[0] *= 1.001
    gold = load_file(GOLDEN / "a.fp32.fix.safetensors")
    ours = run_logits(model, gold["tokens"][:, :16])
    ok, r = early_rows_ok(ours["prefill_logits"], gold["prefill_logits"][:, :16])
    assert not all(ok), r


def test_official_decode_artifact_end_to_end(model_fp32):
    """The stale index-key pointer (docs/model.md §4) changes decode only, from the first even start_pos on: our
    artifact run vs our fixed run on the same tokens (the same code path otherwise, so bit-identity holds)."""
    gold = load_file(GOLDEN / "a.fp32.official.safetensors")
    fixed = run_logits(model_fp32, gold["tokens"], decode_steps=2)
    art = run_logits(model_fp32, gold["tokens"], decode_steps=2, official_decode_artifact=True)
    assert torch.equal(art["prefill_logits"], fixed["prefill_logits"])
    for name in fixed:
        if name.startswith(("topk.", "candidates.", "experts.")):
            assert torch.equal(art[name], fixed[name]), name
    assert torch.equal(art["decode_tokens"], fixed["decode_tokens"])
    assert torch.equal(art["decode_logits"][:, 0], fixed["decode_logits"][:, 0])    # start_pos 201: odd
    assert (rel_rows(art["decode_logits"][:, 1:2], fixed["decode_logits"][:, 1:2]) > 1e-2).all()   # 202: even
    # and the golden files show the same structure: identical prefill, step 0 equal, step 1 apart
    fix_gold = load_file(GOLDEN / "a.fp32.fix.safetensors")
    assert torch.equal(gold["prefill_logits"], fix_gold["prefill_logits"])
    assert (rel_rows(gold["decode_logits"][:, 1:2], fix_gold["decode_logits"][:, 1:2]) > 1e-2).all()


def test_bf16_teacher_forced_within_bf16_distance_of_fp32(blocks):
    """bf16 blocks fed the golden fp32 streams (rounded to bf16) land within bf16's distance of the fp32 outputs:
    per capture a median row error below 0.15 and no row above 0.5 (measured: medians <= 0.08, max 0.24). This
    catches gross errors only (a missing inverse RoPE, wrong KV sharing, no sink: median 0.42 / 0.38, max 0.94);
    the fine parity of the shared code paths is gated in fp32 above."""
    model = load_model(CASE_A, dtype=torch.bfloat16)[0]
    assert model.dtype == torch.bfloat16
    assert model.head.weight.dtype == torch.float32 and model.layers[0].attn.attn_sink.dtype == torch.float32
    ours = run_teacher_forced(model, blocks)
    rep = compare_captures(ours, blocks, 0.5, max_outliers=0)
    assert len(rep) == 58
    assert all(v["ok"] for v in rep.values()), {k: v["max"] for k, v in rep.items() if not v["ok"]}
    assert max(v["median"] for v in rep.values()) < 0.15, {k: v["median"] for k, v in rep.items()}


def test_logits_cli_and_official_checker(tmp_path):
    """`dsv41 logits --teacher-force` output passes the golden data's own check.py (independent profile)."""
    out = tmp_path / "ours.safetensors"
    cmd = [sys.executable, "-m", "dsv41.cli", "logits", "--checkpoint", str(CASE_A), "--tokens",
           str(GOLDEN / "tokens.json"), "--teacher-force", str(GOLDEN / "a.fp32.fix.blocks-seq0.safetensors"),
           "--decode-steps", "8", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    chk = subprocess.run([sys.executable, str(GOLDEN / "check.py"), "--official",
                          str(GOLDEN / "a.fp32.fix.blocks-seq0.safetensors"), "--ours", str(out), "--profile",
                          "independent"], capture_output=True, text=True)
    assert chk.returncode == 0, chk.stdout[-2000:]
    assert chk.stdout.strip().splitlines()[-1].startswith("PASS")


# ------------------------------------------------------------------------------------------------ negative controls

def _no_sink(monkeypatch, model):
    real = attention.sparse_attn
    monkeypatch.setattr(attention, "sparse_attn", lambda q, kv, s, i, sc: real(q, kv, torch.full_like(s, -torch.inf), i, sc))


def _no_inverse_rope(monkeypatch, model):
    def output(self, o, freqs):
        B, T = o.shape[:2]
        o = o.reshape(B, T, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("btgd,grd->btgr", o.to(wo_a.dtype), wo_a).flatten(2))
    monkeypatch.setattr(Attention, "output", output)


def _wrong_sharing(monkeypatch, model):
    attn = model.layers[5].attn          # case A: layer 5 reuses layer 4; make it read layer 2's KV and top-k
    monkeypatch.setattr(attn, "role", dataclasses.replace(attn.role, kv_from=2, topk_from=2))


def _no_candidate_mask(monkeypatch, model):
    for L in (9, 11):
        idx = model.layers[L].attn.indexer
        monkeypatch.setattr(idx, "role", dataclasses.replace(idx.role, uses_candidates=False))


def _no_mhc_lag(monkeypatch, model):
    def forward(self, x, pre_mix, ctx, image_mask=None, attn_extra=None):
        residual = x
        a_pre, a_post, a_comb = self.mixes(x, "attn")
        x = hc_post(self.attn(self.attn_norm(hc_pre(x, a_pre)), ctx), residual, a_post, a_comb)
        residual = x
        f_pre, f_post, f_comb = self.mixes(x, "ffn")
        x = hc_post(self.ffn(self.ffn_norm(hc_pre(x, f_pre)), image_mask), residual, f_post, f_comb)
        return x, f_pre
    monkeypatch.setattr(Block, "forward", forward)


@pytest.mark.parametrize("breakage", [_no_sink, _no_inverse_rope, _wrong_sharing, _no_candidate_mask, _no_mhc_lag])
def test_negative_controls_fail_gate1(breakage, monkeypatch, blocks):
    model = load_model(CASE_A)[0]
    breakage(monkeypatch, model)
    prefill_only = {k: v for k, v in blocks.items() if not k.startswith("decode_")}
    bad, _ = gate1_failures(run_teacher_forced(model, prefill_only), prefill_only)
    assert bad, f"{breakage.__name__} went unnoticed"


def test_tie_rule_decides_gate1(blocks):
    """Exact ties among indexer scores (all-zero ReLU rows) are where gate 1 is sensitive: another tie order
    ("recent") fails it from the first compressed layer on, while "official-cpu" is the official order."""
    model = load_model(CASE_A)[0]
    attention.set_tie_break(model, "recent")
    bad, _ = gate1_failures(run_teacher_forced(model, blocks), blocks)
    assert "block_out.2" in bad and "block_out.0" not in bad and "block_out.1" not in bad
    attention.set_tie_break(model, "official-cpu")
    bad, _ = gate1_failures(run_teacher_forced(model, blocks), blocks)
    assert not bad, bad
    with pytest.raises(ValueError, match="tie break"):
        attention.set_tie_break(model, "newest")


@pytest.mark.gpu
def test_gate1_teacher_forced_fp32_on_the_gpu(blocks):
    """Gate 1 on a GPU in fp32, dense and packed storage, under `use_official_cpu`: the official tie order (CUDA's
    topk orders exact ties otherwise) and the row statistics in the CPU's summation order. Without the latter
    FP8 QDQs of the query path sit at rounding midpoints and flip (CUDA's row means: block_out.9, 16 outlier rows
    on an H100 and an H200; docs/golden.md §4). Both storages are run and printed (pytest -s) before the assertion."""
    bad = {}
    try:
        for storage in ("dense", "packed"):
            model = load_model(CASE_A, storage=storage)[0].cuda()
            attention.use_official_cpu(model)
            with torch.no_grad():
                ours = run_teacher_forced(model, {k: v.cuda() for k, v in blocks.items()})
            bad[storage], _ = gate1_failures({k: v.cpu() for k, v in ours.items()}, blocks)
            print(f"gate 1 on the GPU, fp32, {storage}: failing tensors {bad[storage]}")
    finally:
        set_cpu_order(False)
    assert not any(bad.values()), bad
