"""The docs/system.md §1 numbers, computed from the shipped configs (dsv41.analysis)."""

from __future__ import annotations

import json
import math

import pytest

from dsv41 import cli
from dsv41.analysis import flops, io, kv_bytes, params
from dsv41.analysis.cli import parse_tokens
from dsv41.config import ModelConfig, load_config, role_summary

FLASH = load_config("v41-flash")
GEOM = load_config("v41-geometry")
B = 1e9


def within(x: float, target: float, rel: float) -> bool:
    return abs(x - target) <= rel * abs(target)


# ------------------------------------------------------------------------------------------ KV bytes

@pytest.mark.parametrize("name", ["v41-flash", "v41-geometry"])
def test_kv_entry_sizes_and_global_bytes(name):
    cfg = load_config(name)
    assert kv_bytes.main_entry_bytes(cfg) == 288
    assert kv_bytes.indexer_entry_bytes(cfg) == 68
    assert kv_bytes.global_entry_bytes(cfg) == 356
    assert kv_bytes.global_kv_bytes_per_token(cfg) == 890
    assert kv_bytes.swa_row_bytes(cfg) == 528
    assert kv_bytes.kv_source_layers(cfg) == [(2, 2), (8, 2), (14, 2), (20, 1)]


def test_comparison_table_and_1m_sizes():
    rows = {c.model: c.bytes_per_token for c in kv_bytes.comparison_table(FLASH)}
    assert rows["DeepSeek-V1 (67B)"] == 389_120
    assert rows["DeepSeek-V3.2"] == 48_068
    assert rows["DeepSeek-V4-Flash"] == 3_514
    assert rows["DeepSeek-V4.1-Flash (this config)"] == 890
    # the formulas, not constants: change an input and the figure follows
    assert kv_bytes.v1_bytes_per_token(layers=1) == 389_120 // 95
    assert kv_bytes.v32_bytes_per_token(layers=1) == 788
    r = kv_bytes.kv_report(FLASH)
    assert r["global_kv_bytes_at_tokens"] == 890_000_000          # 890 MB at 1M tokens
    assert within(r["v32_bytes_at_tokens"], 48e9, 0.01)            # ~48 GB


def test_persistent_ratio_is_one_eighth():
    d = kv_bytes.persistent_ratio_vs_v4_flash(FLASH)
    assert d["swa_leaves_persistent_factor"] == 0.5
    assert d["global_kv_ratio"] == pytest.approx(890 / 3514)
    assert round(d["global_kv_ratio"] * 4) == 1                    # ~1/4
    assert d["ratio"] == pytest.approx(0.5 * 890 / 3514)
    assert round(1 / d["ratio"]) == 8
    assert within(d["ratio"], 1 / 8, 0.02)


def test_swa_bytes_per_sequence():
    s = kv_bytes.swa_bytes_per_sequence(FLASH)
    assert s["backbone"] == 40 * 128 * 528
    assert s["encoder"] == s["decoder"] == 20 * 128 * 528
    assert s["dspark"] == 3 * 128 * 528


def test_ratio4_source_changes_bytes():
    ratios = list(FLASH.compress_ratios)
    ratios[2:20] = [4] * 18                                        # encoder sources and their readers at m = 4
    cfg = FLASH.replace(compress_ratios=tuple(ratios))
    assert kv_bytes.global_kv_bytes_per_token(cfg) == 3 * 356 / 4 + 356   # 623
    assert flops.indexer_coefficients(cfg)["per_token"] == 4096 * (3 / 4 + 1)
    ratios = list(FLASH.compress_ratios)
    ratios[20:40] = [2] * 20                                       # decoder at m = 2
    cfg2 = ModelConfig.from_dict({**FLASH.to_dict(), "compress_ratios": ratios})
    assert kv_bytes.global_kv_bytes_per_token(cfg2) == 4 * 178


def test_layer_mode_counts():
    for cfg in (FLASH, GEOM):
        assert role_summary(cfg)["modes"] == {"swa": 2, "full": 4, "reindex": 4, "reuse": 30}


# ------------------------------------------------------------------------------------------ parameters

def test_params_backbone_experts_engram():
    r = params.params_report(FLASH)
    assert r["experts"] == 40 * 385 * 3 * 5120 * 2304
    assert within(r["experts"], 545 * B, 0.01)
    assert within(r["backbone"], 552 * B, 0.01)
    assert r["engram_detail"]["tables"] == sum(FLASH.engram_num_embeddings) * 256
    assert within(r["engram_detail"]["tables"], 196.6 * B, 0.01)
    assert within(r["engram"], 196.6 * B, 0.01)


def test_activated_params():
    # The report gives whole billions (8B, 16B): accept its rounding interval, +-0.5B.
    r = params.params_report(FLASH)
    assert 7.5 * B <= r["activated_prefill"] < 8.5 * B
    assert 15.5 * B <= r["activated_decode"] < 16.5 * B
    # prefill is the encoder half plus a sliver of KV production
    assert r["activated_prefill_detail"]["kv_production"] == 5120 + (512 * 5120 + 512) + (128 * 512 + 128)


def test_conditional_tensors():
    full2, full1 = params.block_params(FLASH, 2), params.block_params(FLASH, 20)
    assert full2["compressor"] == 2 * 512 * 5120 + 512                # wkv + wgate (m = 2) + norm
    assert full1["compressor"] == 512 * 5120 + 512                    # no wgate at m = 1
    reindex, reuse, swa = (params.block_params(FLASH, L) for L in (24, 21, 0))
    assert "indexer_q" in reindex and "compressor" not in reindex and "indexer_k" not in reindex
    assert not {"indexer_q", "compressor", "indexer_k"} & set(reuse)
    assert not {"indexer_q", "compressor", "indexer_k"} & set(swa)
    assert reindex["indexer_q"] == 4096 * 1280 + 32 * 5120


def test_dspark_and_vision_counts():
    d = params.dspark_params(FLASH)
    assert d["markov"] == 2 * 129280 * 256
    assert d["main_proj"] == 5120 * 15360 + 5120
    blocks = sum(sum(params.block_params(FLASH, L).values()) for L in (40, 41, 42))
    assert params.params_report(FLASH)["dspark"] == blocks + d["main_proj"] + d["norm"] + d["markov"] + d["confidence"]
    assert d["experts"] == 3 * 129 * 3 * 5120 * 2304                   # 128 routed + 1 shared, no tied embed/head
    v = params.vision_params(FLASH)
    assert v["special"] == 3 * 5120
    assert v["aligner"] == 5120 * 9216 + 5120 + 5120 * 5120 + 5120
    assert 0.3 * B < v["vit"] < 0.5 * B
    assert params.vision_params(load_config("tiny")) == {"vit": 0, "aligner": 0, "special": 0}


# ------------------------------------------------------------------------------------------ FLOPs

@pytest.mark.parametrize("n", [1 << 15, 100_000, 1_000_000, 1 << 20])
def test_decode_indexer_macs(n):
    assert flops.indexer_macs(FLASH, n) == 10_240 * n + 4 * 4096 * 16_384
    assert flops.indexer_macs(FLASH, n, hierarchical=False) == 26_624 * n
    c = flops.indexer_coefficients(FLASH)
    assert c["per_token"] == 10_240 and c["flat_per_token"] == 26_624
    assert c["constant"] == 4 * 4096 * 16_384 and round(c["constant"] / 1e7) == 27   # 0.27 G
    assert c["effective_full_layers"] == 2.5


def test_small_context_reindex_scans_visible_only():
    # below the pool size the Reindex layers scan only what is visible: same as flat
    assert flops.indexer_macs(FLASH, 8192) == flops.indexer_macs(FLASH, 8192, hierarchical=False)


def test_decode_flops_growth():
    lo = flops.decode_flops(FLASH, 4096)["weighted"]
    hi = flops.decode_flops(FLASH, 1 << 20)["weighted"]
    assert 1.2 <= hi / lo <= 1.3
    assert 18 * B <= lo <= 22 * B                                     # ~20 GFLOPs at 4K
    assert 23 * B <= hi <= 27 * B                                     # ~25 GFLOPs at 1M
    idx = flops.flops_report(FLASH, [4096])["indexer_at_1m"]
    assert within(idx["linear_term_macs"] * 2, 20.5 * B, 0.01)       # 20.5 GFLOPs raw
    assert within(idx["linear_term_macs"] * 2 * 0.25, 5.1 * B, 0.01)  # ~5.1 weighted at FP4
    assert within(idx["flops_weighted_fp4"], 5.1 * B, 0.05)


def test_prefill_encoder_indexer():
    for n in (1 << 18, 1 << 20, 1000):
        e = flops.encoder_indexer_macs(FLASH, n)
        assert e["n2_coefficient"] == 3072
        assert e["macs"] == 3072 * n * n                              # exact for even n (m = 2: q^2 = n^2/4)
    s256 = flops.prefill_indexer_share(FLASH, 1 << 18)
    s1m = flops.prefill_indexer_share(FLASH, 1 << 20)
    assert 0.02 < s256["fraction_weighted"] < 0.08                    # docs/report.md §4.4: ~5%
    assert 0.10 < s1m["fraction_weighted"] < 0.25                     # docs/report.md §4.4: 15-20%
    assert s256["fraction_raw"] < s1m["fraction_raw"]


def test_prefill_cheaper_than_full_forward():
    # CED prefill per token is about half of a full forward's per-token compute
    n = 1 << 16
    pre = sum(t.flops for t in flops.prefill_terms(FLASH, n)) / n
    dec = flops.decode_flops(FLASH, n)["raw"]
    assert 0.4 < pre / dec < 0.7


# ------------------------------------------------------------------------------------------ small presets

@pytest.mark.parametrize("name", ["tiny", "debug"])
def test_small_presets_are_sane(name):
    cfg = load_config(name)
    g = kv_bytes.global_kv_bytes_per_token(cfg)
    assert 0 < g < 890
    expect = sum(kv_bytes.global_entry_bytes(cfg) / m for _, m in kv_bytes.kv_source_layers(cfg))
    assert g == expect
    r = params.params_report(cfg)
    big = params.params_report(FLASH)
    for k in ("backbone", "experts", "engram", "dspark", "activated_prefill", "activated_decode"):
        assert 0 < r[k] < big[k], k
    assert r["activated_prefill"] < r["activated_decode"] < r["backbone"]
    f = [flops.decode_flops(cfg, n)["weighted"] for n in (64, 4096, 1 << 16)]
    assert 0 < f[0] <= f[1] <= f[2] < flops.decode_flops(FLASH, 64)["weighted"]
    c = flops.indexer_coefficients(cfg)
    assert 0 < c["per_token"] < c["flat_per_token"] < 26_624


def test_tiny_numbers():
    cfg = load_config("tiny")
    assert kv_bytes.main_entry_bytes(cfg) == 32 + 4
    assert kv_bytes.indexer_entry_bytes(cfg) == 32 + 2
    assert kv_bytes.global_kv_bytes_per_token(cfg) == 70 / 2 + 70 / 2 + 70
    assert kv_bytes.swa_row_bytes(cfg) == 64 + 2


# ------------------------------------------------------------------------------------------ image I/O

def test_vit_tokens():
    v = io.vit_tokens(FLASH, 1344, 1344)
    assert v["patches"] == 9216 and v["image_tokens"] == 1024
    assert v["span_tokens"] == 32 * 33 + 2 and v["fits_max_n_token"] is False
    assert io.raw_bytes_per_image_token(FLASH) == 14 * 14 * 9 * 3
    with pytest.raises(ValueError):
        io.vit_tokens(load_config("tiny"))


def test_io_criterion_independent_of_n():
    c = io.training_flops_per_token(FLASH)
    for bio, bgpu, rho in [(2e9, 4e14, 5292.0), (1e8, 1e15, 5292.0), (1e9, 1e15, 96.0)]:
        v = io.io_overlap(rho, c, bio, bgpu)
        assert v.threshold == pytest.approx(bio / bgpu * c)
        assert v.hidden == (v.margin > 0) == (v.headroom > 1)
        for n in (1, 1000, 10**6, 10**9):
            assert (io.io_time(n, rho, bio) < io.compute_time(n, c, bgpu)) == v.hidden
    with pytest.raises(ValueError):
        io.io_overlap(-1, c, 1e9, 1e15)


# ------------------------------------------------------------------------------------------ CLI

def _run_json(capsys, *argv):
    assert cli.main(["analyze", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_kv_json(capsys):
    r = _run_json(capsys, "kv")
    for k in ("global_kv_bytes_per_token", "main_entry_bytes", "indexer_entry_bytes",
              "swa_bytes_per_token_per_layer", "kv_source_layers", "comparison", "persistent_ratio_vs_v4_flash"):
        assert k in r, k
    assert r["global_kv_bytes_per_token"] == 890
    assert [c["bytes_per_token"] for c in r["comparison"]] == [389_120, 48_068, 3_514, 890]
    assert all(set(c) >= {"model", "bytes_per_token"} for c in r["comparison"])


def test_cli_params_json(capsys):
    r = _run_json(capsys, "params", "--config", "v41-flash")
    for k in ("backbone", "experts", "engram", "dspark", "vision", "activated_prefill", "activated_decode"):
        assert isinstance(r[k], int), k


def test_cli_flops_json_and_plot(capsys, tmp_path):
    png = tmp_path / "curve.png"
    r = _run_json(capsys, "flops", "--context", "4K", "64K", "1M", "--plot", str(png))
    for k in ("contexts", "indexer_macs", "indexer_macs_flat", "decode_flops_weighted", "prefill_indexer_share"):
        assert k in r, k
    assert r["contexts"] == [4096, 65536, 1 << 20]
    assert r["indexer_macs"][2] == 10_240 * (1 << 20) + 4 * 4096 * 16_384
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_tables_and_errors(capsys, tmp_path):
    for sub in ("kv", "params", "flops"):
        assert cli.main(["analyze", sub, "--config", "debug"]) == 0
    out = capsys.readouterr().out
    assert "global KV" in out and "activated, decode" in out and "indexer MACs" in out
    assert cli.main(["analyze", "kv", "--config", "no-such-config"]) == 2
    assert "error" in capsys.readouterr().err
    path = tmp_path / "config.json"
    FLASH.to_json(path)
    assert cli.main(["analyze", "kv", "--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_kv_bytes_per_token"] == 890
    assert cli.main(["analyze", "io", "--io-bandwidth", "2e9", "--gpu-flops", "4e14"]) == 0
    assert "1024 tokens" in capsys.readouterr().out


def test_parse_tokens():
    assert parse_tokens("4K") == 4096 and parse_tokens("1M") == 1 << 20 and parse_tokens("1000") == 1000
    import argparse
    for bad in ("x", "0", "-4K"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tokens(bad)
    assert math.isclose(kv_bytes.kv_report(FLASH)["global_ratio_vs_v4_flash"], 890 / 3514)
