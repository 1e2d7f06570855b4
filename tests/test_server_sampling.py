"""Per-request logits processing through the real `openai` client: `logit_bias`, presence / frequency /
repetition penalties as vLLM applies them (the sampler unit-tested on known logits, the server checked against the
raw log-probabilities it returns), and structured output (`response_format` json_object / json_schema): the
answer always parses and validates, streamed or not."""

from __future__ import annotations

import json

import pytest
import torch

from dsv41.engine.sampling import SamplingParams, sample_token
from test_server_fixtures import MODEL, make_checkpoint, openai_client, running_server

B = {c: 3 + ord(c) for c in "{}[]:,\" \n\r\t"}                # byte-tokenizer ids
NO_SPACE = {str(B[c]): -100 for c in " \n\r\t"}              # keep a random model from idling in whitespace


def test_sampler_penalties_and_bias_as_vllm():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                       logit_bias={5: 1.5, 0: -300.0}).for_prompt([4])
    for t in (3, 3, 1):
        p.state.record(t)
    counts = torch.tensor([0, 1, 0, 2, 0, 0.0])
    want = logits.clone()
    want[5] += 1.5
    want[0] -= 100                                               # the bias is clamped to [-100, 100]
    seen = torch.tensor([False, True, False, True, True, False])
    want = torch.where(seen, torch.where(want > 0, want / 2, want * 2), want)
    want -= 0.25 * counts + 0.5 * (counts > 0).float()
    assert torch.allclose(p.state.process(logits), want)
    assert sample_token(logits, p, torch.Generator()) == int(want.argmax()) == 5
    assert p.state.counts[5] == 1                               # the sampled token is counted
    q = SamplingParams()
    assert q.for_prompt([1]) is q and q.state is None           # nothing to process: no state
    with pytest.raises(ValueError):
        SamplingParams(logit_bias={7: 1.0}).validate(6)
    with pytest.raises(ValueError):
        SamplingParams(repetition_penalty=0.0).validate(6)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("dbg-sampling"), seed=6)
    with running_server(ckpt, exact=True) as (handle, app):
        yield openai_client(handle)


def test_logit_bias(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    base = client.completions.create(**kw).choices[0].logprobs.tokens
    r = client.completions.create(**kw, logit_bias={str(3 + ord("Q")): 100})
    assert r.choices[0].text == "QQQQQ"
    first = 3 + ord(base[0]) if len(base[0]) == 1 else None
    if first is not None:
        r = client.completions.create(**kw, logit_bias={str(first): -100})
        assert r.choices[0].logprobs.tokens[0] != base[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 logit_bias={str(3 + ord("Z")): 100}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ZZZZ"


def test_frequency_and_presence_penalties_against_raw_logprobs(client):
    f, pres = 1.5, 0.7
    ascii_only = {str(i): -100 for i in [0, 1, 2] + list(range(3 + 128, 512))}   # one text per allowed token
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0, logprobs=20,
                                  frequency_penalty=f, presence_penalty=pres, logit_bias=ascii_only,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    counts: dict[str, int] = {}
    checked = 0
    for tok, top in zip(lp.tokens, lp.top_logprobs):                       # top: raw log-probabilities
        pen = {t: v - f * counts.get(t, 0) - pres * (counts.get(t, 0) > 0) for t, v in top.items()
               if len(t.encode()) == 1}
        if tok in pen:
            assert pen[tok] >= max(pen.values()) - 1e-5, (tok, pen)
            checked += 1
        counts[tok] = counts.get(tok, 0) + 1
    assert checked >= 6 and max(counts.values()) <= 3                    # repeats are penalised away
    plain = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    rep = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 50.0}).choices[0].text
    assert len(set(rep)) >= len(set(plain)) and rep[:1] not in "ab"        # prompt tokens are penalised too


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "color": {"enum": ["red", "green"]},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["n", "color"], "additionalProperties": False}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) <= {"n", "color", "tags"} and isinstance(obj.get("n"), int)
            and obj.get("color") in ("red", "green")
            and all(isinstance(t, str) for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 2)


@pytest.mark.parametrize("seed", [0, 1])
def test_structured_output_parses_and_validates(client, seed):
    bias = {**NO_SPACE, str(B["}"]): 8, str(B["]"]): 8, str(B["\""]): 4}     # nudge strings and values to end
    common = dict(model=MODEL, max_tokens=120, temperature=1.0, seed=seed, logit_bias=bias)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    r = client.chat.completions.create(messages=[{"role": "user", "content": "a thing"}], response_format=fmt,
                                       **common)
    assert r.choices[0].finish_reason == "stop" and _valid(json.loads(r.choices[0].message.content))
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "a thing"}],
                                                 response_format=fmt, stream=True, **common))
    assert _valid(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)))
    r = client.chat.completions.create(messages=[{"role": "user", "content": "json"}],
                                       response_format={"type": "json_object"}, **common)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(prompt="x", extra_body={"response_format": fmt}, **common).choices[0]
    assert _valid(json.loads(c.text))


def test_processing_refused_while_speculating(tmp_path):
    import openai
    ckpt = make_checkpoint(tmp_path / "ck", seed=6)
    with running_server(ckpt, speculative="fixed:2") as (handle, _):
        client = openai_client(handle)
        for kw in ({"logit_bias": {"5": 1}}, {"frequency_penalty": 0.5},
                   {"extra_body": {"response_format": {"type": "json_object"}}}):
            with pytest.raises(openai.BadRequestError) as ei:
                client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)
            assert ei.value.body["code"] == "unsupported_with_speculative"
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason
