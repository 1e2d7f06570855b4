"""Chat templates: messages -> one prompt string.

Two encodings:

* `OfficialTemplate` — the DeepSeek-V4.1 chat encoding, for official checkpoints (tokenizers that know the
  `<｜User｜>` / `<｜Assistant｜>` special tokens). The structure, as published with the V4.1 release
  (encoding_dsv41, also served by SGLang):

      <｜begin▁of▁sentence｜>[<｜System｜>[{effort}]{system}]<｜User｜>{user}<｜Assistant｜>{</think>|<think>}...

  - the BOS token is added by the server as an id (the engine convention), not spelled in the text;
  - `<｜System｜>` opens the first message when it is a system message or when an effort line is rendered; a later
    system message carries its own `<｜System｜>` and, like a user turn, is followed by the assistant header;
  - after the last user-like turn: `<｜Assistant｜><think>` in thinking mode, `<｜Assistant｜></think>` in chat mode;
    earlier turns always get `</think>` (their reasoning is dropped), earlier assistant answers end with
    `<｜end▁of▁sentence｜>`;
  - tool results become `<tool_result>...</tool_result>` blocks of a user turn (V4.1 has no tool role);
    consecutive user turns merge into one, blocks separated by a blank line;
  - reasoning effort, thinking mode only, first message only:
    `Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\\n\\n`.

* `SimpleTemplate` — ours, for the checkpoints we train (byte-level BPE with only <|bos|>/<|eos|>/<|pad|>, no chat
  special tokens): plain text turns

      Reasoning Effort: 75
      {system}

      User: {user}

      Assistant:

Reasoning effort (docs/system.md §7): the API's `low` / `high` / `max` map to b = 50 / 75 / 100 and b is written as a
line `Reasoning Effort: {b}` before the system prompt; an integer 1..100 is accepted as an extension. Anything else
is an error (the server answers 400). Note: the released V4.1 encoder maps low/high/xhigh/max to 25/50/75/100 and
renders a default of 50 in thinking mode; this project follows docs/system.md (50/75/100, no line unless asked for).

A final assistant message is continued (no end-of-sentence, no new header), like DeepSeek's prefix completion.
"""

from __future__ import annotations

from dsv41.engine.engine import partial_suffix
from dsv41.engine.tokenizer import HFTokenizer

EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}

EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK_START, THINK_END = "<think>", "</think>"
OFFICIAL_EFFORT = "Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

ROLES = ("system", "developer", "user", "assistant", "tool")


def effort_budget(effort) -> int | None:
    """reasoning_effort -> b in 1..100 (None when not given). Raises ValueError for anything else."""
    if effort is None:
        return None
    if isinstance(effort, str) and effort in EFFORT_LEVELS:
        return EFFORT_LEVELS[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ValueError(f"invalid reasoning_effort {effort!r}: use one of {', '.join(EFFORT_LEVELS)} "
                     f"or an integer in [1, 100]")


def effort_line(b: int) -> str:
    return f"Reasoning Effort: {b}"


def _check(messages: list[dict]) -> None:
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {m.get('role')!r}")
        if not isinstance(m.get("content") or "", str):
            raise ValueError(f"messages[{i}]: content must be text")
    if all(m["role"] == "assistant" for m in messages):
        raise ValueError("messages need at least one system, developer, user or tool message")


class SimpleTemplate:
    """Our plain-text template (see the module docstring)."""

    name = "simple"

    def render(self, messages: list[dict], effort: int | None = None, thinking: bool | None = None) -> str:
        _check(messages)
        head = [] if effort is None else [effort_line(effort) + "\n"]
        rest = messages
        if messages[0]["role"] in ("system", "developer"):
            head.append((messages[0].get("content") or "") + "\n")
            rest = messages[1:]
        parts = ["".join(head)] if head else []
        for i, m in enumerate(rest):
            content, last = m.get("content") or "", i == len(rest) - 1
            if m["role"] == "assistant":
                parts.append("Assistant:" + (" " + content if content else "") + ("" if last else "\n"))
            else:
                label = {"user": "User", "tool": "Tool"}.get(m["role"], "System")
                parts.append(f"{label}: {content}\n" + ("\nAssistant:" if last else ""))
        return "\n".join(parts)


class OfficialTemplate:
    """The DeepSeek-V4.1 chat encoding, text-only (see the module docstring)."""

    name = "deepseek-v4.1"

    def render(self, messages: list[dict], effort: int | None = None, thinking: bool | None = None) -> str:
        _check(messages)
        thinking = effort is not None if thinking is None else bool(thinking)
        msgs = _merge_tools(messages)
        last_user = max((i for i, m in enumerate(msgs) if _user_like(m, i)), default=-1)
        out = []
        for i, m in enumerate(msgs):
            role, content = m["role"], m.get("content") or ""
            eff = OFFICIAL_EFFORT.format(b=effort) if (i == 0 and thinking and effort is not None) else ""
            s = SYSTEM + eff if i == 0 and (eff or role == "system") else ""
            if role == "system":
                s += (SYSTEM if i > 0 else "") + content
            elif role == "developer":
                s += USER + content
            elif role == "user":
                s += USER + "\n\n".join(m["blocks"])
            elif role == "assistant":
                if thinking and i > last_user:
                    s += (m.get("reasoning_content") or "") + THINK_END
                s += content + ("" if i == len(msgs) - 1 else EOS)         # a final answer is continued
            nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
            if _user_like(m, i) and nxt in (None, "assistant"):
                s += ASSISTANT + (THINK_START if thinking and i >= last_user else THINK_END)
            out.append(s)
        return "".join(out)


def _user_like(m: dict, i: int) -> bool:
    return m["role"] in ("user", "developer") or (m["role"] == "system" and i > 0)


def _merge_tools(messages: list[dict]) -> list[dict]:
    """V4.1 has no tool role: a tool result becomes a `<tool_result>` block of a user turn, and consecutive user
    turns (text or tool results) merge into one, blocks separated by a blank line."""
    out: list[dict] = []
    for m in messages:
        if m["role"] in ("user", "tool"):
            c = m.get("content") or ""
            block = c if m["role"] == "user" else f"<tool_result>{c}</tool_result>"
            if out and out[-1]["role"] == "user":
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        else:
            out.append(dict(m))
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


class ReasoningSplitter:
    """Splits streamed official-template output into reasoning (before `</think>`) and answer text, holding back a
    tail that could still become `</think>`."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        if not self.in_reasoning:
            return "", text
        self.buf += text
        i = self.buf.find(THINK_END)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(THINK_END):]
            self.buf, self.in_reasoning = "", False
            return reasoning, content
        hold = 0 if final else partial_suffix(self.buf, THINK_END)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out, ""
