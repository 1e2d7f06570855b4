"""Rewrite the code's citations of the team's working documents into citations of the repository's own docs/.

    python tools/rewrite_citations.py            # dry run: print every change, then a summary
    python tools/rewrite_citations.py --apply    # write the changes

Scope: every .py file under dsv41/, tests/ and benchmarks/, and README.md.

Rewrites (section numbers are kept: docs/ preserves the numbering of the documents it replaces):
  MODEL.md 3.3 / MODEL.md section 3.3 / (MODEL.md 9)         -> docs/model.md §3.3 / ... / (docs/model.md §9)
  MODEL.md 3.3-3.6, 9 and 10 / MODEL.md 2 items 3-6          -> docs/model.md §3.3-3.6, §9 and §10 / §2 items 3-6
  SYSTEM.md 6                                                -> docs/system.md §6
  ARCHITECTURE.md rule 5                                     -> docs/architecture.md §5
  golden/README.md section 4, golden README s.6,
  shared/golden/README.md                                    -> docs/golden.md §4, docs/golden.md §6, docs/golden.md
  golden/vision/README.md section 3                          -> docs/vision-golden.md §3
  notes section 4.4, report section 2,
  seed/v41-flash-report-notes.zh.txt section 2               -> docs/report.md §4.4, docs/report.md §2, ...
  a document named without a section                         -> the docs/ path alone
plus a few fixed phrasings listed in OVERRIDES.

Checks, printed after the changes:
  unresolved   a docs/ citation (rewritten or already there) whose file or section does not exist in docs/
  leftover     a line that still names one of the old documents after the rewrite (a form this script misses)
  too long     a line that the rewrite takes past 120 characters (to reflow by hand; nothing is reflowed here)
  by hand      in dsv41/: issue numbers, dates (YYYY-MM-DD) and Chinese text (quotes of the reading notes), which
               the code must not carry; everywhere: mentions of the reading notes without a section ("the
               notes ..."), to cite docs/report.md §N or the report instead

Exit status 1 when anything is unresolved or left over, else 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE = 120                  # the code's line width: rewritten lines that pass it are listed for reflowing
DOCS = ROOT / "docs"
SCOPE = ("dsv41", "tests", "benchmarks")
EXTRA_FILES = ("README.md",)

# Exact phrasings that the general rule would get wrong, replaced first (old -> new).
OVERRIDES = {
    "(MODEL.md 10.2, 2)": "(docs/model.md §10.2 item 2)",           # "pitfall 2 of 10.2", not sections 10.2 and 2
    "report section on mHC": "docs/report.md §7.1",
    "the report via the notes, section 6": "the report (docs/report.md §6)",
    "golden/vision/README.md gate 1": "docs/vision-golden.md §5, gate 1",
    "`tests/data/golden/README`-style": "the `docs/golden.md` §4",
    "# golden README section 3: image0": "# docs/vision-golden.md §3: image0",    # the vision README's section
}

# Old document -> docs/ file. Order matters: the vision README before the case-A one.
DOC_PATTERNS = [
    (r"(?:shared/)?golden/vision/README(?:\.md)?", "vision-golden"),
    (r"(?:shared/|tests/data/)?golden/README(?:\.md)?|golden README", "golden"),
    (r"MODEL\.md", "model"),
    (r"SYSTEM\.md", "system"),
    (r"ARCHITECTURE\.md", "architecture"),
    (r"(?:seed/)?v41-flash-report-notes\.zh\.txt", "report"),
    (r"\bnotes(?= section \d)", "report"),
    (r"\breport(?= section \d)", "report"),
]
NUM = r"\d+(?:\.\d+)*(?:b(?!\w))?(?![\d.]\d)"
NUMSPEC = rf"{NUM}(?:[-–]{NUM})?(?:\s+(?:items?|pitfalls?)\s+\d+(?:[-–]\d+)?)?"
LEAD = r"(?:\s+(?:sections?|s\.|rules?|§)\s*|\s+)"
SEP = r"(?:,\s+and\s+|,\s*|\s+and\s+|\s*/\s*)(?:sections?\s+)?"
CITATION = re.compile(rf"(?P<doc>{'|'.join(f'(?P<d{i}>{p})' for i, (p, _) in enumerate(DOC_PATTERNS))})"
                      rf"(?P<tail>{LEAD}{NUMSPEC}(?:{SEP}{NUMSPEC})*)?")
SPEC_IN_TAIL = re.compile(rf"(?P<sep>^{LEAD}|{SEP})(?P<spec>{NUMSPEC})")
DOCS_CITATION = re.compile(r"docs/(?P<name>[a-z][a-z-]*)\.md")
SECTION_REF = re.compile(rf"§\s*(?P<a>{NUM})(?:[-–](?P<b>{NUM}))?")
LEFTOVER = re.compile(r"MODEL\.md|SYSTEM\.md|ARCHITECTURE\.md|golden/README|golden README|seed/v41|"
                      r"report-notes|notes section \d|report section \d")
HAND_DSV41 = re.compile(r"\bissue #?\d+(?![\d%])|(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)")
HAND_NOTES = re.compile(r"\b[Tt]he notes\b|\bnotes[:']|\bnotes \(")
CJK = re.compile(r"[\u3400-\u9fff]")                     # CJK ideographs (not the full-width bars of token names)


@dataclass
class Report:
    changes: list[tuple[str, int, str, str]] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    unresolved: list[tuple[str, int, str]] = field(default_factory=list)
    leftover: list[tuple[str, int, str]] = field(default_factory=list)
    by_hand: list[tuple[str, int, str, str]] = field(default_factory=list)
    too_long: list[tuple[str, int, int]] = field(default_factory=list)
    files_changed: set[str] = field(default_factory=set)


def doc_sections() -> dict[str, set[str]]:
    """docs/<name>.md -> the section numbers its headings carry ("## 3.3 ...", "### 3b. ...")."""
    heading = re.compile(r"^#{1,6}\s+§?(\d+(?:\.\d+)*b?)\.?\s")
    out = {}
    for p in sorted(DOCS.glob("*.md")):
        lines = p.read_text(encoding="utf-8").splitlines()
        out[p.stem] = {m.group(1) for line in lines if (m := heading.match(line))}
    return out


def target_of(m: re.Match) -> str:
    """The docs/ file a CITATION match names (the alternative of DOC_PATTERNS that matched)."""
    return next(name for i, (_, name) in enumerate(DOC_PATTERNS) if m.group(f"d{i}") is not None)


def rewrite_tail(tail: str) -> str:
    """' section 3.3-3.6, 9 and 10' -> ' §3.3-3.6, §9 and §10' (qualifiers such as 'items 3-6' kept)."""
    out, pos = [], 0
    for m in SPEC_IN_TAIL.finditer(tail):
        assert m.start() == pos, (tail, m.start(), pos)
        sep = " " if m.start() == 0 else re.sub(r"sections?\s+$", "", m.group("sep"))
        out.append(f"{sep}§{m.group('spec')}")
        pos = m.end()
    assert pos == len(tail), (tail, pos)
    return "".join(out)


def rewrite_line(line: str) -> str:
    for old, new in OVERRIDES.items():
        line = line.replace(old, new)

    def sub(m: re.Match) -> str:
        name = target_of(m)
        return f"docs/{name}.md" + (rewrite_tail(m.group("tail")) if m.group("tail") else "")
    return CITATION.sub(sub, line)


def check_line(line: str, sections: dict[str, set[str]]) -> list[str]:
    """The docs/ citations of a line that do not resolve (missing file or section)."""
    bad = []
    matches = list(DOCS_CITATION.finditer(line))
    for i, m in enumerate(matches):
        name = m.group("name")
        if name not in sections:
            bad.append(f"docs/{name}.md (no such file)")
            continue
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        window = line[m.end():end]
        for ref in SECTION_REF.finditer(window):
            for sec in (ref.group("a"), ref.group("b")):
                if sec and sec not in sections[name]:
                    bad.append(f"docs/{name}.md §{sec}")
    return bad


def files() -> list[Path]:
    out = [p for d in SCOPE for p in sorted((ROOT / d).rglob("*.py"))]
    return out + [ROOT / f for f in EXTRA_FILES if (ROOT / f).is_file()]


def process(path: Path, sections: dict[str, set[str]], rep: Report, apply: bool) -> None:
    rel = str(path.relative_to(ROOT))
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    new_lines = []
    for n, line in enumerate(lines, 1):
        new = rewrite_line(line)
        if new != line:
            rep.changes.append((rel, n, line.strip(), new.strip()))
            rep.files_changed.add(rel)
            before = Counter(m.group("name") for m in DOCS_CITATION.finditer(line))
            after = Counter(m.group("name") for m in DOCS_CITATION.finditer(new))
            rep.counts.update(after - before)
            if len(new.rstrip("\n")) > MAX_LINE >= len(line.rstrip("\n")):
                rep.too_long.append((rel, n, len(new.rstrip("\n"))))
        for bad in check_line(new, sections):
            rep.unresolved.append((rel, n, bad))
        if LEFTOVER.search(new):
            rep.leftover.append((rel, n, new.strip()))
        hand = [m.group(0) for m in HAND_NOTES.finditer(new)]
        if rel.startswith("dsv41/"):
            hand += [m.group(0) for m in HAND_DSV41.finditer(new)] + (["Chinese text"] if CJK.search(new) else [])
        for what in dict.fromkeys(hand):
            rep.by_hand.append((rel, n, what, new.strip()))
        new_lines.append(new)
    if apply and new_lines != lines:
        path.write_text("".join(new_lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--apply", action="store_true", help="write the changes (default: dry run)")
    args = ap.parse_args(argv)
    sections = doc_sections()
    rep = Report()
    for path in files():
        process(path, sections, rep, args.apply)

    for rel, n, old, new in rep.changes:
        print(f"{rel}:{n}: {old}\n{' ' * (len(rel) + len(str(n)) + 2)}-> {new}")
    print()
    verb = "rewrote" if args.apply else "would rewrite"
    print(f"{verb} {len(rep.changes)} lines in {len(rep.files_changed)} files; citations by target: "
          + ", ".join(f"{k} {v}" for k, v in sorted(rep.counts.items())))
    print(f"unresolved docs/ citations: {len(rep.unresolved)}")
    for rel, n, what in rep.unresolved:
        print(f"  {rel}:{n}: {what}")
    print(f"lines still naming an old document: {len(rep.leftover)}")
    for rel, n, line in rep.leftover:
        print(f"  {rel}:{n}: {line}")
    print(f"lines the rewrite takes past {MAX_LINE} characters (reflow by hand): {len(rep.too_long)}")
    for rel, n, width in rep.too_long:
        print(f"  {rel}:{n}: {width}")
    print(f"to fix by hand (issue numbers, dates and Chinese text in dsv41/; reading-note mentions without a "
          f"section): {len(rep.by_hand)}")
    for rel, n, what, line in rep.by_hand:
        print(f"  {rel}:{n}: [{what}] {line[:150]}")
    return 1 if rep.unresolved or rep.leftover else 0


if __name__ == "__main__":
    sys.exit(main())
