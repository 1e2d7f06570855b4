"""Reasoning output and tool calls through the real `openai` client against the official template (a random
debug checkpoint, byte tokenizer): thinking mode puts the answer in `reasoning_content` and counts it in
`usage.completion_tokens_details.reasoning_tokens`; `tool_choice` required / named constrains decoding to a DSML
call block that comes back as `tool_calls` (streamed too); calls and tool results sent back are rendered into the
next prompt."""

from __future__ import annotations

import json

import openai
import pytest

from test_server_fixtures import MODEL, make_checkpoint, openai_client, running_server

LT = 3 + ord("<")                               # the byte tokenizer's id of '<'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                           "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("dbg-tools"), seed=4)
    with running_server(ckpt, exact=True, chat_template="official", max_seq_len=2048) as (handle, app):
        yield openai_client(handle)


def test_thinking_answer_is_reasoning(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] and m.content == ""        # no </think>: all of it is reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == m.model_extra["reasoning_content"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 6
    chat = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "reasoning_effort": "none"}})
    assert "reasoning_content" not in chat.choices[0].message.model_extra and chat.choices[0].message.content
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0


def _calls(msg) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]


@pytest.mark.parametrize("effort", ["none", "high"])
def test_required_and_named_calls(client, effort):
    # '<' favoured wherever the grammar allows it, so the random model closes values and blocks quickly
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=400, temperature=0, logit_bias={str(LT): 100},
              extra_body={"reasoning_effort": effort})
    if effort == "high":                        # thinking: the reasoning may not end; force it shut with '<'...
        kw["messages"] = USER + [{"role": "assistant", "content": "", "reasoning_content": "I will call."}]
    required = client.chat.completions.create(**kw, tool_choice="required")
    calls = _calls(required.choices[0].message)
    assert required.choices[0].finish_reason == "tool_calls" and calls
    assert all(n in ("get_weather", "get_time") and set(a) <= {"city", "days"} for n, a in calls)
    r = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [n for n, _ in _calls(r.choices[0].message)] and {n for n, _ in _calls(r.choices[0].message)} == {
        "get_time"}
    if effort != "none":
        return
    # streamed: the same calls, each delta carrying a whole call with its index
    chunks = list(client.chat.completions.create(**kw, tool_choice="required", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_calls_and_results_round_trip(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": json.dumps({"city": "Paris", "days": 2})}}
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=2,
                                       extra_body={"return_prompt": True, "reasoning_effort": "none"})
    p = r.model_extra["prompt"]
    assert "## Tools" in p and '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}' in p
    assert ('<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ '
            'parameter>\n<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>') in p
    assert p.endswith("<｜end▁of▁sentence｜><｜User｜><tool_result>rain</tool_result><｜Assistant｜></think>")


def test_tool_errors_name_the_field(client):
    cases = [(dict(tool_choice="required"), "tool_choice"),
             (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
             (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools.0.function.name")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, **kw)
        assert ei.value.body["param"] == param, ei.value.body
