"""The post preset's SFT step on the CPU, side by side in one run: one process vs data-parallel workers, and the
Sinkhorn projection of the fast training forward in its [S,S,N] layout vs the token-major [..,S,S] loop it replaced.

    python benchmarks/sft_step.py                 # prints JSON; RESULT=path also writes it
    STEPS=24 WARM=4 WORKERS=2 python benchmarks/sft_step.py

Rows:
- `sft`: seconds per step of `posttrain sft`'s loop body (batch of the pipeline's recipe: 16 rows, the plan head,
  dense levels) in one process with one thread per worker, and with WORKERS gloo ranks each on its part of the
  batch (`sft.rank_part`, gradients all-reduced: `sft._allreduce_grads`); the mean over STEPS after WARM steps, the
  slowest rank's per step; the speed-up is the ratio of the two in this run.
- `sinkhorn`: forward + backward of `SinkhornFn` on the comb logits of one mHC site at that batch ([16, 63, 4, 4],
  20 iterations) vs the same iterations with autograd-free explicit backward over the token-major layout (the
  previous `SinkhornFn`, written here as the baseline), microseconds per call, median of 5 rounds of 20 calls.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, WARM, WORKERS = (int(os.environ.get(k, d)) for k, d in (("STEPS", 24), ("WARM", 4), ("WORKERS", 2)))


def _steps(rank: int, world: int, rendezvous: str | None, queue) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    from dsv41.model.common import set_quantization
    from dsv41.posttrain.model import build_model
    from dsv41.posttrain.sft import TaskMix, _allreduce_grads, rank_part, sft_batch, sft_loss
    from dsv41.posttrain.tokenizer import load_post_tokenizer
    with tempfile.TemporaryDirectory() as d:
        tok = load_post_tokenizer(d)
    model = build_model(tok, 0).train()
    set_quantization(model, False)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))
    mix = TaskMix(levels=tuple(b for b in range(1, 101) if b not in (12, 37, 62, 87)))
    times = []
    for step in range(WARM + STEPS):
        t0 = time.perf_counter()
        ids, tg = sft_batch(0, step, tok, mix, 16, 0.8, (0.7, 0.3), True, True, True, True)
        ids, tg, share, rows = rank_part(ids, tg, rank, world)
        _, total = sft_loss(model, ids, tg, 1.0, share, rows)
        opt.zero_grad(set_to_none=True)
        total.backward()
        if world > 1:
            _allreduce_grads(params, [0.0])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    queue.put((rank, times[WARM:]))
    if world > 1:
        dist.destroy_process_group()


def sft_row(world: int) -> float:
    """Seconds per step with `world` processes (the slowest rank's time of each step, averaged)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_steps, args=(r, world, os.path.join(d, "rdv"), q)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
    per_step = [max(got[r][i] for r in got) for i in range(STEPS)]
    return sum(per_step) / STEPS


def _token_major(z: torch.Tensor, g: torch.Tensor, iters: int, eps: float):
    """The previous SinkhornFn: the same iterations and explicit backward (of the upstream gradient g) over [..,S,S]
    (strided S-sums); returns the gradient of z."""
    e = torch.exp(z - z.amax(dim=-1, keepdim=True))
    sm = e / e.sum(dim=-1, keepdim=True)
    a, saved = sm + eps, []
    for k in range(2 * iters - 1):
        r = a.sum(dim=-2 if k % 2 == 0 else -1, keepdim=True) + eps
        a = a / r
        saved += [a, r]
    for k in range(len(saved) // 2 - 1, -1, -1):
        a_k, r = saved[2 * k], saved[2 * k + 1]
        g = (g - (g * a_k).sum(dim=-2 if k % 2 == 0 else -1, keepdim=True)) / r
    return sm * (g - (g * sm).sum(dim=-1, keepdim=True))


def sinkhorn_rows() -> dict:
    from dsv41.train.fast import SinkhornFn
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    z0, g0 = torch.randn(16, 63, 4, 4, generator=gen), torch.randn(16, 63, 4, 4, generator=gen)

    def ours():
        z = z0.clone().requires_grad_(True)
        SinkhornFn.apply(z, 20, 1e-6).backward(g0)
        return z.grad

    def base():
        return _token_major(z0, g0, 20, 1e-6)

    def us(f):
        f()
        rounds = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20):
                f()
            rounds.append((time.perf_counter() - t) / 20 * 1e6)
        return statistics.median(rounds)

    ref = base()
    diff = float((ours() - ref).abs().max() / ref.abs().max())
    a, b = us(ours), us(base)
    return {"layout_SSN_us": round(a, 1), "token_major_us": round(b, 1), "speedup": round(b / a, 2),
            "max_grad_diff_rel": diff}


def main() -> int:
    one = sft_row(1)
    many = sft_row(WORKERS)
    res = {"cpu": (os.popen("lscpu | grep 'Model name'").read().split(":")[-1].strip() or "?"),
           "cores": os.cpu_count(), "steps": STEPS, "warm": WARM,
           "sft": {"one_process_s_per_step": round(one, 4), f"{WORKERS}_workers_s_per_step": round(many, 4),
                   "speedup": round(one / many, 2)},
           "sinkhorn": sinkhorn_rows()}
    print(json.dumps(res, indent=2))
    if os.environ.get("RESULT"):
        with open(os.environ["RESULT"], "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
