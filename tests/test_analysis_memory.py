"""`dsv41 analyze memory` (dsv41.analysis.memory): weight bytes by checkpoint storage kind, Engram host bytes, KV for
a context, the split over devices and the fit.

The analysis derives everything from the config. The tests check it against an independent count: a model built
by `dsv41.model` (its parameter names and shapes, the storage kinds its Linears record, the dtypes it holds) and
the tensors the official-layout writer produces for it (`dsv41.model.loading.official_tensors`)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from dsv41 import cli
from dsv41.analysis import kv_bytes, params
from dsv41.analysis.memory import (H200_USABLE_BYTES, TensorSpec, checkpoint_tensors, code_and_scale_bytes,
                                   kv_memory, memory_report)
from dsv41.config import load_config
from dsv41.model.common import Linear
from dsv41.model.init import random_model
from dsv41.model.loading import CODECS, official_tensors, scale_name, storage_map
from dsv41.model.transformer import Transformer

FLASH = load_config("v41-flash")
GEOM = load_config("v41-geometry")

# Small configs covering every storage switch: fp8 / bf16 Linears, fp4 / fp8 / bf16 (null) experts, with and without
# vision, DSpark and Engram, and widths that are not multiples of 32 (ceil of the fp8 tile count).
VARIANTS = {
    "tiny": ("tiny", {}),
    "debug": ("debug", {}),
    "debug-bf16-linears": ("debug", {"dtype": "bf16"}),
    "debug-fp8-experts-odd-widths": ("debug", {"expert_dtype": "fp8", "moe_inter_dim": 48, "q_lora_rank": 40}),
    "debug-bf16-experts": ("debug", {"expert_dtype": None}),
    "debug-no-vision-dspark-engram": ("debug", {"vision_n_layers": 0, "n_mtp_layers": 0, "engram_layer_ids": []}),
}


def variant(key: str):
    name, changes = VARIANTS[key]
    return load_config(name).replace(**changes)


def expand(tensors: list[TensorSpec]) -> dict[str, TensorSpec]:
    """name -> spec, one entry per tensor (a routed-expert set's `{e}` expanded)."""
    return {t.name.format(e=e): t for t in tensors for e in range(t.count)}


def held_kind_from_model(model: torch.nn.Module) -> dict[str, str]:
    """The held storage kind of every parameter, read off a model built in bfloat16: the kind its Linear records
    (fp8 / fp4 / bf16 / fp32: `wo_a` is bf16 there, as the official load converts it), e4m3 rows for the Engram
    tables, and the dtype the model keeps for every other tensor (fp32 where it holds fp32)."""
    kinds = {f"{n}.weight": m.kind for n, m in model.named_modules() if isinstance(m, Linear)}
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("engram.embed.weight"):
            out[name] = "fp8_rows"
        else:
            out[name] = kinds.get(name) or ("fp32" if p.dtype == torch.float32 else "bf16")
    return out


def report_category(name: str, kind: str) -> str:
    if kind == "fp8_rows":
        return "engram_tables"
    return f"experts_{kind}" if ".ffn.experts." in name else kind


# ------------------------------------------------------------------------------------------ the tensor list

def check_tensor_list(cfg, model: torch.nn.Module) -> None:
    """Every parameter of the built model (bfloat16), with its shape, held kind and file kind, and nothing else."""
    specs = expand(checkpoint_tensors(cfg))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert sorted(specs) == sorted(shapes)
    assert {n: s.shape for n, s in specs.items()} == shapes
    assert {n: s.kind for n, s in specs.items()} == held_kind_from_model(model)
    file_kinds = {n: {"f32": "fp32"}.get(k, k) for n, k in storage_map(model, cfg).items()}
    assert {n: s.file_kind for n, s in specs.items()} == file_kinds
    routed = {n for n, s in specs.items() if s.routed}
    assert routed == {n for n in shapes if ".ffn.experts." in n}


@pytest.mark.parametrize("key", list(VARIANTS))
def test_tensor_list_matches_the_model(key):
    cfg = variant(key)
    check_tensor_list(cfg, random_model(cfg, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", ["v41-geometry", pytest.param("v41-flash", marks=pytest.mark.slow)])
def test_tensor_list_and_today_bytes_at_full_size(name):
    """The released geometry, built without storage on the meta device (the Engram hasher needs real tensors, so
    Engram is left out here; the small configs cover it): same tensors, and today's holding to the byte."""
    cfg = load_config(name).replace(engram_layer_ids=[])
    with torch.device("meta"):
        model = Transformer(cfg, dtype=torch.bfloat16)
    check_tensor_list(cfg, model)
    assert memory_report(cfg)["today"]["bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("key", ["tiny", "debug", "debug-fp8-experts-odd-widths", "debug-bf16-linears"])
def test_weight_bytes_by_kind_match_the_written_checkpoint(key):
    """Bytes per report row equal the official writer's tensors (codes + `.scale`) for quantized kinds and 2 / 4
    bytes an element for plain ones; the file total equals what the writer produces; today's holding equals the
    bytes of the model's own parameters, in both model dtypes."""
    cfg = variant(key)
    model = random_model(cfg, dtype=torch.bfloat16)
    written = official_tensors(model, cfg)
    held = held_kind_from_model(model)
    by_row, codes, scales = Counter(), Counter(), Counter()
    for name, p in model.named_parameters():
        kind, row = held[name], report_category(name, held[name])
        if kind in CODECS:                       # same kind in the file (wo_a is held bf16, so never here)
            codes[row] += written[name].numel() * written[name].element_size()
            scales[row] += written[scale_name(name)].numel()
        else:
            codes[row] += p.numel() * (4 if kind == "fp32" else 2)
        by_row[row] = codes[row] + scales[row]
    r = memory_report(cfg)
    rows = {**r["weights"]["by_kind"], "engram_tables": r["engram_tables"]} if cfg.engram_enabled \
        else r["weights"]["by_kind"]
    assert {k: v["bytes"] for k, v in rows.items()} == dict(by_row)
    assert {k: v["code_bytes"] for k, v in rows.items()} == dict(codes)
    assert {k: v["scale_bytes"] for k, v in rows.items()} == {k: scales[k] for k in codes}
    assert r["weights"]["file_bytes"] == sum(t.numel() * t.element_size() for t in written.values())
    assert r["today"]["bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    if key == "tiny":
        m32 = random_model(cfg, dtype=torch.float32)
        assert memory_report(cfg, dtype="float32")["today"]["bytes"] == \
            sum(p.numel() * p.element_size() for p in m32.parameters())


@pytest.mark.parametrize("name", ["v41-flash", "v41-geometry", "tiny", "debug"])
def test_parameter_counts_agree_with_params(name):
    """The tensor list and `dsv41.analysis.params` (two derivations from the config) count the same parameters."""
    cfg = load_config(name)
    by_group = Counter()
    for t in checkpoint_tensors(cfg):
        by_group[t.group] += t.params
    p = params.params_report(cfg)
    assert by_group["backbone"] == p["backbone"]
    assert by_group["engram"] == p["engram"]                     # tables + wkv + q/k weights
    assert by_group["dspark"] == p["dspark"]
    assert by_group["vision"] == p["vision"]


# ------------------------------------------------------------------------------------------ format arithmetic

def test_scale_byte_arithmetic_by_hand():
    # fp8 Linear [4096, 1280] (indexer wq_b): 4096*1280 e4m3 + (4096/32)*(1280/32) = 128*40 tiles
    assert code_and_scale_bytes("fp8", (4096, 1280)) == (5_242_880, 5_120)
    # widths that are not multiples of 32 round the tile grid up: [33, 70] -> 2 x 3 tiles
    assert code_and_scale_bytes("fp8", (33, 70)) == (2_310, 6)
    # fp4 expert w1 [2304, 5120]: 2 codes a byte -> 2304*2560; one scale per row and 32 inputs -> 2304*160
    assert code_and_scale_bytes("fp4", (2304, 5120)) == (5_898_240, 368_640)
    # fp4 expert w2 [5120, 2304]: 5120*1152 + 5120*72
    assert code_and_scale_bytes("fp4", (5120, 2304)) == (5_898_240, 368_640)
    # Engram rows [10, 256]: 10*256 e4m3 + 10*8 e8m0
    assert code_and_scale_bytes("fp8_rows", (10, 256)) == (2_560, 80)
    assert code_and_scale_bytes("bf16", (3, 5)) == (30, 0) and code_and_scale_bytes("fp32", (7,)) == (28, 0)
    with pytest.raises(ValueError, match="fp6"):
        code_and_scale_bytes("fp6", (32, 32))
    with pytest.raises(ValueError, match="1-d"):
        code_and_scale_bytes("fp8", (32,))


def test_flash_totals_by_hand():
    """One fp4 expert is 3 x (5,898,240 + 368,640) = 18,800,640 B; V4.1-Flash has 40 x 384 backbone and 3 x 128
    DSpark experts. The Engram tables are 768,022,850 rows of 256 e4m3 + 8 e8m0."""
    r = memory_report(FLASH, gpus=8)
    one_expert = 3 * (5_898_240 + 368_640)
    assert r["weights"]["by_kind"]["experts_fp4"]["bytes"] == (40 * 384 + 3 * 128) * one_expert
    assert r["weights"]["by_kind"]["experts_fp4"]["per_device_bytes"] == (40 * 48 + 3 * 16) * one_expert
    assert r["engram_tables"]["bytes"] == (384_006_168 + 384_016_682) * (256 + 8)
    assert r["engram_tables"]["location"] == "host" and r["per_device"]["engram_tables"] == 0


def test_flash_and_geometry_against_the_reported_figures():
    """Backbone in the checkpoint formats ~300 GB (the issue's figure; experts FP4, the rest FP8 / bf16 / fp32);
    the Engram tables' e4m3 codes are the reported 196 GB, their e8m0 scales add 1/32. v41-geometry held
    dequantized in bf16 measured 72.2 GB of GPU memory on an H200."""
    r = memory_report(FLASH, gpus=8)
    assert 295e9 < r["weights"]["by_group"]["backbone"]["bytes"] < 305e9
    e = r["engram_tables"]
    assert e["code_bytes"] == e["params"] and 196e9 < e["code_bytes"] < 197e9
    assert e["scale_bytes"] * 32 == e["code_bytes"]
    assert r["per_device"]["fits"] and not r["today_per_device"]["fits"]
    g = memory_report(GEOM, gpus=1)
    assert abs(g["today"]["per_device_bytes"] / 72.2e9 - 1) < 0.02
    assert g["weights"]["bytes"] < 0.4 * g["today"]["weight_bytes"]


# ------------------------------------------------------------------------------------------ split and fit

def test_split_over_devices():
    r1, r5 = memory_report(FLASH, gpus=1), memory_report(FLASH, gpus=5)
    w1, w5 = r1["weights"], r5["weights"]
    routed = w1["routed_expert_bytes"]
    dense = w1["bytes"] - routed
    one_expert = routed // (40 * 384 + 3 * 128)
    assert w5["per_device_bytes"] == dense + (40 * math.ceil(384 / 5) + 3 * math.ceil(128 / 5)) * one_expert
    s5 = memory_report(FLASH, gpus=5, dense="split")["weights"]
    assert s5["per_device_bytes"] == math.ceil(dense / 5) + (w5["per_device_bytes"] - dense)
    on = memory_report(FLASH, gpus=8, engram_on_device=True, dense="split")
    assert on["per_device"]["engram_tables"] == math.ceil(on["engram_tables"]["bytes"] / 8)
    assert on["engram_tables"]["host_bytes"] == 0
    assert on["per_device"]["total"] == sum(on["per_device"][k] for k in ("weights", "engram_tables", "kv"))


def test_fit_and_headroom():
    need = memory_report(GEOM)["per_device"]["total"]
    assert memory_report(GEOM, device_memory=need)["per_device"]["fits"]
    tight = memory_report(GEOM, device_memory=need - 1)["per_device"]
    assert not tight["fits"] and tight["headroom"] == -1
    assert memory_report(GEOM)["device_memory"] == H200_USABLE_BYTES == 139 * 2 ** 30


def test_kv_as_kv_bytes_splits_it():
    k = kv_memory(FLASH, 1 << 20, 1)
    assert k["global_kv_bytes"] == 890 * (1 << 20)
    assert k["main_kv_bytes"] * 68 == k["indexer_k_bytes"] * 288
    swa = kv_bytes.swa_bytes_per_sequence(FLASH)
    assert k["swa_ring_bytes"] == swa["backbone"] + swa["dspark"] == (40 + 3) * 128 * 528
    assert k["compressor_carry_bytes"] == 3 * 2 * 2 * 512 * 4                 # three m = 2 sources
    odd = kv_memory(FLASH, 1001, 3)                                          # 500 entries per m = 2 source
    assert odd["global_entries_per_sequence"] == 3 * 500 + 1001
    assert odd["global_kv_bytes"] == 3 * (3 * 500 + 1001) * 356
    assert odd["bytes"] == 3 * kv_memory(FLASH, 1001, 1)["bytes"]
    assert memory_report(FLASH, gpus=8)["kv"]["per_device_bytes"] == math.ceil(k["bytes"] / 8)


# ------------------------------------------------------------------------------------------ CLI

def test_cli_json_and_table(capsys):
    assert cli.main(["analyze", "memory", "--config", "v41-flash", "--gpus", "8", "--context", "64K", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["config"] == "v41-flash" and r["gpus"] == 8 and r["kv"]["tokens"] == 65536
    assert r["weights"]["bytes"] == memory_report(FLASH, gpus=8, tokens=65536)["weights"]["bytes"]
    assert cli.main(["analyze", "memory", "--config", "debug", "--gpus", "3", "--engram-on-device",
                     "--device-memory", "80", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    for text in ("FP8 Linears", "routed experts FP4", "Engram tables", "SWA rings", "headroom", "80.000"):
        assert text in out, text


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus must be a positive integer, got 0"),
    (["--gpus", "-2"], "--gpus must be a positive integer, got -2"),
    (["--batch", "0"], "--batch must be a positive integer, got 0"),
    (["--device-memory", "-1"], "--device-memory must be positive, got -1 GB"),
])
def test_cli_bad_values(capsys, argv, message):
    assert cli.main(["analyze", "memory", "--config", "debug", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_gpus_not_a_number(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["analyze", "memory", "--gpus", "eight"])
    assert e.value.code == 2
    assert "--gpus" in capsys.readouterr().err


def test_decode_read_bytes_counts_the_touched_experts():
    """One token reads K/E of each layer's routed experts; a large batch reads all of them; the dense part does
    not depend on the batch; packed reads fewer bytes than bf16."""
    from dsv41.analysis.memory import checkpoint_tensors, decode_read_bytes
    cfg = load_config("v41-geometry")
    routed_all = sum(sum(t.bytes()) for t in checkpoint_tensors(cfg) if t.routed and t.group == "backbone")
    E, K = cfg.moe_shape(0)
    one, many = decode_read_bytes(cfg, 1), decode_read_bytes(cfg, 4096)
    assert one["routed_bytes"] == pytest.approx(routed_all * K / E)
    assert many["routed_bytes"] == pytest.approx(routed_all)
    assert one["dense_bytes"] == many["dense_bytes"]
    assert decode_read_bytes(cfg, 8, "bfloat16")["bytes"] > decode_read_bytes(cfg, 8)["bytes"]
    with pytest.raises(ValueError, match="batch"):
        decode_read_bytes(cfg, 0)
