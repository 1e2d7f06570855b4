"""The post-training task families, their exact checkers, the held-out split and the prompt rendering in the
official V4.1 chat format (dsv41/posttrain/tasks.py, tokenizer.py)."""

from __future__ import annotations

import random

import pytest

from dsv41.config import load_config
from dsv41.posttrain.model import PRESET
from dsv41.posttrain import tasks as T
from dsv41.posttrain.tokenizer import PostTokenizer, load_post_tokenizer
from dsv41.server.chat import OfficialTemplate, pick_template


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_post_tokenizer(tmp_path_factory.mktemp("tok"))


def test_tokenizer_shape_and_roundtrip(tok):
    cfg = load_config(PRESET)
    assert tok.vocab_size == cfg.vocab_size
    assert isinstance(pick_template(tok), OfficialTemplate)           # knows the chat special tokens
    text = "sum a0 b1 c2 chase ab ba from a 3"
    assert tok.decode(tok.encode(text)) == text
    assert all(len(tok.tok.id_to_token(i)) == 1 for i in tok.encode("sum 3729"))   # one id per digit
    # the think tags are single ids that a decode keeps (the server's reasoning parser looks for `</think>`)
    assert tok.encode("<think>a3=3</think>3") == [tok.think_start_id] + tok.encode("a3=3") + [tok.think_end_id,
                                                                                              tok.encode("3")[0]]
    assert tok.decode([tok.bos_id] + tok.encode("a3=3</think>3") + [tok.eos_id]) == "a3=3</think>3"
    p = T.make_sums(random.Random(0), 4)
    rendered = T.render_prompt(p, 75)
    assert rendered.startswith("<｜System｜>Reasoning Effort: 75 (range 1-100")
    assert rendered.endswith(f"<｜User｜>{p.content}<｜Assistant｜><think>")
    ids = T.prompt_ids(tok, p, 75)
    assert ids[0] == tok.bos_id and ids[-1] == tok.think_start_id
    assert len(ids) < 20 + len(p.content)                             # the effort phrases are single ids


def test_sums_and_chase_states():
    p = T.make_sums(random.Random(3), 6)
    labelled = p.content.split()[1:]
    assert [x[0] for x in labelled] == list("abcdef")                  # a label letter before each digit
    digits = [int(x[1:]) for x in labelled]
    assert p.answer == str(sum(digits) % 10) and len(p.states) == 6
    assert T.trace(p, 1).split() == [f"{x}={s}" for x, s in zip(labelled, p.states)]
    assert T.trace(p, 4) == f"{''.join(labelled[:4])}={p.states[3]} {''.join(labelled[4:])}={p.states[5]}"
    q = T.make_chase(random.Random(4), 5)
    spec = dict(tuple(kv) for kv in q.content.split()[1:-3])
    at = q.content.split()[-2]
    for s in q.states:
        at = spec[at]
        assert s == at
    assert sorted(spec.values()) == sorted(spec)                     # a permutation: every hop is defined
    assert T.trace(q, 1).split() == list(q.states)                   # the last state written is the answer
    assert T.trace(q, 2).split() == [q.states[1], q.states[3], q.states[4]]


@pytest.mark.parametrize("family", T.FAMILIES)
def test_every_stride_is_checked_correct_and_shorter_strides_reason_longer(tok, family):
    rng = random.Random(7)
    for _ in range(20):
        p = T.sample_problem(rng, family, 2, 8)
        lengths = []
        for s in range(1, p.difficulty + 1):
            v = T.check(tok, p, T.response_ids(tok, p, s))
            assert v.correct and v.closed and v.answer == p.answer
            lengths.append(v.reasoning_tokens)
        assert lengths[-1] == 0 and lengths[0] == max(lengths)
        if p.difficulty > 1:
            assert lengths[0] > 0


def test_checker_rejects_wrong_unclosed_and_trailing(tok):
    p = T.make_sums(random.Random(1), 5)
    wrong = str((int(p.answer) + 1) % 10)
    bad = tok.encode("1=1") + [tok.think_end_id] + tok.encode(wrong) + [tok.eos_id]
    assert not T.check(tok, p, bad).correct
    unclosed = tok.encode("1=1 2=3")
    v = T.check(tok, p, unclosed)
    assert not v.correct and not v.closed and v.reasoning_tokens == len(unclosed)
    extra = [tok.think_end_id] + tok.encode(p.answer + "7")
    assert not T.check(tok, p, extra).correct
    after_eos = [tok.think_end_id] + tok.encode(p.answer) + [tok.eos_id] + tok.encode("9")
    assert T.check(tok, p, after_eos).correct                          # what follows EOS is not the response


def test_held_out_split_is_disjoint_and_deterministic():
    rng = random.Random(0)
    train = {T.sample_problem(rng, "sums", 3, 6).content for _ in range(300)}
    held = {T.sample_problem(rng, "sums", 3, 6, split="held_out").content for _ in range(100)}
    assert not train & held
    assert all(T.held_out(c) for c in held) and not any(T.held_out(c) for c in train)
    a = [T.sample_problem(random.Random(5), "chase", 2, 6).content for _ in range(3)]
    assert a == [T.sample_problem(random.Random(5), "chase", 2, 6).content for _ in range(3)]


def test_bad_inputs_raise(tok, tmp_path):
    with pytest.raises(ValueError, match="family"):
        T.sample_problem(random.Random(0), "poems", 1, 2)
    p = T.make_sums(random.Random(0), 3)
    with pytest.raises(ValueError, match="stride"):
        T.trace(p, 4)
    with pytest.raises(ValueError, match="effort"):
        T.render_prompt(p, 0)
    (tmp_path / "t.json").write_text(load_post_tokenizer(tmp_path / "x").tok.to_str().replace("</think>", "</th>"))
    with pytest.raises(ValueError, match="post-training tokenizer"):
        PostTokenizer(tmp_path / "t.json")


def test_parse_problem_inverts_the_makers():
    """tasks.parse_problem reads back every generated problem from its user message (the server's task_grammar
    needs the problem a request states) and refuses text the tasks never write."""
    rng = random.Random(3)
    for family in T.FAMILIES:
        for _ in range(200):
            p = T.sample_problem(rng, family, 1, 6)
            assert T.parse_problem(p.content) == p
    for bad in ("sum", "sum a1 c2", "sum a12", "sum ax", "hello", "chase ab ba from c 2", "chase ab bb from a 2",
                "chase ab ba from a x", "chase ab ba from a 0", "sum  a1", "chase ab ba  from a 1"):
        with pytest.raises(ValueError):
            T.parse_problem(bad)
