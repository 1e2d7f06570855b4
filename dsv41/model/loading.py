"""Checkpoints: the official release layout (read and write) and our own format (docs/model.md §9).

Official layout: a directory with `config.json` (either spelling), `*.safetensors` shards (optionally a
`model.safetensors.index.json`) holding the official tensor names, with
  fp8 Linear      `X.weight` F8_E4M3 [out,in] + `X.scale` F8_E8M0 [ceil(out/32), ceil(in/32)] (32x32 tiles),
  fp4 experts     `X.weight` I8 [out,in/2] (two E2M1 codes a byte, even element low) + `X.scale` F8_E8M0 [out,in/32],
  Engram table    `engram.embed.weight` F8_E4M3 [rows,hd] + `engram.embed.scale` F8_E8M0 [rows,hd/32],
  everything else plain bf16 / fp32 tensors.
A model holds its quantized weights dequantized (storage "dense", exact in bf16: loading = decode + copy) or as
the checkpoint stores them (storage "packed", `dsv41/model/packed_weights.py`: loading = a byte copy). Either way
the shards are read one tensor at a time through a memory map (`dsv41/model/shards.py`), so a packed load needs
about the model's own bytes and no dequantized copy. The writer quantizes (power-of-two e8m0 scales, RNE codes)
and is used by tests to make official-format checkpoints. `attn.wo_a` is fp8 in the checkpoint and dequantized to
bf16 at load, as upstream convert.py does. Tied copies `mtp.*.embed.weight` / `mtp.*.head.weight` are accepted and
dropped.

Our own format: `config.json` (official spelling) + `model.safetensors` with every tensor as held by the model
(a dense model's floats, or a packed model's codes + scales under the checkpoint's names), plus optional
`tokenizer.json`; either loads into either storage.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41.codecs.weights import CODECS, non_finite_codes, stored_shapes
from dsv41.config import ModelConfig
from dsv41.model.common import Linear, weight_storage
from dsv41.model.engram import PackedTable
from dsv41.model.shards import ShardReader

OWN_FORMAT = "dsv41"
FP32_PLAIN = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$")
TIED_COPIES = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")


# ------------------------------------------------------------------------------------------------ storage map

class Slot(NamedTuple):
    """Where a checkpoint weight's values live in the model."""

    tensor: torch.Tensor                  # the dense parameter, or the packed codes buffer
    scales: torch.Tensor | None           # the packed scales buffer (None: dense)
    shape: tuple[int, ...]                # the weight's (dequantized) shape


def weight_slots(model: torch.nn.Module) -> dict[str, Slot]:
    """Checkpoint weight name -> its Slot: a dense parameter, or a packed weight's codes and scales buffers
    (`X.weight`, `X.scale`). Every weight of the checkpoint once; scales are not listed apart."""
    out = {n: Slot(p, None, tuple(p.shape)) for n, p in model.named_parameters()}
    for n, m in model.named_modules():
        if isinstance(m, Linear) and m.packed:
            out[f"{n}.weight"] = Slot(m.weight, m.scale, (m.out_features, m.in_features))
        elif isinstance(m, PackedTable):
            out[f"{n}.weight"] = Slot(m.weight, m.scale, tuple(m.weight.shape))
    return out


def storage_map(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, str]:
    """Parameter name -> official storage: 'fp8' (weight + 32x32 scale), 'fp4' (packed + per-32 scale),
    'fp8_rows' (Engram table, per-32 scale along rows), 'f32' or 'bf16' (plain)."""
    linear_kinds = {f"{name}.weight": "fp8" if name.endswith("attn.wo_a") and cfg.dtype == "fp8" else mod.kind
                    for name, mod in model.named_modules() if isinstance(mod, Linear) and mod.bias is None}
    out: dict[str, str] = {}
    for name in weight_slots(model):
        if linear_kinds.get(name) in ("fp8", "fp4"):
            out[name] = linear_kinds[name]
        elif name.endswith("engram.embed.weight"):
            out[name] = "fp8_rows"
        elif FP32_PLAIN.search(name) or (name.startswith("vision.") and "norm" in name):
            out[name] = "f32"
        else:
            out[name] = "bf16"
    return out


def scale_name(weight_name: str) -> str:
    """`X.weight` -> `X.scale`: where a quantized weight's scales are stored."""
    return weight_name.removesuffix("weight") + "scale"


def representable(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Round every quantized-storage weight of `model` in place to what the official layout can hold, so
    that writing then loading is the identity (used for random models meant to be written)."""
    slots = weight_slots(model)
    with torch.no_grad():
        for name, kind in storage_map(model, cfg).items():
            p, scales, _ = slots[name]
            if scales is not None:                     # packed: representable by construction
                continue
            if kind in CODECS:
                quant, dequant = CODECS[kind]
                p.copy_(dequant(*quant(p)))
            elif kind == "bf16":
                p.copy_(p.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------ official read

def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {path}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k in out:
                    raise ValueError(f"checkpoint {path}: tensor {k!r} appears in two shards")
                out[k] = st.get_tensor(k)
    return out


def is_own_format(path: Path) -> bool:
    f = path / "model.safetensors"
    if not f.is_file():
        return False
    with safe_open(str(f), "pt") as st:
        return (st.metadata() or {}).get("format") == OWN_FORMAT


def _check(name: str, kind: str, shape: tuple[int, ...], reader: ShardReader, used: set[str]) -> None:
    """ValueError naming the offending tensor unless the checkpoint holds parameter `name` (of `shape`) as `kind`
    stores it; the names read are added to `used`. Headers only: nothing is read."""
    def info(n: str):
        if n not in reader:
            raise ValueError(f"missing tensor {n!r}")
        used.add(n)
        return reader.info(n)

    dtype, got = info(name)
    if kind not in CODECS:
        if got != tuple(shape):
            raise ValueError(f"tensor {name!r}: got shape {got}, want {tuple(shape)}")
        if not dtype.is_floating_point:
            raise ValueError(f"tensor {name!r}: got dtype {dtype}, want a float tensor")
        return
    sname = scale_name(name)
    _, sgot = info(sname)
    want_w, want_s = stored_shapes(kind, *shape)
    ok_dtype = (dtype in (torch.int8, torch.uint8) or "float4" in str(dtype) if kind == "fp4"
                else dtype in (torch.float8_e4m3fn, torch.uint8))
    if got != want_w or not ok_dtype:
        raise ValueError(f"tensor {name!r}: got {dtype} {got}, want {kind} {want_w}")
    if sgot != want_s:
        raise ValueError(f"tensor {sname!r}: got shape {sgot}, want {want_s}")


def _load_weight(name: str, kind: str, slot: Slot, reader: ShardReader) -> None:
    """Copy checkpoint weight `name` into its slot, one tensor resident at a time: packed codes and scales byte for
    byte into a packed slot (or quantized from a float tensor of our own format), decoded into a dense one;
    ValueError for non-finite values."""
    dst, dst_scale, _ = slot
    stored = kind in CODECS and scale_name(name) in reader
    if not stored:                                   # a plain tensor (or a dense one of our own format)
        with reader.tensor(name) as t:
            if not torch.isfinite(t).all():
                raise ValueError(f"tensor {name!r}: non-finite values")
            if dst_scale is None:
                dst.copy_(t)
            else:
                codes, scales = CODECS[kind][0](t)
                dst.copy_(codes.view(torch.uint8))
                dst_scale.copy_(scales.view(torch.uint8))
        return
    with reader.tensor(name) as w, reader.tensor(scale_name(name)) as s:
        if non_finite_codes(kind, w, s):
            raise ValueError(f"tensor {name!r}: non-finite values")
        if dst_scale is not None:
            dst.copy_(w.view(torch.uint8))
            dst_scale.copy_(s.view(torch.uint8))
        else:
            dst.copy_(CODECS[kind][1](w, s))


def load_official_state(model: torch.nn.Module, cfg: ModelConfig, reader: ShardReader) -> None:
    """Copy official-layout tensors into `model` tensor by tensor (packed slots take the bytes as stored, dense
    ones the decoded values); every problem is one ValueError naming each offending tensor."""
    slots = weight_slots(model)
    problems: list[str] = []
    used: set[str] = set()
    smap = storage_map(model, cfg)
    for name, kind in smap.items():
        try:
            _check(name, kind, slots[name].shape, reader, used)
        except ValueError as e:
            problems.append(str(e))
    problems += [f"unexpected tensor {k!r}" for k in reader.keys() if k not in used and not TIED_COPIES.match(k)]
    if not problems:
        order = {k: i for i, k in enumerate(reader.keys())}
        with torch.no_grad():
            for name, kind in sorted(smap.items(), key=lambda item: order[item[0]]):    # each file read once
                try:
                    _load_weight(name, kind, slots[name], reader)
                except (ValueError, RuntimeError, TypeError) as e:
                    problems.append(str(e) if isinstance(e, ValueError) else f"tensor {name!r}: cannot decode ({e})")
    if problems:
        raise ValueError(f"bad checkpoint ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))


# ------------------------------------------------------------------------------------------------ official write

def official_tensors(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The official layout's tensors of `model`: quantized weights as codes + scales (a packed model's own bytes,
    a dense model's weights quantized as the release stores them), the rest plain bf16 / fp32."""
    slots = weight_slots(model)
    out: dict[str, torch.Tensor] = {}
    for name, kind in storage_map(model, cfg).items():
        p, scales, _ = slots[name]
        p = p.detach()
        if scales is not None:
            out[name] = p.view(torch.int8 if kind == "fp4" else torch.float8_e4m3fn)
            out[scale_name(name)] = scales.view(torch.float8_e8m0fnu)
        elif kind in CODECS:
            out[name], out[scale_name(name)] = CODECS[kind][0](p)
        else:
            out[name] = p.to(torch.float32 if kind == "f32" else torch.bfloat16).contiguous()
    return out


def write_official(model: torch.nn.Module, cfg: ModelConfig, path: str | Path, shards: int = 2,
                   tokenizer_json: str | Path | None = None) -> Path:
    """Write `model` in the official release layout (config.json in the official spelling, N shards and
    model.safetensors.index.json). Weights are quantized as the release stores them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg_d = {k: v for k, v in cfg.to_dict().items() if k != "max_seq_len"}
    (path / "config.json").write_text(json.dumps(cfg_d, indent=2) + "\n")
    tensors = official_tensors(model, cfg)
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(tensors[k].numel() * tensors[k].element_size() for k in weight_map)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    _copy_tokenizer(tokenizer_json, path)
    return path


def _copy_tokenizer(tokenizer_json: str | Path | None, path: Path) -> None:
    if tokenizer_json is not None and Path(tokenizer_json).resolve() != (path / "tokenizer.json").resolve():
        (path / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())


# ------------------------------------------------------------------------------------------------ our format

def save_checkpoint(model: torch.nn.Module, cfg: ModelConfig, path: str | Path, extra_meta: dict | None = None,
                    tokenizer_json: str | Path | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg.to_json(path / "config.json")
    meta = {"format": OWN_FORMAT, **{k: str(v) for k, v in (extra_meta or {}).items()}}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata=meta)
    _copy_tokenizer(tokenizer_json, path)
    return path


def load_own_state(model: torch.nn.Module, cfg: ModelConfig, reader: ShardReader, path: Path) -> None:
    """Copy our own format's tensors into `model` tensor by tensor. Quantized weights may be stored either way
    (dense floats: a trained model; codes + scales: a packed one) and are converted to the model's storage."""
    slots, smap = weight_slots(model), storage_map(model, cfg)
    state = model.state_dict()
    scales = {scale_name(n) for n, k in smap.items() if k in CODECS}
    want = {n for n in state if n not in scales} | set(slots)
    have = {k for k in reader.keys() if k not in scales}
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path}: missing {missing}, unexpected {unexpected}")
    order = {k: i for i, k in enumerate(reader.keys())}
    with torch.no_grad():
        for name in sorted(want, key=order.__getitem__):
            stored = name in slots and smap[name] in CODECS and scale_name(name) in reader
            shape = slots[name].shape if name in slots else tuple(state[name].shape)
            if not stored and reader.info(name)[1] != shape:
                raise ValueError(f"checkpoint {path}: tensor {name!r} has shape {reader.info(name)[1]}, want {shape}")
            if name in slots:
                _load_weight(name, smap[name], slots[name], reader)
            else:                                             # a persistent buffer
                with reader.tensor(name) as t:
                    state[name].copy_(t)


ENGRAM_HOST_BYTES = 1 << 30     # "auto": packed Engram tables larger than this stay in host memory on a GPU


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               storage: str = "dense", engram_tables: str = "auto"):
    """Load a checkpoint directory (official layout or ours) -> (model, cfg). Engram's token map comes from
    the directory's tokenizer.json when the model has Engram and the file exists.

    storage "dense": quantized weights held dequantized (training, today's GPU kernels); "packed": held as the
    checkpoint stores them (docs/model.md §9), the model built packed and the shards read tensor by tensor through
    a memory map, so that loading needs about the model's own bytes (`benchmarks/load_memory.py`).

    engram_tables (packed storage): "host" keeps the Engram tables in host memory, their looked-up rows prefetched
    to the device each step (`dsv41.model.engram.prefetch_host_rows`); "device" moves them with the model (small
    models, tests); "auto" = host when the device is a GPU and the tables exceed `ENGRAM_HOST_BYTES`."""
    from dsv41.config import load_config
    from dsv41.model.transformer import Transformer

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path}: not a directory")
    cfg = load_config(path)
    token_map = None
    tok = path / "tokenizer.json"
    if cfg.engram_enabled and tok.is_file():
        from tokenizers import Tokenizer

        from dsv41.model.engram import build_compressed_token_map
        token_map = build_compressed_token_map(Tokenizer.from_file(str(tok)))     # the hasher checks its size
    with weight_storage(storage):
        model = Transformer(cfg, dtype=dtype, token_map=token_map)
    with ShardReader(path) as reader:
        if is_own_format(path):
            load_own_state(model, cfg, reader, path)
        else:
            load_official_state(model, cfg, reader)
    if storage == "packed" and engram_host(model, engram_tables, torch.device(device)):
        from dsv41.model.packed_weights import engram_tables_on_host
        engram_tables_on_host(model)
    return model.to(device), cfg


def engram_host(model: torch.nn.Module, choice: str, device: torch.device) -> bool:
    """Whether a packed model's Engram tables stay in host memory (`load_model`'s engram_tables)."""
    if choice not in ("auto", "host", "device"):
        raise ValueError(f"engram_tables must be 'auto', 'host' or 'device', got {choice!r}")
    if choice != "auto":
        return choice == "host"
    from dsv41.model.packed_weights import resident_weight_bytes
    return device.type == "cuda" and resident_weight_bytes(model)["engram_tables"] > ENGRAM_HOST_BYTES
