"""Guards training on a small corpus: when the split by document name leaves validation empty, tiny or most of the
text (a dozen files, two files, one file), validation is the tail of every document instead, the corpus says so,
and training reports a validation loss; only a corpus too small for both sides (a few bytes) is refused, with its
size and what is needed. The text is the standard library's own source, read at test time."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from dsv41.train import data as D
from dsv41.train.config import TrainConfig
from dsv41.train.trainer import train

FRACTION = D.DEFAULT_VAL_FRACTION


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _code(n_chars: int, start: int = 0) -> str:
    """About n_chars of real Python source (top-level standard-library modules), ending at a line end."""
    parts, have = [], 0
    for p in sorted(D.stdlib_root().glob("*.py")):
        parts.append(p.read_text(encoding="utf-8", errors="replace"))
        have += len(parts[-1])
        if have > start + n_chars:
            break
    text = "".join(parts)[start:start + n_chars]
    return text[:text.rfind("\n") + 1]


def _named(pattern: str, n: int, side: str = "train", pieces: int = 1) -> list[str]:
    """The first n names of `pattern` whose documents (`name:k` for k < pieces when a file is cut) all fall on
    `side` by name: a corpus the split by name cannot serve."""
    def on_side(name):
        names = [name] if pieces == 1 else [f"{name}:{k}" for k in range(pieces)]
        return all(D.split_of(x, FRACTION) == side for x in names)
    return list(itertools.islice((x for x in map(pattern.format, itertools.count()) if on_side(x)), n))


def _corpus(root: Path, sizes: list[int], pieces: int = 1) -> Path:
    """A directory of len(sizes) files of about those sizes, none validation by name."""
    root.mkdir()
    for i, (name, size) in enumerate(zip(_named("mod{}.py", len(sizes), pieces=pieces), sizes)):
        (root / name).write_text(_code(size, start=i * size))
    return root


def _single(root: Path, size: int) -> Path:
    """One text file, cut into documents of LINES_PER_DOC lines, none validation by name."""
    root.mkdir()
    text = _code(size)
    pieces = math.ceil(text.count("\n") / D.LINES_PER_DOC)
    path = root / _named("notes{}.txt", 1, pieces=pieces)[0]
    path.write_text(text)
    return path


def _check_tail_split(c: D.Corpus, docs: list[D.Document], min_chars: int) -> None:
    assert c.note.startswith("split:") and "by text" in c.provenance["split"]
    heads, tails = {d.name: d.text for d in c.train}, {d.name.removesuffix(":tail"): d.text for d in c.val}
    assert set(tails) == {d.name for d in docs}                        # every document gives validation its tail
    for d in docs:
        assert heads[d.name] + tails[d.name] == d.text                  # nothing lost, nothing shared
        assert heads[d.name].endswith("\n")                             # cut at a line start
    val, total = sum(map(len, tails.values())), sum(len(d.text) for d in docs)
    assert max(min_chars, FRACTION * total) <= val <= 2 * max(min_chars, FRACTION * total) + len(docs)


KINDS = ["12 files", "2 files", "1 file"]


def _small(kind: str, root: Path) -> Path:
    """A dozen files of ~50 KB, two files (30 and 12 KB) or one file of 20 KB, none validation by name."""
    if kind == "1 file":
        return _single(root, 20_000)
    return _corpus(root, [50_000] * 12 if kind == "12 files" else [30_000, 12_000])


@pytest.mark.parametrize("kind", KINDS)
def test_small_corpus_splits_by_document_tails(tmp_path, kind):
    path = _small(kind, tmp_path / "d")
    docs = [d for d in D.path_documents(path) if d.text.strip()]
    assert all(D.split_of(d.name, FRACTION) == "train" for d in docs)      # the split by name gives no validation
    min_chars = D.min_val_chars(128)
    c = D.load_corpus(path, FRACTION, min_chars)
    _check_tail_split(c, docs, min_chars)
    assert c.provenance["val_documents"] == len(docs) and D.load_corpus(path, FRACTION, min_chars) == c


def test_name_split_kept_unless_validation_is_most_or_short(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    big, small = _named("v{}.py", 1, side="val")[0], _named("t{}.py", 1)[0]
    (d / big).write_text(_code(20_000))
    (d / small).write_text(_code(5_000, start=20_000))
    docs = D.path_documents(d)
    _check_tail_split(D.load_corpus(d, FRACTION), docs, 0)             # validation would be 80% of the text
    (d / small).write_text(_code(60_000, start=20_000))
    c = D.load_corpus(d, FRACTION)                                      # now a quarter: the split by name stands
    assert c.note == "" and [x.name for x in c.val] == [big] and "sha256" in c.provenance["split"]
    _check_tail_split(D.load_corpus(d, FRACTION, 30_000), D.path_documents(d), 30_000)   # short of min_chars


def test_a_few_bytes_are_refused_with_the_size_and_the_need(tmp_path):
    (tmp_path / "tiny.txt").write_text("print(1)\n")
    need = 2 * D.min_val_chars(128)
    with pytest.raises(ValueError, match=rf"1 non-empty document, 9 characters \(9 bytes\).*at least {need:,} "):
        D.load_corpus(tmp_path / "tiny.txt", FRACTION, D.min_val_chars(128))
    with pytest.raises(ValueError, match="too little text"):
        train(TrainConfig(preset="debug", data=str(tmp_path / "tiny.txt"), out=str(tmp_path / "run"), steps=1,
                          quiet=True))


@pytest.mark.parametrize("kind", KINDS)
def test_training_on_a_small_corpus_reports_validation(tmp_path, kind, capsys):
    path = _small(kind, tmp_path / "d")
    s = train(TrainConfig(preset="debug", data=str(path), out=str(tmp_path / "run"), steps=2, seq_len=32,
                          batch_size=2, eval_windows=4, sample_tokens=0, threads=1))
    assert math.isfinite(s["val_loss"]) and s["val_loss"] > 0 and s["val_bpb"] > 0
    out = capsys.readouterr().out
    assert "split:" in out and "validation is the last" in out and "validation: loss" in out
