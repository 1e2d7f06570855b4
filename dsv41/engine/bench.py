"""`dsv41 bench prefill|decode`: prefill-mode speed ratios and decode speed, measured side by side in one run.

Random weights (speed does not depend on them). Every figure is a measurement of this process on this machine;
the analytic ratio beside the prefill ratios is the FLOPs-style row count ratio of the CED dataflow:
  full: N rows on L layers; ced: N rows on `split` encoder layers + R_k rows on each decoder layer k
  (ced-bounded R = n_win -> ratio -> split/L + n_win/N * D/L, i.e. 0.5 + n_win/(2N) at L = 2 * split).
The decode bench also times the step's GEMMs alone: every Linear call of one step (projections, routed and shared
experts, head) recorded by shape, then plain `F.linear` at those shapes; step / GEMM is the host and non-GEMM
overhead factor of the step.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from dsv41.config import DTYPES, load_config, parse_dtype
from dsv41.engine.prefill import check_ced, decoder_rows, prefill
from dsv41.engine.store import make_pool
from dsv41.model.common import Linear, set_quantization
from dsv41.model.init import random_model


def _model(config: str, dtype: torch.dtype, device: str, quant: bool):
    cfg = load_config(config)
    m = random_model(cfg, dtype=dtype, seed=0, device=device)
    set_quantization(m, quant)
    return cfg, m


def timed(fn, device) -> float:
    """Seconds `fn()` takes, the device synchronised before and after."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def synthetic_batch(model, device, batch: int, context: int):
    """(pool, sequence ids, token ids [batch, 1]): `batch` sequences whose packed stores hold a synthetic context of
    `context` tokens (`dsv41.kv.accounting.fill_random`: random codec records, not a prefill), ready to decode."""
    from dsv41.kv.accounting import fill_random
    pool = make_pool(model, device)
    sids = [pool.new_sequence() for _ in range(batch)]
    for s in sids:
        fill_random(pool, s, context)
    return pool, sids, torch.zeros(batch, 1, dtype=torch.long, device=device)


def time_prefill(m, ids: torch.Tensor, mode: str, chunk_size: int | None = None) -> float:
    """Seconds of one prefill of `ids` [1, N] in `mode` into a fresh sequence."""
    pool = make_pool(m, ids.device)
    view = pool.bind([pool.new_sequence()])
    return timed(lambda: prefill(m, ids, view, mode, chunk_size), ids.device)


def analytic_ratio(cfg, mode: str, n: int) -> float:
    return (check_ced(cfg) * n + sum(decoder_rows(cfg, mode, n))) / (cfg.n_layers * n)


def bench_prefill(config="tiny", lengths=(4096, 16384), dtype=torch.float32, device="cpu", repeats=1,
                  quant=True, chunk_size=None) -> list[dict]:
    cfg, m = _model(config, dtype, device, quant)
    rows = []
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
        t = {mode: statistics.median(time_prefill(m, ids, mode, chunk_size) for _ in range(repeats))
             for mode in ("full", "ced-exact", "ced-bounded")}
        rows.append({"tokens": n, "full_s": t["full"], "ced_exact_s": t["ced-exact"], "ced_bounded_s": t["ced-bounded"],
                     "ratio_bounded": t["ced-bounded"] / t["full"], "ratio_exact": t["ced-exact"] / t["full"],
                     "analytic_ratio": analytic_ratio(cfg, "ced-bounded", n),
                     "analytic_ratio_exact": analytic_ratio(cfg, "ced-exact", n)})
    return rows


def bench_decode(config="tiny", contexts=(1024, 4096), batches=(1, 8), steps=8, dtype=torch.float32,
                 device="cpu", quant=True, cuda_graphs: bool = False) -> list[dict]:
    """Decode step time vs context (batch 1) and tokens/s at several batch sizes; contexts are filled by a
    ced-bounded prefill of random tokens. cuda_graphs: also the step of fixed shapes (`dsv41.engine.graphs`:
    replayed from CUDA graphs on a GPU, its eager twin elsewhere) on the same sequences, after the eager steps."""
    cfg, m = _model(config, dtype, device, quant)
    out = []
    for n in contexts:
        for b in batches:
            pool = make_pool(m, device)
            sids = [pool.new_sequence() for _ in range(b)]
            for i, sid in enumerate(sids):
                ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(i)).to(device)
                view = pool.bind([sid])
                prefill(m, ids, view, "ced-bounded")
                pool.release(view, [sid])
            times = []
            tok = torch.zeros(b, 1, dtype=torch.long, device=device)
            with torch.no_grad():
                for _ in range(steps):
                    view = pool.bind(sids)
                    times.append(timed(lambda: m(tok, view, last_only=True), device))
                    pool.release(view, sids)
                view = pool.bind(sids)
                shapes = gemm_shapes(m, lambda: m(tok, view, last_only=True))
                pool.release(view, sids)
            step = statistics.median(times[1:] if len(times) > 1 else times)
            gemm = time_gemms(shapes, dtype, device, repeats=max(9, steps))       # the ratio's denominator: steady
            out.append({"context": n, "batch": b, "step_s": step, "tokens_per_s": b / step, "gemm_s": gemm,
                        "gemms": len(shapes), "step_over_gemm": step / gemm})
            if cuda_graphs:
                out[-1].update(time_graph_steps(m, pool, sids, tok, n + 2 * steps + 8, steps, step))
    return out


def time_graph_steps(m, pool, sids, tok, max_seq_len: int, steps: int, eager_s: float) -> dict:
    """Median seconds of the static decode step on these sequences (the first call, which captures, untimed)."""
    from dsv41.engine.graphs import DecodeGraphs
    graphs = DecodeGraphs(m, pool, max_seq_len)
    with torch.no_grad():
        times = [timed(lambda: graphs.forward(tok, pool.bind(sids)), tok.device) for _ in range(steps + 1)]
    step = statistics.median(times[1:])
    return {"graph_step_s": step, "graph_captured": graphs.capture, "eager_over_graph": eager_s / step}


def gemm_shapes(m, run) -> list[tuple[int, int, int]]:
    """(rows, in, out) of every Linear call `run()` makes (one decode step)."""
    shapes: list[tuple[int, int, int]] = []

    def hook(mod, args, _out):
        shapes.append((args[0].numel() // args[0].size(-1), mod.in_features, mod.out_features))
    handles = [mod.register_forward_hook(hook) for mod in m.modules() if isinstance(mod, Linear)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return shapes


def time_gemms(shapes, dtype, device, repeats: int = 3) -> float:
    """Median seconds of plain `F.linear` over all `shapes` in sequence (operands made once, outside the timing)."""
    g = torch.Generator().manual_seed(0)
    ops = {sh: (torch.randn(sh[0], sh[1], generator=g).to(device, dtype),
                torch.randn(sh[2], sh[1], generator=g).to(device, dtype)) for sh in set(shapes)}
    seq = [ops[sh] for sh in shapes]

    def run():
        for x, w in seq:
            torch.nn.functional.linear(x, w)
    run()                                                              # warm-up
    return statistics.median(timed(run, device) for _ in range(repeats))


def register(bsub) -> None:
    p = bsub.add_parser("prefill", help="prefill time of ced-bounded / ced-exact vs full")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=None)
    p.set_defaults(func=_prefill_main)
    d = bsub.add_parser("decode", help="decode step time vs context and tokens/s vs batch")
    d.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    d.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    d.add_argument("--steps", type=int, default=8)
    d.add_argument("--cuda-graphs", action="store_true",
                   help="also time the step of fixed shapes: CUDA graphs on a GPU, their eager twin on a CPU")
    d.set_defaults(func=_decode_main)
    for q in (p, d):
        q.add_argument("--config", default="tiny")
        q.add_argument("--device", default="cpu")
        q.add_argument("--dtype", choices=list(DTYPES), default="float32")
        q.add_argument("--no-quant", action="store_true", help="switch the FP8/FP4 QDQs off")
        q.add_argument("--json", action="store_true")


def _prefill_main(args) -> int:
    rows = bench_prefill(args.config, args.tokens, parse_dtype(args.dtype), args.device, args.repeats,
                         not args.no_quant, args.chunk_size)
    return _report(args, "prefill", rows, f"{'tokens':>8} {'full s':>9} {'exact s':>9} {'bounded s':>10} "
                   f"{'bounded/full':>13} {'exact/full':>11} {'analytic':>9}",
                   lambda r: f"{r['tokens']:>8} {r['full_s']:>9.3f} {r['ced_exact_s']:>9.3f} "
                             f"{r['ced_bounded_s']:>10.3f} {r['ratio_bounded']:>13.3f} {r['ratio_exact']:>11.3f} "
                             f"{r['analytic_ratio']:>9.3f}")


def _decode_main(args) -> int:
    rows = bench_decode(args.config, args.contexts, args.batches, args.steps, parse_dtype(args.dtype), args.device,
                        not args.no_quant, args.cuda_graphs)
    graph = (lambda r: f" {r['graph_step_s'] * 1e3:>9.1f} {r['eager_over_graph']:>12.2f}") if args.cuda_graphs \
        else (lambda r: "")
    return _report(args, "decode", rows, f"{'context':>8} {'batch':>6} {'step ms':>9} {'tokens/s':>9} "
                   f"{'GEMMs ms':>9} {'step/GEMM':>10}" + (f" {'graph ms':>9} {'eager/graph':>12}"
                                                          if args.cuda_graphs else ""),
                   lambda r: f"{r['context']:>8} {r['batch']:>6} {r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>9.1f} "
                             f"{r['gemm_s'] * 1e3:>9.1f} {r['step_over_gemm']:>10.2f}" + graph(r))


def _report(args, bench: str, rows: list[dict], header: str, line) -> int:
    """The table (unless --json), then the rows as one JSON line."""
    if not args.json:
        print(f"{bench}, config {args.config}, {args.device}, {args.dtype}")
        print(header)
        for r in rows:
            print(line(r))
    print(json.dumps({"bench": bench, "config": args.config, "device": args.device, "rows": rows}))
    return 0
