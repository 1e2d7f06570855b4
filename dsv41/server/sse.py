"""Server-sent events: the framing of a streamed response's chunks, and a response that always runs its cleanup."""

from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from dsv41.server.protocol import APIError

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def error_sse(message: str, status: int) -> str:
    """A failure inside a stream (the headers are gone), as an OpenAI error event."""
    return sse(APIError(status, message).body())


class SSEResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` when it is done, whatever happened."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
