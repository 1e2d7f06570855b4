"""File-system primitives of the persistent tier (docs/system.md §4), for several processes sharing one directory.

Atomic replacement: the bytes go to a temp file `.tmp.<key>.<pid>.<random>` in the same directory, which is
written, fsync'd, renamed over the final name and the directory fsync'd: a reader sees either no file or a complete
one, from any process. A temp file whose writer is gone (dead pid, or older than a bound, against pid reuse) is
stale. An advisory `fcntl.flock` on a lock file serialises the processes that evict.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import time
from contextlib import contextmanager, suppress
from pathlib import Path

TMP_PREFIX = ".tmp."


def tmp_name(key: str) -> str:
    """A fresh temp file name for a write of `key` by this process."""
    return f"{TMP_PREFIX}{key}.{os.getpid()}.{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:                           # alive, another user's
        return True
    except OSError:                                   # ProcessLookupError: gone
        return False
    return True


def is_stale_tmp(name: str, mtime: float, stale_s: float) -> bool:
    """Whether temp file `name` (modified at `mtime`, wall clock) is a leftover: of this process (a write in flight
    is the caller's to exclude), of a dead process, or older than `stale_s`."""
    parts = name[len(TMP_PREFIX):].split(".")
    try:
        pid = int(parts[1])
    except (IndexError, ValueError):
        return time.time() - mtime > stale_s
    if pid == os.getpid():
        return True                                   # ours but not in flight: a leftover
    return not _pid_alive(pid) or time.time() - mtime > stale_s


def read_file(path: Path) -> tuple[bytes, int]:
    """(contents, inode) of a file; OSError (FileNotFoundError when it is gone) otherwise."""
    with open(path, "rb") as f:
        return f.read(), os.fstat(f.fileno()).st_ino


def _write_all(write, fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while len(mv):
        n = write(fd, mv)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        mv = mv[n:]


def write_atomic(tmp: Path, final: Path, parts, durable: bool, write=os.write, fsync=os.fsync) -> None:
    """Write the parts to the new file `tmp` (fsync'd when durable) and rename it over `final`. OSError on a
    failure, after which `tmp` is gone. `write` / `fsync`: `os.write` / `os.fsync`, or fault-injecting stand-ins."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            for part in parts:
                _write_all(write, fd, part)
            if durable:
                fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def fsync_dir(path: Path, fsync=os.fsync) -> OSError | None:
    """Make a rename in directory `path` durable; the error, if the file system reports one it supports."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            return e
    finally:
        os.close(fd)
    return None


@contextmanager
def flock(path: Path, on_error):
    """An advisory exclusive lock on file `path` for the block; a failure to lock (`on_error(exc)` is told) only
    loses the mutual exclusion, never the block."""
    fd = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        on_error(e)
    try:
        yield
    finally:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
