"""Tools in the DeepSeek-V4.1 format: the definitions' section of the system prompt, an assistant's calls as a DSML
block, tool results in call order, the checks of `tools` / `tool_choice`, and the grammar that makes the model call
a tool when `tool_choice` is `required` or names one.

A call block, as the model writes it and as earlier calls are rendered back (｜DSML｜ is one token where the
tokenizer has it):

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

String arguments are written as they are (`string="true"`), every other value as JSON (`string="false"`). In an
assistant turn the block follows the answer text after a blank line.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

DSML = "｜DSML｜"
CALLS_START, CALLS_END = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_START, INVOKE_END = f'<{DSML} invoke name="', f"</{DSML} invoke>"
PARAM_START, PARAM_END = f"<{DSML} parameter", f"</{DSML} parameter>"
TOOL_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
_INVOKE = re.compile(re.escape(INVOKE_START) + r'([^"]*)">(.*?)' + re.escape(INVOKE_END), re.DOTALL)
_PARAM = re.compile(re.escape(PARAM_START) + r'\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>(.*?)'
                    + re.escape(PARAM_END), re.DOTALL)

TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{calls}" block like the following:

{calls}
{invoke}$TOOL_NAME">
{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{param_end}
...
{invoke_end}
{invoke}$TOOL_NAME2">
...
{invoke_end}
{calls_end}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The "## Tools" section for OpenAI-format tool definitions ({"type": "function", "function": {...}})."""
    return TOOLS_SECTION.format(calls=CALLS_START, calls_end=CALLS_END, invoke=INVOKE_START, invoke_end=INVOKE_END,
                                param=PARAM_START, param_end=PARAM_END,
                                schemas="\n".join(_json(t["function"]) for t in tools))


def call_arguments(raw: Any) -> dict:
    """An OpenAI call's `arguments` (a JSON string, tolerated double-encoded, or a dict) as a dict; anything that
    is not an object becomes {"arguments": raw}."""
    args = raw
    for _ in range(2):
        if not isinstance(args, str):
            break
        try:
            args = json.loads(args)
        except ValueError:
            break
    return args if isinstance(args, dict) else {"arguments": raw}


def render_calls(tool_calls: list[dict] | None) -> str:
    """An assistant turn's calls as the DSML block that follows its answer ("" for none)."""
    if not tool_calls:
        return ""
    invokes = []
    for c in tool_calls:
        f = c.get("function") or {}
        params = [f'{PARAM_START} name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else _json(v)}{PARAM_END}'
                  for k, v in call_arguments(f.get("arguments", "{}")).items()]
        invokes.append(f'{INVOKE_START}{f.get("name", "")}">\n' + "\n".join(params) + f"\n{INVOKE_END}")
    return "\n\n" + CALLS_START + "\n" + "\n".join(invokes) + "\n" + CALLS_END


def sort_results(blocks: list[tuple], call_ids: list) -> list[tuple]:
    """A user turn's blocks (is_tool, text, tool_call_id): its tool results reordered to follow the calls of the
    assistant turn before it (unknown ids first, stably); text blocks stay where they are."""
    tool = [b for b in blocks if b[0]]
    if len(tool) < 2 or not call_ids:
        return blocks
    order = {cid: k for k, cid in enumerate(call_ids) if cid}
    it = iter(sorted(tool, key=lambda b: order.get(b[2], 0)))
    return [next(it) if b[0] else b for b in blocks]


def parse_invoke(name: str, body: str) -> dict:
    """One parsed call in OpenAI's shape; a value without `string="true"` is read as JSON when it parses."""
    args: dict[str, Any] = {}
    for m in _PARAM.finditer(body):
        key, is_str, value = m.groups()
        if is_str == "true":
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": _json(args)}}


def complete_invokes(text: str) -> tuple[list[dict], int]:
    """The calls whose invoke block is complete in `text` (inside a calls block) and where the last one ends."""
    calls, end = [], 0
    for m in _INVOKE.finditer(text):
        calls.append(parse_invoke(m.group(1), m.group(2)))
        end = m.end()
    return calls, end


# ------------------------------------------------------------------------------------------------ checks

def check_tools(tools: list | None, tool_choice: Any) -> tuple[list[dict], str | None]:
    """`tools` and `tool_choice` -> (the tool definitions, the mode: None (no tools offered or `none`), "auto",
    "required" or the name of the function the model must call). ValueError naming the field for bad input."""
    tools = tools or []
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise ValueError(f"tools.{i}: a tool is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"tools.{i}.function.name: {name!r} is not a valid function name "
                             f"(letters, digits, _ - . up to 64)")
        if name in names:
            raise ValueError(f"tools.{i}.function.name: {name!r} is defined twice")
        if not isinstance(f.get("parameters", {}), dict):
            raise ValueError(f"tools.{i}.function.parameters must be a JSON schema object")
        names.append(name)
    if tool_choice is None:
        return tools, "auto" if tools else None
    if tool_choice == "none":
        return tools, None
    if tool_choice in ("auto", "required"):
        if not tools and tool_choice == "required":
            raise ValueError("tool_choice: `required` needs tools")
        return tools, tool_choice if tools else None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}")
    if name not in names:
        raise ValueError(f"tool_choice: the function {name!r} is not among the tools")
    return tools, name


def call_grammar(tools: list[dict], mode: str) -> str:
    """Lark rules (start symbol `body`) for the answer when a call is required (`mode` "required" or a function
    name): one calls block of invokes of the allowed functions; a function whose parameters schema lists
    properties takes only those parameter names; a value is free text without a '<' (the values' own schema is
    not enforced)."""
    q = json.dumps
    allowed = [t["function"] for t in tools if mode == "required" or t["function"]["name"] == mode]
    rules = [f"body: {q(CALLS_START + chr(10))} invoke+ {q(CALLS_END)}",
             "invoke: " + " | ".join(f"invoke{k}" for k in range(len(allowed)))]
    for k, f in enumerate(allowed):
        props = list(((f.get("parameters") or {}).get("properties") or {}))
        key = " | ".join(q(p) for p in props) if props else "KEY"
        rules += [f"invoke{k}: {q(INVOKE_START + f['name'] + chr(34) + '>' + chr(10))} param{k}* "
                  f"{q(INVOKE_END + chr(10))}",
                  f"param{k}: {q(PARAM_START + ' name=' + chr(34))} ({key}) {q(chr(34) + ' string=' + chr(34))} "
                  f"BOOL {q(chr(34) + '>')} VALUE? {q(PARAM_END + chr(10))}"]
    rules += ['BOOL: "true" | "false"', "KEY: /[A-Za-z0-9_\\-.]+/", "VALUE: /[^<]+/"]
    return "\n".join(rules) + "\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
