"""The official DeepSeek-V4.1 chat format on fixed conversations (the strings the release's encoder renders for
them: thinking and chat modes, the effort line, earlier turns, developer and mid-conversation system messages, tool
definitions, earlier tool calls as DSML blocks, tool results in call order), the end-of-sentence id mapping, and
rendered calls read back by the output parser (no server)."""

from __future__ import annotations

import json

from dsv41.engine.tokenizer import ByteTokenizer
from dsv41.server.chat import OfficialTemplate, SimpleTemplate, encode_prompt
from dsv41.server.parsing import parse_all
from dsv41.server.tools import check_tools, render_calls

EFF = "Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL1 = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": json.dumps({"city": "Paris", "days": 3})}}
CALL2 = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501
BLOCK = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
         '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
         '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
         '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
         '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def test_thinking_drops_earlier_reasoning_and_developer_turns():
    t = OfficialTemplate()
    msgs = [{"role": "developer", "content": "D"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"}, {"role": "developer", "content": "D2"},
            {"role": "user", "content": "q"}]
    assert t.render(msgs, 75, True) == (f"<｜System｜>{EFF.format(b=75)}<｜User｜>hi<｜Assistant｜></think>a"
                                        "<｜end▁of▁sentence｜><｜User｜>q<｜Assistant｜><think>")
    assert t.render(msgs, None, False) == ("<｜User｜>D<｜User｜>hi<｜Assistant｜></think>a<｜end▁of▁sentence｜>"
                                           "<｜User｜>D2<｜User｜>q<｜Assistant｜></think>")


def test_tools_definitions_calls_and_results_in_call_order():
    t = OfficialTemplate()
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [CALL1, CALL2]},
            {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    # with tools every turn keeps its reasoning and opens <think>; a turn of tool results is not a user turn
    assert t.render(msgs, 75, True, TOOLS) == (
        f"<｜System｜>{EFF.format(b=75)}\n\n{TOOLS_SECTION}<｜User｜>weather?<｜Assistant｜><think>think</think>"
        f"{BLOCK}<｜end▁of▁sentence｜><｜User｜><tool_result>rain</tool_result>\n\n<tool_result>sunny</tool_result>"
        "<｜Assistant｜><think>")
    # chat mode, the definitions appended to an existing system message
    assert t.render([{"role": "system", "content": "S"}] + msgs, None, False, TOOLS) == (
        f"<｜System｜>S\n\n{TOOLS_SECTION}<｜User｜>weather?<｜Assistant｜></think>{BLOCK}<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>rain</tool_result>\n\n<tool_result>sunny</tool_result><｜Assistant｜></think>")
    # without tools in the request, thinking drops the reasoning before the last real user turn only
    more = msgs + [{"role": "assistant", "content": "It rains."}, {"role": "user", "content": "thanks"}]
    assert t.render(more, 50, True) == (
        f"<｜System｜>{EFF.format(b=50)}<｜User｜>weather?<｜Assistant｜></think>{BLOCK}<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>rain</tool_result>\n\n<tool_result>sunny</tool_result><｜Assistant｜></think>"
        "It rains.<｜end▁of▁sentence｜><｜User｜>thanks<｜Assistant｜><think>")


def test_rendered_calls_parse_back():
    d, _ = parse_all("done" + BLOCK, False, True)
    assert d.content == "done" and [json.loads(c["function"]["arguments"]) for c in d.calls] == [
        {"city": "Paris", "days": 3}, {"city": "Rome"}]
    assert render_calls([{"function": {"name": "f", "arguments": '"[1]"'}}]).count('name="arguments"') == 1
    assert render_calls(None) == ""


def test_simple_template_tools_and_eos_mapping():
    s = SimpleTemplate().render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x",
                                                                     "tool_calls": [CALL2]},
                                 {"role": "tool", "content": "ok"}], tools=TOOLS)
    assert s.startswith(TOOLS_SECTION + "\n\nUser: hi\n") and s.endswith("Tool: ok\n\nAssistant:")
    assert '<｜DSML｜ invoke name="get_weather">' in s
    tok = ByteTokenizer(300)
    ids = encode_prompt(tok, "a<｜end▁of▁sentence｜>b")
    assert ids == [3 + ord("a"), tok.eos_id, 3 + ord("b")]                    # the model's own EOS id


def test_check_tools_modes():
    assert check_tools(None, None) == ([], None) and check_tools(TOOLS, None) == (TOOLS, "auto")
    assert check_tools(TOOLS, "none")[1] is None and check_tools(TOOLS, "required")[1] == "required"
    assert check_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})[1] == "get_weather"
