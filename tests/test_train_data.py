"""Guards the training data: the train/validation split is a deterministic function of each document's name,
the stdlib corpus skips test and third-party directories, the tokenizer has its special ids and round-trips
text, bits-per-byte counts bytes correctly, and the packed loader's order is seeded, rank-sliced and resumable."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dsv41.train import data as D


def _docs(n: int) -> list[D.Document]:
    return [D.Document(f"pkg/mod{i}.py", f"def f{i}(x):\n    return x + {i}  # caf\u00e9 \u2713\n" * 3)
            for i in range(n)]


def test_split_is_a_function_of_the_name():
    names = [f"lib/m{i}.py" for i in range(2000)]
    a = [D.split_of(n, 0.1) for n in names]
    assert a == [D.split_of(n, 0.1) for n in reversed(names)][::-1]
    frac = a.count("val") / len(a)
    assert 0.07 < frac < 0.13
    assert D.split_of("lib/m3.py", 0.1) == D.split_of("lib/m3.py", 0.1)


def test_stdlib_corpus_split_and_skips(tmp_path):
    root = tmp_path / "lib"
    for rel in ("a.py", "pkg/b.py", "pkg/test/c.py", "tests/d.py", "site-packages/e.py", "x.txt"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"# {rel}\nprint(1)\n")
    names = [d.name for d in D.stdlib_documents(root)]
    assert names == ["a.py", "pkg/b.py"]


def test_path_corpus_directory_and_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(30):
        (tmp_path / "d" / f"f{i}.txt").write_text(f"text {i}\n")
    (tmp_path / "d" / ".hidden.txt").write_text("no")
    (tmp_path / "d" / "bin.dat").write_bytes(b"\0\1")
    c1 = D.load_corpus(tmp_path / "d", 0.2)
    c2 = D.load_corpus(tmp_path / "d", 0.2)
    assert [d.name for d in c1.val] == [d.name for d in c2.val] and c1.val
    assert len(c1.train) + len(c1.val) == 30
    lines = [json.dumps({"text": f"record {i}"}) for i in range(40)]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    c = D.load_corpus(tmp_path / "r.jsonl", 0.2)
    assert len(c.train) + len(c.val) == 40 and c.train[0].name.startswith("r.jsonl:")
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match="text"):
        D.load_corpus(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="no such"):
        D.load_corpus(tmp_path / "missing")


def test_tokenizer_specials_round_trip_and_bytes():
    docs = _docs(40)
    tok = D.train_tokenizer(docs, 300)
    ids = D.special_ids(tok)
    assert (ids["<|bos|>"], ids["<|eos|>"], ids["<|pad|>"]) == (0, 1, 2)
    assert ids["<|draft|>"] == tok.get_vocab_size() - 1 and ids["<|image|>"] == tok.get_vocab_size() - 2
    text = "def g(y):\n\treturn y * 2  # na\u00efve \U0001F600\n"
    enc = tok.encode(text).ids
    assert tok.decode(enc) == text
    nbytes = D.token_byte_lengths(tok)
    assert int(nbytes[enc].sum()) == len(text.encode("utf-8"))
    assert all(nbytes[i] == 0 for i in ids.values())
    assert tok.to_str() == D.train_tokenizer(docs, 300).to_str()      # deterministic


def test_packed_loader_order_ranks_and_resume():
    tokens = np.arange(1000, dtype=np.int32)
    one = D.PackedLoader(tokens, seq_len=10, batch_size=4, seed=7)
    x, y = one.next()
    assert x.shape == (4, 10) and torch.equal(y[:, :-1], x[:, 1:])
    ranks = [D.PackedLoader(tokens, 10, 2, seed=7, rank=r, world=2) for r in range(2)]
    fresh = D.PackedLoader(tokens, 10, 4, seed=7)
    for _ in range(30):                              # across epoch boundaries too
        xa, _ = fresh.next()
        xr = torch.cat([r.next()[0] for r in ranks])
        assert torch.equal(xa, xr)
    state = fresh.state_dict()
    later = [fresh.next()[0] for _ in range(5)]
    again = D.PackedLoader(tokens, 10, 4, seed=7)
    again.load_state_dict(state)
    assert all(torch.equal(a, again.next()[0]) for a in later)
    other = D.PackedLoader(tokens, 10, 4, seed=8)
    assert not torch.equal(other.next()[0], D.PackedLoader(tokens, 10, 4, seed=7).next()[0])
    with pytest.raises(ValueError, match="resume"):
        D.PackedLoader(tokens, 12, 4, seed=7).load_state_dict(state)


def test_eval_windows_fixed():
    tokens = np.arange(500, dtype=np.int32)
    w = D.eval_windows(tokens, 16, 8)
    assert w.shape == (8, 17) and torch.equal(w, D.eval_windows(tokens, 16, 8))
