"""Speculative decoding figures: acceptance per draft position, tokens per target forward and decode
tokens/s of no speculation vs fixed verify lengths vs the confidence scheduler, measured side by side in one run,
at batch 1 and at a loaded batch. Greedy decoding, so every mode must produce the same tokens (checked).

    # the trained tiny model with its DSpark-trained drafter (CPU)
    python benchmarks/speculative.py --checkpoint runs/train-tiny-dspark --batches 1 8
    # v41-geometry shapes, random weights, on a GPU: the drafter's forward runs (its cost is real) but its
    # proposals are replaced by the target's own greedy tokens, each kept with probability --agree (a drafter
    # "made to agree with the target"); the confidence it reports is --agree too
    python benchmarks/speculative.py --config v41-geometry --device cuda --dtype bfloat16 --batches 1 16

Decode phase only: the requests are admitted (prefilled) in a first engine step, then the remaining steps are
timed. Prints a table and one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import DTYPES, parse_dtype  # noqa: E402


class AgreeingDrafter:
    """The real drafter's forward (for its cost), proposing the target's greedy continuation instead, each draft
    kept with probability `agree` (else replaced by another token)."""

    def __init__(self, base, futures: dict, agree: float, vocab: int, seed: int = 0):
        self.base, self.futures, self.agree, self.vocab = base, futures, agree, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def seed(self, *args, **kwargs):
        return self.base.seed(*args, **kwargs)

    def propose(self, view, seqs, pos):
        prop = self.base.propose(view, seqs, pos)
        G = prop.tokens.size(1)
        for b, s in enumerate(seqs):
            fut, k = self.futures[s.request_id], len(s.output_ids)
            for i in range(G):
                t = fut[k + i] if k + i < len(fut) else 0
                if float(torch.rand((), generator=self.gen)) >= self.agree:
                    t = (t + 1 + int(torch.randint(0, self.vocab - 1, (), generator=self.gen))) % self.vocab
                prop.tokens[b, i] = t
        prop.accept.fill_(self.agree)
        prop.q = [None] * len(seqs)
        return prop


def stdlib_prompts(tok, n: int, chars: int = 400) -> list[list[int]]:
    """Prompts cut from Python standard-library sources (always present, like the training corpus)."""
    import os
    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4 * chars)
    out = []
    for i in range(n):
        text = files[(37 * i) % len(files)].read_text(errors="replace")
        a = (len(text) // 3 + 997 * i) % max(1, len(text) - chars)
        ids = tok.encode(text[a:a + chars])
        bos = getattr(tok, "bos_id", None)
        out.append(([bos] if bos is not None else []) + ids)
    return out


def run_mode(engine, prompts, max_tokens: int, sync) -> dict:
    from dsv41.engine.sampling import SamplingParams
    rids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    engine.step()                                          # admit + prefill every request (no decode yet)
    sync()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync()
    dt = time.perf_counter() - t0
    outs = [engine.completion(r).output_ids for r in rids]
    tokens = sum(len(o) - 1 for o in outs)                 # the first token of each came from prefill
    return {"seconds": dt, "steps": steps, "decode_tokens": tokens, "tok_per_s": tokens / dt,
            "tokens_per_forward_per_row": tokens / max(1, sum(engine.completion(r).stats["speculative"]
                                                                ["target_forwards"] for r in rids)),
            "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--config", default=None, help="random weights of this preset instead of a checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="random-weight runs: prompt length")
    ap.add_argument("--modes", nargs="+", default=None, help="default: off, fixed:1, fixed:G/2, fixed:G, dspark")
    ap.add_argument("--agree", type=float, default=0.8, help="random-weight runs: the drafter's agreement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ties", choices=["official", "recent"], default="recent",
                    help="top-k tie rule; 'recent' makes greedy outputs independent of chunking and batch company, "
                         "so 'same tokens' checks speculation itself (with 'official' ties among exactly equal "
                         "indexer scores are broken by tensor shape)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu",
           "torch": torch.__version__, "dtype": args.dtype,
           "commit": os.environ.get("DSV41_GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                        text=True).stdout.strip()
           or None}
    model, cfg, tok, prompts_all = _model_and_prompts(args, res)
    G = cfg.dspark_block_size
    modes = args.modes or ["off", "fixed:1", f"fixed:{max(1, G // 2)}", f"fixed:{G}", "dspark"]
    modes = ["off"] + [m for m in modes if m != "off"]                 # the baseline runs first
    prof = _profile(args, model, res)
    res["runs"] = []
    for B in args.batches:
        _run_batch(args, res, model, tok, prompts_all[:B], modes, prof, sync)
    line = _json(res)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


def _model_and_prompts(args, res: dict):
    """The checkpoint's model and standard-library prompts, or random weights of --config and random prompts;
    -> (model, cfg, tokenizer or None, prompts)."""
    from dsv41.engine.speculative.policy import has_trained_drafter
    from dsv41.model.attention import set_tie_break
    dtype, dev = parse_dtype(args.dtype), args.device
    if args.checkpoint:
        from dsv41.engine.tokenizer import load_tokenizer
        from dsv41.model.loading import load_model
        model, cfg = load_model(args.checkpoint, dtype=dtype)
        model.to(dev)
        tok = load_tokenizer(args.checkpoint, cfg.vocab_size)
        res["model"] = f"checkpoint {args.checkpoint} (trained drafter: {has_trained_drafter(args.checkpoint)})"
        prompts_all = stdlib_prompts(tok, max(args.batches))
    else:
        from dsv41.config import load_config
        from dsv41.model.init import random_model
        cfg = load_config(args.config or "debug")
        t0 = time.perf_counter()
        model = random_model(cfg, dtype=dtype, device=dev)
        res["model_init_s"] = time.perf_counter() - t0
        tok = None
        res["model"] = f"random {cfg.name if hasattr(cfg, 'name') else args.config} (agreeing drafter p={args.agree})"
        g = torch.Generator().manual_seed(0)
        prompts_all = [torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist()
                       for _ in range(max(args.batches))]
    model.eval()
    set_tie_break(model, args.ties)
    res["ties"] = args.ties
    return model, cfg, tok, prompts_all


def _profile(args, model, res: dict):
    """The checkpoint's T(n) profile, else one measured now."""
    from dsv41.engine.speculative.profile import PROFILE_FILE, StepProfile, profile_step
    prof_path = Path(args.checkpoint) / PROFILE_FILE if args.checkpoint else None
    if prof_path is not None and prof_path.exists():
        res["profile"] = f"{prof_path}"
        return StepProfile.load(prof_path)
    t0 = time.perf_counter()
    prof = profile_step(model, batches=sorted(set(args.batches)), context=min(512, args.prompt_tokens),
                        repeats=2, device=args.device, log=lambda *a: print(*a, flush=True))
    res["profile"] = {"measured_s": time.perf_counter() - t0, **prof.to_json()}
    return prof


def _run_batch(args, res: dict, model, tok, prompts: list, modes: list[str], prof, sync) -> None:
    """Every mode on one batch of prompts, side by side with the first ("off")."""
    from dsv41.engine.engine import Engine
    from dsv41.engine.speculative.drafter import DSparkDrafter
    B = len(prompts)
    base = None
    for mode in modes:
        eng = Engine(model, tok, prefill_mode="ced-bounded", max_batch=B, max_seq_len=8192, device=args.device,
                     speculative=mode, step_profile=prof)
        if args.checkpoint is None and eng.drafter is not None:
            futures = {f"req-{i}": o for i, o in enumerate(base["outputs"])}
            eng.drafter = AgreeingDrafter(DSparkDrafter(model), futures, args.agree, model.cfg.vocab_size)
        r = run_mode(eng, prompts, args.max_tokens, sync)
        sc = eng.spec_counts
        r.update(batch=B, mode=mode,
                 acceptance=[a / n if n else None for a, n in zip(sc["accepted"], sc["reached"])],
                 drafted=sum(sc["reached"]), accepted=sum(sc["accepted"]))
        if base is None:
            base = r
        r["speedup_vs_off"] = r["tok_per_s"] / base["tok_per_s"]
        r["same_tokens_as_off"] = r["outputs"] == base["outputs"]
        res["runs"].append(r)
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance"])
        print(f"batch {B:3d}  {mode:9s}  {r['tok_per_s']:8.2f} tok/s  x{r['speedup_vs_off']:.2f}  "
              f"tokens/forward/row {r['tokens_per_forward_per_row']:.2f}  acceptance [{acc}]  "
              f"same tokens {r['same_tokens_as_off']}", flush=True)
        if args.out:                                   # after every run: a time limit keeps what was measured
            Path(args.out).write_text(_json(res) + "\n")


def _json(res: dict) -> str:
    return json.dumps({**res, "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in res["runs"]]})


if __name__ == "__main__":
    main()
