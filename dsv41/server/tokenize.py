"""vLLM's tokenizer endpoints, which evaluation harnesses use to count tokens with the server's own tokenizer
(`lm-evaluation-harness`'s remote tokenizer backend):

    POST /tokenize        {"prompt": text, "add_special_tokens": true}  or  {"messages": [...], chat fields}
                          -> {"count", "max_model_len", "tokens", "token_strs" (with "return_token_strs")}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  the special tokens' spellings (bos_token, eos_token, pad_token) and the template name

`add_special_tokens` adds the BOS id (the engine's convention for text prompts); a chat request is rendered exactly
as /v1/chat/completions renders it (the BOS included).
"""

from __future__ import annotations

from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from dsv41.engine.tokenizer import HFTokenizer
from dsv41.server.protocol import APIError, ChatCompletionRequest, _Strict, parse
from dsv41.server.serving_chat import ServingChat
from dsv41.server.validation import check_model, encode, read_json


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def _special(tokenizer, i: int | None) -> str | None:
    if i is None:
        return None
    return tokenizer.tok.id_to_token(i) if isinstance(tokenizer, HFTokenizer) else None


def add_tokenizer_routes(app: FastAPI) -> None:
    async def run(request: Request, fn) -> JSONResponse:
        state = request.app.state.dsv41
        try:
            body = await read_json(request, state.settings.max_body_bytes)
            return JSONResponse(fn(state, body))
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await run(request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await run(request, _detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        st = request.app.state.dsv41
        tok = st.tokenizer
        return {"tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size,
                "bos_token": _special(tok, tok.bos_id), "eos_token": _special(tok, tok.eos_id),
                "pad_token": _special(tok, getattr(tok, "pad_id", None)), "chat_template": None,
                "chat_template_name": st.template.name, "model_max_length": st.engine.max_seq_len}


def _tokenize(state, body: Union[dict, Any]) -> dict:
    req = parse(TokenizeRequest, body)
    if req.model is not None:
        check_model(state.settings, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either prompt or messages", "prompt")
    if req.prompt is not None:
        ids = encode(state.tokenizer, req.prompt, "prompt")
        ids = ids if req.add_special_tokens or state.tokenizer.bos_id is None else ids[1:]
    else:
        chat = parse(ChatCompletionRequest, {**body, "model": state.settings.model_name})
        ids = ServingChat(state, chat).render()
    out = {"count": len(ids), "max_model_len": state.engine.max_seq_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [state.token_text.text(i) for i in ids]
    return out


def _detokenize(state, body) -> dict:
    req = parse(DetokenizeRequest, body)
    if req.model is not None:
        check_model(state.settings, req.model)
    V = state.engine.cfg.vocab_size
    if any(not 0 <= t < V for t in req.tokens):
        raise APIError(400, f"tokens: token ids must be in [0, {V})", "tokens", "invalid_token_id")
    return {"prompt": state.tokenizer.decode(req.tokens)}
