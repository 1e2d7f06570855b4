"""The persistent tier's entry file (docs/system.md §4): one file `<key>.kv` per prefix-unit key (64 lowercase hex),
little-endian, checksummed so that a damaged, truncated, renamed or foreign file is never served:

    offset size  field
    0      8     magic b"DSV41KV\\0"
    8      2     format version (u16) = 1
    10     2     flags (u16) = 0
    12     4     meta length M (u32, at most 65536)
    16     32    fingerprint (the 32 bytes of the namespace's SHA-256 fingerprint)
    48     32    key (the 32 bytes of the file's own key: a renamed or copied file is detected)
    80     8     payload length N (u64)
    88     8     created (f64, the store clock at write time)
    96     32    SHA-256 of meta || payload
    128    4     CRC-32 of bytes 0..127 (header checksum)
    132    4     reserved (0)
    136    M     meta (small, caller-defined; the prefix manager keeps its boundary index there)
    136+M  N     payload

The header alone (CRC, key, lengths against the file size) is what a directory scan checks; a read checks the
whole file (the SHA-256 and the fingerprint too).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import NamedTuple

from dsv41.kv.prefix import check_key

MAGIC = b"DSV41KV\x00"
FORMAT_VERSION = 1
MAX_META = 1 << 16
_HEAD = struct.Struct("<8sHHI32s32sQd32s")        # 128 bytes
_TAIL = struct.Struct("<II")                      # header CRC-32, reserved
HEADER_BYTES = _HEAD.size + _TAIL.size            # 136


class BadEntry(Exception):
    """An entry that must not be served; `counter` says how it is counted when removed, `ino` which file it was
    (None: not known, so it is not removed)."""

    def __init__(self, reason: str, counter: str = "corrupt_removed", ino: int | None = None):
        super().__init__(reason)
        self.reason, self.counter, self.ino = reason, counter, ino


class Header(NamedTuple):
    meta_len: int
    payload_len: int
    created: float
    fingerprint: bytes
    digest: bytes


def fingerprint_bytes(fp: str | None) -> bytes:
    """The 32 header bytes of a fingerprint (zeros for none)."""
    return bytes(32) if fp is None else bytes.fromhex(check_key(fp))


def entry_header(key: str, fingerprint: bytes, meta: bytes, payload, created: float) -> bytes:
    """The HEADER_BYTES bytes that precede meta and payload in the entry file of `key`."""
    h = hashlib.sha256(meta)
    h.update(payload)
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(meta), fingerprint, bytes.fromhex(key), len(payload), created,
                      h.digest())
    return head + _TAIL.pack(zlib.crc32(head), 0)


def parse_header(head: bytes, key: str | None = None, file_size: int | None = None) -> Header:
    """The header of an entry; BadEntry if it is not one (or does not belong to `key`, or disagrees with
    `file_size`)."""
    if len(head) < HEADER_BYTES:
        raise BadEntry(f"truncated header ({len(head)} of {HEADER_BYTES} bytes)")
    magic, version, _flags, m_len, fp, k, n_len, created, digest = _HEAD.unpack_from(head)
    crc, _ = _TAIL.unpack_from(head, _HEAD.size)
    size = HEADER_BYTES + m_len + n_len
    for broken, reason in (                           # checked in this order
            (magic != MAGIC, "bad magic"),
            (zlib.crc32(head[:_HEAD.size]) != crc, "header checksum mismatch"),
            (version != FORMAT_VERSION, f"format version {version}, this reader knows {FORMAT_VERSION}"),
            (m_len > MAX_META, "meta too long"),
            (key is not None and k != bytes.fromhex(key), "header key differs from the file name"),
            (file_size is not None and file_size != size,
             f"length mismatch (file {file_size} bytes, header says {size})")):
        if broken:
            raise BadEntry(reason)
    return Header(m_len, n_len, created, fp, digest)


def parse_entry(data: bytes, key: str | None = None, fingerprint: str | None = None) -> tuple[Header, bytes, bytes]:
    """(header, meta, payload) of a whole entry file after every check; BadEntry otherwise (counter
    `foreign_removed` when only the fingerprint differs from the expected one)."""
    head = parse_header(data, key, len(data))
    body = memoryview(data)[HEADER_BYTES:]
    if hashlib.sha256(body).digest() != head.digest:
        raise BadEntry("payload checksum mismatch")
    if fingerprint is not None and head.fingerprint != fingerprint_bytes(fingerprint):
        raise BadEntry("entry of another fingerprint", "foreign_removed")
    return head, bytes(body[:head.meta_len]), bytes(body[head.meta_len:])
