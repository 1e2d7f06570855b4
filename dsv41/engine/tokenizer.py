"""Tokenizers the engine accepts: a byte-level fallback (for tests and random models) and a Hugging Face
`tokenizers` file (the trained tiny model's, or an official checkpoint's tokenizer.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """What the engine and the server ask of a tokenizer; bos_id / eos_id are None when it has none."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer(Tokenizer):
    """ids 0/1/2 = BOS/EOS/PAD, byte b -> 3 + b. Needs vocab_size >= 259."""

    bos_id, eos_id, pad_id = 0, 1, 2

    def __init__(self, vocab_size: int = 259):
        if vocab_size < 259:
            raise ValueError(f"a byte tokenizer needs a vocabulary of >= 259 ids, the model has {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [3 + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A `tokenizers` JSON file. BOS/EOS are looked up by their usual spellings."""

    BOS = ("<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<bos>", "<s>", "<|bos|>")
    EOS = ("<｜end▁of▁sentence｜>", "<|end_of_text|>", "<eos>", "</s>", "<|eos|>", "<|endoftext|>")

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = {n: self.tok.token_to_id(n) for n in self.BOS + self.EOS}
        self.bos_id = next((ids[n] for n in self.BOS if ids[n] is not None), None)
        self.eos_id = next((ids[n] for n in self.EOS if ids[n] is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int) -> Tokenizer:
    p = None if checkpoint is None else Path(checkpoint) / "tokenizer.json"
    if p is not None and p.is_file():
        return HFTokenizer(p)
    return ByteTokenizer(vocab_size)
