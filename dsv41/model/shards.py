"""Reading safetensors shards one tensor at a time through a memory map, without keeping what was read resident.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range of
the data section) and the data. `ShardReader` maps every `*.safetensors` file of a directory (private, read-only
use) and hands out zero-copy views of one tensor at a time; when the caller is done with a view, the pages it
touched (and the neighbours the kernel mapped along) are dropped from the process (`madvise(MADV_DONTNEED)`: they stay in the page cache, outside the RSS).
Loading a checkpoint this way holds the model's own storage plus one tensor's pages at a time, where a mapping
kept whole (safetensors' `safe_open`) keeps every page read so far resident until it is closed.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from pathlib import Path
from typing import Iterator

import torch

# Pages dropped on either side of a tensor as well: a read fault maps the neighbouring cached pages too (the
# kernel's fault-around, 64 KiB by default), which would otherwise stay resident. Dropping a page another open view
# still uses is harmless: the private mapping is never written, so the page is read again from the file.
_MARGIN = 1 << 20

# safetensors dtype names -> torch dtypes (those this torch build has)
_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")) if hasattr(torch, attr)}


class ShardReader:
    """The tensors of a checkpoint directory's `*.safetensors` shards: `keys()`, `info(name)` -> (dtype, shape)
    from the headers alone, and `tensor(name)` (a context manager) -> a view valid inside the block only."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"checkpoint {path}: no *.safetensors files")
        self._maps: dict[int, mmap.mmap] = {}
        self._entries: dict[str, tuple[int, torch.dtype, tuple[int, ...], int, int]] = {}
        for i, f in enumerate(self.files):
            for name, (dtype, shape, begin, end) in _header(f).items():
                if name in self._entries:
                    raise ValueError(f"checkpoint {path}: tensor {name!r} appears in two shards")
                self._entries[name] = (i, dtype, shape, begin, end)

    def keys(self) -> list[str]:
        """Tensor names in file order (shard, then position): reading them in this order reads each file once."""
        return sorted(self._entries, key=lambda n: (self._entries[n][0], self._entries[n][3]))

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        _, dtype, shape, _, _ = self._entries[name]
        return dtype, shape

    @contextlib.contextmanager
    def tensor(self, name: str) -> Iterator[torch.Tensor]:
        """A zero-copy view of tensor `name`; do not keep it (or a view of it) past the block."""
        i, dtype, shape, begin, end = self._entries[name]
        if end == begin:
            yield torch.empty(shape, dtype=dtype)
            return
        mm = self._map(i)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=begin)
        try:
            yield raw.view(dtype).view(shape)
        finally:
            del raw
            lo = max(0, begin - _MARGIN) // mmap.PAGESIZE * mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, lo, min(len(mm), end + _MARGIN) - lo)

    def _map(self, i: int) -> mmap.mmap:
        if i not in self._maps:
            with open(self.files[i], "rb") as fh:       # private mapping: writable views, the file never changes
                self._maps[i] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[i]

    def close(self) -> None:
        for mm in self._maps.values():
            with contextlib.suppress(BufferError):      # a view still alive: the map goes with it
                mm.close()
        self._maps.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header(f: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, begin, end) with absolute byte offsets; ValueError for a malformed file."""
    with open(f, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{f}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{f}: not a safetensors file ({e})") from None
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{f}: tensor {name!r} has dtype {meta['dtype']}, which this torch cannot read")
        begin, end = meta["data_offsets"]
        out[name] = (_DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin, base + end)
    return out
