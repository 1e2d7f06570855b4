"""A job: the engine requests of one HTTP request (one per choice), submitted to the engine loop together, their
events arriving on one asyncio queue, and the client watched while they run: a client that goes away has its
engine requests aborted, which frees their batch slots."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import Request

from dsv41.engine.sampling import SamplingParams
from dsv41.server.protocol import APIError
from dsv41.server.runner import Accepted, Done, Failed
from dsv41.server.state import ServerState


@dataclass
class Choice:
    """One engine request of a job: a choice of the response."""
    index: int                 # choice index in the response
    prompt_index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


class ClientGone(Exception):
    pass


class Job:
    def __init__(self, state: ServerState, choices: list[Choice]):
        self.state = state
        self.choices = {c.rid: c for c in choices}
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.open: set[str] = set()
        self.early: list = []
        self._get: asyncio.Task | None = None
        self._counted = 0
        self._checked = time.monotonic()

    def _sink(self, ev) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ev)     # raises once the loop is closed: the runner aborts

    async def start(self, request: Request | None) -> None:
        """Submit every choice and wait until the engine accepted them all (APIError if it refused one)."""
        st = self.state
        n = len(self.choices)
        if st.in_flight + n > st.settings.max_in_flight:
            raise APIError(429, f"the server has {st.in_flight} requests in flight (limit "
                                f"{st.settings.max_in_flight}); retry later", code="too_many_requests")
        if not st.runner.alive():
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        st.in_flight += n
        self._counted = n
        for c in self.choices.values():
            st.runner.submit(c.prompt_ids, c.params, c.rid, self._sink)
        pending = set(self.choices)
        failure: Failed | None = None
        try:
            while pending:
                ev = await self._next(request)
                if isinstance(ev, Accepted):
                    pending.discard(ev.request_id)
                    self.open.add(ev.request_id)
                elif isinstance(ev, Failed):
                    pending.discard(ev.request_id)
                    failure = failure or ev
                else:
                    self.early.append(ev)
            if failure is not None:
                raise APIError(failure.status, failure.message,
                               code="invalid_request" if failure.status == 400 else None)
        except BaseException:
            self.abort()
            raise

    async def _next(self, request: Request | None):
        """The next event; with a request, check every `disconnect_poll_s` (events flowing or not) whether the
        client went away."""
        poll = self.state.settings.disconnect_poll_s
        while True:
            if request is not None and time.monotonic() - self._checked >= poll:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone()
            if self._get is None:
                self._get = asyncio.ensure_future(self.q.get())
            done, _ = await asyncio.wait({self._get}, timeout=None if request is None else poll)
            if done:
                ev, self._get = self._get.result(), None
                return ev

    async def events(self, request: Request | None):
        """Events until every choice is done (or one fails)."""
        for ev in self.early:
            yield ev
        self.early = []
        while self.open:
            ev = await self._next(request)
            if isinstance(ev, (Done, Failed)):
                self.open.discard(ev.request_id)
            yield ev

    def abort(self) -> None:
        for rid in list(self.open):
            self.state.runner.abort(rid)
        self.open.clear()
        if self._get is not None:
            self._get.cancel()
            self._get = None

    def release(self) -> None:
        """Abort what still runs and count the job's requests out of the in-flight total (once)."""
        self.abort()
        self.state.in_flight -= self._counted
        self._counted = 0
