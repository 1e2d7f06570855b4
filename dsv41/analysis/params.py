"""Parameter counts from the config, tensor by tensor (docs/model.md §9; docs/system.md §1).

Counts are numbers of weight elements of the checkpoint tensors listed in docs/model.md §9, derived from the config:
`.scale` tensors of quantized weights are storage metadata, not parameters, and are not counted (Engram's
per-row scales included). Conditional tensors follow the layer roles: compressor `wgate` only where m > 1 (the
released config has it exactly on the ratio-2 sources), indexer `wk`/`k_norm` and the compressor only on KV
sources, indexer `wq_b`/`weights_proj` only on index sources, `gate.bias_vl` only with vision enabled.

Report figures this reproduces (docs/report.md §1): backbone ~552B, of which ~545B experts (40 * 385 * 3 * 5120 *
2304: the 384 routed plus the shared expert of each layer), Engram ~196.6B (2 modules * 3 n-gram orders * 8 heads
* ~16M rows * 256), activated ~8B in prefill and ~16B in decode.

Activated parameters (our definition; the report gives no formula, this one reproduces its rounded figures):
the parameters that take part in a multiply-accumulate for one token. Only the top-k routed experts count, plus
the shared expert; table lookups (the token-embedding row, the Engram rows) are memory reads, not compute, and
count 0; the LM head counts where the token's logits are computed.
- decode: every backbone layer in full (attention, hc mixes, norms, gate, shared + top-k routed experts, and the
  compressor / indexer tensors of the layers that have them), every Engram module's projections, final norm and
  LM head. The DSpark drafter is a separate model and is not included.
- prefill (CED, docs/system.md §2): a prompt token runs the encoder only (layers below `ced_split`, with the Engram
  modules placed at or below the split) plus the decoder KV source's global-KV production: its attn_norm (the
  collapse uses the previous block's mix, so no hc projection of its own), compressor and indexer key projection.
  The decoder layers in full and the LM head run only for the last window / last position, which is O(1) per
  prompt, not per token.
"""

from __future__ import annotations

from typing import Any

from dsv41.config import Mode, ModelConfig, ced_split, layer_roles


def hc_mix_width(cfg: ModelConfig) -> int:
    """hc_mixes outputs: hc pre weights + hc post weights + hc x hc comb matrix = 4 + 4 + 16 = 24."""
    return (2 + cfg.hc_mult) * cfg.hc_mult


def expert_params(cfg: ModelConfig) -> int:
    """One SwiGLU expert: w1, w3 [inter, dim] and w2 [dim, inter]."""
    return 3 * cfg.moe_inter_dim * cfg.dim


def block_params(cfg: ModelConfig, layer: int) -> dict[str, int]:
    """Parameters of one block (a backbone layer or a DSpark stage), by component.

    `routed_experts` holds all routed experts of the layer; activated counts take `n_activated` of them."""
    D, H, d = cfg.dim, cfg.n_heads, cfg.head_dim
    mixw = hc_mix_width(cfg)
    hc_one = mixw * cfg.hc_mult * D + mixw + 3            # fn [24, 4D] + base [24] + scale [3]
    n_experts, _ = cfg.moe_shape(layer)
    p: dict[str, int] = {
        "hc_attn": hc_one, "hc_ffn": hc_one, "attn_norm": D, "ffn_norm": D, "attn_sink": H,
        "attn_q": cfg.q_lora_rank * D + cfg.q_lora_rank + H * d * cfg.q_lora_rank,   # wq_a, q_norm, wq_b
        "attn_wkv": d * D + d,                                                        # wkv, kv_norm
        "attn_out": cfg.o_groups * cfg.o_lora_rank * (H * d // cfg.o_groups)          # wo_a
                    + D * cfg.o_groups * cfg.o_lora_rank,                             # wo_b
        "gate": n_experts * D + n_experts + (n_experts if cfg.vision_enabled else 0),  # weight, bias, bias_vl
        "shared_expert": expert_params(cfg) * cfg.n_shared_experts,
        "routed_experts": expert_params(cfg) * n_experts,
    }
    role = layer_roles(cfg)[layer] if layer < cfg.n_layers else None
    if role is not None and role.is_kv_source:
        p["compressor"] = d * D + (d * D if role.ratio > 1 else 0) + d                # wkv, wgate, norm
        p["indexer_k"] = cfg.index_head_dim * d + cfg.index_head_dim                  # wk, k_norm
    if role is not None and role.is_index_source:
        p["indexer_q"] = (cfg.index_n_heads * cfg.index_head_dim * cfg.q_lora_rank  # wq_b
                          + cfg.index_n_heads * D)                                  # weights_proj
    return p


def engram_params(cfg: ModelConfig) -> dict[str, int]:
    """Engram modules: tables (rows x head_dim, FP8 in storage), wkv [(hc+1)*dim, orders*heads*head_dim] (hc
    per-stream keys + one value), q_weight and k_weight [hc, dim]. The report's ~196.6B is the tables alone."""
    if not cfg.engram_enabled:
        return {"tables": 0, "wkv": 0, "qk_weights": 0, "modules": 0}
    n_mod = len(cfg.engram_layer_ids)
    return {"tables": sum(cfg.engram_num_embeddings) * cfg.engram_head_dim, "wkv": n_mod * engram_wkv_params(cfg),
            "qk_weights": n_mod * 2 * cfg.hc_mult * cfg.dim, "modules": n_mod}


def engram_wkv_params(cfg: ModelConfig) -> int:
    """One Engram module's wkv: [(hc+1)*dim, (max_ngram - 1) orders * heads * head_dim]."""
    orders = cfg.engram_max_ngram_size - 1
    return (cfg.hc_mult + 1) * cfg.dim * orders * cfg.engram_n_heads * cfg.engram_head_dim


def dspark_params(cfg: ModelConfig) -> dict[str, int]:
    """DSpark drafter: its blocks (128 experts each), main_proj/main_norm, final norm, Markov embedding and head,
    confidence head. Token embedding and LM head are tied to the backbone and not counted again."""
    if not cfg.dspark_enabled:
        return dict.fromkeys(("blocks", "main_proj", "norm", "markov", "confidence", "experts"), 0)
    D = cfg.dim
    blocks = [block_params(cfg, L) for L in range(cfg.n_layers, cfg.total_layers)]
    return {"blocks": sum(sum(b.values()) for b in blocks),
            "experts": sum(b["routed_experts"] + b["shared_expert"] for b in blocks),
            "main_proj": D * D * len(cfg.dspark_target_layer_ids) + D, "norm": D,
            "markov": 2 * cfg.vocab_size * cfg.dspark_markov_rank, "confidence": D + cfg.dspark_markov_rank}


def vision_params(cfg: ModelConfig) -> dict[str, int]:
    """ViT (patch embed, blocks, final norm) + aligner (3x3 unshuffle MLP) + image_start/end/newline."""
    if not cfg.vision_enabled:
        return {"vit": 0, "aligner": 0, "special": 0}
    vd, vi, p = cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size
    patch = vd * 3 * p * p + vd
    block = (2 * vd                       # norm1, norm2
             + 3 * vd * vd + 3 * vd       # wqkv + bias
             + vd * vd + vd               # wo + bias
             + 2 * vi * vd + vd * vi)     # mlp w1 [2*inter, vd], w2 [vd, inter]
    vit = patch + cfg.vision_n_layers * block + vd
    aligner = cfg.dim * vd * cfg.vision_downsample_ratio ** 2 + cfg.dim + cfg.dim * cfg.dim + cfg.dim
    return {"vit": vit, "aligner": aligner, "special": 3 * cfg.dim}


def _activated_block(cfg: ModelConfig, layer: int) -> int:
    p = block_params(cfg, layer)
    return sum(p.values()) - p["routed_experts"] + cfg.moe_shape(layer)[1] * expert_params(cfg)


def _engram_per_module(cfg: ModelConfig) -> int:
    e = engram_params(cfg)
    return (e["wkv"] + e["qk_weights"]) // e["modules"] if e["modules"] else 0


def activated_decode(cfg: ModelConfig) -> dict[str, int]:
    """Per generated token: all backbone layers, Engram projections, final norm + LM head (module docstring)."""
    layers = sum(_activated_block(cfg, L) for L in range(cfg.n_layers))
    engram = _engram_per_module(cfg) * len(cfg.engram_layer_ids)
    head = cfg.dim + cfg.vocab_size * cfg.dim
    return {"layers": layers, "engram": engram, "head": head, "total": layers + engram + head}


def kv_production_params(cfg: ModelConfig, layer: int) -> int:
    """What a KV source runs to produce its global KV for a token: attn_norm, compressor, indexer keys."""
    p = block_params(cfg, layer)
    return p["attn_norm"] + p.get("compressor", 0) + p.get("indexer_k", 0)


def activated_prefill(cfg: ModelConfig) -> dict[str, int]:
    """Per prompt token under CED: encoder layers + Engram at or below the split + the split layer's global-KV
    production. Without a CED split (no KV sources) every layer runs: same as decode minus the head."""
    split = ced_split(cfg)
    if split is None:
        d = activated_decode(cfg)
        enc, engram, kvp = d["layers"], d["engram"], 0
    else:
        enc = sum(_activated_block(cfg, L) for L in range(split))
        engram = _engram_per_module(cfg) * sum(1 for L in cfg.engram_layer_ids if L <= split)
        kvp = kv_production_params(cfg, split)
    return {"encoder_layers": enc, "engram": engram, "kv_production": kvp, "total": enc + engram + kvp}


def params_report(cfg: ModelConfig) -> dict[str, Any]:
    """Everything `dsv41 analyze params` prints. `backbone` = token embedding + backbone layers (incl. all
    experts) + final norm + LM head; Engram, DSpark and vision are separate and not in it."""
    blocks = [block_params(cfg, L) for L in range(cfg.n_layers)]
    layers = sum(sum(b.values()) for b in blocks)
    routed, shared = sum(b["routed_experts"] for b in blocks), sum(b["shared_expert"] for b in blocks)
    embed = head = cfg.vocab_size * cfg.dim
    backbone = embed + layers + cfg.dim + head
    eng, dsp, vis = engram_params(cfg), dspark_params(cfg), vision_params(cfg)
    engram = eng["tables"] + eng["wkv"] + eng["qk_weights"]
    dspark = sum(v for k, v in dsp.items() if k != "experts")
    per_mode = {m.value: sum(sum(blocks[r.layer].values()) for r in layer_roles(cfg) if r.mode == m) for m in Mode}
    act_p, act_d = activated_prefill(cfg), activated_decode(cfg)
    return {
        "backbone": backbone, "experts": routed + shared,
        "backbone_detail": {"embed": embed, "head": head, "layers": layers, "layers_by_mode": per_mode,
                            "non_expert_layers": layers - routed - shared, "routed_experts": routed,
                            "shared_experts": shared},
        "engram": engram, "engram_detail": eng,
        "dspark": dspark, "dspark_detail": dsp,
        "vision": sum(vis.values()), "vision_detail": vis,
        "total": backbone + engram + dspark + sum(vis.values()),
        "activated_prefill": act_p["total"], "activated_prefill_detail": act_p,
        "activated_decode": act_d["total"], "activated_decode_detail": act_d,
        "ced_split": ced_split(cfg),
    }
