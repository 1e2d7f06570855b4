"""`task_grammar` (a dsv41 extension of chat completions): a post-trained checkpoint served under the plan grammar
it was trained with (posttrain/constrain.py), over the task the user message states, at the request's effort."""

from __future__ import annotations

import httpx
import pytest

from dsv41.posttrain import constrain as C
from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import build_model, save
from dsv41.posttrain.tokenizer import load_post_tokenizer
from test_server_fixtures import openai_client, running_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("post")
    tok = load_post_tokenizer(d / "tok")
    ckpt = save(build_model(tok, seed=3).eval(), tok, d / "post-rl", {"stage": "rl", "config": {"constrain": "sml"}})
    with running_server(ckpt, max_seq_len=256) as (handle, _):
        yield handle, tok, ckpt


@pytest.mark.parametrize("content", ["sum a3 b9 c4 d7", "chase ab bc ca dd ef fe from a 5"])
@pytest.mark.parametrize("effort", [1, 100])
def test_answer_follows_the_plan_grammar(served, content, effort):
    """An untrained model's sampled answer is a sentence of the grammar of (problem, b): band letter of b, size
    digit, a plan letter, the plan's trace template, `</think>`, an answer state; without the grammar it is not."""
    handle, tok, _ = served
    p = T.parse_problem(content)
    g = C.Grammar(tok, p, effort, "sml")
    client = openai_client(handle)
    r = client.chat.completions.create(model="dbg", messages=[{"role": "user", "content": content}], max_tokens=40,
                                       temperature=1.0, seed=5, logprobs=True,
                                       extra_body={"reasoning_effort": effort, "task_grammar": "sml"})
    m = r.choices[0].message
    think = (m.model_extra or {}).get("reasoning_content") or ""
    ids = tok.encode(think) + [tok.think_end_id] + tok.encode(m.content or "") + [tok.eos_id]
    assert all(t in g.allowed(ids[:k]) for k, t in enumerate(ids)), (think, m.content)
    assert think[:2] == T.effort_band(effort, True) + str(p.difficulty) and think[2] in "SML"
    assert r.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model="dbg", messages=[{"role": "user", "content": content}],
                                          max_tokens=40, temperature=1.0, seed=5,
                                          extra_body={"reasoning_effort": effort})
    m = free.choices[0].message
    think = (m.model_extra or {}).get("reasoning_content") or ""
    ids = tok.encode(think) + [tok.think_end_id] + tok.encode(m.content or "")
    assert not all(t in g.allowed(ids[:k]) for k, t in enumerate(ids))


@pytest.mark.parametrize("body, message", [
    ({"task_grammar": "xyz", "reasoning_effort": 50}, "task_grammar 'xyz'"),
    ({"task_grammar": "sml", "reasoning_effort": "none"}, "needs thinking mode"),
    ({"task_grammar": "sml", "reasoning_effort": 50, "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"task_grammar": "sml", "reasoning_effort": 50, "content": "what is 2+2"}, "not a task problem"),
])
def test_task_grammar_refusals(served, body, message):
    handle, _, _ = served
    content = body.pop("content", "sum a1 b2")
    r = httpx.post(handle.url + "/v1/chat/completions", timeout=60,
                   json={"model": "dbg", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "task_grammar" or "response_format" in body


def test_checkpoint_plans_follows_the_init_chain(tmp_path):
    import json
    def write(name, cfg):
        (tmp_path / name).mkdir()
        (tmp_path / name / "posttrain.json").write_text(json.dumps({"config": cfg}))
        return str(tmp_path / name)
    head = {"echo": True, "plan": True, "echo_size": True, "merge_top": True}
    sft = write("sft", head)
    plain = write("plain", {**head, "echo_size": False})
    assert C.checkpoint_plans(write("rl", {"init": sft, "constrain": "strides"})) == "strides"
    assert C.checkpoint_plans(write("opd", {"init": write("rl2", {"init": sft})})) == "sml"
    assert C.checkpoint_plans(write("rl3", {"init": plain})) is None
    assert C.checkpoint_plans(tmp_path / "missing") is None
