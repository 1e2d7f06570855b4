"""A throwaway redis-server for tests and benchmarks (not a test module).

    with redis_server() as srv:          # installs redis-server (apt-get) if missing; SkipUnavailable if impossible
        url = srv.url                    # redis://127.0.0.1:PORT/0 on a free loopback port, no persistence
        srv.stop(); srv.start()          # stop / restart on the same port (fault injection)

`unavailable_reason()` says why Redis cannot be had (None when it can): redis-server missing and not installable
(no root / sudo, no apt-get, apt failing), or redis-py missing and not installable. The pytest fixture that uses
this skips with that reason; nothing else makes the Redis tests skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

_reason_cache: list = []


class SkipUnavailable(RuntimeError):
    pass


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, text=True,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, str(e)
    return p.returncode, p.stdout[-400:]


def _install_redis_server() -> str | None:
    """apt-get install redis-server; None on success, else why not."""
    if os.environ.get("DSV41_NO_INSTALL") == "1":
        return "redis-server is not installed and DSV41_NO_INSTALL=1"
    if shutil.which("apt-get") is None:
        return "redis-server is not installed and apt-get is not available"
    prefix: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") and _run(["sudo", "-n", "true"], 10)[0] == 0:
            prefix = ["sudo", "-n"]
        else:
            return "redis-server is not installed and this user cannot install it (not root, no passwordless sudo)"
    rc, out = _run(prefix + ["apt-get", "update", "-qq"], 300)
    if rc:
        return f"redis-server is not installed and apt-get update failed: {out.strip()[-200:]}"
    rc, out = _run(prefix + ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "redis-server"], 600)
    if rc or shutil.which("redis-server") is None:
        return f"apt-get install redis-server failed: {out.strip()[-200:]}"
    return None


def _install_redis_py() -> str | None:
    import importlib.util
    if importlib.util.find_spec("redis") is not None:
        return None
    if os.environ.get("DSV41_NO_INSTALL") == "1":
        return "redis-py is not installed and DSV41_NO_INSTALL=1"
    rc, out = _run([sys.executable, "-m", "pip", "install", "-q", "redis"], 300)
    if rc:
        return f"redis-py is not installed and pip install redis failed: {out.strip()[-200:]}"
    import importlib
    importlib.invalidate_caches()
    try:
        importlib.import_module("redis")
    except ImportError:
        return "redis-py installed but cannot be imported"
    return None


def unavailable_reason() -> str | None:
    """None when redis-server and redis-py are usable (installing them if needed, once per process)."""
    if not _reason_cache:
        reason = None
        if shutil.which("redis-server") is None:
            reason = _install_redis_server()
        if reason is None:
            reason = _install_redis_py()
        _reason_cache.append(reason)
    return _reason_cache[0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisService:
    """One redis-server process on 127.0.0.1 (no RDB / AOF persistence, its own temp dir)."""

    def __init__(self, port: int | None = None, maxmemory: str | None = None):
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self.dir = tempfile.mkdtemp(prefix="dsv41-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, wait_s: float = 10.0) -> str:
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        args = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", self.dir, "--logfile", "",
                "--protected-mode", "yes"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "volatile-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            if _ping(self.port):
                return self.url
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {wait_s} s")

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def redis_server(maxmemory: str | None = None):
    """A started RedisService (stopped and cleaned up afterwards); SkipUnavailable with the reason when Redis
    cannot be had."""
    reason = unavailable_reason()
    if reason:
        raise SkipUnavailable(reason)
    srv = None
    for _attempt in range(3):                        # a free port can be taken between probe and bind
        srv = RedisService(maxmemory=maxmemory)
        try:
            srv.start()
            break
        except RuntimeError:
            srv.close()
            srv = None
    if srv is None:
        raise RuntimeError("could not start redis-server on a loopback port")
    try:
        yield srv
    finally:
        srv.close()
