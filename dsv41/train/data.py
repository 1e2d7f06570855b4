"""Training data: the corpus, its train/validation split, the byte-level BPE tokenizer and packed sequences.

Default corpus (no download): the Python standard library's own `*.py` sources of the interpreter that runs the
trainer (`sysconfig.get_paths()["stdlib"]`), about 12 MB of real code that is always present. Directories named
`test`, `tests`, `idle_test`, `site-packages` and `__pycache__` are skipped: the test suites are half of the tree
and hold deliberately odd files (bad encodings, syntax-error fixtures, huge generated tables) that teach a tiny
model little; third-party packages are not the standard library and differ from machine to machine.

`--data PATH` takes a text file, a directory (every `.txt .md .rst .py .jsonl` file under it, hidden entries
skipped) or a JSONL file whose lines are objects with a "text" field. A single plain-text file is cut into
documents of `LINES_PER_DOC` lines so that it can be split.

Split: by document, deterministically from the SHA-256 of the document's name (its path relative to the corpus
root, plus `:line` for JSONL records and `:part` for cut files), so the same file is always on the same side, on
every machine and whatever else the corpus holds. A small corpus (a dozen files, one file) often gets no
validation document that way, or one that is most of the text or too short to evaluate on; then the split is by
text instead: validation is the last `val_fraction` of every document's characters (cut at a line start; more
when that is less than one evaluation window, `min_val_chars`), training the rest, and the corpus says so in its
`note`. Only a corpus too small for both sides (a file of a few bytes) is refused.

Tokenizer: byte-level BPE trained with Hugging Face `tokenizers` on the training split only. Ids 0, 1, 2 are
`<|bos|>`, `<|eos|>`, `<|pad|>` (the config's `engram_pad_id` is 2); the last two ids are `<|image|>` (image
placeholder) and `<|draft|>` (the DSpark noise input), added after training so that a vocabulary that reaches
the model's size puts them at V-2 and V-1, where the tiny and debug presets expect them.

Packing: each document becomes `<|bos|> tokens <|eos|>`; documents are concatenated (sorted by name) into one
stream per split, cut into windows of `seq_len + 1` tokens (inputs are the first `seq_len`, targets the last
`seq_len`). Windows cross document boundaries (no attention masking between documents, as usual for packed
pretraining). The training order is a seeded permutation of the windows per epoch; the loader's position
(epoch, cursor) is its whole state, so a run resumes exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")      # ids 0, 1, 2
EXTRA_SPECIAL_TOKENS = ("<|image|>", "<|draft|>")       # appended after training: ids V-2, V-1 when saturated
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".jsonl"})
LINES_PER_DOC = 400
DEFAULT_VAL_FRACTION = 0.05
SPLIT_SALT = "dsv41-split-v1:"
MAX_VAL_SHARE = 0.5             # of the characters: validation's most (a split by name that gives it more is
                                # replaced by the tail split; a corpus that would need more is refused)
CHARS_PER_TOKEN = 6             # validation reserves this many characters per token of a window: byte-level BPE
                                # at the presets' vocabularies measured 3.5 on the stdlib and up to ~4 on a small
                                # corpus, whose tokenizer has learnt its text


@dataclass
class Document:
    name: str           # unique within the corpus; the split hashes it
    text: str


@dataclass
class Corpus:
    name: str
    train: list[Document]
    val: list[Document]
    provenance: dict
    note: str = ""      # what was split, when it is not the split by name (a line for the user)


# ------------------------------------------------------------------------------------------------ split

def split_of(name: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
    """'val' or 'train' for a document name: the first 8 bytes of SHA-256(salt + name) as a fraction of 2^64."""
    h = hashlib.sha256((SPLIT_SALT + name).encode("utf-8")).digest()
    return "val" if int.from_bytes(h[:8], "big") / 2.0 ** 64 < val_fraction else "train"


def min_val_chars(seq_len: int) -> int:
    """The characters validation needs for one evaluation window of `seq_len + 1` tokens."""
    return (seq_len + 1) * CHARS_PER_TOKEN


def _chars(docs: list[Document]) -> int:
    return sum(len(d.text) for d in docs)


def tail_split(docs: list[Document], share: float) -> tuple[list[Document], list[Document]]:
    """(train, val): the head and the last `share` of every document's characters (its tail, named `name:tail`),
    cut at the line start before that point unless that would double the tail; blank halves dropped."""
    train, val = [], []
    for d in docs:
        want = math.ceil(share * len(d.text))
        cut = len(d.text) - want
        k = d.text.rfind("\n", 0, cut) + 1
        k = cut if k == 0 or cut - k > want else k
        if d.text[:k].strip():
            train.append(Document(d.name, d.text[:k]))
        if d.text[k:].strip():
            val.append(Document(f"{d.name}:tail", d.text[k:]))
    return train, val


def _split(docs: list[Document], val_fraction: float, min_chars: int, where: str):
    """(train, val, share): the split by name (share None), or the tail split of `share` when that one leaves
    validation empty, short of `min_chars` or larger than training (module docstring); ValueError when the text
    is too little for both sides."""
    train = [d for d in docs if split_of(d.name, val_fraction) == "train"]
    val = [d for d in docs if split_of(d.name, val_fraction) == "val"]
    total = _chars(docs)
    if train and val and min_chars <= _chars(val) <= MAX_VAL_SHARE * total:
        return train, val, None
    share = max(val_fraction, min_chars / max(total, 1))
    if share <= MAX_VAL_SHARE:
        train, val = tail_split(docs, share)
    if share > MAX_VAL_SHARE or not train or not val:
        size = f"{len(docs)} non-empty document{'s' * (len(docs) != 1)}, {total:,} characters " \
               f"({sum(len(d.text.encode()) for d in docs):,} bytes)"
        raise ValueError(f"corpus {where!r}: {size}: too little text to split into training and validation; "
                         f"validation needs at least {max(min_chars, 1):,} characters (one evaluation window) and "
                         f"training as many again: give at least {max(2 * min_chars, 2):,} characters of text"
                         + (", or a shorter --seq-len" if min_chars else ""))
    return train, val, share


# ------------------------------------------------------------------------------------------------ sources

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def stdlib_documents(root: Path | None = None) -> list[Document]:
    """Every `*.py` under the standard library, test and third-party directories skipped, sorted by name."""
    root = stdlib_root() if root is None else Path(root)
    rels = [p.relative_to(root) for p in root.rglob("*.py") if p.is_file()]
    return sorted((Document(r.as_posix(), _read_text(root / r)) for r in rels
                   if not STDLIB_SKIP_DIRS.intersection(r.parts[:-1])), key=lambda d: d.name)


def _jsonl_documents(path: Path, name: str) -> list[Document]:
    docs = []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--data {path}: line {i} is not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ValueError(f"--data {path}: line {i} has no string field 'text'")
        docs.append(Document(f"{name}:{i}", rec["text"]))
    return docs


def _file_documents(p: Path, name: str, cut: bool) -> list[Document]:
    """A JSONL file's records, or the file's text as one document (`cut`: as pieces of LINES_PER_DOC lines)."""
    if p.suffix == ".jsonl":
        return _jsonl_documents(p, name)
    if not cut:
        return [Document(name, _read_text(p))]
    lines = _read_text(p).splitlines(keepends=True)
    return [Document(f"{name}:{k // LINES_PER_DOC}", "".join(lines[k:k + LINES_PER_DOC]))
            for k in range(0, max(len(lines), 1), LINES_PER_DOC)]


def path_documents(path: str | Path) -> list[Document]:
    """Documents of a user's `--data PATH` (see the module docstring)."""
    path = Path(path)
    if path.is_file():
        return _file_documents(path, path.name, cut=True)
    if not path.is_dir():
        raise ValueError(f"--data {str(path)!r}: no such file or directory")
    rels = [p.relative_to(path) for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return [d for r in rels if not any(part.startswith(".") for part in r.parts)
            for d in _file_documents(path / r, r.as_posix(), cut=False)]


def load_corpus(data: str | Path | None = None, val_fraction: float = DEFAULT_VAL_FRACTION,
                min_chars: int = 0) -> Corpus:
    """The default stdlib corpus (data None) or a user's path, split by document name or, for a small corpus, by
    the tails of its documents (module docstring); `min_chars`: the characters validation must hold at least
    (the trainer asks for one evaluation window, `min_val_chars`)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if data is None:
        docs, name, where = stdlib_documents(), "python-stdlib-{}.{}.{}".format(*sys.version_info), str(stdlib_root())
    else:
        docs, name, where = path_documents(data), Path(data).name, str(Path(data).resolve())
    docs = [d for d in docs if d.text.strip()]
    train, val, share = _split(docs, val_fraction, min_chars, where)
    split, note = f"sha256('{SPLIT_SALT}' + document name)[:8] / 2^64 < {val_fraction} -> validation", ""
    if share is not None:
        split = f"by text: the last {share:.4g} of every document's characters -> validation"
        named = [d for d in docs if split_of(d.name, val_fraction) == "val"]
        why = "none of them" if not named else "all of them" if len(named) == len(docs) else (
            f"{len(named)} of them, {_chars(named):,} characters: "
            + ("too few for one evaluation window" if _chars(named) < min_chars else "most of the text"))
        note = (f"split: {len(docs)} document{'s' * (len(docs) != 1)}; by name validation would get {why}, so "
                f"validation is the last {share:.1%} of each document's text ({_chars(val):,} of {_chars(docs):,} "
                f"characters) and training the rest")
    return Corpus(name, train, val, {
        "corpus": name, "root": where, "python": sys.version.split()[0], "split": split,
        "val_fraction": val_fraction, "train_documents": len(train), "val_documents": len(val),
        "train_bytes": sum(len(d.text.encode()) for d in train), "val_bytes": sum(len(d.text.encode()) for d in val),
        "train_listing_sha256": hashlib.sha256("\n".join(d.name for d in train).encode()).hexdigest()[:16],
        "skipped_dirs": sorted(STDLIB_SKIP_DIRS) if data is None else []}, note)


# ------------------------------------------------------------------------------------------------ tokenizer

def train_tokenizer(docs: list[Document], vocab_size: int):
    """Byte-level BPE with the special tokens of the module docstring; `vocab_size` counts them all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    n_special = len(SPECIAL_TOKENS) + len(EXTRA_SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte symbols + {n_special} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(EXTRA_SPECIAL_TOKENS), min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    tok.add_special_tokens(list(EXTRA_SPECIAL_TOKENS))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, PAD_ID]
    return tok


def special_ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + EXTRA_SPECIAL_TOKENS}


def token_byte_lengths(tok) -> np.ndarray:
    """UTF-8 bytes each id stands for (0 for special tokens): byte-level BPE writes one symbol per byte."""
    specials = set(special_ids(tok).values())
    n = tok.get_vocab_size(with_added_tokens=True)
    return np.array([0 if i in specials else len(tok.id_to_token(i)) for i in range(n)], dtype=np.int64)


def encode_documents(tok, docs: list[Document]) -> np.ndarray:
    """One int32 stream: <|bos|> doc <|eos|> for every document, in the given order."""
    parts = [np.asarray([BOS_ID] + enc.ids + [EOS_ID], dtype=np.int32)
             for enc in tok.encode_batch([d.text for d in docs], add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# ------------------------------------------------------------------------------------------------ packing

class PackedLoader:
    """Windows of `seq_len + 1` tokens of a stream, served in global batches of `batch_size * world` windows.

    Rank r takes windows [r*B, (r+1)*B) of each global batch, so W processes with batch B see exactly the data
    of one process with batch W*B. Training order: a permutation of all windows, drawn per epoch from
    `numpy.random.default_rng([seed, epoch])`; an incomplete last global batch is dropped."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world: int = 1):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
        self.tokens = np.asarray(tokens)
        self.seq_len, self.batch_size, self.seed, self.rank, self.world = seq_len, batch_size, seed, rank, world
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < batch_size * world:
            raise ValueError(f"the stream has {len(self.tokens)} tokens: {self.n_windows} windows of {seq_len}+1, "
                             f"fewer than one global batch of {batch_size * world}; use a shorter --seq-len, a "
                             f"smaller --batch-size or more data")
        self.epoch, self.cursor = 0, 0
        self._order = (-1, None)                       # (epoch, its permutation), drawn once per epoch

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch `next()` would return, without advancing."""
        if self._order[0] != self.epoch:
            self._order = (self.epoch, np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows))
        B, T = self.batch_size, self.seq_len
        mine = self._order[1][self.cursor + self.rank * B:self.cursor + (self.rank + 1) * B]
        w = torch.from_numpy(np.stack([self.tokens[i * T:i * T + T + 1] for i in mine]).astype(np.int64))
        return w[:, :-1], w[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B,T], targets [B,T]) int64."""
        batch = self.peek()
        glob = self.batch_size * self.world
        self.cursor += glob
        if self.cursor + glob > self.n_windows:
            self.epoch, self.cursor = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.batch_size * self.world, "n_windows": self.n_windows}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for k in ("seed", "seq_len", "global_batch", "n_windows"):
            if state[k] != mine[k]:
                raise ValueError(f"cannot resume the data order: saved {k}={state[k]}, this run has {mine[k]}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def eval_windows(tokens: np.ndarray, seq_len: int, n_windows: int) -> torch.Tensor:
    """`n_windows` windows of `seq_len + 1` spread evenly over a validation stream (all of them if fewer):
    a fixed evaluation set. [N, T+1] int64."""
    total = (len(tokens) - 1) // seq_len
    if total < 1:
        raise ValueError(f"the validation stream has {len(tokens)} tokens, fewer than one window of {seq_len}+1")
    idx = np.unique(np.linspace(0, total - 1, num=min(n_windows, total)).round().astype(np.int64))
    return torch.from_numpy(np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in idx]).astype(np.int64))
