"""lm-evaluation-harness against `dsv41 serve`: its `local-completions` model scores the local multiple-choice task
in benchmarks/lm_eval_task/ through /v1/completions (echo + logprobs over token-id prompts, counted with the
server's /tokenize), and every log-likelihood it reports is compared with the one the model computes directly
(one full forward, log-softmax, summed over the continuation's tokens): within 1e-6, bitwise with
--deterministic. Accuracy is recomputed from the direct numbers too.

    pip install 'dsv41[eval]'      (or lm-eval in a venv of its own: pass --lm-eval PATH/TO/lm_eval)
    python benchmarks/lm_eval_check.py [--checkpoint DIR] [--deterministic] [--save]

Without --checkpoint a random `debug` checkpoint is written to a temp dir (byte tokenizer): the point is the
protocol, not the score. Prints a table and a final JSON line (--save also writes benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "dsv41_mc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, port: int, deterministic: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dsv41.cli", "serve", "--checkpoint", ckpt, "--port", str(port),
           "--served-model-name", "dsv41-eval", "--speculative", "off", "--log-level", "warning"]
    proc = subprocess.Popen(cmd + (["--deterministic"] if deterministic else []))
    t_end = time.monotonic() + 300
    while time.monotonic() < t_end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("dsv41 serve exited")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("dsv41 serve did not come up")


def run_lm_eval(lm_eval: str, port: int, out: Path) -> None:
    args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model=dsv41-eval,tokenizer_backend=remote,"
            f"tokenized_requests=True,num_concurrent=1,max_retries=1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([lm_eval, "--model", "local-completions", "--model_args", args, "--tasks", TASK,
                    "--include_path", str(TASK_DIR), "--log_samples", "--output_path", str(out)],
                   cwd=TASK_DIR, env=env, check=True)


def read_outputs(out: Path) -> tuple[dict, list[dict]]:
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    samples = [json.loads(line) for f in out.rglob(f"samples_{TASK}_*.jsonl") for line in f.read_text().splitlines()]
    return results, sorted(samples, key=lambda s: s["doc_id"])


def direct_loglikelihoods(ckpt: str, deterministic: bool, pairs: list[tuple[str, str]]) -> list[float]:
    """The model's own numbers for each (context, continuation): tokens split as the harness splits them (trailing
    context spaces move to the continuation; the continuation is what the whole encoding adds to the context's)."""
    from dsv41.engine.tokenizer import load_tokenizer
    from dsv41.model.cache import DenseCache
    from dsv41.model.loading import load_model

    model, cfg = load_model(ckpt)
    if deterministic:
        from dsv41.model.attention import set_tie_break, use_deterministic
        set_tie_break(model, "recent")
        use_deterministic(model)
    tok = load_tokenizer(ckpt, cfg.vocab_size)
    out = []
    for ctx, cont in pairs:
        n = len(ctx) - len(ctx.rstrip())
        ctx, cont = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
        whole, c = tok.encode(ctx + cont), tok.encode(ctx)
        ids = c + whole[len(c):]
        with torch.no_grad():
            logits = model(torch.tensor([ids]), DenseCache(cfg, 1, model.dtype)).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        out.append(float(lp[len(c) - 1:].double().sum()))
    return out


def make_random_checkpoint() -> str:
    from dsv41.config import load_config
    from dsv41.model.init import random_model
    from dsv41.model.loading import save_checkpoint
    path = tempfile.mkdtemp(prefix="dsv41-lmeval-ckpt-")
    cfg = load_config("debug")
    save_checkpoint(random_model(cfg, seed=0), cfg, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--lm-eval", default=shutil.which("lm_eval") or "lm_eval")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    ckpt = args.checkpoint or make_random_checkpoint()
    port = free_port()
    out = Path(tempfile.mkdtemp(prefix="dsv41-lmeval-out-"))
    server = start_server(ckpt, port, args.deterministic)
    try:
        t0 = time.perf_counter()
        run_lm_eval(args.lm_eval, port, out)
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(30)
    results, samples = read_outputs(out)
    args_of = [[s["arguments"][k] for k in sorted(s["arguments"], key=lambda k: int(k.rsplit("_", 1)[1]))]
               for s in samples]                      # {"gen_args_i": {"arg_0": context, "arg_1": continuation}}
    pairs = [(a["arg_0"], a["arg_1"]) for doc in args_of for a in doc]
    harness = [float(r[0]) for s in samples for r in s["filtered_resps"]]
    direct = direct_loglikelihoods(ckpt, args.deterministic, pairs)
    diffs = [abs(h - d) for h, d in zip(harness, direct)]
    k = 0
    correct = 0
    for s in samples:                               # accuracy from the direct numbers
        n = len(s["filtered_resps"])
        correct += int(max(range(n), key=lambda i: direct[k + i]) == int(s["target"]))
        k += n
    report = {"task": TASK, "docs": len(samples), "loglikelihoods": len(pairs), "checkpoint": ckpt,
              "deterministic": args.deterministic, "acc_lm_eval": results.get("acc,none"),
              "acc_direct": correct / len(samples), "acc_norm_lm_eval": results.get("acc_norm,none"),
              "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
              "bitwise_equal": sum(d == 0.0 for d in diffs), "within_1e-6": all(d <= 1e-6 for d in diffs),
              "first": [{"context": p[0][-40:], "continuation": p[1], "lm_eval": h, "direct": d}
                        for p, h, d in list(zip(pairs, harness, direct))[:4]], "lm_eval_wall_s": round(wall, 1)}
    print(f"{'context tail':<44}{'continuation':<16}{'lm-eval':>14}{'direct':>14}")
    for r in report["first"]:
        print(f"{r['context']!r:<44}{r['continuation']!r:<16}{r['lm_eval']:>14.7f}{r['direct']:>14.7f}")
    print(f"acc lm-eval {report['acc_lm_eval']}  acc direct {report['acc_direct']}  max |diff| "
          f"{report['max_abs_diff']:.3g} over {len(pairs)} log-likelihoods ({report['bitwise_equal']} bitwise equal)")
    print(json.dumps(report))
    if args.save:
        day = datetime.date.today().isoformat()
        Path(__file__).parent.joinpath("results", f"lm_eval_check-{day}.json").write_text(json.dumps(report, indent=1))
    if not report["within_1e-6"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
