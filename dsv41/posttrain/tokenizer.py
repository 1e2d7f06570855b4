"""The post-training tokenizer: one id per character, the V4.1 chat special tokens as single ids, and the effort
line's fixed text as two ids (docs/system.md §7).

Why not the pretraining BPE: the tasks are digit arithmetic and letter chasing, where a merged "37" would hide the
digits the model must add; and a prompt's effort line would cost ~90 character ids without its two phrase ids.
The vocabulary is fixed (nothing to train, so every run, teacher and student shares it bit for bit): the special
tokens (BOS / EOS / PAD are ids 0 / 1 / 2, the config's `engram_pad_id`), the two phrases, newline and printable
ASCII, reserved ids up to the model's vocabulary of 128 (every id the model can sample must be one the tokenizer and
Engram's token map know), and `<|image|>` / `<|draft|>` last (the image placeholder and the DSpark noise input,
at V-2 and V-1 as in the other presets).
Anything else encodes as `<|unk|>`. It is a Hugging Face `tokenizers` file, so the engine, the server (which picks
the official chat template because the tokenizer knows `<｜User｜>`) and Engram's token map read it as they read any
checkpoint's tokenizer.json.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dsv41.engine.tokenizer import HFTokenizer
from dsv41.server.chat import ASSISTANT, EOS, OFFICIAL_EFFORT, SYSTEM, THINK_END, THINK_START, USER

BOS = "<｜begin▁of▁sentence｜>"
PAD, UNK, IMAGE, DRAFT = "<|pad|>", "<|unk|>", "<|image|>", "<|draft|>"
SPECIALS = [BOS, EOS, PAD, UNK, SYSTEM, USER, ASSISTANT, THINK_START, THINK_END]
PHRASES = list(OFFICIAL_EFFORT.split("{b}"))[:1] + [OFFICIAL_EFFORT.split("{b}")[1].rstrip("\n")]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB_SIZE = 128                             # the post preset's vocab_size: reserved ids fill the gap
TAIL = [IMAGE, DRAFT]


def build_tokenizer():
    """The `tokenizers.Tokenizer` of the module docstring."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    head = SPECIALS + PHRASES + CHARS
    reserved = [f"<|reserved_{k}|>" for k in range(VOCAB_SIZE - len(head) - len(TAIL))]
    vocab = {t: i for i, t in enumerate(head + reserved + TAIL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    pattern = "|".join(re.escape(p) for p in PHRASES) + r"|.|\n"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # the think tags are added tokens but not special ones (as in the official tokenizer): a decode that skips
    # special tokens keeps them, so the server's reasoning parser finds `</think>`
    think = (THINK_START, THINK_END)
    tok.add_special_tokens([t for t in SPECIALS if t not in think] + reserved + TAIL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in think])
    return tok


def save_tokenizer(path: str | Path) -> Path:
    """The tokenizer written to `path` through a temporary file and a rename, so a concurrent reader (a
    data-parallel rank, an evaluation worker) never sees a partial file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    build_tokenizer().save(str(tmp))
    os.replace(tmp, path)
    return path


class PostTokenizer(HFTokenizer):
    """The engine's tokenizer interface over the file, plus the ids the checkers and the losses look for."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        if self.tok.token_to_id(THINK_END) is None or self.bos_id != 0 or self.eos_id != 1:
            raise ValueError(f"{path}: not the post-training tokenizer (no {THINK_END} / BOS 0 / EOS 1)")
        self.think_end_id = self.tok.token_to_id(THINK_END)
        self.think_start_id = self.tok.token_to_id(THINK_START)
        self.pad_id = self.tok.token_to_id(PAD)
        self.path = Path(path)


def load_post_tokenizer(directory: str | Path) -> PostTokenizer:
    """The tokenizer.json in `directory`, written there first when missing."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tokenizer(path)
    return PostTokenizer(path)
