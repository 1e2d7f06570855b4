"""The OpenAI wire format the server speaks: request models (pydantic, strict), the error shape, and usage.

Requests are validated strictly: a string where a number belongs, a float where an integer belongs, or a bool
where either belongs is a 400, as OpenAI does (pydantic's lax coercion would accept "5" for 5). Unknown fields are
ignored, as vLLM and SGLang do. Fields we cannot honour (`suffix`, `best_of` other than n) are rejected with a 400
naming the field instead of being silently dropped.

Every error body has OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 16                       # choices per request
MAX_STOP = 16                    # stop strings per request
MAX_TOP_LOGPROBS = 20            # the engine's limit
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = {404: "not_found_error", 429: "rate_limit_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": _safe(message), "type": type, "param": None if param is None else _safe(param),
                      "code": code}}


def _safe(s: str) -> str:
    """Text that can always be encoded as UTF-8 (a client's lone surrogates are escaped)."""
    return str(s).encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def refuse(param: str, used, message: str | None = None, code: str | None = "unsupported_parameter") -> None:
    """A 400 naming `param` when `used`: by default a field this server cannot honour."""
    if used:
        raise bad_request(message or f"{param} is not supported by this server", param, code)


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field (dotted path, list indices included)."""
    errs = e.errors(include_url=False)
    first = errs[0]
    param = ".".join(str(x) for x in first.get("loc", ()) if not _is_union_tag(x)) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    return bad_request(f"{param}: {msg}{more}" if param else f"{msg}{more}", param, "invalid_type"
                       if "type" in first.get("type", "") else "invalid_value")


def _is_union_tag(x) -> bool:
    # pydantic names union members in the location ("str", "list[str]", "function-after[...]"): hide them
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none")
                                   or x.startswith(("function-", "list[", "literal[")))


# ------------------------------------------------------------------------------------------------ requests

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class CallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, ImagePart]], None] = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None                                 # the same, as some clients name it
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def parts(self) -> list[TextPart | ImagePart]:
        return self.content if isinstance(self.content, list) else [TextPart(type="text", text=self.content or "")]


class _Sampling(_Strict):
    """Fields chat and completions share."""
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)                      # extension (vLLM): -1 or 0 = off
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Union[str, list[str], None] = None
    n: int | None = Field(1, ge=1, le=MAX_N)                    # null = 1, as OpenAI
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)        # extension (vLLM)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)          # extension (vLLM): prefix-cache isolation
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False                                    # extension (vLLM)
    stop_token_ids: list[int] | None = None                     # extension (vLLM)
    return_prompt: bool = False                                 # extension: echo the rendered prompt back

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        lst = [] if v is None else [v] if isinstance(v, str) else v
        if len(lst) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if "" in lst:
            raise ValueError("stop sequences must be non-empty strings")
        return v

    _null_is_false: tuple[str, ...] = ()

    def model_post_init(self, __context) -> None:
        """OpenAI accepts null for these and means the default."""
        if self.n is None:
            self.n = 1
        for name in ("stream",) + self._null_is_false:
            if getattr(self, name) is None:
                setattr(self, name, False)

    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def bias(self, vocab_size: int) -> dict[int, float]:
        """`logit_bias` with integer keys; a 400 for a key that is not a token id of this model."""
        out = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                t = int(k)
            except ValueError:
                raise bad_request(f"logit_bias: key {k!r} is not a token id", "logit_bias") from None
            if not 0 <= t < vocab_size:
                raise bad_request(f"logit_bias: token id {t} is outside [0, {vocab_size})", "logit_bias",
                                  "invalid_token_id")
            out[t] = v
        return out

    def check_unsupported(self) -> None:
        refuse("stream_options", self.stream_options is not None and not self.stream,
               "stream_options is only allowed when stream is true", None)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning_effort: Union[str, int, None] = None
    chat_template_kwargs: dict[str, Any] | None = None           # extension (vLLM): {"thinking": bool}
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)      # extension (vLLM)
    # extension (dsv41): a post-trained checkpoint's plan grammar ("sml" / "strides", posttrain/constrain.py) over
    # the task the last user message states, at the request's effort: the decoding that model was trained under
    task_grammar: str | None = None
    _null_is_false = ("logprobs",)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        refuse("top_logprobs", self.top_logprobs is not None and not self.logprobs,
               "top_logprobs requires logprobs to be true", None)
        refuse("prompt_logprobs", self.prompt_logprobs is not None and self.stream,
               "prompt_logprobs are not available when stream is true", None)

    def max_new_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)                    # 0: only with echo (score the prompt)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)      # extension (vLLM)
    return_tokens_as_token_ids: bool = False                    # extension (vLLM): logprobs name "token_id:ID"
    _null_is_false = ("echo",)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        refuse("suffix", self.suffix)
        refuse("best_of", self.best_of is not None and self.best_of != self.n,
               "best_of other than n is not supported by this server")
        refuse("max_tokens", self.max_tokens == 0 and not self.echo,
               "max_tokens 0 is only allowed with echo (the prompt alone is returned)", "invalid_value")
        refuse("prompt_logprobs", self.prompt_logprobs is not None and self.stream,
               "prompt_logprobs are not available when stream is true", None)

    def scored(self) -> int | None:
        """Alternatives per prompt position to compute (None: the prompt is not scored): `prompt_logprobs`, or
        `logprobs` when the prompt is echoed, as vLLM does."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, a list of strings, a list of token ids, or a list of such lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if len(p) > MAX_N:
            raise bad_request(f"at most {MAX_N} prompts per request", "prompt")
        return list(p)


def parse(model: type[_Strict], body: Any) -> _Strict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


# ------------------------------------------------------------------------------------------------ usage

def usage_from_stats(stats: dict, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> dict:
    """OpenAI `usage` for one sequence from the engine's `Completion.stats`.

    The prefix-cache figures are read from the stats when present: `cached_tokens` (int), `cache_path` ("cold" /
    "swa-hit" / "replay") and the tokens per tier, either as the dict `cached_tokens_by_tier` (the engine's) or as
    flat keys `cached_<tier>_tokens`. Absent, they read 0 / "cold"."""
    p = int(stats.get("prompt_tokens", 0) if prompt_tokens is None else prompt_tokens)
    c = int(stats.get("generated_tokens", 0) if completion_tokens is None else completion_tokens)
    tiers = {str(k): int(v) for k, v in (stats.get("cached_tokens_by_tier") or {}).items()}
    for k, v in stats.items():
        if k.startswith("cached_") and k.endswith("_tokens") and k != "cached_tokens" and isinstance(v, int):
            tiers.setdefault(k[len("cached_"):-len("_tokens")], int(v))
    cached = stats.get("cached_tokens")
    cached = int(cached) if isinstance(cached, int) else sum(tiers.values())
    path = stats.get("cache_path") or ("cold" if cached == 0 else "hit")
    spec = stats.get("speculative") or {}
    drafted, accepted = int(spec.get("drafted_tokens", 0)), int(spec.get("accepted_tokens", 0))
    return _usage(p, c, min(cached, p), tiers, str(path), accepted, drafted - accepted)


def merge_usage(per_choice: list[dict], prompt_tokens_once: list[int], prompt_index: list[int] | None = None) -> dict:
    """Usage of a request with several choices (and prompts; prompt_index: each choice's, default all 0): each
    distinct prompt counts once (as OpenAI does for n > 1), completion tokens add up; cached tokens: the
    best-served choice of each prompt."""
    if not per_choice:
        return usage_from_stats({}, 0, 0)
    best: dict[int, dict] = {}                                  # prompt index -> its best-served prompt details
    for u, k in zip(per_choice, prompt_index or [0] * len(per_choice)):
        d = u["prompt_tokens_details"]
        if k not in best or d["cached_tokens"] > best[k]["cached_tokens"]:
            best[k] = d
    tiers: dict[str, int] = {}
    for d in best.values():
        for t, v in d["cached_tokens_by_tier"].items():
            tiers[t] = tiers.get(t, 0) + v
    paths = sorted({u["prompt_tokens_details"]["cache_path"] for u in per_choice})
    spec = [sum(u["completion_tokens_details"][k] for u in per_choice)
            for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")]
    return _usage(sum(prompt_tokens_once), sum(u["completion_tokens"] for u in per_choice),
                  sum(d["cached_tokens"] for d in best.values()), tiers, ",".join(paths), *spec)


def _usage(p: int, c: int, cached: int, tiers: dict[str, int], path: str, accepted: int, rejected: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached, "cached_tokens_by_tier": tiers, "cache_path": path},
            # speculative decoding (OpenAI's predicted-output fields): drafts the target accepted / rejected
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}

