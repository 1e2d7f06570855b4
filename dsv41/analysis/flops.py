"""Decode and prefill compute versus context length, from the config (docs/system.md §1; docs/report.md §4.4).

Units: a MAC is one multiply-accumulate; FLOPs = 2 * MACs. "Weighted" FLOPs follow the report's Figure 2
convention: each FLOP is weighted by the relative cost of its precision, BF16 1, FP8 0.5, FP4 0.25 (FP32 counted
as BF16). Elementwise work (norms, RoPE, softmax, SwiGLU, hc_post, compressor pooling) is not counted: only
matrix products.

Decode indexer (docs/report.md §4.4): each (query, entry) score is index_n_heads * index_head_dim = 32 * 128 = 4096
MACs. Full layers (own keys) scan every visible entry, N // m of them; Reindex layers scan only the candidate pool,
candidate_topk_blocks * candidate_block_size = 2048 * 8 = 16,384 entries (or all visible ones if fewer):

    MAC_idx(N) = 4096 * (3 * N/2 + N) + 4 * 4096 * 16,384 = 10,240 N + 0.27 G.

Without the hierarchical indexer the Reindex layers scan everything too: 4096 * (3/2 + 1 + 4) N = 26,624 N. The
per-entry head-weighting sum (32 MACs, 0.8%) is left out, as in the report's formula.

Per-token decode model (`decode_terms`), one generated token at context N, every backbone layer:
- FP8 linears (`dtype` fp8; activations are quantized to FP8 per 32, docs/model.md §9): wq_a, wq_b, wkv, wo_a, wo_b,
  the shared expert, the indexer's wq_b, Engram's wkv. wo_a is counted at its checkpoint format (FP8); the
  reference dequantizes it to BF16 at load only because its grouped einsum needs it.
- Routed experts, top-k of them: weights FP4 but activations FP8, and a mixed-operand MMA runs at the rate of its
  wider operand, so they count at FP8 (0.5). `expert_mma="fp4"` counts them at 0.25 instead (a GPU with a native
  W4A8 path at FP4 rate); see `decode_report` for both curves. The FP8 choice is the one that reproduces Figure 2's
  ~20 GFLOPs at short context (16B activated; docs/report.md §4.4: "about 20 vs 17 GFLOPs").
- BF16 / FP32 matmuls (weight 1): the MoE gate, the hc_mixes projections, the compressor (fp32 for m = 2, bf16 for
  m = 1), the indexer's wk (once per new entry, i.e. 1/m per token) and weights_proj, the LM head.
- Attention core in BF16: QK and PV over the window (min(W, N) rows) plus the top-k compressed entries
  (min(index_topk, N // m)) for layers with m > 0: 2 * n_heads * head_dim MACs per entry.
- Indexer scores at FP4 (q and k are both MXFP4): the formula above.
The DSpark drafter is not part of the per-token model (it is a separate, optional forward).

Prefill (`prefill_report`), a prompt of N tokens under CED (docs/system.md §2): the encoder layers run on all N tokens
(attention core and indexer over the causal prefix of each query), the decoder KV source produces global KV for
all N tokens, the decoder layers run in full on the last window_size tokens only, the head on the last token.
The encoder Full layers' indexer is still O(N^2): query i sees (i+1)//m entries, N/(2m) on average, so
3 layers * 4096 * N * N/4 = 3072 N^2 MACs; the hierarchical indexer does not cover the encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from dsv41.analysis.params import engram_wkv_params, expert_params, hc_mix_width
from dsv41.config import LayerRole, Mode, ModelConfig, ced_split, layer_roles

PRECISION_WEIGHT = {"bf16": 1.0, "fp32": 1.0, "fp8": 0.5, "fp4": 0.25}

# Default contexts: 4K to 1M (256x, binary), the range of the report's Figure 2.
DEFAULT_CONTEXTS = tuple(4096 << k for k in range(9))
# docs/report.md §4.4 quotes the indexer at "N = 1M" as 10.2 G MACs / 20.5 GFLOPs, i.e. N = 10^6.
ONE_MILLION = 1_000_000


def linear_precision(cfg: ModelConfig) -> str:
    """Compute precision of an ordinary Linear: FP8 x FP8 when the checkpoint stores it FP8, else BF16."""
    return "fp8" if cfg.dtype == "fp8" else "bf16"


def expert_precision(cfg: ModelConfig, expert_mma: str = "auto") -> str:
    """Compute precision of a routed-expert GEMM. 'auto': the wider of the weight format (expert_dtype, fp4) and
    the activation format (fp8 for quantized weights): FP8. Or an explicit 'fp4' / 'fp8' / 'bf16'."""
    if expert_mma != "auto":
        if expert_mma not in PRECISION_WEIGHT:
            raise ValueError(f"expert_mma must be auto, fp4, fp8 or bf16, not {expert_mma!r}")
        return expert_mma
    # The config allows fp4 / fp8 / bf16 weights: quantized ones run at FP8 (their activations' width).
    return "bf16" if (cfg.expert_dtype or cfg.dtype) == "bf16" else "fp8"


# ------------------------------------------------------------------------------------------ indexer

def index_score_macs(cfg: ModelConfig) -> int:
    """MACs of one (query, entry) indexer score: index_n_heads * index_head_dim (4096)."""
    return cfg.index_n_heads * cfg.index_head_dim


def candidate_pool_entries(cfg: ModelConfig) -> int:
    """Entries in the hierarchical indexer's candidate pool: 2048 blocks * 8 = 16,384."""
    return cfg.candidate_topk_blocks * cfg.candidate_block_size


def _scanned_entries(cfg: ModelConfig, role: LayerRole, visible: int, hierarchical: bool) -> int:
    if role.mode == Mode.REINDEX and hierarchical and role.uses_candidates:
        return min(candidate_pool_entries(cfg), visible)
    return visible if role.mode in (Mode.FULL, Mode.REINDEX) else 0


def indexer_macs(cfg: ModelConfig, n: int, hierarchical: bool = True) -> int:
    """Decode indexer MACs for one token at context n (n // m entries visible per index source)."""
    return sum(index_score_macs(cfg) * _scanned_entries(cfg, r, n // r.ratio if r.ratio else 0, hierarchical)
               for r in layer_roles(cfg))


def indexer_coefficients(cfg: ModelConfig) -> dict[str, float]:
    """The linear form a*N + b of the decode indexer for N large enough that every pool is full.

    a = 4096 * sum over Full layers of 1/m (10,240); b = 4096 * pool * (# Reindex layers) (~0.27 G);
    flat (no hierarchical indexer): a = 4096 * sum over all index sources of 1/m (26,624)."""
    s = index_score_macs(cfg)
    full = [r for r in layer_roles(cfg) if r.mode == Mode.FULL]
    reidx = [r for r in layer_roles(cfg) if r.mode == Mode.REINDEX]
    pooled = [r for r in reidx if r.uses_candidates]
    a = s * sum(1 / r.ratio for r in full + [r for r in reidx if not r.uses_candidates])
    return {"per_token": a, "constant": s * candidate_pool_entries(cfg) * len(pooled),
            "flat_per_token": s * sum(1 / r.ratio for r in full + reidx),
            "effective_full_layers": sum(1 / r.ratio for r in full)}


# ------------------------------------------------------------------------------------------ per-token decode

@dataclass(frozen=True)
class Term:
    name: str
    macs: float
    precision: str

    @property
    def flops(self) -> float:
        return 2.0 * self.macs

    @property
    def weighted(self) -> float:
        return self.flops * PRECISION_WEIGHT[self.precision]


def _summed(terms: Iterable[Term]) -> list[Term]:
    """Terms of the same name and precision added up, in order of first appearance."""
    acc: dict[tuple[str, str], float] = {}
    for t in terms:
        acc[(t.name, t.precision)] = acc.get((t.name, t.precision), 0.0) + t.macs
    return [Term(name, macs, prec) for (name, prec), macs in acc.items()]


def _layer_linear_terms(cfg: ModelConfig, role: LayerRole, expert_mma: str) -> list[Term]:
    """Matmul terms of one backbone layer that do not depend on context (per token)."""
    D, H, d = cfg.dim, cfg.n_heads, cfg.head_dim
    lin = linear_precision(cfg)
    n_exp, k = cfg.moe_shape(role.layer)
    t = [
        Term("hc_mixes", 2 * hc_mix_width(cfg) * cfg.hc_mult * D, "fp32"),
        Term("attn_q", cfg.q_lora_rank * D + H * d * cfg.q_lora_rank, lin),
        Term("attn_wkv", d * D, lin),
        Term("attn_out", cfg.o_groups * cfg.o_lora_rank * (H * d // cfg.o_groups) + D * cfg.o_groups * cfg.o_lora_rank,
             lin),
        Term("moe_gate", n_exp * D, "fp32"),
        Term("shared_expert", expert_params(cfg) * cfg.n_shared_experts, lin),
        Term("routed_experts", k * expert_params(cfg), expert_precision(cfg, expert_mma)),
    ]
    if role.is_kv_source:
        t += [Term("compressor", (2 if role.ratio > 1 else 1) * d * D, "fp32" if role.ratio > 1 else "bf16"),
              Term("indexer_k", cfg.index_head_dim * d / role.ratio, "bf16")]
    if role.is_index_source:
        t += [Term("indexer_q", cfg.index_n_heads * cfg.index_head_dim * cfg.q_lora_rank, lin),
              Term("indexer_weights", cfg.index_n_heads * D, "bf16")]
    return t


def _attn_core(cfg: ModelConfig, rows: int) -> Term:
    """QK and PV over `rows` keys (window rows + selected compressed entries), BF16."""
    return Term("attention_core", 2 * cfg.n_heads * cfg.head_dim * rows, "bf16")


def _token_terms(cfg: ModelConfig, role: LayerRole, n: int, expert_mma: str, hierarchical: bool,
                 skip: tuple[str, ...] = ()) -> Iterator[Term]:
    """One layer's terms for one token at context n (the token itself included), less the names in `skip`."""
    yield from (t for t in _layer_linear_terms(cfg, role, expert_mma) if t.name not in skip)
    visible = n // role.ratio if role.ratio else 0
    yield _attn_core(cfg, min(cfg.window_size, n) + min(cfg.index_topk, visible))
    scanned = _scanned_entries(cfg, role, visible, hierarchical)
    if scanned:
        yield Term("indexer_scores", index_score_macs(cfg) * scanned, "fp4")


def decode_terms(cfg: ModelConfig, n: int, expert_mma: str = "auto", hierarchical: bool = True) -> list[Term]:
    """All matmul terms of one decode token at context n (the token itself included), summed over layers."""
    lin = linear_precision(cfg)
    return _summed([*(t for r in layer_roles(cfg) for t in _token_terms(cfg, r, n, expert_mma, hierarchical)),
                    *(Term("engram_wkv", engram_wkv_params(cfg), lin) for _ in cfg.engram_layer_ids),
                    Term("lm_head", cfg.vocab_size * cfg.dim, "bf16")])


def decode_flops(cfg: ModelConfig, n: int, expert_mma: str = "auto", hierarchical: bool = True) -> dict[str, float]:
    terms = decode_terms(cfg, n, expert_mma, hierarchical)
    return {"raw": sum(t.flops for t in terms), "weighted": sum(t.weighted for t in terms)}


# ------------------------------------------------------------------------------------------ prefill

def _sum_floor(n: int, m: int) -> int:
    """sum_{i=1..n} floor(i/m), exact."""
    if n <= 0:
        return 0
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _sum_min_floor(n: int, m: int, cap: int) -> int:
    """sum_{i=1..n} min(cap, floor(i/m)), exact."""
    return _sum_floor(n, m) if n < cap * m else _sum_floor(cap * m - 1, m) + cap * (n - cap * m + 1)


def _encoder_layers(cfg: ModelConfig) -> int:
    """Layers below the CED split: all of them when there is no split."""
    split = ced_split(cfg)
    return split if split is not None else cfg.n_layers


def encoder_indexer_macs(cfg: ModelConfig, n: int) -> dict[str, float]:
    """Prefill indexer MACs of the encoder (layers below the CED split), exact over the causal prefix:
    query i (0-based) of a ratio-m layer sees (i+1)//m entries. Coefficient of N^2: 4096 * sum 1/(2m) = 3072."""
    s = index_score_macs(cfg)
    total, coef = 0, 0.0
    for r in layer_roles(cfg)[:_encoder_layers(cfg)]:
        if r.mode == Mode.FULL or (r.mode == Mode.REINDEX and not r.uses_candidates):
            total += s * _sum_floor(n, r.ratio)
            coef += s / (2 * r.ratio)
        elif r.mode == Mode.REINDEX:
            total += s * _sum_min_floor(n, r.ratio, candidate_pool_entries(cfg))
    return {"macs": total, "n2_coefficient": coef, "approx_macs": coef * n * n}


def _prefill_parts(cfg: ModelConfig, n: int, expert_mma: str) -> Iterator[Term]:
    """Every term of a CED prefill of n tokens, in order, before `_summed` adds up the equal ones."""
    split, roles = _encoder_layers(cfg), layer_roles(cfg)
    for r in roles[:split]:                                   # encoder: every prompt token
        yield from (Term(t.name, t.macs * n, t.precision) for t in _layer_linear_terms(cfg, r, expert_mma))
        topk_rows = _sum_min_floor(n, r.ratio, cfg.index_topk) if r.ratio else 0
        yield _attn_core(cfg, _sum_min_floor(n, 1, cfg.window_size) + topk_rows)
    yield Term("indexer_scores", encoder_indexer_macs(cfg, n)["macs"], "fp4")
    if split < cfg.n_layers:                                  # decoder KV source: global KV for every token
        m = roles[split].ratio
        yield Term("compressor", (2 if m > 1 else 1) * cfg.head_dim * cfg.dim * n, "fp32" if m > 1 else "bf16")
        yield Term("indexer_k", cfg.index_head_dim * cfg.head_dim * (n // m), "bf16")
    tail = min(cfg.window_size, n)                            # decoder: the last window, in full
    for i in range(n - tail, n):                              # (compressor, indexer_k: counted above for all n)
        for r in roles[split:]:
            yield from _token_terms(cfg, r, i + 1, expert_mma, True, skip=("compressor", "indexer_k"))
    for L in cfg.engram_layer_ids:
        yield Term("engram_wkv", engram_wkv_params(cfg) * (n if L <= split else tail), linear_precision(cfg))
    yield Term("lm_head", cfg.vocab_size * cfg.dim, "bf16")


def prefill_terms(cfg: ModelConfig, n: int, expert_mma: str = "auto") -> list[Term]:
    """All matmul terms of a CED prefill of n prompt tokens (module docstring)."""
    return _summed(_prefill_parts(cfg, n, expert_mma))


def prefill_indexer_share(cfg: ModelConfig, n: int, expert_mma: str = "auto") -> dict[str, float]:
    """The encoder indexer's share of a CED prefill of n tokens, raw and weighted (indexer at FP4).

    docs/report.md §4.4's rough estimate (backbone all at FP8): ~15-20% at 1M, ~5% at 256K."""
    enc = encoder_indexer_macs(cfg, n)
    terms = prefill_terms(cfg, n, expert_mma)
    raw, weighted = sum(t.flops for t in terms), sum(t.weighted for t in terms)
    idx_raw = 2.0 * enc["macs"]
    return {"tokens": n, "encoder_indexer_macs": enc["macs"], "n2_coefficient": enc["n2_coefficient"],
            "approx_macs": enc["approx_macs"], "prefill_flops_raw": raw, "prefill_flops_weighted": weighted,
            "fraction_raw": idx_raw / raw, "fraction_weighted": idx_raw * PRECISION_WEIGHT["fp4"] / weighted}


# ------------------------------------------------------------------------------------------ report

def flops_report(cfg: ModelConfig, contexts: Iterable[int] = DEFAULT_CONTEXTS,
                 prefill_contexts: Iterable[int] = (1 << 18, 1 << 20)) -> dict[str, Any]:
    """Everything `dsv41 analyze flops` prints, as a JSON-ready dict (FLOPs in units of 1, not G)."""
    ctx = [int(c) for c in contexts]
    if not ctx or any(c <= 0 for c in ctx):
        raise ValueError(f"contexts must be positive token counts, got {ctx}")
    coefs, idx_1m = indexer_coefficients(cfg), indexer_macs(cfg, ONE_MILLION)
    dec, dec_fp4 = [decode_flops(cfg, n) for n in ctx], [decode_flops(cfg, n, expert_mma="fp4") for n in ctx]
    lo, hi = min(ctx), max(ctx)
    ilo, ihi = ctx.index(lo), ctx.index(hi)
    terms = [{f"{t.name}[{t.precision}]": t.weighted for t in decode_terms(cfg, c)} for c in (lo, hi)]
    return {
        "contexts": ctx,
        "indexer_macs": [indexer_macs(cfg, n) for n in ctx],
        "indexer_macs_flat": [indexer_macs(cfg, n, hierarchical=False) for n in ctx],
        "indexer_formula": {**coefs, "score_macs": index_score_macs(cfg), "pool_entries": candidate_pool_entries(cfg)},
        "indexer_at_1m": {"tokens": ONE_MILLION, "macs": idx_1m, "linear_term_macs": coefs["per_token"] * ONE_MILLION,
                          "flops_raw": 2.0 * idx_1m, "flops_weighted_fp4": 2.0 * idx_1m * PRECISION_WEIGHT["fp4"],
                          "flat_macs": indexer_macs(cfg, ONE_MILLION, hierarchical=False)},
        "decode_flops_raw": [d["raw"] for d in dec], "decode_flops_weighted": [d["weighted"] for d in dec],
        "decode_flops_weighted_fp4_experts": [d["weighted"] for d in dec_fp4],
        "decode_growth": {"from": lo, "to": hi, "ratio": dec[ihi]["weighted"] / dec[ilo]["weighted"],
                          "ratio_fp4_experts": dec_fp4[ihi]["weighted"] / dec_fp4[ilo]["weighted"]},
        "decode_terms_weighted": {"context": lo, "terms": terms[0], "context_hi": hi, "terms_hi": terms[1]},
        "precision_weights": PRECISION_WEIGHT, "expert_precision": expert_precision(cfg),
        "prefill_indexer_share": [prefill_indexer_share(cfg, n) for n in prefill_contexts],
    }


def plot_decode_curve(cfg: ModelConfig, contexts: Iterable[int], path: str) -> None:
    """Write the decode weighted-FLOPs-vs-context curve (log-x), Figure-2 style, to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = sorted(int(c) for c in contexts)
    if not ctx:
        raise ValueError("no contexts to plot")
    lo, hi, steps = ctx[0], ctx[-1], 64
    dense = sorted(set(ctx) | {round(lo * (hi / lo) ** (k / steps)) for k in range(steps + 1)})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for kw, style, label in (({}, "-", "hierarchical indexer (experts at FP8 MMA rate)"),
                             ({"expert_mma": "fp4"}, "--", "experts counted at FP4"),
                             ({"hierarchical": False}, ":", "no hierarchical indexer")):
        ax.plot(dense, [decode_flops(cfg, n, **kw)["weighted"] / 1e9 for n in dense], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context N (tokens)", ylabel="decode GFLOPs per token (BF16 1, FP8 0.5, FP4 0.25)",
           title="Decode compute vs context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
