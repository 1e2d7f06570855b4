"""Speculative decoding figures: acceptance per draft position, tokens per target forward and decode
tokens/s of no speculation vs fixed verify lengths vs the confidence scheduler, measured side by side in one run,
at batch 1 and at a loaded batch. Greedy decoding, so every mode must produce the same tokens (checked).

    # the trained tiny model with its DSpark-trained drafter (CPU)
    python benchmarks/speculative.py --checkpoint runs/train-tiny-dspark --batches 1 8
    # v41-geometry shapes, random weights, on a GPU: the drafter's forward runs (its cost is real) but its
    # proposals are replaced by the target's own greedy tokens, each kept with probability --agree (a drafter
    # "made to agree with the target"); the confidence it reports is --agree too
    python benchmarks/speculative.py --config v41-geometry --device cuda --dtype bfloat16 --batches 1 16
    # issue 28's CPU table: batches 1, 8, 32; off, fixed:1/2/4, the scheduler and its online correction
    python benchmarks/speculative.py --config tiny --batches 1 8 32 --max-tokens 32 \
        --modes off fixed:1 fixed:2 fixed:4 dspark dspark:online

The T(n) profile (plain decode and V = 0..G at each batch, whole engine steps, warmed, median of
--profile-repeats) is the checkpoint's step_profile.json when it has one, else measured first at the benchmark's
batches and context. Each run records the verify lengths the engine chose (row-steps by length, 0: decoded without
drafting), the tokens the scheduler predicted vs those emitted, and the decode steps' seconds the cost model
predicted vs those they took (every mode is given the profile, so fixed lengths show how well T fits their
shapes); a table of ratios vs off per batch closes the output.

Decode phase only: the engine steps until every request is prefilled (its first token sampled; at batch 32 the
prompts span several steps of the token budget), then the remaining steps are timed and the tokens they emit
counted. Prints a table and one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import gc
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


def run_mode(engine, groups, max_tokens: int, sync) -> dict:
    """Each group of prompts decoded as one batch, the groups one after another on the same engine (`--solo`: many
    prompts at batch 1); seconds, tokens and forwards summed over the groups."""
    from dsv41.engine.sampling import SamplingParams
    total = {"seconds": 0.0, "steps": 0, "decode_tokens": 0, "forwards": 0, "outputs": []}
    for prompts in groups:
        rids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        engine.step()                                      # admit + prefill every request
        while engine.waiting or any(s.pending is None for s in engine.running):
            engine.step()                                  # prompts beyond one step's token budget (batch 32)
        before = {s.request_id: len(s.output_ids) for s in engine.running}
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            total["steps"] += 1
        sync()
        total["seconds"] += time.perf_counter() - t0
        outs = [engine.completion(r).output_ids for r in rids]
        total["decode_tokens"] += sum(len(o) - before.get(r, len(o)) for r, o in zip(rids, outs))   # timed steps
        total["forwards"] += sum(engine.completion(r).stats["speculative"]["target_forwards"] for r in rids)
        total["outputs"] += outs
    return {**total, "tok_per_s": total["decode_tokens"] / total["seconds"],
            "tokens_per_forward_per_row": total["decode_tokens"] / max(1, total["forwards"])}


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
    ap.add_argument("--profile-repeats", type=int, default=5,
                    help="T(n) profile: timed repeats per shape, the median kept (on a machine shared with other "
                         "work, a median of 3 was often a slowed sample and misled the scheduler)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every mode this many times, interleaved (off, A, B, ...; then A, B, ..., off; then "
                         "B, ..., off, A: each later round rotates the order); each mode's fastest round is "
                         "reported (a machine shared with other work slows some rounds)")
    ap.add_argument("--deterministic", action="store_true",
                    help="the engine's deterministic mode (and the profile measured in it): greedy outputs then do "
                         "not depend on speculation at all, bit for bit (without it, a random-weight model's nearly "
                         "flat logits may flip an argmax between a verify chunk and a decode step)")
    ap.add_argument("--ties", choices=["official", "recent"], default="recent",
                    help="top-k tie rule; 'recent' makes greedy outputs independent of chunking and batch company, "
                         "so 'same tokens' checks speculation itself (with 'official' ties among exactly equal "
                         "indexer scores are broken by tensor shape)")
    ap.add_argument("--solo", type=int, default=1,
                    help="batch 1 over this many prompts, one after another (summed): one prompt's acceptance is "
                         "luck (a repetitive continuation gives x3, another x1.5)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default=None, help="a note stored in the result (the machine's load, what changed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu",
           "torch": torch.__version__, "dtype": args.dtype,
           "commit": os.environ.get("DSV41_GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                        text=True).stdout.strip()
           or None}
    if args.note:
        res["note"] = args.note
    model, cfg, tok, prompts_all = _model_and_prompts(args, res)
    G = cfg.dspark_block_size
    modes = args.modes or ["off", "fixed:1", f"fixed:{max(1, G // 2)}", f"fixed:{G}", "dspark"]
    modes = ["off"] + [m for m in modes if m != "off"]                 # the baseline runs first
    prof = _profile(args, model, tok, res)
    res["runs"] = []
    res["loadavg"] = {"start": os.getloadavg()}       # 1/5/15-minute load of the machine (shared: other work)
    for B in args.batches:
        groups = [[p] for p in prompts_all[:args.solo]] if B == 1 else [prompts_all[:B]]
        _run_batch(args, res, model, tok, groups, modes, prof, sync)
        res["loadavg"][f"after batch {B}"] = os.getloadavg()
    res["table"] = _table(res, args.batches, modes)
    res["ceiling"] = _ceiling(res, args.batches, G)
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
        prompts_all = stdlib_prompts(tok, max(args.batches + [args.solo]))
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
                       for _ in range(max(args.batches + [args.solo]))]
    model.eval()
    set_tie_break(model, args.ties)
    res["ties"] = args.ties
    res["deterministic"] = args.deterministic
    if args.deterministic:
        from dsv41.model.attention import use_deterministic
        use_deterministic(model)
        res["ties"] = "recent"
    return model, cfg, tok, prompts_all


def _profile(args, model, tok, res: dict):
    """The checkpoint's T(n) profile, else one measured now."""
    from dsv41.engine.speculative.profile import PROFILE_FILE, StepProfile, profile_step
    prof_path = Path(args.checkpoint) / PROFILE_FILE if args.checkpoint else None
    if prof_path is not None and prof_path.exists():
        res["profile"] = f"{prof_path}"
        return StepProfile.load(prof_path)
    t0 = time.perf_counter()
    context = min(512, args.prompt_tokens if tok is None else len(stdlib_prompts(tok, 1)[0]))
    prof = profile_step(model, batches=sorted(set(args.batches)), context=context, repeats=args.profile_repeats,
                        device=args.device, log=lambda *a: print(*a, flush=True), tokenizer=tok)
    res["profile"] = {"measured_s": time.perf_counter() - t0, **prof.to_json()}
    return prof


def _run_batch(args, res: dict, model, tok, groups: list, modes: list[str], prof, sync) -> None:
    """Every mode on groups of prompts (`run_mode`), side by side with the first ("off"), `--rounds` times
    interleaved; each mode's fastest round is reported (all rounds' tok/s kept)."""
    from dsv41.engine.engine import Engine
    from dsv41.engine.speculative.drafter import DSparkDrafter
    B, n_req = len(groups[0]), sum(len(g) for g in groups)
    best: dict[str, dict] = {}
    futures = None
    for rnd in range(args.rounds):
        k = rnd % len(modes)                  # later rounds rotate the order, so no mode always follows the same one
        for mode in modes[k:] + modes[:k]:
            gc.collect()                      # the previous engine's garbage is not collected inside a timed step
            eng = Engine(model, tok, prefill_mode="ced-bounded", max_batch=B, max_seq_len=8192, device=args.device,
                         speculative=mode, step_profile=prof, deterministic=args.deterministic)
            if args.checkpoint is None and eng.drafter is not None:
                eng.drafter = AgreeingDrafter(DSparkDrafter(model), futures, args.agree, model.cfg.vocab_size)
            r = run_mode(eng, groups, args.max_tokens, sync)
            if futures is None:
                futures = {f"req-{i}": o for i, o in enumerate(r["outputs"])}
            sc = eng.spec_counts
            st = [eng.completion(f"req-{i}").stats["speculative"] for i in range(n_req)]
            lengths: dict[int, int] = {}
            for x in st:
                for v, c in x.get("verify_lengths", {}).items():
                    lengths[int(v)] = lengths.get(int(v), 0) + c
            r.update(batch=B, mode=mode, requests=n_req,
                     acceptance=[a / n if n else None for a, n in zip(sc["accepted"], sc["reached"])],
                     drafted=sum(sc["reached"]), accepted=sum(sc["accepted"]),
                     verify_lengths=dict(sorted(lengths.items())),
                     predicted_tokens=sum(x.get("predicted_tokens", 0.0) for x in st),
                     realised_tokens=sum(x.get("realised_tokens", 0) for x in st),
                     timed_steps=sc.get("timed_steps", 0), step_predicted_s=sc.get("predicted_s", 0.0),
                     step_realised_s=sc.get("realised_s", 0.0),
                     closed_batch_steps={"plain": sc.get("closed_plain", 0), "spec": sc.get("closed_spec", 0)},
                     seeding_share=sc["seed_s"] / sc["seeded_s"] if sc.get("seeded_s") else None,
                     stopped={"never_pays": sc.get("stopped_never_pays", 0),
                              "seeding_cost": sc.get("stopped_seeding_cost", 0)})
            prev = best.get(mode)
            rounds = (prev["rounds_tok_per_s"] if prev else []) + [r["tok_per_s"]]
            if prev is None or r["tok_per_s"] > prev["tok_per_s"]:
                best[mode] = r
            best[mode]["rounds_tok_per_s"] = rounds
            print(f"  round {rnd}  batch {B:3d}  {mode:13s}  {r['tok_per_s']:8.2f} tok/s", flush=True)
    base = best[modes[0]]
    for mode in modes:
        r = best[mode]
        r["speedup_vs_off"] = r["tok_per_s"] / base["tok_per_s"]
        r["median_tok_per_s"] = _median(r["rounds_tok_per_s"])      # one lucky round moves the best, not this
        r["median_speedup_vs_off"] = r["median_tok_per_s"] / _median(base["rounds_tok_per_s"])
        r["same_tokens_as_off"] = r["outputs"] == base["outputs"]
        res["runs"].append(r)
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance"])
        vl = " ".join(f"{v}:{c}" for v, c in r["verify_lengths"].items())
        print(f"batch {B:3d}  {mode:13s}  {r['tok_per_s']:8.2f} tok/s  x{r['speedup_vs_off']:.2f}  "
              f"tokens/forward/row {r['tokens_per_forward_per_row']:.2f}  acceptance [{acc}]  "
              f"verify lengths [{vl}]  predicted/realised {r['predicted_tokens']:.0f}/{r['realised_tokens']}  "
              f"step s predicted/realised {r['step_predicted_s']:.2f}/{r['step_realised_s']:.2f}  "
              f"closed-batch plan plain/spec {r['closed_batch_steps']['plain']}/{r['closed_batch_steps']['spec']}  "
              f"seeding share {'-' if r['seeding_share'] is None else format(r['seeding_share'], '.2f')}  "
              f"stopped never-pays/seeding {r['stopped']['never_pays']}/{r['stopped']['seeding_cost']}  "
              f"same tokens {r['same_tokens_as_off']}", flush=True)
    if args.out:                                       # after every batch: a time limit keeps what was measured
        Path(args.out).write_text(_json(res) + "\n")


def _median(xs):
    s = sorted(xs)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def _table(res: dict, batches, modes) -> dict:
    """{mode: {batch: ratio vs off}} from this run (each mode's best round), printed as a table, then the same from
    each mode's median round (res["table_median"])."""
    tabs = []
    for key, title in (("speedup_vs_off", "best round"), ("median_speedup_vs_off", "median round")):
        tab = {m: {str(B): None for B in batches} for m in modes}
        for r in res["runs"]:
            tab[r["mode"]][str(r["batch"])] = r.get(key)
        print(f"\nratio vs off (tok/s, each mode's {title}), one run")
        print(f"{'mode':14s}" + "".join(f"  batch {B:<4d}" for B in batches))
        for m in modes:
            print(f"{m:14s}" + "".join("  " + (f"x{tab[m][str(B)]:.2f}" if tab[m][str(B)] is not None
                                               else "-").ljust(10) for B in batches))
        tabs.append(tab)
    res["table_median"] = tabs[1]
    return tabs[0]


def _ceiling(res: dict, batches, G: int) -> dict:
    """Per batch, from this run's profile: the speed-up a drafter whose every draft is accepted would give at verify
    length G, (G + 1) T_plain / T_G, and the tokens per forward a verify-G step must emit for x3 over plain decoding,
    3 T_G / T_plain, beside those fixed:G emitted (the arithmetic behind a batch-1 target)."""
    prof, out = res.get("profile") or {}, {}
    plain = {p["batch"]: p["seconds"] for p in prof.get("plain", [])}
    verify = {p["batch"]: p["seconds"] for p in prof.get("points", []) if p["verify"] == G}
    realised = {r["batch"]: r["tokens_per_forward_per_row"] for r in res["runs"] if r["mode"] == f"fixed:{G}"}
    rows = [B for B in batches if B in plain and B in verify]
    if rows:
        print(f"\nverify-{G} ceiling (profile): batch, T_plain s, T_{G} s, perfect-drafter speed-up, "
              f"tokens/forward for x3, fixed:{G}'s")
    for B in rows:
        tp, tg = plain[B], verify[B]
        out[str(B)] = {"plain_s": tp, "verify_s": tg, "perfect_speedup": (G + 1) * tp / tg,
                       "tokens_per_forward_for_x3": 3 * tg / tp, "fixed_tokens_per_forward": realised.get(B)}
        got = realised.get(B)
        print(f"  batch {B:3d}  {tp:.4f}  {tg:.4f}  x{(G + 1) * tp / tg:.2f}  {3 * tg / tp:.2f}  "
              + (f"{got:.2f}" if got is not None else "-"))
    return out


def _json(res: dict) -> str:
    return json.dumps({**res, "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in res["runs"]]})


if __name__ == "__main__":
    main()
