"""Checks every generation request goes through before it reaches the engine: the body (size, JSON), the model
name, the prompt's text and token ids (the completion length the context leaves is `OpenAIServing.max_tokens`).
Each failure is an `APIError` naming the offending field."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from dsv41.engine.tokenizer import Tokenizer
from dsv41.server.protocol import APIError, bad_request
from dsv41.server.state import ServerSettings


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON, refusing bodies over `max_bytes` before reading them whole."""
    too_large = APIError(413, f"request body over {max_bytes} bytes", code="body_too_large")
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > max_bytes:
        raise too_large
    chunks, size = [], 0
    try:
        async for c in request.stream():
            size += len(c)
            if size > max_bytes:
                raise too_large
            chunks.append(c)
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the request body") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object", code="invalid_json")

    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        return json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise bad_request("malformed JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"malformed JSON: {str(e)[:200]}", code="invalid_json") from None


def check_model(settings: ServerSettings, name: str) -> None:
    if name != settings.model_name and name not in settings.aliases:
        raise APIError(404, f"The model `{name[:200]}` does not exist; this server serves "
                            f"`{settings.model_name}`", param="model", code="model_not_found")


def check_text(text: str, param: str) -> str:
    """`text` when it is valid Unicode (JSON escapes can smuggle in lone surrogates), else a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param}: text is not valid Unicode (lone surrogate)", param) from None
    return text


def encode(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    """Prompt text -> token ids, BOS first when the tokenizer has one."""
    bos = tokenizer.bos_id
    return ([bos] if bos is not None else []) + list(tokenizer.encode(check_text(text, param)))


def check_ids(ids: list[int], vocab: int, param: str) -> None:
    if not ids:
        raise bad_request(f"{param}: the prompt is empty", param)
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"{param}: token ids must be in [0, {vocab})", param, "invalid_token_id")

