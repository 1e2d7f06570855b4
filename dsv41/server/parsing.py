"""The model's answer split the way clients read it: reasoning (`reasoning_content`), answer text (`content`) and
tool calls (`tool_calls`), fed piece by piece as the engine streams text, so that a tag cut across two chunks is
still recognised (the tail that could still become a tag is held back until it is decided).

In thinking mode the answer starts inside the reasoning (the prompt ended with `<think>`); `</think>` ends it.
With tools, a `<｜DSML｜ calls>` block (`dsv41.server.tools`) ends the reasoning or the answer text: each invoke is
returned as a call as soon as its closing tag arrives, and anything after the block is dropped (a call ends the
turn). Whitespace before the block is not content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv41.engine.engine import partial_suffix
from dsv41.server.chat import THINK_END
from dsv41.server.tools import CALLS_END, CALLS_START, complete_invokes

REASONING, CONTENT, CALLS, AFTER = "reasoning", "content", "calls", "after"


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def add(self, other: "Delta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


class OutputParser:
    def __init__(self, thinking: bool, tools: bool):
        self.state = REASONING if thinking else CONTENT
        self.tools = tools
        self.buf = ""                   # text not yet handed out
        self.reasoning_chars = 0        # characters of the answer text up to the end of the reasoning
        self.seen = 0                   # characters fed so far
        self.n_calls = 0

    def _ends(self) -> list[str]:
        """The tags that end the current state."""
        if self.state == REASONING:
            return [THINK_END] + ([CALLS_START] if self.tools else [])
        return [CALLS_START] if self.state == CONTENT and self.tools else []

    def feed(self, text: str, final: bool = False) -> Delta:
        out = Delta()
        self.seen += len(text)
        self.buf += text
        while True:
            if self.state in (REASONING, CONTENT):
                if not self._text_state(out, final):
                    return out
            elif self.state == CALLS:
                calls, end = complete_invokes(self.buf)
                out.calls += calls
                self.n_calls += len(calls)
                self.buf = self.buf[end:]
                i = self.buf.find(CALLS_END)
                if i < 0:
                    return out
                self.buf, self.state = "", AFTER
            else:
                self.buf = ""
                return out

    def _text_state(self, out: Delta, final: bool) -> bool:
        """Hand out the reasoning / answer text in the buffer; True when a tag switched the state."""
        hits = [(self.buf.find(t), t) for t in self._ends()]
        hits = [(i, t) for i, t in hits if i >= 0]
        if hits:
            i, tag = min(hits)
            self._emit(out, self.buf[:i], drop_trailing_space=tag == CALLS_START)
            if self.state == REASONING:
                self.reasoning_chars = self.seen - len(self.buf) + i
            self.buf = self.buf[i + len(tag):]
            self.state = CONTENT if tag == THINK_END else CALLS
            return True
        hold = 0 if final else max([partial_suffix(self.buf, t) for t in self._ends()] + [0])
        if not final and self.state == CONTENT and self.tools:     # whitespace may precede a calls block
            rest = self.buf[:len(self.buf) - hold]
            hold += len(rest) - len(rest.rstrip())
        self._emit(out, self.buf[:len(self.buf) - hold])
        self.buf = self.buf[len(self.buf) - hold:]
        if final and self.state == REASONING:
            self.reasoning_chars = self.seen
        return False

    def _emit(self, out: Delta, text: str, drop_trailing_space: bool = False) -> None:
        if self.state == REASONING:
            out.reasoning += text
        else:
            out.content += text.rstrip() if drop_trailing_space else text


def parse_all(text: str, thinking: bool, tools: bool) -> tuple[Delta, int]:
    """The whole answer at once -> (its parts, characters of reasoning including the closing tag's start)."""
    p = OutputParser(thinking, tools)
    d = p.feed(text, final=True)
    return d, p.reasoning_chars
