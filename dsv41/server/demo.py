"""`dsv41 demo`: the main job, end to end on one machine.

1. Checkpoint: reuse `--checkpoint` (default runs/demo-tiny) when it holds a model; otherwise train the tiny preset
   for `--train-minutes` with `dsv41 train` (its progress bar shows). When this build has no `dsv41 train` (or it
   fails), a randomly initialised tiny model is saved instead and the output says so plainly.
2. Start the OpenAI-compatible server on 127.0.0.1 (ephemeral port) in this process.
3. With the official `openai` client: a chat request, the same request again (prefix-cache hit once the prefix
   cache is in the engine), one request per reasoning effort (low/high/max; the rendered prompt's effort line is
   shown), and a streamed completion.
4. Print the answers, usage and cached-token figures, the KV report (global KV bytes per token measured from the
   packed store vs the analytic figure of `dsv41.analysis.kv_bytes`; SWA bytes per sequence), a few /metrics lines,
   then stop the server.
5. The post-trained model: when `--posttrained` (default runs/post-rl, what `dsv41 posttrain all` writes) holds a
   checkpoint, serve it the same way and ask it held-out task problems (an easy, a middle and a hard one:
   `POSTTRAINED_TASKS`) at the lowest and the highest reasoning effort (`reasoning_effort` 1 and 100), under the
   plan grammar it was trained with (`task_grammar`, when its SFT wrote the plan head), printing its reasoning,
   its answer, whether the answer is right and the reasoning tokens, after the checkpoint's own held-out
   evaluation at those efforts when `posttrain eval` wrote one; otherwise print the command that makes one. It
   never waits for input.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import time
from pathlib import Path

DEMO_CHECKPOINT = "runs/demo-tiny"
POSTTRAINED = "runs/post-rl"
# (family, chain length) of the post-trained model's chat: an easy, a middle and a hard problem (the shortest plan
# that stays right differs with the length: tasks.py)
POSTTRAINED_TASKS = (("sums", 3), ("chase", 4), ("sums", 6))
RANDOM_MARKER = "DEMO_RANDOM_INIT"
# Long enough (well over the tiny model's n_win = 64 tokens) that the repeated request is worth a prefix-cache hit:
# hits no longer than n_win are not adopted (docs/system.md §4).
SYSTEM_PROMPT = ("You are a concise Python assistant. Answer with working Python 3 code that follows PEP 8: "
                 "four-space indentation, snake_case names, a short docstring for every function, type hints on "
                 "parameters and return values, and no third-party imports. Prefer the standard library, keep "
                 "functions small, raise ValueError with a clear message on bad input, and add a doctest example.")
QUESTION = "Write a function that returns the sum of a list of numbers."


def _p(*a, **k):
    print(*a, **k, flush=True)


def _rule(title: str) -> None:
    _p(f"\n== {title} " + "=" * max(3, 74 - len(title)))


def _show(text: str, limit: int = 400) -> str:
    """Model text, printable: control characters shown as escapes, long answers cut."""
    out = "".join(c if (c.isprintable() or c in "\n\t") else repr(c)[1:-1] for c in text)
    if len(out) > limit:
        out = out[:limit] + f" ... [{len(text) - limit} more chars]"
    return "    " + out.replace("\n", "\n    ")


# ------------------------------------------------------------------------------------------------ checkpoint

def has_model(ckpt: Path) -> bool:
    return (ckpt / "config.json").is_file() and any(ckpt.glob("*.safetensors"))


def train_available() -> bool:
    """Whether this build ships `dsv41 train` (it runs in a subprocess: `train_tiny`)."""
    return importlib.util.find_spec("dsv41.train.cli") is not None


def train_tiny(ckpt: Path, minutes: float) -> bool:
    cmd = [sys.executable, "-m", "dsv41.cli", "train", "--preset", "tiny", "--minutes", f"{minutes:g}",
           "--out", str(ckpt)]
    _p(f"training the tiny model for {minutes:g} min: {' '.join(cmd[1:])}")
    root = str(Path(__file__).resolve().parents[2])                  # the trainer imports this checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        rc = subprocess.call(cmd, env=env)
    except OSError as e:
        _p(f"could not start the trainer: {e}")
        return False
    if rc != 0:
        _p(f"the trainer exited with status {rc}")
    return rc == 0 and has_model(ckpt)


def save_random_tiny(ckpt: Path) -> Path:
    from dsv41.config import load_config
    from dsv41.model.init import random_model
    from dsv41.model.loading import save_checkpoint

    if (ckpt / "tokenizer.json").exists():          # left by a failed training run: keep it out of the way
        ckpt = ckpt.with_name(ckpt.name + "-random")
    cfg = load_config("tiny")
    save_checkpoint(random_model(cfg, seed=0), cfg, ckpt, extra_meta={"origin": "random init (dsv41 demo fallback)"})
    (ckpt / RANDOM_MARKER).write_text("This checkpoint is a randomly initialised tiny model written by `dsv41 demo`"
                                      " because no trained checkpoint was available.\n")
    return ckpt


def ensure_checkpoint(ckpt: Path, minutes: float, allow_train: bool = True) -> tuple[Path, str]:
    """-> (checkpoint dir, origin: existing | trained | random)."""
    if has_model(ckpt) and not (ckpt / RANDOM_MARKER).exists():
        return ckpt, "existing"
    if allow_train:
        if train_available():
            if train_tiny(ckpt, minutes):
                (ckpt / RANDOM_MARKER).unlink(missing_ok=True)
                return ckpt, "trained"
            _p("training did not produce a checkpoint; falling back to a random model")
        else:
            _p("`dsv41 train` is not available in this build.")
    for c in (ckpt, ckpt.with_name(ckpt.name + "-random")):
        if has_model(c) and (c / RANDOM_MARKER).exists() and not (c / "tokenizer.json").exists():
            return c, "random"
    return save_random_tiny(ckpt), "random"


# ------------------------------------------------------------------------------------------------ KV report

def print_kv_report(cfg, stats_list: list[tuple[str, dict]]) -> None:
    """Each request's global KV bytes as the store measured them against the analytic count, and the analytic
    SWA bytes per sequence."""
    from dsv41.analysis.kv_bytes import (global_entry_bytes, global_kv_bytes_per_token, kv_source_layers,
                                         swa_bytes_per_sequence)

    g = float(global_kv_bytes_per_token(cfg))
    entry = global_entry_bytes(cfg)
    _p(f"analytic global KV: {g:g} B/token (sum over KV-source layers of entry bytes / ratio); an entry exists "
       f"only for complete blocks, so a sequence of N tokens holds sum floor(N/m) x entry bytes")
    _p(f"{'request':<14}{'tokens':>7}{'global B':>10}{'B/token':>9}{'analytic':>9}{'complete-block':>16}"
       f"{'SWA B/seq':>11}")
    ok, packed = True, None
    for label, st in stats_list:
        kv = st.get("kv_bytes") or {}
        n = int(kv.get("tokens", 0))
        measured = kv.get("global_entries_bytes", kv.get("global_bytes"))
        if not n or measured is None:
            continue
        exact = sum(int(entry * (n // m)) for _, m in kv_source_layers(cfg))
        ok &= int(measured) == exact
        packed = ("global_entries_bytes" in kv) if packed is None else packed
        _p(f"{label:<14}{n:>7}{int(measured):>10}{measured / n:>9.2f}{g:>9.2f}{exact:>16}"
           f"{kv.get('swa_bytes', '-'):>11}")
    if packed is not None:
        kind = "packed store (uint8 codes + scales)" if packed else "dense reference store (unpacked)"
        _p(f"measured from the {kind}: global bytes {'==' if ok else '!='} the analytic count for every request")
    swa = swa_bytes_per_sequence(cfg)
    _p(f"analytic SWA rings per sequence: {swa['backbone']} B backbone ({swa['backbone_layers']} layers x "
       f"{swa['rows_per_layer']} rows) + {swa['dspark']} B DSpark = {swa['backbone'] + swa['dspark']} B; of which "
       f"the encoder rings the SWA pool snapshots: {swa['encoder']} B")


# ------------------------------------------------------------------------------------------------ the demo

def _usage_line(u) -> str:
    d = u.prompt_tokens_details
    extra = getattr(d, "model_extra", None) or {}
    tier_s = ", ".join(f"{k} {v}" for k, v in (extra.get("cached_tokens_by_tier") or {}).items()) or "none"
    return (f"usage: prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {d.cached_tokens} "
            f"(path {extra.get('cache_path', '?')}; by tier: {tier_s})")


def _ask(client, model: str, messages: list[dict], max_tokens: int, label: str, stats_list: list, **kw):
    """One greedy chat request, printed with its timing, prompt start, answer and usage."""
    t = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    extra = r.model_extra or {}
    _p(f"\n[{label}] {time.perf_counter() - t:.2f}s, finish {r.choices[0].finish_reason}")
    if "prompt" in extra:
        first = extra["prompt"].split("\n", 1)[0]
        _p(f"  prompt starts: {first!r}")
    _p(_show(r.choices[0].message.content or ""))
    _p("  " + _usage_line(r.usage))
    stats_list.extend((label, s) for s in extra.get("engine_stats") or [])
    return r


def _chat(client, model: str, max_tokens: int, stats_list: list) -> None:
    """The same chat twice (the repeat is a prefix-cache hit), then once per reasoning effort."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]
    _rule("chat (greedy)")
    _p(f"system: {SYSTEM_PROMPT}\nuser:   {QUESTION}")
    first = _ask(client, model, messages, max_tokens, "first", stats_list)
    second = _ask(client, model, messages, max_tokens, "repeat", stats_list)
    same = first.choices[0].message.content == second.choices[0].message.content
    _p(f"\nprefix cache: cached tokens {first.usage.prompt_tokens_details.cached_tokens} on the first request, "
       f"{second.usage.prompt_tokens_details.cached_tokens} on the repeat; answers "
       f"{'identical' if same else 'differ (replay path, docs/system.md §4)'}")

    _rule("reasoning effort (docs/system.md §7: low/high/max -> 50/75/100)")
    for effort in ("low", "high", "max"):
        _ask(client, model, messages, max_tokens, f"effort={effort}", stats_list, reasoning_effort=effort,
             extra_body={"return_prompt": True})


def _stream(client, model: str, max_tokens: int) -> None:
    _rule("streamed completion")
    prompt = "def fibonacci(n):\n"
    _p(prompt, end="")
    t = time.perf_counter()
    n_chunks, usage = 0, None
    for ch in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            n_chunks += 1
            _p("".join(c if (c.isprintable() or c in "\n\t") else "?" for c in ch.choices[0].text), end="")
        if ch.usage is not None:
            usage = ch.usage
    _p(f"\n[stream] {n_chunks} chunks in {time.perf_counter() - t:.2f}s")
    if usage is not None:
        _p("  " + _usage_line(usage))


def _metrics_excerpt(url: str) -> None:
    import httpx

    _rule("GET /metrics (excerpt)")
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(("dsv41_requests_total", "dsv41_generation_tokens_total", "dsv41_prompt_tokens_total",
                            "dsv41_prefix_cache_queries_total", "dsv41_prefix_cache_hits_total",
                            "dsv41_prefix_cache_requests_total", "dsv41_kv_bytes_peak",
                            "dsv41_batch_size_count", "dsv41_aborted_sequences_total")):
            _p("  " + line)


def _eval_lines(ckpt: Path, efforts=(1, 100)) -> list[str]:
    """The checkpoint's own held-out evaluation (`posttrain eval`'s eval*.json beside it) at `efforts`, a line each."""
    import json
    lines = []
    for f in sorted(ckpt.glob("eval*.json")):
        if f.name.startswith("eval_raw"):
            continue
        d = json.loads(f.read_text())
        mode = "greedy" if not d.get("temperature") else f"sampled at temperature {d['temperature']}"
        for b in efforts:
            lv = d.get("levels", {}).get(str(b))
            if lv:
                fams = ", ".join(f"{k} {v:.2f}" for k, v in sorted(lv.get("accuracy_by_family", {}).items()))
                lines.append(f"  effort {b:>3}: accuracy {lv['accuracy']:.3f} ({fams}), mean reasoning "
                             f"{lv['mean_length']:.1f} tokens, {lv['n']} held-out problems ({f.name}, {mode})")
    return lines


def _posttrained(args: argparse.Namespace, tasks=POSTTRAINED_TASKS) -> None:
    """Step 5 of the module docstring."""
    import copy

    from openai import OpenAI

    from dsv41.engine.cli import engine_from_args
    from dsv41.posttrain import tasks as T
    from dsv41.posttrain.constrain import checkpoint_plans
    from dsv41.server.app import create_app, serve_in_thread
    from dsv41.server.state import ServerSettings

    _rule("post-trained model (dsv41 posttrain: SFT -> RL with controllable effort)")
    ckpt = Path(args.posttrained)
    if not (has_model(ckpt) and (ckpt / "posttrain.json").is_file()):
        _p(f"no post-trained checkpoint in {ckpt}: `dsv41 posttrain all` makes one (runs/post-sft, post-rl, post-opd;"
           " about 20 minutes on 2 cores), then run `dsv41 demo` again")
        return
    plans = checkpoint_plans(ckpt)
    pargs = copy.copy(args)
    pargs.checkpoint, pargs.cache_dir, pargs.swa_pool = str(ckpt), "none", "none"
    engine = engine_from_args(pargs)
    tok = engine.tokenizer
    app = create_app(engine, ServerSettings.from_args(pargs))
    with serve_in_thread(app, "127.0.0.1", 0) as handle:
        client = OpenAI(base_url=handle.url + "/v1", api_key="dsv41-demo", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        _p(f"serving {ckpt} as {model} on {handle.url}; held-out problems (never trained on), greedy"
           + (f", under the plan grammar it was trained with (task_grammar {plans!r})" if plans else ""))
        grammar = {"task_grammar": plans} if plans else {}
        lines = _eval_lines(ckpt)
        if lines:
            _p("its held-out evaluation (dsv41 posttrain eval):")
            for line in lines:
                _p(line)
        rng = random.Random("demo:posttrained")
        for fam, n in tasks:
            p = T.sample_problem(rng, fam, n, n, split="held_out")
            _p(f"\nuser: {p.content}   (answer {p.answer})")
            for b in (1, 100):
                r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p.content}],
                                                   max_tokens=T.MAX_TOKENS, temperature=0,
                                                   extra_body={"reasoning_effort": b, **grammar})
                m = r.choices[0].message
                think = (m.model_extra or {}).get("reasoning_content") or ""
                ans = (m.content or "").strip()
                k = len(tok.encode(think)) if think else 0
                _p(f"  effort {b:>3}: reasoning {k:>2} tokens {think!r:<36} answer {ans!r} "
                   f"{'right' if ans == p.answer else 'wrong'}")


def run_demo(args: argparse.Namespace) -> int:
    from openai import OpenAI

    from dsv41.engine.cli import engine_from_args
    from dsv41.server.app import create_app, serve_in_thread
    from dsv41.server.state import ServerSettings

    t0 = time.monotonic()
    _rule("checkpoint")
    ckpt, origin = ensure_checkpoint(Path(args.checkpoint), args.train_minutes, allow_train=not args.no_train)
    args.checkpoint = str(ckpt)
    if origin == "random":
        _p(f"NOTE: serving a RANDOMLY INITIALISED (untrained) tiny model from {ckpt}: `dsv41 train` was not available"
           " or failed, so the answers below are noise. Everything else (server, batching, usage, KV bytes) is real.")
    else:
        _p(f"using the {'freshly trained' if origin == 'trained' else 'existing'} checkpoint {ckpt}")
    args.cache_dir = str(Path(ckpt) / "prefix-cache") if args.cache_dir is None else args.cache_dir
    args.swa_pool = "memory" if args.swa_pool is None else args.swa_pool
    engine = engine_from_args(args)
    pc = engine.prefix_cache
    _p(f"prefix cache: global KV on disk in {pc.disk.dir} (empty it: dsv41 cache clear --cache-dir {pc.disk.dir}), "
       f"SWA snapshots {'in memory' if pc.swa is not None else 'off'}; `dsv41 serve` keeps its cache in "
       "~/.cache/dsv41/prefix/<weights fingerprint> ($DSV41_CACHE_DIR, $XDG_CACHE_HOME), `dsv41 cache clear` "
       "empties that" if pc is not None and pc.disk is not None else "prefix cache: off")
    cfg = engine.cfg
    app = create_app(engine, ServerSettings.from_args(args))
    _p(f"model: {cfg.n_layers} layers, dim {cfg.dim}, vocab {cfg.vocab_size}; prefill {engine.prefill_mode}; "
       f"chat template {app.state.dsv41.template.name}; KV store {'packed' if engine.pool.packed else 'dense'}")

    stats_list: list[tuple[str, dict]] = []
    with serve_in_thread(app, "127.0.0.1", 0) as handle:
        _rule(f"server on {handle.url} (loopback, ephemeral port)")
        client = OpenAI(base_url=handle.url + "/v1", api_key="dsv41-demo", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        _p(f"GET /v1/models -> {model}")
        _chat(client, model, args.max_tokens, stats_list)
        _stream(client, model, args.max_tokens)
        _rule("KV report (bytes per token: measured vs analytic)")
        print_kv_report(cfg, stats_list)
        _metrics_excerpt(handle.url)
        _p("\nstopping the server")
    _posttrained(args)
    _p(f"demo done in {time.monotonic() - t0:.1f}s (checkpoint: {origin})")
    return 0
