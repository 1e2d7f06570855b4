"""Prompt log-probabilities through the real `openai` client, the protocol `lm-evaluation-harness` scores with:
`echo` + `logprobs` (max_tokens 0 and 1, text and token-id prompts, streamed too) and vLLM's `prompt_logprobs`,
equal to the log-likelihoods the model computes directly; and vLLM's /tokenize, /detokenize, /tokenizer_info."""

from __future__ import annotations

import httpx
import pytest
import torch

from dsv41.model.cache import DenseCache
from test_server_fixtures import MODEL, make_checkpoint, openai_client, running_server

IDS = [0, 75, 104, 111, 46, 35, 104, 46, 120, 35, 64, 35, 52, 13]         # BOS + "def f(x): return" ish bytes


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("dbg-lp"), seed=5)
    with running_server(ckpt, exact=True) as (handle, app):
        yield handle, app.state.dsv41.engine


def direct(engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from one full forward of the model."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids]), DenseCache(engine.cfg, 1, engine.model.dtype)).logits[0]
    return torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_logprobs_equal_direct_loglikelihoods(served):
    handle, engine = served
    client = openai_client(handle)
    want = direct(engine, IDS)
    r = client.completions.create(model=MODEL, prompt=IDS, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(IDS) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1:len(IDS)])
    assert torch.allclose(got, want.double().float(), atol=1e-6, rtol=0), (got - want).abs().max()
    for k in range(1, len(IDS)):                    # the own token is always in the dict (harnesses read max())
        top = lp.top_logprobs[k]
        assert lp.tokens[k] in top and abs(top[lp.tokens[k]] - lp.token_logprobs[k]) < 1e-9 and len(top) <= 2
    assert r.choices[0].text.startswith(engine.tokenizer.decode(IDS))
    # max_tokens 0: the prompt only
    r0 = client.completions.create(model=MODEL, prompt=IDS, echo=True, logprobs=3, max_tokens=0)
    assert r0.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:len(IDS)]
    assert r0.choices[0].text == engine.tokenizer.decode(IDS) and r0.usage.completion_tokens == 0
    assert r0.usage.prompt_tokens == len(IDS) and r0.choices[0].finish_reason == "length"
    # streamed: the prompt with its logprobs first, then the completion
    chunks = list(client.completions.create(model=MODEL, prompt=IDS, echo=True, logprobs=1, max_tokens=1,
                                            temperature=0, stream=True))
    tl = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert tl == lp.token_logprobs and "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_text_prompt_batch_and_prompt_logprobs(served):
    handle, engine = served
    client = openai_client(handle)
    r = client.completions.create(model=MODEL, prompt=["x = 1", "y"], echo=True, logprobs=0, max_tokens=0,
                                  extra_body={"prompt_logprobs": 2})
    for choice, text in zip(r.choices, ["x = 1", "y"]):
        ids = [0] + [3 + b for b in text.encode()]
        assert choice.text == text and choice.logprobs.tokens[0] == ""               # BOS first
        assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs[1:]), direct(engine, ids), atol=1e-6)
        plp = choice.model_extra["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for k, d in enumerate(plp[1:], 1):
            own = d[str(ids[k])]
            assert abs(own["logprob"] - choice.logprobs.token_logprobs[k]) < 1e-9 and own["rank"] >= 1
            assert sorted(v["rank"] for v in d.values())[:2] == [1, 2]                 # the top 2, and the own token
            assert len(d) == (2 if own["rank"] <= 2 else 3)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 1, "return_prompt": True})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_tokenize_detokenize(served):
    handle, engine = served
    c = httpx.Client(base_url=handle.url, timeout=60)
    r = c.post("/tokenize", json={"model": MODEL, "prompt": "hé", "return_token_strs": True}).json()
    assert r["tokens"] == [0, 3 + 104, 3 + 0xC3, 3 + 0xA9] and r["count"] == 4 and r["max_model_len"] == 512
    assert c.post("/tokenize", json={"prompt": "hé", "add_special_tokens": False}).json()["tokens"] == r["tokens"][1:]
    assert c.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hé"}
    msgs = [{"role": "user", "content": "hi"}]
    chat = c.post("/tokenize", json={"messages": msgs}).json()
    usage = openai_client(handle).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert c.get("/tokenizer_info").json()["chat_template_name"] == "simple"
    for path, body, param in (("/detokenize", {"tokens": [10 ** 6]}, "tokens"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "nope"}, "model")):
        resp = c.post(path, json=body)
        assert 400 <= resp.status_code < 500 and resp.json()["error"]["param"] == param
