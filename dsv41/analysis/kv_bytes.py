"""KV-cache bytes per token, from the config (docs/system.md §1; docs/report.md §2, "890 bytes/token").

The report factors KV cost into three multiplied dimensions: the size of one entry, the sequence dimension (m
tokens pooled into one entry) and the layer dimension (only some layers store KV of their own):

    B_global = sum over l in F of b_entry / m_l,      F = the layers that produce KV (the KV sources).

Every figure here is derived from the config fields; the only literal constants are the reported V4-Flash figure
(3,514 B/token, taken from the report's Figure 1(b); it cannot be recomputed from a V4.1 config) and the share of
SWA snapshots in V4's persistent cache (the report: "nearly half"), both cited where they are defined.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from dsv41.config import Mode, ModelConfig, ced_split, layer_roles

# ------------------------------------------------------------------------------------------ packed formats
# Bit widths of the packed formats (docs/model.md §3.3-3.6 and §9, "Packed byte layouts").
E2M1_BITS = 4          # FP4 code
SCALE_BYTES = 1        # E4M3 / UE8M0 / E8M0 scale: one byte each
MAIN_KV_GROUP = 16     # main KV: one E4M3 scale per 16 channels (NVFP4-like, no second-level global scale)
INDEX_K_GROUP = 32     # indexer K: MXFP4, one E8M0 scale per 32 elements
SWA_GROUP = 32         # SWA row: FP8 E4M3 codes, one UE8M0 scale per 32 channels
FP8_BYTES = 1

# V4-Flash global KV per token: the DeepSeek-V4.1-Flash technical report, Figure 1(b), the row "DeepSeek-V4-Flash"
# of the table in docs/report.md §2. V4's CSA/HCA layout is not described by a V4.1 config, so this one figure
# stays a cited constant.
V4_FLASH_GLOBAL_BYTES_PER_TOKEN = 3514

# Share of V4's persistent (SSD) cache taken by SWA snapshots: the report says uncompressed SWA KV took "nearly
# half" of it (docs/report.md §6). V4.1 moves SWA out of the persistent tier, which leaves (1 - share) of it.
V4_PERSISTENT_SWA_SHARE = Fraction(1, 2)

# "1M tokens" in the report's KV figures is 10^6 (890 B/token -> 890 MB; V3.2 -> ~48 GB).
ONE_MILLION = 1_000_000


def _num(x: Fraction) -> int | float:
    """An exact integer when the fraction is one, else a float (JSON friendly)."""
    return int(x) if x.denominator == 1 else float(x)


def _fp4_entry_bytes(channels: int, group: int) -> Fraction:
    """channels E2M1 codes (4 bit) + one 1-byte scale per `group` channels."""
    return Fraction(channels * E2M1_BITS, 8) + Fraction(channels, group) * SCALE_BYTES


def main_entry_bytes(cfg: ModelConfig) -> Fraction:
    """Compressed main-KV entry: head_dim E2M1 codes (4 bit) + one E4M3 scale per 16 channels.

    512 -> 256 + 32 = 288 B, i.e. 4.5 bit/channel (docs/system.md §1, report eq. for b_main)."""
    return _fp4_entry_bytes(cfg.head_dim, MAIN_KV_GROUP)


def indexer_entry_bytes(cfg: ModelConfig) -> Fraction:
    """Indexer key entry: index_head_dim MXFP4 = E2M1 codes + one E8M0 scale per 32. 128 -> 64 + 4 = 68 B."""
    return _fp4_entry_bytes(cfg.index_head_dim, INDEX_K_GROUP)


def global_entry_bytes(cfg: ModelConfig) -> Fraction:
    """One global-KV entry = main KV + indexer K = 356 B for V4.1-Flash."""
    return main_entry_bytes(cfg) + indexer_entry_bytes(cfg)


def swa_row_bytes(cfg: ModelConfig) -> Fraction:
    """SWA ring row per token per layer: head_dim FP8 E4M3 + one UE8M0 per 32 = 512 + 16 = 528 B.

    This is the format the official code simulates (act_quant, docs/model.md §3.3); the SWA branch stays FP8 because
    the report found it quantization-sensitive."""
    return Fraction(cfg.head_dim * FP8_BYTES) + Fraction(cfg.head_dim, SWA_GROUP) * SCALE_BYTES


def kv_source_layers(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(layer, ratio m) of every layer that produces global KV (mode Full), from `layer_roles`."""
    return [(r.layer, r.ratio) for r in layer_roles(cfg) if r.mode == Mode.FULL]


def global_kv_bytes_per_token(cfg: ModelConfig) -> Fraction:
    """B_global = sum over KV sources of entry / m. V4.1-Flash: 3 * 356/2 + 356/1 = 890 B/token."""
    e = global_entry_bytes(cfg)
    return sum((e / m for _, m in kv_source_layers(cfg)), Fraction(0))


# ------------------------------------------------------------------------------------------ comparison models

def v1_bytes_per_token(layers: int = 95, kv_heads: int = 8, head_dim: int = 128, bytes_per_value: int = 2) -> int:
    """DeepSeek-V1 (67B): plain GQA cache, K and V for every layer in BF16: 95 * 2 * 8 * 128 * 2 = 389,120."""
    return layers * 2 * kv_heads * head_dim * bytes_per_value


def v32_bytes_per_token(layers: int = 61, latent: int = 512, latent_scale_bytes: int = 16, rope_bytes: int = 128,
                        index_k_bytes: int = 128, index_scale_bytes: int = 4) -> int:
    """DeepSeek-V3.2: per layer an FP8 MLA latent (512 B) + its scales (16 B) + the BF16 RoPE part (64 dims,
    128 B), plus an FP8 indexer key (128 B) + its scale (4 B): 61 * (656 + 132) = 48,068."""
    return layers * ((latent + latent_scale_bytes + rope_bytes) + (index_k_bytes + index_scale_bytes))


@dataclass(frozen=True)
class Comparison:
    model: str
    bytes_per_token: int | float
    how: str


def comparison_table(cfg: ModelConfig) -> list[Comparison]:
    """The report's Figure 1(b) comparison, each row computed from its formula (V4-Flash: cited constant)."""
    return [
        Comparison("DeepSeek-V1 (67B)", v1_bytes_per_token(), "95 layers * 2 (K,V) * 8 heads * 128 dims * 2 B"),
        Comparison("DeepSeek-V3.2", v32_bytes_per_token(),
                   "61 * [(512 FP8 latent + 16 B scales + 128 B RoPE) + (128 B indexer K + 4 B scale)]"),
        Comparison("DeepSeek-V4-Flash", V4_FLASH_GLOBAL_BYTES_PER_TOKEN, "reported figure (technical report, Fig. 1b)"),
        Comparison("DeepSeek-V4.1-Flash (this config)", _num(global_kv_bytes_per_token(cfg)),
                   "sum over KV sources of (main + indexer entry) / m"),
    ]


def persistent_ratio_vs_v4_flash(cfg: ModelConfig) -> dict[str, Any]:
    """Persistent (SSD / host) KV of V4.1 relative to V4-Flash, as the report derives it (docs/report.md §6):

    - V4's persistent cache holds global KV and SWA snapshots, SWA being about half of it; V4.1 moves SWA to a
      short-TTL DRAM pool, which leaves (1 - 1/2) = 1/2;
    - what remains is global KV, 890 / 3514 ~= 1/4 of V4-Flash's (CSA2 cross-layer reuse + FP4 main KV).

    Product ~= 1/2 * 1/4 = 1/8."""
    global_ratio = global_kv_bytes_per_token(cfg) / V4_FLASH_GLOBAL_BYTES_PER_TOKEN
    swa_factor = 1 - V4_PERSISTENT_SWA_SHARE
    ratio = swa_factor * global_ratio
    return {"swa_leaves_persistent_factor": float(swa_factor), "global_kv_ratio": float(global_ratio),
            "ratio": float(ratio), "as_one_over": float(1 / ratio) if ratio else float("inf")}


# ------------------------------------------------------------------------------------------ SWA rings

def swa_bytes_per_sequence(cfg: ModelConfig) -> dict[str, int | float]:
    """Bytes of the SWA rings one sequence holds: every layer with a window ring keeps window_size rows of 528 B.

    All backbone layers have the SWA branch (every CSA2 mode computes its own SWA KV; SWA-only layers have only
    it). The DSpark stages are window-only layers with their own rings and are reported separately. Under CED the
    encoder rings (layers below the split) are what the SWA pool snapshots; decoder rings are rebuilt by replay
    on every prefill and never persisted (docs/system.md §2, §4)."""
    ring = cfg.window_size * swa_row_bytes(cfg)
    split = ced_split(cfg)
    n_enc = split if split is not None else cfg.n_layers
    n_dspark = cfg.n_mtp_layers if cfg.dspark_enabled else 0
    return {"rows_per_layer": cfg.window_size, "backbone_layers": cfg.n_layers, "backbone": _num(cfg.n_layers * ring),
            "encoder": _num(n_enc * ring), "decoder": _num((cfg.n_layers - n_enc) * ring),
            "dspark_layers": n_dspark, "dspark": _num(n_dspark * ring)}


# ------------------------------------------------------------------------------------------ report

def kv_report(cfg: ModelConfig, n_tokens: int = ONE_MILLION) -> dict[str, Any]:
    """Everything `dsv41 analyze kv` prints, as a JSON-ready dict."""
    g, e = global_kv_bytes_per_token(cfg), global_entry_bytes(cfg)
    persistent = persistent_ratio_vs_v4_flash(cfg)
    return {
        "main_entry_bytes": _num(main_entry_bytes(cfg)), "indexer_entry_bytes": _num(indexer_entry_bytes(cfg)),
        "global_entry_bytes": _num(e),
        "kv_source_layers": [{"layer": L, "ratio": m, "bytes_per_token": _num(e / m)}
                             for L, m in kv_source_layers(cfg)],
        "global_kv_bytes_per_token": _num(g), "swa_bytes_per_token_per_layer": _num(swa_row_bytes(cfg)),
        "swa_bytes_per_sequence": swa_bytes_per_sequence(cfg),
        "comparison": [asdict(c) for c in comparison_table(cfg)],
        "tokens": n_tokens, "global_kv_bytes_at_tokens": _num(g * n_tokens),
        "v32_bytes_at_tokens": v32_bytes_per_token() * n_tokens,
        "global_ratio_vs_v4_flash": float(g / V4_FLASH_GLOBAL_BYTES_PER_TOKEN),
        "persistent_ratio_vs_v4_flash": persistent["ratio"], "persistent_ratio_detail": persistent,
    }
