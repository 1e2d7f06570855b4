"""Muon + Sinkhorn (the routed recipe of docs/system.md §6) versus AdamW for everything: same model, data, seed, step
budget and schedule; validation loss and bits per byte after the same steps.

    PYTHONPATH=. python benchmarks/train_optimizers.py [--preset tiny] [--steps 60] [--lr 1e-2] \
        [--adamw-lr 3e-3] [--seq-len 128] [--batch-size 8] [--threads 1] [--out runs/bench-optimizers]

Both runs use the trainer (`dsv41.train.trainer.train`) with the same initial weights (the seed), the same data
order and the same evaluation windows. `--adamw-lr` (default: `--lr`) lets AdamW run at its own peak learning
rate; by construction (update-RMS matching, muon.py) one learning rate is meant to suit both. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.train.config import TrainConfig  # noqa: E402
from dsv41.train.trainer import train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--data", default=None)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--adamw-lr", type=float, default=None)
    ap.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--eval-windows", type=int, default=TrainConfig.eval_windows)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench-optimizers")
    args = ap.parse_args(argv)
    rows = []
    for name, lr in (("muon", args.lr), ("adamw", args.adamw_lr or args.lr)):
        cfg = TrainConfig(preset=args.preset, data=args.data, out=f"{args.out}/{name}", steps=args.steps, lr=lr,
                          optimizer=name, seq_len=args.seq_len, batch_size=args.batch_size,
                          eval_windows=args.eval_windows, threads=args.threads, seed=args.seed,
                          eval_every=max(1, args.steps // 4), sample_tokens=0, quiet=True)
        print(f"running {name} ({args.steps} steps, lr {lr:g}) ...", flush=True)
        s = train(cfg)
        curve = [(h["step"], h["val_loss"]) for h in _history(cfg.out) if "val_loss" in h]
        rows.append({"optimizer": name, "lr": lr, "steps": s["steps"], "tokens": s["tokens"],
                     "val_loss": s["val_loss"], "val_bpb": s["val_bpb"], "val_loss_qdq": s.get("val_loss_qdq"),
                     "tok_per_s": s["tok_per_s"], "val_curve": curve, "loss_curve": s["loss_curve"]})
    hdr = f"{'optimizer':<10}{'lr':>9}{'steps':>7}{'tokens':>10}{'val loss':>10}{'bits/byte':>11}{'tok/s':>8}  curve"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        curve = " ".join(f"{v:.3f}" for _, v in r["val_curve"])
        print(f"{r['optimizer']:<10}{r['lr']:>9.2g}{r['steps']:>7}{r['tokens']:>10,}{r['val_loss']:>10.4f}"
              f"{r['val_bpb']:>11.4f}{r['tok_per_s']:>8.0f}  {curve}")
    delta = rows[1]["val_loss"] - rows[0]["val_loss"]
    print(f"AdamW minus Muon+Sinkhorn validation loss: {delta:+.4f} nats/token")
    print(json.dumps({"benchmark": "train_optimizers", "preset": args.preset, "steps": args.steps,
                      "seq_len": args.seq_len, "batch_size": args.batch_size, "rows": rows,
                      "adamw_minus_muon_val_loss": delta}))
    return 0


def _history(out: str) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "log.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    raise SystemExit(main())
