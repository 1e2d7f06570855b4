"""Code lines of the package: non-blank lines that are neither comments nor docstrings, per file and in total.

    python benchmarks/code_lines.py [--rev COMMIT] [--top N]

A docstring is a string-literal expression statement (module, class, function, or a bare string statement);
comment lines are those whose only token is a comment. --rev counts the tree of a commit (via `git show`)
instead of the working tree. Prints the N largest files, the total, and a JSON line.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def code_lines(src: str) -> int:
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in skip:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in doc_lines:
                code.add(line)
    return len(code)


def files_at(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "dsv41").rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "dsv41"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default=None, help="a commit to count instead of the working tree")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    counts = {name: code_lines(src) for name, src in files_at(args.rev).items()}
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{n:>7}  {name}")
    total = sum(counts.values())
    print(f"{total:>7}  total ({len(counts)} files, {args.rev or 'working tree'})")
    print(json.dumps({"rev": args.rev, "files": len(counts), "code_lines": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
