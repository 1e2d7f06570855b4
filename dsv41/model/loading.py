"""Checkpoints: the official release layout (read and write) and our own format (docs/model.md §9).

Official layout: a directory with `config.json` (either spelling), `*.safetensors` shards (optionally a
`model.safetensors.index.json`) holding the official tensor names, with
  fp8 Linear      `X.weight` F8_E4M3 [out,in] + `X.scale` F8_E8M0 [ceil(out/32), ceil(in/32)] (32x32 tiles),
  fp4 experts     `X.weight` I8 [out,in/2] (two E2M1 codes a byte, even element low) + `X.scale` F8_E8M0 [out,in/32],
  Engram table    `engram.embed.weight` F8_E4M3 [rows,hd] + `engram.embed.scale` F8_E8M0 [rows,hd/32],
  everything else plain bf16 / fp32 tensors.
Our model holds every weight dequantized (exact in bf16), so loading = decode + copy; the writer quantizes
(power-of-two e8m0 scales, RNE codes) and is used by tests to make official-format checkpoints. `attn.wo_a`
is fp8 in the checkpoint and dequantized to bf16 at load, as upstream convert.py does. Tied copies
`mtp.*.embed.weight` / `mtp.*.head.weight` are accepted and dropped.

Our own format: `config.json` (official spelling) + `model.safetensors` with every parameter as stored in the
model (float), plus optional `tokenizer.json`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41.codecs import (e2m1_to_float, e4m3_to_float, e8m0_to_float, float_to_e2m1, float_to_e4m3,
                          float_to_e8m0, pack_nibbles, unpack_nibbles)
from dsv41.config import ModelConfig
from dsv41.model.common import Linear

OWN_FORMAT = "dsv41"
FP32_PLAIN = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$")
TIED_COPIES = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")


# ------------------------------------------------------------------------------------------------ storage map

def storage_map(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, str]:
    """Parameter name -> official storage: 'fp8' (weight + 32x32 scale), 'fp4' (packed + per-32 scale),
    'fp8_rows' (Engram table, per-32 scale along rows), 'f32' or 'bf16' (plain)."""
    linear_kinds = {f"{name}.weight": "fp8" if name.endswith("attn.wo_a") and cfg.dtype == "fp8" else mod.kind
                    for name, mod in model.named_modules() if isinstance(mod, Linear) and mod.bias is None}
    out: dict[str, str] = {}
    for name, _ in model.named_parameters():
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


# ------------------------------------------------------------------------------------------------ quantizers

def _tile_scales(scale: torch.Tensor, rows: int, cols: int, tile: int) -> torch.Tensor:
    return scale.repeat_interleave(tile, 0)[:rows].repeat_interleave(tile, 1)[:, :cols]


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, tile: int = 32) -> torch.Tensor:
    w = e4m3_to_float(weight)
    return w * _tile_scales(e8m0_to_float(scale), *w.shape, tile)


def _row_scaled(w: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return w * e8m0_to_float(scale).repeat_interleave(group, 1)[:, :w.size(1)]


def dequant_fp4(weight: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    return _row_scaled(e2m1_to_float(unpack_nibbles(weight.view(torch.uint8))), scale, group)


def dequant_rows(weight: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    return _row_scaled(e4m3_to_float(weight), scale, group)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (s >= 2^-127), as the release's weight scales."""
    amax = amax.float().clamp_min(2.0 ** -120)
    return torch.exp2(torch.ceil(torch.log2(amax / qmax))).clamp(2.0 ** -127, 2.0 ** 127)


def quant_fp8(w: torch.Tensor, tile: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out,in] -> (e4m3 bytes [out,in], e8m0 bytes [ceil(out/32), ceil(in/32)])."""
    w = w.float()
    R, C = w.shape
    pr, pc = -R % tile, -C % tile
    t = torch.nn.functional.pad(w, (0, pc, 0, pr)).view((R + pr) // tile, tile, (C + pc) // tile, tile)
    s = _pow2_scale(t.abs().amax(dim=(1, 3)), 448.0)
    codes = float_to_e4m3(w / _tile_scales(s, R, C, tile))
    return codes.view(torch.float8_e4m3fn), float_to_e8m0(s).view(torch.float8_e8m0fnu)


def _quant_row_groups(w: torch.Tensor, group: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out,in] -> (values divided by their scale [out,in], e8m0 bytes [out,in/group]): one power-of-two
    scale per `group` along each row, the smallest that brings the group's amax within qmax."""
    w = w.float()
    R, C = w.shape
    g = w.view(R, C // group, group)
    s = _pow2_scale(g.abs().amax(-1), qmax)
    return (g / s.unsqueeze(-1)).view(R, C), float_to_e8m0(s).view(torch.float8_e8m0fnu)


def quant_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out,in] -> (int8 [out,in/2] two E2M1 codes a byte, e8m0 bytes [out,in/32])."""
    x, s = _quant_row_groups(w, group, 6.0)
    return pack_nibbles(float_to_e2m1(x.clamp(-6, 6))).view(torch.int8), s


def quant_rows(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out,in] -> (e4m3 bytes [out,in], e8m0 bytes [out,in/32]): the Engram table's storage."""
    x, s = _quant_row_groups(w, group, 448.0)
    return float_to_e4m3(x).view(torch.float8_e4m3fn), s


# quantized storage kind -> (quantizer, decoder, (codes shape, scales shape) of an [R, C] parameter)
CODECS = {
    "fp8": (quant_fp8, dequant_fp8, lambda R, C: ((R, C), (math.ceil(R / 32), math.ceil(C / 32)))),
    "fp4": (quant_fp4, dequant_fp4, lambda R, C: ((R, C // 2), (R, C // 32))),
    "fp8_rows": (quant_rows, dequant_rows, lambda R, C: ((R, C), (R, C // 32))),
}


def representable(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Round every quantized-storage weight of `model` in place to what the official layout can hold, so
    that writing then loading is the identity (used for random models meant to be written)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, kind in storage_map(model, cfg).items():
            p = params[name]
            if kind in CODECS:
                quant, dequant, _ = CODECS[kind]
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


def _decode(name: str, kind: str, shape: torch.Size, tensors: dict[str, torch.Tensor], used: set[str]):
    """One parameter from the official tensors (the names read are added to `used`); ValueError naming the
    offending tensor."""
    def take(n: str) -> torch.Tensor:
        if n not in tensors:
            raise ValueError(f"missing tensor {n!r}")
        used.add(n)
        return tensors[n]

    t = take(name)
    if kind not in CODECS:
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r}: got shape {tuple(t.shape)}, want {tuple(shape)}")
        if not t.is_floating_point():
            raise ValueError(f"tensor {name!r}: got dtype {t.dtype}, want a float tensor")
        return t.float()
    sname = scale_name(name)
    s = take(sname)
    _, decode, shapes = CODECS[kind]
    want_w, want_s = shapes(*shape)
    ok_dtype = (t.dtype in (torch.int8, torch.uint8) or "float4" in str(t.dtype) if kind == "fp4"
                else t.dtype in (torch.float8_e4m3fn, torch.uint8))
    if tuple(t.shape) != want_w or not ok_dtype:
        raise ValueError(f"tensor {name!r}: got {t.dtype} {tuple(t.shape)}, want {kind} {want_w}")
    if tuple(s.shape) != want_s:
        raise ValueError(f"tensor {sname!r}: got shape {tuple(s.shape)}, want {want_s}")
    return decode(t, s)


def load_official_state(model: torch.nn.Module, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Decode official-layout tensors into `model`'s parameters; every problem is one ValueError naming
    each offending tensor."""
    params = dict(model.named_parameters())
    problems: list[str] = []
    used: set[str] = set()
    decoded: dict[str, torch.Tensor] = {}
    for name, kind in storage_map(model, cfg).items():
        try:
            dec = _decode(name, kind, params[name].shape, tensors, used)
            if not torch.isfinite(dec).all():
                raise ValueError(f"tensor {name!r}: non-finite values")
            decoded[name] = dec
        except ValueError as e:
            problems.append(str(e))
        except (RuntimeError, TypeError) as e:
            problems.append(f"tensor {name!r}: cannot decode ({e})")
    problems += [f"unexpected tensor {k!r}" for k in sorted(tensors) if k not in used and not TIED_COPIES.match(k)]
    if problems:
        raise ValueError(f"bad checkpoint ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for name, dec in decoded.items():
            params[name].copy_(dec.to(params[name].dtype))


# ------------------------------------------------------------------------------------------------ official write

def official_tensors(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    smap = storage_map(model, cfg)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        kind, p = smap[name], p.detach()
        if kind in CODECS:
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


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a checkpoint directory (official layout or ours) -> (model, cfg). Engram's token map comes from
    the directory's tokenizer.json when the model has Engram and the file exists."""
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
    model = Transformer(cfg, dtype=dtype, token_map=token_map)
    if is_own_format(path):
        tensors = read_tensors(path)
        missing = sorted(set(model.state_dict()) - set(tensors))
        unexpected = sorted(set(tensors) - set(model.state_dict()))
        if missing or unexpected:
            raise ValueError(f"checkpoint {path}: missing {missing}, unexpected {unexpected}")
        model.load_state_dict(tensors)
    else:
        load_official_state(model, cfg, read_tensors(path))
    return model.to(device), cfg
