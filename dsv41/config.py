"""ModelConfig, presets and per-layer roles of DeepSeek-V4.1-Flash.

Field names are those of the official `inference/config.json` (docs/model.md §1.1). The Hugging Face root
`config.json` spelling (`hidden_size`, `num_hidden_layers`, ...) is accepted too and mapped onto them.

Per-layer structure is data: `layer_roles(cfg)` resolves once, for every backbone layer, whether it is SWA-only,
Full (owns a compressor, global KV and index keys, runs its indexer), Reindex (own indexer over a Full layer's
keys, restricted to the candidate pool) or Reuse (reads a source's compressed KV and top-k), together with the
layer it reads each of those from (docs/model.md §1.2, docs/system.md §2).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = ("v41-flash", "v41-geometry", "tiny", "debug")


@dataclass
class ModelConfig:
    """Shape and numerics of a V4.1 model. Defaults are the released V4.1-Flash values."""

    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = tuple([0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    # rope / YaRN
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # indexer and candidate pool
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    # storage
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    # DSpark
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # vision
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: float | None = None
    image_token_id: int = 129264
    # not in the official JSON: a runtime bound for serving (RoPE tables are built on demand beyond it)
    max_seq_len: int = 1 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                setattr(self, f.name, tuple(v))
        self.validate()

    # ---------------------------------------------------------------- derived
    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def dspark_enabled(self) -> bool:
        return self.dspark_block_size > 0 and self.n_mtp_layers > 0

    @property
    def engram_enabled(self) -> bool:
        return len(self.engram_layer_ids) > 0

    @property
    def total_layers(self) -> int:
        """Backbone layers plus DSpark stages (compress_ratios has one entry per each)."""
        return self.n_layers + (self.n_mtp_layers if self.dspark_enabled else 0)

    def moe_shape(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, activated) for a backbone layer or a DSpark stage (`get_moe_config`)."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"config field {name!r} = {getattr(self, name)!r}: {why}")

        def backbone(name: str) -> None:
            for L in getattr(self, name):
                if not 0 <= L < self.n_layers:
                    raise bad(name, f"layer {L} is not a backbone layer")

        positive = ["vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "q_lora_rank", "head_dim",
                    "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
                    "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "n_activated_experts"]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, "must be a positive integer")
        n_total = self.total_layers
        rules = [                                         # (broken, field, why), checked in this order
            (self.n_mtp_layers < 0, "n_mtp_layers", "must be >= 0"),
            (self.score_func not in ("softmax", "sigmoid", "sqrtsoftplus"), "score_func",
             "must be softmax, sigmoid or sqrtsoftplus"),
            (self.n_shared_experts != 1, "n_shared_experts", "the V4.1 MoE has exactly one shared expert"),
            (self.n_activated_experts > self.n_routed_experts, "n_activated_experts",
             f"exceeds n_routed_experts={self.n_routed_experts}"),
            (self.dtype not in ("fp8", "bf16"), "dtype", "must be 'fp8' or 'bf16'"),
            (self.expert_dtype not in ("fp4", None, "fp8", "bf16"), "expert_dtype",
             "must be 'fp4', 'fp8', 'bf16' or null"),
            (not 0 < self.rope_head_dim <= self.head_dim or self.rope_head_dim % 2, "rope_head_dim",
             f"must be even and within head_dim={self.head_dim}"),
            (self.rope_head_dim > self.index_head_dim, "rope_head_dim",
             f"exceeds index_head_dim={self.index_head_dim}"),
            (self.head_dim % 32, "head_dim", "must be a multiple of 32 (FP8 groups of 32, FP4 groups of 16)"),
            (self.index_head_dim % 32, "index_head_dim", "must be a multiple of 32 (MXFP4 groups of 32)"),
            (self.n_heads % self.o_groups, "o_groups", f"must divide n_heads={self.n_heads}"),
            (len(self.compress_ratios) < n_total, "compress_ratios",
             f"needs one entry per layer incl. DSpark stages ({n_total})"),
            (any(m < 0 for m in self.compress_ratios), "compress_ratios", "entries must be >= 0"),
        ]
        for broken, name, why in rules:
            if broken:
                raise bad(name, why)
        for name in ("kv_source_layers", "index_source_layers"):
            backbone(name)
            layers = getattr(self, name)
            for L in layers:
                if self.compress_ratios[L] <= 0:
                    raise bad(name, f"layer {L} has compress ratio 0")
            if list(layers) != sorted(set(layers)):
                raise bad(name, "must be strictly increasing")
        if self.candidate_source_layer >= 0:
            if self.candidate_source_layer not in self.index_source_layers:
                raise bad("candidate_source_layer", "must be an index source layer (or -1 for none)")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                raise bad("candidate_topk_blocks", "candidate pool needs positive blocks and block size")
        backbone("engram_layer_ids")
        if self.engram_enabled:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                raise bad("engram_num_embeddings", "needs one entry per engram layer")
            if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim % 32:
                raise bad("engram_head_dim", "engram needs n-grams >= 2, heads > 0, head_dim % 32 == 0")
        if self.dspark_enabled:
            if not self.dspark_target_layer_ids:
                raise bad("dspark_target_layer_ids", "DSpark needs target layers")
            backbone("dspark_target_layer_ids")
            for L in range(self.n_layers, n_total):
                if self.compress_ratios[L] != 0:
                    raise bad("compress_ratios", f"DSpark stage {L} must be window-only (ratio 0)")
        if self.vision_enabled and self.vision_dim % self.vision_n_heads:
            raise bad("vision_n_heads", f"must divide vision_dim={self.vision_dim}")
        # roles resolve or raise (sources with a different ratio than a reader, etc.)
        layer_roles(self)

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = _from_hf_spelling(dict(d))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - _IGNORED_KEYS)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
        kwargs = {k: v for k, v in d.items() if k in known}
        _check_types(kwargs)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------------ spellings

# Hugging Face root config.json spelling -> official inference spelling.
HF_KEYS = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim", "num_experts_per_tok": "n_activated_experts",
    "routed_scaling_factor": "route_scale", "scoring_func": "score_func", "rms_norm_eps": "norm_eps",
    "qk_rope_head_dim": "rope_head_dim", "sliding_window": "window_size", "num_nextn_predict_layers": "n_mtp_layers",
    "index_topk_blocks": "candidate_topk_blocks", "hc_sinkhorn_iterations": "hc_sinkhorn_iters",
}
# Keys that appear in HF / official configs but carry no model shape.
_IGNORED_KEYS = {
    "architectures", "model_type", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "use_cache", "attention_bias", "attention_dropout", "hidden_act",
    "initializer_range", "max_position_embeddings", "auto_map", "quantization_config", "rope_scaling",
    "num_key_value_heads", "max_batch_size", "temperature",
}


def _from_hf_spelling(d: dict[str, Any]) -> dict[str, Any]:
    for hf, ours in HF_KEYS.items():
        if hf in d:
            v = d.pop(hf)
            if ours in d and d[ours] != v:
                raise ValueError(f"config field {ours!r} given twice with different values: {d[ours]!r} / {hf}={v!r}")
            d[ours] = v
    rs = d.get("rope_scaling")
    if isinstance(rs, dict):
        for hf, ours in (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                         ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if hf in rs:
                d.setdefault(ours, rs[hf])
    if "dtype" not in d and isinstance(d.get("quantization_config"), dict):
        d["dtype"] = "fp8"
    return d


def _check_types(kwargs: dict[str, Any]) -> None:
    hints = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    for k, v in kwargs.items():
        t = str(hints[k])
        if t == "int" and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"config field {k!r} = {v!r}: expected an integer")
        if t == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            raise ValueError(f"config field {k!r} = {v!r}: expected a finite number")
        if t.startswith("tuple") and not (isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v)):
            raise ValueError(f"config field {k!r} = {v!r}: expected a list of integers")
        if t == "bool" and not isinstance(v, bool):
            raise ValueError(f"config field {k!r} = {v!r}: expected true/false")
        if t == "str" and not isinstance(v, str):
            raise ValueError(f"config field {k!r} = {v!r}: expected a string")


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A preset name, a config.json path, or a checkpoint directory holding config.json."""
    s = str(name_or_path)
    if s in PRESETS:
        return ModelConfig.from_json(PRESET_DIR / f"{s}.json")
    p = Path(s)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"no such config: {s!r} (presets: {', '.join(PRESETS)}; or a config.json / checkpoint dir)")
    return ModelConfig.from_json(p)


# ------------------------------------------------------------------------------------------------ precision

# The two precisions a model runs in: float32 (parity, tests) and bfloat16 (the official numerics).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype a `--dtype` name stands for."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


# ------------------------------------------------------------------------------------------------ token counts

def parse_tokens(s: str) -> int:
    """A token count: an integer, or with a binary suffix K (1024) / M (1048576)."""
    t = s.strip()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:].upper())
    try:
        n = int(t[:-1] if mult else t) * (mult or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r} (use e.g. 4096, 4K, 1M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"token count must be positive: {s!r}")
    return n


# ------------------------------------------------------------------------------------------------ roles

class Mode(str, enum.Enum):
    SWA_ONLY = "swa"        # window attention only (m = 0)
    FULL = "full"           # owns compressor + global KV + index keys, runs its indexer over all entries
    REINDEX = "reindex"     # own indexer on a Full layer's keys, restricted to the candidate pool
    REUSE = "reuse"         # reads a source's compressed KV and top-k


@dataclass(frozen=True)
class LayerRole:
    layer: int
    mode: Mode
    ratio: int                       # compression ratio m (0 = window only)
    kv_from: int | None              # layer whose compressed KV (and index keys) this layer reads
    topk_from: int | None            # layer whose top-k this layer uses (itself for index sources)
    is_candidate_source: bool = False
    uses_candidates: bool = False    # indexer restricted to the candidate source's pool
    candidates_from: int | None = None
    has_engram: bool = False
    is_dspark_tap: bool = False

    @property
    def is_kv_source(self) -> bool:
        return self.kv_from == self.layer

    @property
    def is_index_source(self) -> bool:
        return self.topk_from == self.layer


def layer_roles(cfg: ModelConfig) -> list[LayerRole]:
    """Resolve every backbone layer's role once (docs/model.md §1.2 and §4: each slot holds its latest writer)."""
    roles: list[LayerRole] = []
    kv_src: int | None = None
    topk_src: int | None = None
    cand = cfg.candidate_source_layer
    for L in range(cfg.n_layers):
        m = cfg.compress_ratios[L]
        if L in cfg.kv_source_layers:
            kv_src = L
        if L in cfg.index_source_layers:
            topk_src = L
        tags = {"has_engram": L in cfg.engram_layer_ids,
                "is_dspark_tap": L in cfg.dspark_target_layer_ids and cfg.dspark_enabled}
        if m == 0:
            roles.append(LayerRole(L, Mode.SWA_ONLY, 0, None, None, **tags))
            continue
        if kv_src is None:
            raise ValueError(f"config field 'kv_source_layers' = {list(cfg.kv_source_layers)!r}: layer {L} has "
                             f"compress ratio {m} but no KV source at or before it")
        if cfg.compress_ratios[kv_src] != m:
            raise ValueError(f"config field 'compress_ratios': layer {L} (ratio {m}) would read the compressed KV "
                             f"of layer {kv_src} (ratio {cfg.compress_ratios[kv_src]})")
        if topk_src is None or topk_src < kv_src:
            raise ValueError(f"config field 'index_source_layers' = {list(cfg.index_source_layers)!r}: layer {L} "
                             f"has no index source reading KV source {kv_src}")
        is_kv = L == kv_src
        is_idx = L == topk_src
        uses_cand = is_idx and 0 <= cand < L
        if uses_cand and cfg.compress_ratios[cand] != m:
            raise ValueError(f"config field 'candidate_source_layer' = {cand}: its ratio differs from layer {L}'s")
        if is_kv and not is_idx:
            raise ValueError(f"config field 'index_source_layers': KV source {L} must also be an index source")
        mode = Mode.FULL if is_kv else Mode.REINDEX if is_idx else Mode.REUSE
        roles.append(LayerRole(L, mode, m, kv_src, topk_src, is_candidate_source=L == cand,
                               uses_candidates=uses_cand, candidates_from=cand if uses_cand else None, **tags))
    return roles


def ced_split(cfg: ModelConfig) -> int | None:
    """First decoder layer of the causal encoder-decoder split (docs/system.md §2): the last KV source.

    Every layer from there up must read global KV produced from that layer's own input, which holds when the
    split layer is the last KV source. Returns None when the config has no valid CED split (no KV sources)."""
    return max(cfg.kv_source_layers) if cfg.kv_source_layers else None


def role_summary(cfg: ModelConfig) -> dict[str, Any]:
    roles = layer_roles(cfg)
    count = {m.value: sum(r.mode == m for r in roles) for m in Mode}
    return {
        "kv_source_layers": [r.layer for r in roles if r.is_kv_source],
        "index_source_layers": [r.layer for r in roles if r.is_index_source],
        "modes": count,
        "layers": [{"layer": r.layer, "mode": r.mode.value, "ratio": r.ratio, "kv_from": r.kv_from,
                    "topk_from": r.topk_from} for r in roles],
    }
