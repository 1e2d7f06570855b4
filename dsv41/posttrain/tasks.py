"""Verifiable task families whose useful reasoning length varies by problem, with exact checkers, and the prompts
in the official chat format (docs/system.md §7).

Every family has a chain of intermediate states (running sums, pointer positions) and a final state, the answer.
A response is `{trace}</think>{answer}<eos>` after the prompt's `<｜Assistant｜><think>`: the trace writes, for
every chunk of `stride` steps of the chain (the last chunk may be shorter), what the chunk consumes and the state
after it, so stride 1 is the longest, most explicit reasoning, and the answer is the trace's last state; stride = n
(the chain length) is the empty one, where the model must do the whole chain in one token. More steps = harder; a longer trace = more accurate for the same model. The reasoning tokens
are the trace's tokens (between the think tags).

* `sums`: running sums mod 10 of n labelled digits: `sum a3 b7 c2 d9 e1` -> trace `a3b7=0 c2d9=1 e1=2` (stride 2)
  -> answer `2`. Each step copies the next label's digit and adds it to the last partial sum: the labels make the
  copy a lookup by content (find `c` in the prompt, read its digit), as a pointer hop is, instead of a count of
  positions, which a model with rotary positions on a few dimensions learns far more slowly (the 2026-12-05
  unlabelled format, `sum 37291` -> `3=3 7=0 2=2 9=1`, where the last digit was read from the prompt in the
  answer token, was not learned by the `post` preset within 1,500 SFT steps; benchmarks/results/
  posttrain-cpu-2026-12-05c/diag).
* `chase`: pointer chasing on a map of letters, each pair written as two adjacent letters (`ac`: a maps to c):
  `chase ac ba cd db from a 3` -> trace `c d b` (stride 1) -> answer `b` (the letter after 3 hops). Adjacent
  pairs make a hop the same lookup as a sums copy (the token whose predecessor is the current letter); with `a>c`
  the `post` preset did not learn the hop within 1,500 SFT steps (diag, as above).

Held-out problems are those whose content hashes into bucket 0 of 10 (`held_out`); training never draws them.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from dsv41.server.chat import OfficialTemplate, THINK_END, encode_prompt

FAMILIES = ("sums", "chase")
LETTERS = "abcdefghij"
HELD_OUT_BUCKETS = 10
MAX_TOKENS = 40          # the response limit of every stage: the longest response at n = 6 (sums, stride 1) is 32


@dataclass(frozen=True)
class Problem:
    family: str
    content: str                 # the user message
    states: tuple[str, ...]      # the chain's states after each step; the last one is the answer
    pieces: tuple[str, ...]      # what each step consumes, as written in the trace (digits; "" for a hop)
    difficulty: int              # chain length n

    @property
    def answer(self) -> str:
        return self.states[-1]


def held_out(content: str) -> bool:
    return int(hashlib.sha256(content.encode()).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


def sums_problem(digits: list[int]) -> Problem:
    """The `sums` problem of these digits, labelled a, b, c, ..."""
    n = len(digits)
    if not 1 <= n <= len(LETTERS):
        raise ValueError(f"sums: {n} digits outside [1, {len(LETTERS)}] (one label letter each)")
    states, s = [], 0
    for d in digits:
        s = (s + d) % 10
        states.append(str(s))
    pieces = tuple(f"{LETTERS[i]}{d}" for i, d in enumerate(digits))
    return Problem("sums", "sum " + " ".join(pieces), tuple(states), pieces, n)


def sums_digits(p: Problem) -> list[int]:
    return [int(x[1:]) for x in p.pieces]


def make_sums(rng: random.Random, n: int) -> Problem:
    return sums_problem([rng.randrange(10) for _ in range(n)])


def chase_problem(mapping: dict[str, str], start: str, n: int) -> Problem:
    """The `chase` problem of this map (keys a, b, c, ... in order), followed n hops from `start`."""
    states, at = [], start
    for _ in range(n):
        at = mapping[at]
        states.append(at)
    spec = " ".join(f"{k}{v}" for k, v in mapping.items())
    return Problem("chase", f"chase {spec} from {start} {n}", tuple(states), ("",) * n, n)


def make_chase(rng: random.Random, n: int, letters: int = 6) -> Problem:
    keys = list(LETTERS[:letters])
    targets = keys[:]
    rng.shuffle(targets)
    return chase_problem(dict(zip(keys, targets)), rng.choice(keys), n)


MAKERS = {"sums": make_sums, "chase": make_chase}


def parse_problem(content: str) -> Problem:
    """The problem a user message states, as `Problem.content` writes it (`sum a3 b7 c0`, `chase ab ba from a 2`):
    the inverse of the makers, so a served request can be checked and constrained like a generated one. Raises
    ValueError for any other text."""
    words = content.split()
    if len(words) >= 2 and words[0] == "sum":
        labels = [w[:1] for w in words[1:]]
        if (labels != list(LETTERS[:len(labels)]) or any(len(w) != 2 or not w[1].isdigit() for w in words[1:])):
            raise ValueError(f"not a sums problem: {content!r} (sum a<digit> b<digit> ...)")
        p = sums_problem([int(w[1]) for w in words[1:]])
    elif len(words) >= 5 and words[0] == "chase" and words[-3] == "from":
        pairs, start, n = words[1:-3], words[-2], words[-1]
        keys = [w[:1] for w in pairs]
        mapping = {w[0]: w[1] for w in pairs if len(w) == 2}
        if (keys != list(LETTERS[:len(keys)]) or len(mapping) != len(keys) or sorted(mapping.values()) != keys
                or start not in mapping or not n.isdigit() or not 1 <= int(n) <= len(LETTERS)):
            raise ValueError(f"not a chase problem: {content!r} (chase <key><target> ... from <key> <n>)")
        p = chase_problem(mapping, start, int(n))
    else:
        raise ValueError(f"not a task problem: {content!r} (a sums or chase problem as the tasks write them)")
    if p.content != content:
        raise ValueError(f"not a task problem as the tasks write it: {content!r} (expected {p.content!r})")
    return p


def check_family(family: str) -> str:
    if family not in MAKERS:
        raise ValueError(f"unknown task family {family!r}: choose from {', '.join(FAMILIES)}")
    return family


def sample_problem(rng: random.Random, family: str, lo: int, hi: int, split: str = "train") -> Problem:
    """A problem of `family` with a chain length uniform in [lo, hi], from the train or held-out split."""
    if split not in ("train", "held_out"):
        raise ValueError(f"unknown split {split!r}: train or held_out")
    while True:
        p = MAKERS[check_family(family)](rng, rng.randint(lo, hi))
        if held_out(p.content) == (split == "held_out"):
            return p


def trace(p: Problem, stride: int) -> str:
    """The reasoning for `stride`: each chunk of `stride` steps (the last one may be shorter), then its state
    (`a3b7=0`, `c`); empty at stride n."""
    n = p.difficulty
    if not 1 <= stride <= n:
        raise ValueError(f"stride {stride} outside [1, {n}]")
    if stride == n:
        return ""
    items = []
    for start in range(0, n, stride):
        end = min(start + stride, n)
        chunk = "".join(p.pieces[start:end])
        items.append(f"{chunk}={p.states[end - 1]}" if chunk else p.states[end - 1])
    return " ".join(items)


def response(p: Problem, stride: int, head: str = "") -> str:
    """The full response text after the prompt's `<think>` (without the end-of-sentence token); `head`: the
    reasoning's opening tokens (`plan_head`), written before the trace."""
    return head + trace(p, stride) + THINK_END + p.answer


# Optional opening of the reasoning (SFT's `--echo` / `--plan`; off by default): an echo of the effort level's
# band, then a plan letter that fixes the trace's stride. The echo is a function of the prompt alone and the plan
# is drawn independently of b in SFT, so the reasoning length still does not depend on b before RL; what they add
# is (echo) a token whose embedding carries b into the position where the plan is chosen (the reading of b is
# taught, its use is not) and (plan) one position that decides the whole length, the only place RL has to move.
BANDS = "ABCDEFGHIJK"            # b // 10: 1-9 -> A, 10-19 -> B, ..., 90-99 -> J, 100 -> K
PLANS = "SML"                    # short: the empty trace; medium: two chunks; long: the full trace (stride 1)


def effort_band(b: int, merge_top: bool = False) -> str:
    """b's band letter; merge_top: b = 100 shares J with 90-99 (ten bands of ten levels; with K, b = 100 alone
    had a letter that 1 of 96 dense training levels wrote, and was rl5b's outlier, 2026-12-06d)."""
    if not 1 <= b <= 100:
        raise ValueError(f"effort {b} outside [1, 100]")
    return BANDS[min(b // 10, 9) if merge_top else b // 10]


def plan_stride(p: Problem, plan: str) -> int:
    """The stride a plan letter fixes for this problem: S = n (empty), M = ceil(n / 2) (two chunks), L = 1."""
    n = p.difficulty
    return {"S": n, "M": max(1, (n + 1) // 2), "L": 1}[plan]


HEAD_TOKENS = 3                  # the longest head: band letter, size digit (echo_size), plan letter


def opened_plan(tokenizer, out_ids: list[int]) -> str | None:
    """The plan letter a sampled response opened its reasoning with (among its first HEAD_TOKENS tokens), or
    None. (Trace tokens are lower-case letters, digits, `=` and spaces, so no trace opening reads as a plan.)"""
    for t in out_ids[:HEAD_TOKENS]:
        c = tokenizer.decode([t])
        if len(c) == 1 and c in PLANS:
            return c
    return None


def plan_head(b: int, plan: str | None, echo: bool, size: int | None = None, merge_top: bool = False) -> str:
    """The reasoning's opening: the band letter of b (echo; merge_top: effort_band's), then the problem's chain
    length n as one digit (size, None: none), then the plan letter (None: no plan).

    Why the size digit (SFT's --echo-size): the reward's best plan depends on n as much as on b (the L - S reward
    difference of sums changes sign at a b that grows with n, 06c section 2), and rl5b learned one threshold for
    every n (a step near b 40). With band and size as the two tokens before the plan letter, the plan position's
    own input and its predecessor carry the (b, n) cell the plan should depend on."""
    if plan is not None and plan not in PLANS:
        raise ValueError(f"unknown plan {plan!r}: one of {PLANS}")
    if size is not None and not 1 <= size <= 9:
        raise ValueError(f"size echo {size} is not one digit in [1, 9]")
    return (effort_band(b, merge_top) if echo else "") + ("" if size is None else str(size)) + (plan or "")


def render_prompt(p: Problem, effort: int) -> str:
    """The official V4.1 chat prompt in thinking mode with the effort line (ends with `<｜Assistant｜><think>`)."""
    if not 1 <= effort <= 100:
        raise ValueError(f"effort {effort} outside [1, 100]")
    return OfficialTemplate().render([{"role": "user", "content": p.content}], effort=effort, thinking=True)


def prompt_ids(tokenizer, p: Problem, effort: int) -> list[int]:
    """[BOS] + the rendered prompt's ids (the engine convention: BOS as an id, not spelled in the text)."""
    return [tokenizer.bos_id] + encode_prompt(tokenizer, render_prompt(p, effort))


def response_ids(tokenizer, p: Problem, stride: int, head: str = "") -> list[int]:
    return encode_prompt(tokenizer, response(p, stride, head)) + [tokenizer.eos_id]


@dataclass(frozen=True)
class Verdict:
    correct: bool
    reasoning_tokens: int        # tokens before `</think>` (all of them when it never came)
    closed: bool                 # the response closed its think span
    answer: str


def check(tokenizer, p: Problem, out_ids: list[int]) -> Verdict:
    """Score a sampled response (token ids after the prompt, EOS excluded or included): correct when it closes
    the think span and the text after it, stripped, is exactly the answer."""
    end = tokenizer.think_end_id
    eos = tokenizer.eos_id
    ids = out_ids[:out_ids.index(eos)] if eos in out_ids else list(out_ids)
    if end not in ids:
        return Verdict(False, len(ids), False, "")
    k = ids.index(end)
    answer = tokenizer.decode(ids[k + 1:]).strip()
    return Verdict(answer == p.answer, k, True, answer)
