"""Memory accounting: weight bytes per device by storage kind, Engram tables in host memory, KV bytes for a context,
and whether it all fits a device (docs/model.md §9 for the formats, docs/system.md §1 and §3 for the KV).

The weights are listed tensor by tensor from the config (`checkpoint_tensors`): the checkpoint names of
docs/model.md §9 with their shapes and two storage kinds each,
  kind       what the model holds in the checkpoint formats (after the official load conversions): fp8 Linears as
             e4m3 codes + one e8m0 scale per 32x32 tile, routed experts as packed e2m1 (two a byte) + one e8m0 per
             row and 32 inputs, Engram tables as e4m3 rows + one e8m0 per 32 of a row, the rest plain bf16 / fp32;
             tensors the official code converts at load are counted as it holds them (`wo_a` dequantized to bf16;
             `head`, the ratio-2 compressor `wkv`/`wgate`, the DSpark Markov and confidence heads promoted to fp32);
  file_kind  how the checkpoint file stores them (`wo_a` fp8, those heads and compressor weights bf16).
Today dsv41 holds every weight dequantized: in the model dtype (bfloat16 or float32), fp32 where the kind is fp32,
the Engram tables included and on the device; `today_bytes` counts that holding.

Splitting over N devices (an even split by kind; a distribution plan would replace it): the routed experts of each
layer are spread over the devices (a device holds ceil(E / N) of a layer's E experts: the fullest device is what
must fit); every other device weight is replicated (data-parallel attention), or divided by N with
`dense="split"`. The Engram tables stay in host memory (one copy); with `engram_on_device` they count on the device
under the same policy as the dense weights. KV bytes are divided evenly by N. Activations, workspaces and the
allocator's slack are not counted.

`parallel_plan` counts `dsv41/parallel`'s plan instead: the head-split attention tensors 1/N per device, routed
experts ceil(E / N), the rest replicated, the latent KV whole on every device (next to data-parallel attention),
and an estimate of one block's activations for a prefill chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from dsv41.analysis.kv_bytes import (global_kv_bytes_per_token, indexer_entry_bytes, kv_source_layers, main_entry_bytes,
                                     swa_bytes_per_sequence)
from dsv41.config import LayerRole, ModelConfig, layer_roles

# ------------------------------------------------------------------------------------------ storage formats
TILE = 32              # fp8 Linear: one e8m0 scale per TILE x TILE block of the weight
GROUP = 32             # fp4 experts and Engram rows: one e8m0 scale per GROUP inputs of a row
SCALE_BYTES = 1        # e8m0
PLAIN_BYTES = {"bf16": 2, "fp32": 4}
QUANT_KINDS = ("fp8", "fp4", "fp8_rows")
CATEGORIES = ("fp8", "experts_fp4", "experts_fp8", "experts_bf16", "bf16", "fp32")    # report rows, in order
GROUPS = ("backbone", "engram", "dspark", "vision")
HOLDING_DTYPES = {"bfloat16": 2, "float32": 4}     # today's dequantized holding: model dtype -> bytes per element
DENSE_POLICIES = ("replicated", "split")
H200_USABLE_BYTES = 139 * 2 ** 30                  # one H200 as the device reports it: 139 GiB


def code_and_scale_bytes(kind: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(code bytes, scale bytes) of one tensor stored as `kind` (docs/model.md §9, "Storage formats").

    fp8 [R, C]: R*C e4m3 + ceil(R/32)*ceil(C/32) e8m0; fp4 [R, C]: R*ceil(C/2) packed e2m1 + R*ceil(C/32) e8m0;
    fp8_rows [R, C]: R*C e4m3 + R*ceil(C/32) e8m0; bf16 / fp32: 2 / 4 bytes an element, no scales."""
    n = math.prod(shape)
    if kind in PLAIN_BYTES:
        return n * PLAIN_BYTES[kind], 0
    if kind not in QUANT_KINDS or len(shape) != 2:
        raise ValueError(f"storage kind {kind!r} of a {len(shape)}-d tensor: expected bf16, fp32 or a 2-d "
                         f"{' / '.join(QUANT_KINDS)}")
    R, C = shape
    if kind == "fp8":
        return n, math.ceil(R / TILE) * math.ceil(C / TILE) * SCALE_BYTES
    codes = R * math.ceil(C / 2) if kind == "fp4" else n
    return codes, R * math.ceil(C / GROUP) * SCALE_BYTES


# ------------------------------------------------------------------------------------------ the tensors

@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor, or `count` identical ones (a layer's routed experts: `{e}` in the name)."""

    name: str
    shape: tuple[int, ...]
    kind: str                  # held storage in the checkpoint formats (after the load conversions)
    file_kind: str             # storage in the checkpoint file
    group: str                 # backbone | engram | dspark | vision
    count: int = 1
    routed: bool = False       # routed experts: spread over the devices

    @property
    def params(self) -> int:
        return self.count * math.prod(self.shape)

    def bytes(self, kind: str | None = None) -> tuple[int, int]:
        """(code bytes, scale bytes) of all `count` tensors in `kind` (default: the held kind)."""
        c, s = code_and_scale_bytes(kind or self.kind, self.shape)
        return self.count * c, self.count * s


class _Collector:
    """Appends TensorSpecs under a name prefix and a group."""

    def __init__(self, out: list[TensorSpec], prefix: str, group: str):
        self.out, self.prefix, self.group = out, prefix, group

    def add(self, name: str, shape: tuple[int, ...], kind: str, file_kind: str | None = None, count: int = 1,
            routed: bool = False) -> None:
        self.out.append(TensorSpec(self.prefix + name, tuple(shape), kind, file_kind or kind, self.group, count,
                                   routed))


def _linear_kind(cfg: ModelConfig) -> str:
    """The ordinary Linears: fp8 in a `dtype: fp8` checkpoint, else plain bf16."""
    return "fp8" if cfg.dtype == "fp8" else "bf16"


def _block(c: _Collector, cfg: ModelConfig, layer: int) -> None:
    """A backbone layer or DSpark stage: mHC, attention, gate, shared and routed experts (docs/model.md §9)."""
    D, H, d, lk = cfg.dim, cfg.n_heads, cfg.head_dim, _linear_kind(cfg)
    mixw = (2 + cfg.hc_mult) * cfg.hc_mult
    for which in ("attn", "ffn"):
        c.add(f"hc_{which}_fn", (mixw, cfg.hc_mult * D), "fp32")
        c.add(f"hc_{which}_base", (mixw,), "fp32")
        c.add(f"hc_{which}_scale", (3,), "fp32")
    c.add("attn.attn_sink", (H,), "fp32")
    c.add("attn.wq_a.weight", (cfg.q_lora_rank, D), lk)
    c.add("attn.q_norm.weight", (cfg.q_lora_rank,), "bf16")
    c.add("attn.wq_b.weight", (H * d, cfg.q_lora_rank), lk)
    c.add("attn.wkv.weight", (d, D), lk)
    c.add("attn.kv_norm.weight", (d,), "bf16")
    c.add("attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups), "bf16", lk)  # bf16 at load
    c.add("attn.wo_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), lk)
    n_experts, _ = cfg.moe_shape(layer)
    c.add("ffn.gate.weight", (n_experts, D), "bf16")
    c.add("ffn.gate.bias", (n_experts,), "fp32")
    if cfg.vision_enabled:
        c.add("ffn.gate.bias_vl", (n_experts,), "fp32")
    ek, F = cfg.expert_dtype or "bf16", cfg.moe_inter_dim
    for w, shape in (("w1", (F, D)), ("w2", (D, F)), ("w3", (F, D))):
        c.add(f"ffn.experts.{{e}}.{w}.weight", shape, ek, count=n_experts, routed=True)
        c.add(f"ffn.shared_experts.{w}.weight", shape, lk)
    c.add("attn_norm.weight", (D,), "bf16")
    c.add("ffn_norm.weight", (D,), "bf16")


def _attention_extras(c: _Collector, cfg: ModelConfig, role: LayerRole) -> None:
    """Compressor and indexer keys on KV sources, indexer queries on index sources (docs/model.md §3.4, §3.6)."""
    D, d, I, lk = cfg.dim, cfg.head_dim, cfg.index_head_dim, _linear_kind(cfg)
    if role.is_kv_source:
        c.add("attn.compressor.norm.weight", (d,), "bf16")
        pooled = role.ratio > 1                                  # m > 1: wkv and wgate, bf16 promoted to fp32
        for w in ("wkv", "wgate") if pooled else ("wkv",):
            c.add(f"attn.compressor.{w}.weight", (d, D), "fp32" if pooled else "bf16", "bf16")
        c.add("attn.indexer.wk.weight", (I, d), "bf16")
        c.add("attn.indexer.k_norm.weight", (I,), "bf16")
    if role.is_index_source:
        c.add("attn.indexer.wq_b.weight", (cfg.index_n_heads * I, cfg.q_lora_rank), lk)
        c.add("attn.indexer.weights_proj.weight", (cfg.index_n_heads, D), "bf16")


def _engram(c: _Collector, cfg: ModelConfig, index: int) -> None:
    """An Engram module: the hash table (e4m3 rows, host memory), its fp8 wkv, the q/k weights (docs/model.md §6)."""
    S, D, W = cfg.hc_mult, cfg.dim, cfg.engram_head_dim
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * W
    c.add("engram.q_weight", (S, D), "bf16")
    c.add("engram.k_weight", (S, D), "bf16")
    c.add("engram.embed.weight", (cfg.engram_num_embeddings[index], W), "fp8_rows")
    c.add("engram.wkv.weight", (D * (S + 1), cols), "fp8")      # fp8 whatever the config's dtype


def _dspark_stage(c: _Collector, cfg: ModelConfig, stage: int) -> None:
    """DSpark stage k (`mtp.{k}.`): a block, stage 0's tap projection, the last stage's norm and heads."""
    D, r = cfg.dim, cfg.dspark_markov_rank
    _block(c, cfg, cfg.n_layers + stage)
    if stage == 0:
        c.add("main_proj.weight", (D, D * len(cfg.dspark_target_layer_ids)), _linear_kind(cfg))
        c.add("main_norm.weight", (D,), "bf16")
    if stage == cfg.n_mtp_layers - 1:
        c.add("norm.weight", (D,), "bf16")
        c.add("markov_head.embed.weight", (cfg.vocab_size, r), "bf16")
        c.add("markov_head.head.weight", (cfg.vocab_size, r), "fp32", "bf16")
        c.add("confidence_head.proj.weight", (1, D + r), "fp32", "bf16")


def _vision(out: list[TensorSpec], cfg: ModelConfig) -> None:
    """ViT, aligner and the span delimiters: bf16 except the ViT norms (fp32) (docs/model.md §8)."""
    vd, vi, p, D = cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size, cfg.dim
    c = _Collector(out, "vision.", "vision")
    c.add("patch_embed.proj.weight", (vd, 3 * p * p), "bf16")
    c.add("patch_embed.proj.bias", (vd,), "bf16")
    for i in range(cfg.vision_n_layers):
        b = _Collector(out, f"vision.blocks.{i}.", "vision")
        b.add("norm1.weight", (vd,), "fp32")
        b.add("norm2.weight", (vd,), "fp32")
        for name, o, n in (("attn.wqkv", 3 * vd, vd), ("attn.wo", vd, vd)):
            b.add(f"{name}.weight", (o, n), "bf16")
            b.add(f"{name}.bias", (o,), "bf16")
        b.add("mlp.w1.weight", (2 * vi, vd), "bf16")
        b.add("mlp.w2.weight", (vd, vi), "bf16")
    c.add("norm.weight", (vd,), "fp32")
    a = _Collector(out, "aligner.", "vision")
    for name, o, n in (("w1", D, vd * cfg.vision_downsample_ratio ** 2), ("w2", D, D)):
        a.add(f"{name}.weight", (o, n), "bf16")
        a.add(f"{name}.bias", (o,), "bf16")
    top = _Collector(out, "", "vision")
    for name in ("image_start", "image_end", "image_newline"):
        top.add(name, (D,), "bf16")


def checkpoint_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint (docs/model.md §9), derived from the config. `.scale` tensors are not listed:
    their bytes are part of their weight's (`TensorSpec.bytes`). Tied `mtp.*.embed/head` copies are not held."""
    out: list[TensorSpec] = []
    top = _Collector(out, "", "backbone")
    top.add("embed.weight", (cfg.vocab_size, cfg.dim), "bf16")
    for role in layer_roles(cfg):
        L = role.layer
        c = _Collector(out, f"layers.{L}.", "backbone")
        _block(c, cfg, L)
        _attention_extras(c, cfg, role)
        if L in cfg.engram_layer_ids:
            _engram(_Collector(out, f"layers.{L}.", "engram"), cfg, cfg.engram_layer_ids.index(L))
    top.add("norm.weight", (cfg.dim,), "bf16")
    top.add("head.weight", (cfg.vocab_size, cfg.dim), "fp32", "bf16")     # bf16 in the file, promoted to fp32
    for k in range(cfg.n_mtp_layers if cfg.dspark_enabled else 0):
        _dspark_stage(_Collector(out, f"mtp.{k}.", "dspark"), cfg, k)
    if cfg.vision_enabled:
        _vision(out, cfg)
    return out


# ------------------------------------------------------------------------------------------ accounting

def category(t: TensorSpec) -> str:
    """The report row of a tensor: `engram_tables`, `experts_<kind>` for routed experts, else its held kind."""
    if t.kind == "fp8_rows":
        return "engram_tables"
    return f"experts_{t.kind}" if t.routed else t.kind


def today_bytes(t: TensorSpec, dtype: str) -> int:
    """Bytes of today's dequantized holding: fp32 where the held kind is fp32, else the model dtype."""
    return t.params * (PLAIN_BYTES["fp32"] if t.kind == "fp32" else HOLDING_DTYPES[dtype])


def per_device_bytes(tensors: Iterable[TensorSpec], bytes_of: Callable[[TensorSpec], int], gpus: int,
                     dense: str) -> int:
    """Bytes the fullest of `gpus` devices holds: ceil(E / N) of each routed expert set, the other tensors
    replicated (or divided by N, `dense="split"`)."""
    routed = dense_total = 0
    for t in tensors:
        if t.routed:
            routed += bytes_of(t) // t.count * math.ceil(t.count / gpus)
        else:
            dense_total += bytes_of(t)
    return routed + (dense_total if dense == "replicated" else math.ceil(dense_total / gpus))


def _sum_rows(tensors: list[TensorSpec], gpus: int, dense: str) -> dict[str, int]:
    codes = sum(t.bytes()[0] for t in tensors)
    scales = sum(t.bytes()[1] for t in tensors)
    return {"tensors": sum(t.count for t in tensors), "params": sum(t.params for t in tensors),
            "code_bytes": codes, "scale_bytes": scales, "bytes": codes + scales,
            "per_device_bytes": per_device_bytes(tensors, lambda t: sum(t.bytes()), gpus, dense)}


def _by(tensors: list[TensorSpec], key: Callable[[TensorSpec], str], order: tuple[str, ...], gpus: int,
        dense: str) -> dict[str, dict]:
    """Rows of `_sum_rows` per value of key(t), in `order` (values that occur only)."""
    present = {key(t) for t in tensors}
    return {k: _sum_rows([t for t in tensors if key(t) == k], gpus, dense) for k in order if k in present}


def kv_memory(cfg: ModelConfig, tokens: int, batch: int) -> dict[str, int]:
    """KV bytes of `batch` sequences of `tokens` tokens, split as `dsv41.analysis.kv_bytes` splits them: main KV
    and indexer keys of the global store (one entry per completed group of m positions per KV source), the SWA
    rings (W rows of every backbone layer and DSpark stage, allocated whole), and the compressor carry (fp32 kv
    and score, m x head_dim each, per KV source with m > 1)."""
    entries = sum(tokens // m for _, m in kv_source_layers(cfg))
    main = math.ceil(entries * main_entry_bytes(cfg)) * batch
    index = math.ceil(entries * indexer_entry_bytes(cfg)) * batch
    swa = swa_bytes_per_sequence(cfg)
    rings = math.ceil(swa["backbone"] + swa["dspark"]) * batch
    carry = sum(2 * m * cfg.head_dim * PLAIN_BYTES["fp32"] for _, m in kv_source_layers(cfg) if m > 1) * batch
    return {"tokens": tokens, "batch": batch, "global_entries_per_sequence": entries, "main_kv_bytes": main,
            "indexer_k_bytes": index, "global_kv_bytes": main + index, "swa_ring_bytes": rings,
            "swa_ring_encoder_bytes": math.ceil(swa["encoder"]) * batch,
            "swa_ring_decoder_bytes": math.ceil(swa["decoder"]) * batch,
            "swa_ring_dspark_bytes": math.ceil(swa["dspark"]) * batch, "compressor_carry_bytes": carry,
            "bytes": main + index + rings + carry}


def _fit(device_memory: int, **parts: int) -> dict[str, Any]:
    total = sum(parts.values())
    return {**parts, "total": total, "device_memory": device_memory, "headroom": device_memory - total,
            "fits": total <= device_memory}


def _check(gpus: Any, tokens: Any, batch: Any, device_memory: Any, dense: str, dtype: str) -> None:
    for name, v in (("gpus", gpus), ("context", tokens), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"--{name} must be a positive integer, got {v!r}")
    if not isinstance(device_memory, (int, float)) or not math.isfinite(device_memory) or device_memory <= 0:
        raise ValueError(f"--device-memory must be positive, got {device_memory / 1e9:g} GB")
    if dense not in DENSE_POLICIES:
        raise ValueError(f"dense weights {dense!r}: expected one of {', '.join(DENSE_POLICIES)}")
    if dtype not in HOLDING_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(HOLDING_DTYPES)}")


def memory_report(cfg: ModelConfig, gpus: int = 1, tokens: int = 1 << 20, batch: int = 1,
                  device_memory: float = H200_USABLE_BYTES, dense: str = "replicated", engram_on_device: bool = False,
                  dtype: str = "bfloat16") -> dict[str, Any]:
    """Everything `dsv41 analyze memory` prints, as a JSON-ready dict (see the module docstring for the split)."""
    _check(gpus, tokens, batch, device_memory, dense, dtype)
    device_memory = int(device_memory)
    tensors = checkpoint_tensors(cfg)
    weights = [t for t in tensors if t.kind != "fp8_rows"]
    tables = [t for t in tensors if t.kind == "fp8_rows"]
    w, tab = _sum_rows(weights, gpus, dense), _sum_rows(tables, gpus, dense)
    tab_on_device = tab["per_device_bytes"] if engram_on_device else 0
    kv = kv_memory(cfg, tokens, batch)
    kv_pd = math.ceil(kv["bytes"] / gpus)
    today = {"dtype": dtype, "weight_bytes": sum(today_bytes(t, dtype) for t in weights),
             "engram_table_bytes": sum(today_bytes(t, dtype) for t in tables),
             "per_device_bytes": per_device_bytes(tensors, lambda t: today_bytes(t, dtype), gpus, dense)}
    today["bytes"] = today["weight_bytes"] + today["engram_table_bytes"]
    return {
        "gpus": gpus, "dense": dense, "engram_on_device": engram_on_device, "device_memory": device_memory,
        "weights": {**w, "by_kind": _by(weights, category, CATEGORIES, gpus, dense),
                    "by_group": _by(weights, lambda t: t.group, GROUPS, gpus, dense),
                    "routed_expert_bytes": sum(sum(t.bytes()) for t in weights if t.routed),
                    "file_bytes": sum(sum(t.bytes(t.file_kind)) for t in tensors)},
        "engram_tables": {**tab, "modules": len(tables), "location": "device" if engram_on_device else "host",
                          "host_bytes": 0 if engram_on_device else tab["bytes"]},
        "today": today,
        "kv": {**kv, "global_kv_bytes_per_token": float(global_kv_bytes_per_token(cfg)), "per_device_bytes": kv_pd},
        "per_device": _fit(device_memory, weights=w["per_device_bytes"], engram_tables=tab_on_device, kv=kv_pd),
        "today_per_device": _fit(device_memory, weights=today["per_device_bytes"], kv=kv_pd),
    }


# ------------------------------------------------------------------------------------------ the parallel plan

HEAD_SPLIT = ("attn.wq_b.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink")   # 1/N per rank
PREFILL_CHUNK = 4096


def activation_bytes(cfg: ModelConfig, gpus: int, chunk: int, batch: int, dtype: str) -> dict[str, int]:
    """An estimate of one rank's largest live activations: one block's tensors for a prefill chunk of `chunk`
    tokens under the parallel plan (and the last position's logits of `batch` rows). Counted: the hyper-connection
    streams (block input, residual, output: 3 x T x S x D in the model dtype, plus one fp32 copy for the mHC
    math), the rank's queries and attention output (T x H/N x C each), the gathered wo_a output (T x G x R), the
    window + top-k KV rows the torch reference gathers per query (T x (W + K) x C; the GPU kernels read them in
    place), the expert slots merged over the ranks (T x K x D fp32) and the routed hidden rows (T x K x F fp32),
    the logits (batch x V fp32). Workspaces, allocator slack and the CUDA context are not counted."""
    b, T, S, D = HOLDING_DTYPES[dtype], chunk, cfg.hc_mult, cfg.dim
    H, C = cfg.n_heads // gpus, cfg.head_dim
    _, K = cfg.moe_shape(0)
    parts = {"streams": 3 * T * S * D * b + T * S * D * 4, "attention": 2 * T * H * C * b + T * cfg.o_groups *
             cfg.o_lora_rank * b, "gathered_kv": T * (cfg.window_size + cfg.index_topk) * C * b,
             "experts": T * K * (D + cfg.moe_inter_dim) * 4, "logits": batch * cfg.vocab_size * 4}
    return {**parts, "bytes": sum(parts.values()), "chunk": chunk}


def _plan_weights(cfg: ModelConfig, gpus: int) -> tuple[int, int, int]:
    """(per-GPU weight bytes under the plan, bytes of the head-split tensors whole, their share on one GPU)."""
    weights = [t for t in checkpoint_tensors(cfg) if t.kind != "fp8_rows"]
    split = {t.name for t in weights if t.name.endswith(HEAD_SPLIT)}
    share = {t.name: sum(t.bytes()) // gpus for t in weights if t.name in split}
    per_gpu = per_device_bytes(weights, lambda t: share.get(t.name, sum(t.bytes())), gpus, "replicated")
    return per_gpu, sum(sum(t.bytes()) for t in weights if t.name in split), sum(share.values())


def plan_splits(cfg: ModelConfig, gpus: int) -> str | None:
    """None when the plan splits `cfg` over `gpus` ranks, else why not."""
    bad = [f"{n} = {v}" for n, v in (("n_heads", cfg.n_heads), ("o_groups", cfg.o_groups), ("dim", cfg.dim))
           if v % gpus]
    return f"{', '.join(bad)} not divisible by {gpus}" if bad else None


def parallel_plan(cfg: ModelConfig, gpus: int = 8, tokens: int = 1 << 20, batch: int = 1,
                  chunk: int = PREFILL_CHUNK, device_memory: float = H200_USABLE_BYTES,
                  dtype: str = "bfloat16") -> dict[str, Any]:
    """Bytes per GPU under `dsv41.parallel`'s plan (heads, wo groups and wo_b rows 1/N; routed experts ceil(E/N);
    everything else replicated; Engram tables in host memory; the latent KV whole on every rank), next to
    data-parallel attention (attention weights replicated, each rank the KV of ceil(batch/N) sequences), and the
    batch of `tokens`-token sequences beyond which data-parallel attention holds fewer bytes; the plan's fit on
    4 and 8 devices."""
    _check(gpus, tokens, batch, device_memory, "replicated", dtype)
    if plan_splits(cfg, gpus):
        return {"gpus": gpus, "splits": False, "why": plan_splits(cfg, gpus)}
    tp_weights, attn_bytes, attn_share = _plan_weights(cfg, gpus)
    kv_seq = kv_memory(cfg, tokens, 1)["bytes"]
    act = activation_bytes(cfg, gpus, chunk, batch, dtype)
    tp = _fit(int(device_memory), weights=tp_weights, kv=kv_seq * batch, activations=act["bytes"])
    dp = _fit(int(device_memory), weights=tp_weights - attn_share + attn_bytes,
              kv=kv_seq * math.ceil(batch / gpus), activations=act["bytes"])
    fits = {}
    for n in (4, 8):
        if plan_splits(cfg, n) is None:
            w = _plan_weights(cfg, n)[0]
            fits[n] = _fit(int(device_memory), weights=w, kv=kv_seq * batch,
                           activations=activation_bytes(cfg, n, chunk, batch, dtype)["bytes"])
    crossover = None if gpus == 1 else (attn_bytes - attn_share) / (kv_seq * (1 - 1 / gpus))
    return {"gpus": gpus, "splits": True, "tokens": tokens, "batch": batch, "attention_split_bytes": attn_bytes,
            "kv_bytes_per_sequence": kv_seq, "activations": act, "tensor_parallel_attention": tp,
            "data_parallel_attention": dp, "crossover_batch": crossover, "fits": fits}


# ------------------------------------------------------------------------------------------ decode weight reads

def decode_read_bytes(cfg: ModelConfig, batch: int, holding: str = "packed") -> dict[str, float]:
    """Weight bytes one decode step of `batch` tokens must read: every backbone weight outside the routed experts
    (attention, shared experts, gates, mHC, head, Engram's projections; not the token-embedding and Engram tables,
    of which a step reads only its rows), plus the routed experts the batch is expected to touch: a layer of E
    experts with top-K routing, each token picking K of them uniformly, touches E (1 - (1 - K/E)^B) in expectation.
    holding: "packed" (the checkpoint formats) or a dense holding dtype ("bfloat16" / "float32"). Divided by a
    measured copy bandwidth this is the step's weight-read limit (the decode benchmarks)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if holding != "packed" and holding not in HOLDING_DTYPES:
        raise ValueError(f"holding must be 'packed' or one of {sorted(HOLDING_DTYPES)}, got {holding!r}")

    def size(t: TensorSpec) -> int:
        return sum(t.bytes()) if holding == "packed" else today_bytes(t, holding)

    dense = routed = 0.0
    for t in checkpoint_tensors(cfg):
        if t.group not in ("backbone", "engram") or t.kind == "fp8_rows" or t.name == "embed.weight":
            continue
        if t.routed:
            E, K = cfg.moe_shape(int(t.name.split(".")[1]))
            routed += size(t) / t.count * E * (1 - (1 - K / E) ** batch)
        else:
            dense += size(t)
    return {"dense_bytes": dense, "routed_bytes": routed, "bytes": dense + routed}
