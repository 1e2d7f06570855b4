"""The engine loop: one thread owns the (not thread-safe) engine.

HTTP handlers never touch the engine. They call `submit` / `abort`, which put commands on a thread-safe queue; the
loop thread drains the queue between steps (admitting requests with `add_request`, aborting), runs `engine.step()`
while anything is unfinished, and hands every event to the request's sink — a callable the handler supplied,
which typically does `loop.call_soon_threadsafe(queue.put_nowait, event)` onto an asyncio queue.

Events a sink receives, in order:
    Accepted(request_id)                         the engine took the request (add_request succeeded)
    Scored(request_id, entries)                  the prompt's log-probabilities, when asked for (`scoring`)
    StepOutput                                   the engine's output of every step that produced something for it
    Completion                                   it finished (the engine's, stats included)
or a single Failed(request_id, status, message) instead (bad input rejected by the engine: 400; anything else: 500).

A request whose sink raises or whose client is gone is aborted; an exception inside `engine.step()` fails every
request in flight with a 500 and the loop carries on, so no request can stop the server.

Threads. The loop thread runs its torch ops with `threads` intra-op threads: $DSV41_ENGINE_THREADS when set (any
device; 0: torch's setting), else 1 for a CPU engine and torch's setting for a GPU one. Once the main thread has
run a parallel torch op (building the model does), a second thread's parallel regions get an OpenMP team of their
own, the teams together outnumber the cores, and libgomp stops spinning between regions: on a 2-core machine the
same engine step took 2-2.6 x longer in the loop thread than in the main thread (tiny model: a 64-token prefill
1.0-1.2 s vs 0.4-0.6 s, 8 rows of decode 10.5 s vs 4.1 s), and with one thread there 0.5-0.7 s and 3.7-3.8 s
(measured 2026-12-07h; the model's ops are small, so one thread loses little). On a GPU the loop's host work is
mostly launches; whether its few parallel CPU ops pay the same cost is not measured (on an H100 host the server's
idle TTFT was 812 ms where the engine in the main thread took 550 ms): `DSV41_ENGINE_THREADS=1` against unset is
that comparison.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsv41.engine.engine import Completion

log = logging.getLogger("dsv41.server")


@dataclass
class Accepted:
    request_id: str


@dataclass
class Scored:
    request_id: str
    entries: list


@dataclass
class Failed:
    request_id: str
    status: int
    message: str


class EngineRunner:
    def __init__(self, engine, metrics, idle_poll_s: float = 0.05, kv_refresh_s: float = 0.25,
                 threads: int | None = None):
        self.engine, self.metrics = engine, metrics
        if threads is None:
            env = os.environ.get("DSV41_ENGINE_THREADS")
            cpu = getattr(engine, "device", torch.device("cpu")).type == "cpu"
            threads = int(env) if env is not None else (1 if cpu else 0)
        self.threads = threads                               # 0: torch's setting
        self.idle_poll_s, self.kv_refresh_s = idle_poll_s, kv_refresh_s
        self._cmds: queue.Queue = queue.Queue()
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_kv = 0.0
        # read by other threads (plain ints: atomic enough for monitoring)
        self.n_running = self.n_waiting = self.n_steps = self.n_aborted = self.n_step_failures = 0

    # ---------------------------------------------------------------- any thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put((lambda: None,))                          # wake the loop
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt, params, request_id: str, sink: Callable[[Any], None], score: int | None = None,
               generate: bool = True, images: tuple | None = None) -> None:
        """Queue a request; `score`: also compute the prompt's log-probabilities with that many alternatives;
        `generate=False`: only score (the request then completes with no output); `images`: the prompt's image
        records and token types (`Engine.add_request`)."""
        self._cmds.put((self._add, prompt, params, request_id, sink, score, generate, images))

    def abort(self, request_id: str) -> None:
        self._cmds.put((self._abort, request_id))

    # ---------------------------------------------------------------- loop thread
    def _loop(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)              # this thread's own setting (module docstring)
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._gauges()
            except Exception:                                   # never let the loop die
                log.error("engine loop error:\n%s", traceback.format_exc())
                time.sleep(0.01)
        self._fail_all(503, "the server is shutting down")
        self._drain(block=False)                                # answer whatever is still queued

    def _drain(self, block: bool) -> None:
        """Run the queued commands (a method of the loop thread and its arguments); with `block`, wait up to
        `idle_poll_s` for the first."""
        while True:
            try:
                cmd = self._cmds.get(timeout=self.idle_poll_s) if block else self._cmds.get_nowait()
            except queue.Empty:
                return
            block = False
            cmd[0](*cmd[1:])

    def _add(self, prompt, params, rid: str, sink, score: int | None, generate: bool, images) -> None:
        if self._stop.is_set():
            self._send(sink, Failed(rid, 503, "the server is shutting down"))
            return
        try:
            scored = None if score is None else Scored(rid, self.engine.score_prompt(prompt, score))
            if not generate:
                done = Completion(rid, list(prompt), [], "", "length", {"prompt_tokens": len(prompt)}, [])
                for ev in (Accepted(rid), scored, done):
                    if ev is not None:
                        self._send(sink, ev)
                return
            self.engine.add_request(prompt, params, request_id=rid, **({} if images is None else {"images": images}))
        except ValueError as e:
            self._send(sink, Failed(rid, 400, str(e)))
            return
        except Exception as e:
            log.error("add_request failed:\n%s", traceback.format_exc())
            self._send(sink, Failed(rid, 500, f"internal error while admitting the request: {type(e).__name__}"))
            return
        self._sinks[rid] = sink
        if not (self._send(sink, Accepted(rid)) and (scored is None or self._send(sink, scored))):
            self._abort(rid)

    def _abort(self, rid: str) -> None:
        if self._sinks.pop(rid, None) is not None:
            self.engine.abort(rid)
            self.n_aborted += 1
            self.metrics.aborted.inc()
        self.engine.finished.pop(rid, None)

    def _fail_all(self, status: int, message: str) -> None:
        """Every request in flight gets `Failed` (its engine request aborted)."""
        for rid, sink in self._sinks.items():
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            self.engine.finished.pop(rid, None)
            self._send(sink, Failed(rid, status, message))
        self._sinks.clear()

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            self.n_step_failures += 1
            log.error("engine step failed; failing every request in flight:\n%s", traceback.format_exc())
            self._fail_all(500, f"internal engine error: {type(e).__name__}: {e}")
            return
        self.n_steps += 1
        self.metrics.observe_step(len(self.engine.running) + sum(1 for o in outs if o.finished),
                                  getattr(self.engine, "last_step_cost", None))
        for o in outs:
            rid = o.request_id
            sink = self._sinks.get(rid)
            if sink is None:                                    # aborted meanwhile: forget it once finished
                self.engine.finished.pop(rid, None)
                continue
            ok = self._send(sink, o)
            if o.finished:
                self._finish(rid, sink)
            elif not ok:
                self._abort(rid)

    def _finish(self, rid: str, sink) -> None:
        self._sinks.pop(rid, None)
        try:
            comp = self.engine.completion(rid)
        except Exception:
            log.error("completion(%s) failed:\n%s", rid, traceback.format_exc())
            self._send(sink, Failed(rid, 500, "internal error while finishing the request"))
            return
        finally:
            self.engine.finished.pop(rid, None)
        self.metrics.observe_completion(comp)
        self._send(sink, comp)

    def _gauges(self) -> None:
        self.n_running, self.n_waiting = len(self.engine.running), len(self.engine.waiting)
        now = time.monotonic()
        if now - self._last_kv < self.kv_refresh_s and self.engine.has_unfinished():
            return
        self._last_kv = now
        self.metrics.observe_engine(self.n_running, self.n_waiting, kv_in_use(self.engine), store_counters(self.engine))

    @staticmethod
    def _send(sink, event) -> bool:
        try:
            sink(event)
            return True
        except Exception:
            return False


def kv_in_use(engine) -> dict[str, int]:
    """KV bytes the live sequences hold, by kind (global entries, SWA rings, compressor carry), plus the packed
    pool's allocated global pages."""
    out = {"global": 0, "swa": 0, "pending": 0}
    pool = engine.pool
    for s in engine.running:                            # running sequences hold a pool sequence
        b = pool.seq_bytes(s.sid)
        out["global"] += int(b.get("global_entries_bytes", b.get("global_bytes", 0)))
        out["swa"] += int(b.get("swa_bytes", 0))
        out["pending"] += int(b.get("pending_bytes", 0))
    if pool.packed:
        out["global_allocated"] = int(pool.pool_bytes().get("global_allocated_bytes", 0))
    return out


def store_counters(engine) -> dict[str, float]:
    """The prefix cache's flat counters (`PrefixCache.metrics()`), when the engine has a prefix cache."""
    if engine.prefix_cache is None:
        return {}
    try:                                                # a store that cannot answer leaves its gauges as they were
        return {str(k): float(v) for k, v in engine.prefix_cache.metrics().items()}
    except Exception:
        return {}
