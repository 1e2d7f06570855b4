"""Where `dsv41 serve` runs its model: the device (`--device cpu | cuda | cuda:N`), the dtype (bfloat16 on a GPU,
float32 on a CPU, unless --dtype says otherwise), the weights (a checkpoint, or `--random-weights` of a preset
`--config`: the serving benchmark's model at the released geometry, no checkpoint to write or read) and the kernel
backend (`--kernels`, else $DSV41_KERNELS; auto picks the Triton kernels for CUDA bf16 inputs, `dsv41.kernels.backend`).

The model is built on its device before the engine, so the engine's KV pool (the packed store when quantization is
on, `dsv41.engine.store.make_pool`) and every step live there too. Under `torchrun` the ranks place their shards
themselves (`dsv41.parallel.lockstep.serving_engine`), so these flags keep their defaults there.
"""

from __future__ import annotations

import argparse

import torch

from dsv41.config import PRESETS, parse_dtype
from dsv41.kernels import BACKENDS, set_backend


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu); a GPU defaults --dtype to "
                   "bfloat16 and, with --kernels auto, runs the Triton kernels")
    p.add_argument("--random-weights", action="store_true",
                   help="serve a model of --config with random checkpoint-like weights instead of a checkpoint "
                        "(benchmarks: the serving path at a geometry without its weights)")
    p.add_argument("--config", default=None, help=f"preset for --random-weights: one of {', '.join(PRESETS)} or a "
                   "config JSON path")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-weights")
    p.add_argument("--kernels", choices=list(BACKENDS), default=None,
                   help="kernel backend: auto (Triton on CUDA bf16, the torch references otherwise), torch, triton "
                        "(default: $DSV41_KERNELS, else auto)")
    p.set_defaults(dtype=None)                 # resolved by `resolve_dtype`: bfloat16 on a GPU, float32 on a CPU


def resolve_device(name: str) -> torch.device:
    """The torch device `--device` names; ValueError for a CUDA device this machine does not have."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: not a device name ({e})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, built "
                             f"{'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}, "
                             "torch.cuda.is_available() is False); serve on --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(args: argparse.Namespace) -> str:
    """--dtype as given, else bfloat16 on a GPU and float32 on a CPU (written back into args)."""
    if args.dtype is None:
        args.dtype = "bfloat16" if str(getattr(args, "device", "cpu")).startswith("cuda") else "float32"
    parse_dtype(args.dtype)
    return args.dtype


def check_weight_flags(args: argparse.Namespace) -> None:
    """Exactly one source of weights: --checkpoint, or --random-weights with --config."""
    if args.random_weights:
        if args.checkpoint is not None:
            raise ValueError(f"--random-weights and --checkpoint {args.checkpoint}: give one of them")
        if args.config is None:
            raise ValueError("--random-weights needs --config PRESET (e.g. v41-geometry, tiny, debug)")
    elif args.checkpoint is None:
        raise ValueError("give --checkpoint DIR, or --random-weights --config PRESET")
    elif args.config is not None:
        raise ValueError(f"--config {args.config} only applies with --random-weights (a checkpoint has its own)")


def serving_model(args: argparse.Namespace):
    """The model `dsv41 serve` runs for these flags, on its device, in eval mode."""
    from dsv41.config import load_config
    from dsv41.model.init import random_model
    from dsv41.model.loading import load_model
    from dsv41.model.packed_weights import pack_weights

    check_weight_flags(args)
    device = resolve_device(args.device)
    dtype = parse_dtype(resolve_dtype(args))
    if args.kernels is not None:
        set_backend(args.kernels)
    if not args.random_weights:
        return load_model(args.checkpoint, dtype=dtype, device=device, storage=args.storage,
                          engram_tables=args.engram_tables)[0]
    model = random_model(load_config(args.config), dtype=dtype, seed=args.seed, device=device)
    if args.storage == "packed":
        pack_weights(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()                # the dense copies the packing replaced
    return model
