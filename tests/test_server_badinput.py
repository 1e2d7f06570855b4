"""Hundreds of malformed and adversarial requests (raw httpx): every one answered with a 4xx in OpenAI's error shape,
the server healthy afterwards, a valid request streamed during the barrage undisturbed, and valid requests
afterwards still giving the same answers. Run with -s to see the table (kind, count, statuses, crashes)."""

from __future__ import annotations

import json
import threading
from collections import defaultdict

import httpx
import pytest

from test_server_fixtures import MODEL, make_checkpoint, running_server, wait_idle

MAX_LEN = 512
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hello"}]


def _chat(**kw):
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **kw}


def _comp(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def cases() -> list[tuple[str, str, str, bytes | None, dict]]:
    """(kind, method, path, raw body, headers)."""
    out = []

    def add(kind, body, path=None, method="POST", headers=None, raw=False):
        paths = [path] if path else [CHAT, COMP]
        for p in paths:
            data = body if raw else json.dumps(body).encode()
            out.append((kind, method, p, data, headers or {"content-type": "application/json"}))

    _syntax_cases(add)
    _value_cases(add)
    # ---- wrong method / path
    for method, path in (("GET", CHAT), ("PUT", CHAT), ("DELETE", COMP), ("GET", COMP), ("POST", "/v1/models"),
                         ("POST", "/health"), ("GET", "/v1/chat/completions/"), ("POST", "/v1/completions/"),
                         ("GET", "/v1/nope"), ("POST", "/v2/chat/completions"), ("GET", "/v1/models/nope")):
        out.append(("wrong_route", method, path, b"{}" if method != "GET" else None, {}))
    # ---- body too large
    big = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (9 << 20)}])).encode()
    out.append(("body_too_large", "POST", CHAT, big, {"content-type": "application/json"}))
    out.append(("body_too_large", "POST", COMP, big, {"content-type": "application/json"}))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("dbg-bad"), seed=2)
    with running_server(ckpt, exact=True, max_seq_len=MAX_LEN) as (handle, app):
        yield handle


def _syntax_cases(add) -> None:
    """Bodies that are not a well-formed request: bad JSON, not an object, fields missing or of the wrong type."""
    # ---- malformed JSON (raw bytes), both endpoints
    for raw in (b"", b"   ", b"{", b"}", b"{bad}", b"[1,2", b"nul", b"\xff\xfe\x00garbage", b'{"model": "dbg",}',
                b"NaN", b'{"model": NaN}', b'{"temperature": Infinity, "model": "dbg"}', b'{"model": -Infinity}',
                b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 3000 + b"1" + b"}" * 3000, b'{"model": "\xff\xfe"}',
                b"\x00", b'{"model": "dbg", "messages": [{"role": "user", "content": "\\ud8"}]}',
                b'{"max_tokens": ' + b"9" * 5000 + b"}", b"'single quotes'", b'{"model": "dbg"} trailing',
                b"\xef\xbb\xbf{}", b"true false", b'{"model": "dbg", "model": 3'):
        add("malformed_json", raw, raw=True)
    # ---- JSON that is not an object
    for v in ([], [1, 2], [_chat()], 1, -3.5, "string", None, True, False):
        add("not_an_object", v)
    # ---- missing fields
    for b in ({}, {"model": MODEL}, {"messages": MSG}, {"model": MODEL, "messages": None}):
        add("missing_field", b, CHAT)
    for b in ({}, {"model": MODEL}, {"prompt": "x"}, {"model": MODEL, "prompt": None}):
        add("missing_field", b, COMP)
    # ---- wrong types, chat
    wrong_chat = {
        "model": [1, None, [], {}, True],
        "messages": ["hi", {}, [1], [None], [[]], [{"role": 1, "content": "x"}], [{"content": "x"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": {"text": "x"}}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "wizard", "content": "x"}],
                     [{"role": "user", "content": ["x"]}], [{"role": "assistant", "content": "only me"}]],
        "max_tokens": ["5", 5.5, True, [], {}], "max_completion_tokens": ["5", 2.0, False],
        "temperature": ["0", [], True, {}], "top_p": ["1", True, []], "n": ["2", 1.5, True, []],
        "stream": ["yes", 1, 0, [], {}], "seed": ["1", 1.5, True, []], "stop": [5, [1], [None], {"a": 1}, True],
        "logprobs": ["yes", 2, 1.0], "top_logprobs": ["3", 3.5, True], "stream_options": ["x", 1, [],
                                                                                           {"include_usage": "yes"}],
        "chat_template_kwargs": ["x", 1, {"thinking": "yes"}], "return_prompt": ["x", 2], "top_k": ["x", 2.5],
        "stop_token_ids": ["x", [1.5], ["a"], 3], "ignore_eos": ["no", 0], "user": [1, []],
    }
    for field, values in wrong_chat.items():
        for v in values:
            add("wrong_type", _chat(**{field: v}) | ({"stream": True} if field == "stream_options" else {}), CHAT)
    # ---- wrong types, completions
    wrong_comp = {
        "prompt": [5, [], [[]], [1.5], [[1], "x"], [True], {"text": "x"}, [None], [[1.5]]],
        "max_tokens": ["5", 5.5, True], "logprobs": ["2", True, 1.5], "echo": ["yes", 1], "n": ["2", 2.5],
        "best_of": ["2", 1.5], "suffix": [1, []], "temperature": ["hot"], "stop": [7, [3]],
    }
    for field, values in wrong_comp.items():
        for v in values:
            add("wrong_type", _comp(**{field: v}), COMP)


def _value_cases(add) -> None:
    """Well-formed requests with values the server must refuse."""
    # ---- unknown model
    for name in ("nope", "", "DBG", "dbg ", " dbg", "x" * 10_000, "модель", "dbg\x00", "../../etc/passwd"):
        add("unknown_model", _chat(model=name), CHAT)
        add("unknown_model", _comp(model=name), COMP)
    # ---- prompt longer than the context (byte tokenizer: one token per byte, plus BOS)
    for n in (MAX_LEN - 1, MAX_LEN, MAX_LEN + 1, 4 * MAX_LEN, 50_000):
        add("prompt_too_long", _chat(messages=[{"role": "user", "content": "x" * n}], max_tokens=1), CHAT)
        add("prompt_too_long", _comp(prompt="x" * n, max_tokens=1), COMP)
        add("prompt_too_long", _comp(prompt=[5] * (n + 1), max_tokens=1), COMP)      # ids: no BOS added
    for mt in (MAX_LEN, MAX_LEN * 10, 2 ** 31, 10 ** 30, 2 ** 64):
        add("prompt_too_long", _chat(max_tokens=mt), CHAT)
        add("prompt_too_long", _comp(max_tokens=mt), COMP)
    # ---- invalid reasoning effort
    for e in ("medium", "minimal", "None", "LOW", "", " high", 0, 101, -1, 1000, True, False, 1.5, [], {},
              ["low"], {"level": "low"}):
        add("invalid_effort", _chat(reasoning_effort=e), CHAT)
    # ---- n and max_tokens out of range, other ranges
    for n in (0, -1, 17, 1000, 10 ** 9, -(10 ** 20)):
        add("n_out_of_range", _chat(n=n), CHAT)
        add("n_out_of_range", _comp(n=n), COMP)
    add("n_out_of_range", _comp(prompt=["a"] * 8, n=16), COMP)
    add("n_out_of_range", _comp(prompt=["a"] * 17), COMP)
    for mt in (0, -1, -(10 ** 9)):
        add("max_tokens_out_of_range", _chat(max_tokens=mt), CHAT)
        add("max_tokens_out_of_range", _chat(max_completion_tokens=mt), CHAT)
        add("max_tokens_out_of_range", _comp(max_tokens=mt), COMP)
    for kw in ({"temperature": -0.1}, {"temperature": 2.5}, {"temperature": 1e308}, {"top_p": 0}, {"top_p": -1},
               {"top_p": 1.01}, {"top_k": -2}, {"seed": 2 ** 64}, {"seed": -(2 ** 63) - 1},
               {"stop": [""]}, {"stop": ["x"] * 17}, {"presence_penalty": 3}, {"frequency_penalty": -3}):
        add("value_out_of_range", _chat(**kw), CHAT)
        add("value_out_of_range", _comp(**kw), COMP)
    for kw in ({"top_logprobs": -1}, {"top_logprobs": 21}, {"top_logprobs": 3}, {"stop_token_ids": [-1]},
               {"stop_token_ids": [10 ** 6]}):
        add("value_out_of_range", _chat(**kw), CHAT)
    for kw in ({"logprobs": -1}, {"logprobs": 21}, {"prompt": [-1]}, {"prompt": [10 ** 9]}, {"prompt": [[1], [-5]]},
               {"prompt": ""}, {"prompt": [""]}):
        add("value_out_of_range", _comp(**kw), COMP)
    # ---- unsupported features (named, not silently dropped)
    for kw in ({"suffix": "end"}, {"best_of": 3}, {"stream_options": {}}, {"max_tokens": 0},
               {"echo": True, "logprobs": 1, "prompt_logprobs": 1, "stream": True}):
        add("unsupported", _comp(**kw), COMP)
    add("unsupported", _chat(stream_options={"include_usage": True}), CHAT)
    add("unsupported", _chat(prompt_logprobs=2, stream=True), CHAT)
    # ---- bad values of the tools, structured output, penalty / bias and cache fields
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for kw in ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, {"tools": [{"type": "x"}]},
               {"tools": "f"}, {"tools": [tool, tool]}, {"tools": [{"type": "function", "function": {}}]},
               {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
               {"tool_choice": "required"}, {"tool_choice": "sometimes", "tools": [tool]}, {"tool_choice": 5},
               {"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [tool]},
               {"tool_choice": {"type": "function"}, "tools": [tool]},
               {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}, {"role": "user", "content": "x"}]},
               {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                             {"role": "user", "content": "x"}]},
               {"chat_template_kwargs": {"thinking": "yes"}}, {"messages": [{"role": "developer", "content": ""}]},
               {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
               {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}):
        add("bad_tools_or_content", _chat(**kw), CHAT)
    for kw in ({"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}},
               {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
               {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
               {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object",
                                                                                      "properties": 3}}}},
               {"response_format": "json"}, {"logit_bias": {"abc": 1}}, {"logit_bias": {"100000000": 5}},
               {"logit_bias": {"-1": 1}}, {"logit_bias": {"1": "x"}}, {"logit_bias": [1]},
               {"repetition_penalty": 0}, {"repetition_penalty": -1}, {"repetition_penalty": "1"},
               {"presence_penalty": 2.5}, {"frequency_penalty": "x"}, {"cache_salt": ""}, {"cache_salt": 5},
               {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        add("bad_new_fields", _chat(**kw), CHAT)
        add("bad_new_fields", _comp(**kw), COMP)
    # ---- text that is not valid Unicode (lone surrogates arrive through JSON escapes)
    for s in ("\ud800", "ok \udfff ok", "\udbff\udc00\ud800"):
        add("bad_unicode", _chat(messages=[{"role": "user", "content": s}]), CHAT)
        add("bad_unicode", _comp(prompt=s), COMP)
        add("bad_unicode", _chat(model=s), CHAT)



def _valid(client):
    r = client.post(CHAT, json=_chat(max_tokens=8, temperature=0), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_bad_inputs_all_4xx_and_server_survives(server):
    handle = server
    client = httpx.Client(base_url=handle.url, timeout=120)
    ref = _valid(client)
    ref_long = client.post(COMP, json=_comp(prompt="stream me", max_tokens=60, temperature=0, ignore_eos=True)).json()
    # a valid streamed request runs through the whole barrage
    streamed: dict = {}

    def stream_valid():
        with httpx.stream("POST", handle.url + COMP, timeout=300, json=_comp(
                prompt="stream me", max_tokens=60, temperature=0, ignore_eos=True, stream=True)) as r:
            text = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])
                    text += [c["text"] for c in ch["choices"]]
            streamed["text"] = "".join(text)
            streamed["status"] = r.status_code
    t = threading.Thread(target=stream_valid)
    t.start()

    table: dict[str, dict] = defaultdict(lambda: {"count": 0, "statuses": defaultdict(int), "crashes": 0})
    bad = []
    all_cases = cases()
    for kind, method, path, body, headers in all_cases:
        r = client.request(method, path, content=body, headers=headers)
        row = table[kind]
        row["count"] += 1
        row["statuses"][r.status_code] += 1
        ok_shape = False
        try:
            err = r.json()["error"]
            ok_shape = set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        except Exception:
            pass
        if not (400 <= r.status_code < 500) or not ok_shape:
            row["crashes"] += 1
            bad.append((kind, method, path, (body or b"")[:120], r.status_code, r.text[:200]))
    t.join(300)

    print(f"\n{'kind':<26}{'count':>6}  {'statuses':<28}{'crashes':>8}")
    for kind, row in table.items():
        st = ", ".join(f"{k} x{v}" for k, v in sorted(row["statuses"].items()))
        print(f"{kind:<26}{row['count']:>6}  {st:<28}{row['crashes']:>8}")
    print(f"{'total':<26}{len(all_cases):>6}  {'':<28}{sum(r['crashes'] for r in table.values()):>8}")

    assert not bad, bad[:10]
    assert len(all_cases) >= 300
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["step_failures"] == 0
    assert streamed.get("status") == 200 and streamed["text"] == ref_long["choices"][0]["text"]
    assert _valid(client) == ref                                  # still correct afterwards
    assert wait_idle(handle)["in_flight"] == 0
