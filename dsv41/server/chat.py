"""Chat templates: messages -> one prompt string, and that string -> token ids.

Two encodings:

* `OfficialTemplate` — the DeepSeek-V4.1 chat encoding as the release's encoder renders it (and vLLM serves it):

      [<｜System｜>[{effort}]{system}[\\n\\n{tools}]]<｜User｜>{user}<｜Assistant｜>{<think>|</think>}...

  - the BOS token is added by the server as an id (the engine convention), not spelled in the text;
  - modes: thinking (the default) and chat (`reasoning_effort: "none"` or `chat_template_kwargs.thinking: false`);
  - the effort line, thinking mode only, opens the first message (`<｜System｜>` leads the prompt when it is there
    or when the first message is a system message): `Reasoning Effort: {b} (range 1-100, the higher the value,
    the more thorough the reasoning)` and a blank line. low / high / xhigh / max -> b = 50 / 75 / 75 / 100, an
    integer 1..100 as is, the default `high` (75); `none` is chat mode (no line);
  - a later system message carries its own `<｜System｜>` and, like a user or developer turn, is followed by the
    assistant header; a developer message is a `<｜User｜>` turn;
  - the header after the last user turn is `<｜Assistant｜><think>` in thinking mode, `<｜Assistant｜></think>` in
    chat mode; in thinking mode earlier turns drop their reasoning (their header gets `</think>`, their answer no
    reasoning) and developer messages before the last user turn are dropped — unless the request has tools, in
    which case every turn keeps its reasoning and every header opens `<think>`;
  - tool definitions go into the first system message (one is created when there is none) as the release's
    "## Tools" section; an assistant's tool calls follow its answer as a DSML block (`tools.render_calls`); tool
    results become `<tool_result>...</tool_result>` blocks of a user turn (V4.1 has no tool role), sorted in the
    order of the calls they answer; consecutive user turns merge into one, blocks separated by a blank line; a
    user turn of tool results only does not count as the last user turn;
  - images are `<｜deepseek_image｜>` placeholders where their content part stands (parts joined by a blank line).

  The special strings (`<｜User｜>`, `<think>`, the DSML tags, ...) are single ids where the tokenizer has them and
  plain text otherwise (our byte-level BPE); the end-of-sentence string always becomes the tokenizer's EOS id
  (`encode_prompt`), since that is the token the model ends a turn with.

* `SimpleTemplate` — ours, for the checkpoints we train (byte-level BPE with only <|bos|>/<|eos|>/<|pad|>, no chat
  special tokens): plain text turns

      Reasoning Effort: 75
      {system}

      User: {user}

      Assistant:

  with the effort line only when an effort is given (same mapping), tool definitions after the system text and
  tool calls in the same DSML blocks as the official encoding (so the same parser reads them).

A final assistant message is continued (no end-of-sentence, no new header), like DeepSeek's prefix completion.
"""

from __future__ import annotations

from dsv41.engine.tokenizer import HFTokenizer, Tokenizer
from dsv41.server.tools import render_calls, render_tools, sort_results

EFFORT_LEVELS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
NO_THINKING = "none"

EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
IMAGE = "<｜deepseek_image｜>"
THINK_START, THINK_END = "<think>", "</think>"
OFFICIAL_EFFORT = "Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

ROLES = ("system", "developer", "user", "assistant", "tool")


def effort_budget(effort) -> int | None:
    """reasoning_effort -> b in 1..100 (None when not given or `none`). Raises ValueError for anything else."""
    if effort is None or effort == NO_THINKING:
        return None
    if isinstance(effort, str) and effort in EFFORT_LEVELS:
        return EFFORT_LEVELS[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ValueError(f"invalid reasoning_effort {effort!r}: use one of {', '.join(EFFORT_LEVELS)}, "
                     f"{NO_THINKING} or an integer in [1, 100]")


def effort_line(b: int) -> str:
    return f"Reasoning Effort: {b}"


def chat_mode(effort, thinking: bool | None, official: bool) -> tuple[bool, int | None]:
    """(thinking, effort budget) of a request. Official encoding: thinking unless `none` or thinking=False, the
    budget defaulting to `high`; simple: no thinking split, a budget only when one is given."""
    b = effort_budget(effort)
    if not official:
        return False, b
    think = effort != NO_THINKING if thinking is None else bool(thinking) and effort != NO_THINKING
    return think, (EFFORT_LEVELS[DEFAULT_EFFORT] if b is None else b) if think else None


def _check(messages: list[dict]) -> None:
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {m.get('role')!r}")
        if not isinstance(m.get("content") or "", str):
            raise ValueError(f"messages[{i}]: content must be text")
        if m["role"] == "developer" and not m.get("content"):
            raise ValueError(f"messages[{i}]: a developer message needs content")
    if all(m["role"] == "assistant" for m in messages):
        raise ValueError("messages need at least one system, developer, user or tool message")


class SimpleTemplate:
    """Our plain-text template (see the module docstring)."""

    name = "simple"

    def render(self, messages: list[dict], effort: int | None = None, thinking: bool = False,
               tools: list[dict] | None = None) -> str:
        _check(messages)
        head = [] if effort is None else [effort_line(effort) + "\n"]
        rest = messages
        if messages[0]["role"] in ("system", "developer"):
            head.append((messages[0].get("content") or "") + "\n")
            rest = messages[1:]
        if tools:
            head.append(render_tools(tools) + "\n")
        parts = ["".join(head)] if head else []
        for i, m in enumerate(rest):
            content, last = m.get("content") or "", i == len(rest) - 1
            if m["role"] == "assistant":
                content += render_calls(m.get("tool_calls"))
                parts.append("Assistant:" + (" " + content if content else "") + ("" if last else "\n"))
            else:
                label = {"user": "User", "tool": "Tool"}.get(m["role"], "System")
                parts.append(f"{label}: {content}\n" + ("\nAssistant:" if last else ""))
        return "\n".join(parts)


class OfficialTemplate:
    """The DeepSeek-V4.1 chat encoding (see the module docstring)."""

    name = "deepseek-v4.1"

    def render(self, messages: list[dict], effort: int | None = None, thinking: bool = False,
               tools: list[dict] | None = None) -> str:
        _check(messages)
        msgs = _merge_tools([dict(m) for m in messages])
        if tools:
            _attach_tools(msgs, tools)
        keep_reasoning = bool(tools)
        if thinking and not keep_reasoning:
            msgs = _drop_earlier(msgs)
        last_user = _last_user(msgs)
        out = []
        for i, m in enumerate(msgs):
            eff = OFFICIAL_EFFORT.format(b=effort) if i == 0 and thinking and effort is not None else ""
            s = SYSTEM + eff if i == 0 and (eff or m["role"] == "system") else ""
            s += self._body(m, i, len(msgs), thinking and (keep_reasoning or i > last_user))
            nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
            if _user_like(m, i) and nxt in (None, "assistant"):
                s += ASSISTANT + (THINK_START if thinking and (keep_reasoning or i >= last_user) else THINK_END)
            out.append(s)
        return "".join(out)

    @staticmethod
    def _body(m: dict, i: int, n: int, with_reasoning: bool) -> str:
        role, content = m["role"], m.get("content") or ""
        tools = "\n\n" + m["tools"] if m.get("tools") else ""
        if role == "system":
            return (SYSTEM if i > 0 else "") + content + tools
        if role == "developer":
            return USER + content + tools
        if role == "user":
            return USER + "\n\n".join(m["blocks"])
        s = (m.get("reasoning_content") or "") + THINK_END if with_reasoning else ""
        s += content + render_calls(m.get("tool_calls"))
        return s + ("" if i == n - 1 else EOS)                               # a final answer is continued


def _user_like(m: dict, i: int) -> bool:
    return m["role"] in ("user", "developer") or (m["role"] == "system" and i > 0)


def _last_user(msgs: list[dict]) -> int:
    """The last user-like turn; a user turn of tool results only does not start a turn."""
    return max((i for i, m in enumerate(msgs) if _user_like(m, i) and not (m["role"] == "user" and m["tool_only"])),
               default=-1)


def _merge_tools(messages: list[dict]) -> list[dict]:
    """V4.1 has no tool role: a tool result becomes a `<tool_result>` block of a user turn, and consecutive user
    turns (text or tool results) merge into one; tool results are put in the order of the calls they answer."""
    out: list[dict] = []
    for m in messages:
        if m["role"] in ("user", "tool"):
            c = m.get("content") or ""
            block = (False, c, None) if m["role"] == "user" else (True, f"<tool_result>{c}</tool_result>",
                                                                  m.get("tool_call_id"))
            if out and out[-1]["role"] == "user":
                out[-1]["raw"].append(block)
            else:
                out.append({"role": "user", "raw": [block]})
        else:
            out.append(m)
    calls: list = []
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [c.get("id") for c in m["tool_calls"]]
        elif m["role"] == "user":
            m["raw"] = sort_results(m["raw"], calls)
            m["blocks"] = [text for _, text, _ in m["raw"]]
            m["tool_only"] = all(is_tool for is_tool, _, _ in m["raw"])
    return out


def _attach_tools(msgs: list[dict], tools: list[dict]) -> None:
    """The tool definitions go into the first system message, created at the front when there is none."""
    system = next((m for m in msgs if m["role"] == "system"), None)
    if system is None:
        system = {"role": "system", "content": ""}
        msgs.insert(0, system)
    system["tools"] = render_tools(tools)


def _drop_earlier(msgs: list[dict]) -> list[dict]:
    """Thinking mode: before the last user turn, assistant turns lose their reasoning and developer turns go."""
    last = _last_user(msgs)
    out = []
    for i, m in enumerate(msgs):
        if i < last and m["role"] == "developer":
            continue
        if i < last and m["role"] == "assistant":
            m = {**m, "reasoning_content": None}
        out.append(m)
    return out


def pick_template(tokenizer, which: str = "auto"):
    """`official` / `simple` / `auto` (official when the tokenizer knows the V4.1 chat special tokens)."""
    if which not in ("auto", "official", "simple"):
        raise ValueError(f"unknown chat template {which!r}: use auto, official or simple")
    if which == "auto":
        knows = isinstance(tokenizer, HFTokenizer) and all(tokenizer.tok.token_to_id(t) is not None
                                                           for t in (USER, ASSISTANT))
        which = "official" if knows else "simple"
    return OfficialTemplate() if which == "official" else SimpleTemplate()


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """A rendered prompt -> token ids without the BOS: the end-of-sentence string is the tokenizer's EOS id when
    the tokenizer does not spell it as one token itself (the rest is the tokenizer's own encoding)."""
    own = isinstance(tokenizer, HFTokenizer) and tokenizer.tok.token_to_id(EOS) is not None
    if own or tokenizer.eos_id is None or EOS not in text:
        return list(tokenizer.encode(text))
    ids: list[int] = []
    for k, piece in enumerate(text.split(EOS)):
        ids += ([tokenizer.eos_id] if k else []) + (list(tokenizer.encode(piece)) if piece else [])
    return ids
