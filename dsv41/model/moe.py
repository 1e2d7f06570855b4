"""Mixture of experts: sqrt-softplus gate with selection-only bias, SwiGLU experts with the asymmetric clamp,
one shared expert (docs/model.md §5).

Legend: N tokens (flattened B*T), D width, F expert hidden width, E routed experts, K activated experts.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.kernels import expert_act, moe_combine, moe_experts, moe_gate, qdq_fp8
from dsv41.kernels.choice import fused_moe
from dsv41.kernels.invariant import small_sum
from dsv41.kernels.moe_ref import gate_scores
from dsv41.model.common import Linear, lin_kind


class Gate(nn.Module):
    """scores = score_func(v W_g^T / gate_temp) in fp32; experts picked by top-K of scores + bias (the bias
    steers selection only, aux-loss-free balancing); weights from the unbiased scores, normalised, x route_scale.
    Image-span tokens select with `bias_vl` (one bias per modality, docs/system.md §6)."""

    def __init__(self, cfg, n_experts: int, topk: int, dtype: torch.dtype):
        super().__init__()
        self.topk, self.score_func = topk, cfg.score_func
        self.gate_temp, self.norm_topk_prob, self.route_scale = cfg.gate_temp, cfg.norm_topk_prob, cfg.route_scale
        self.weight = nn.Parameter(torch.empty(n_experts, cfg.dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32)) if cfg.vision_enabled else None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return gate_scores(x, self.weight, self.score_func, self.gate_temp)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None, indices: torch.Tensor | None = None):
        """x [N,D], image_mask [N] bool -> (weights [N,K] fp32, indices [N,K] long, scores [N,E]).
        indices: the experts to use (a replayed routing) instead of the top-K selection; the weights are still the
        current scores at them (so the gate trains)."""
        if indices is None and (image_mask is None or self.bias_vl is None):     # one Triton launch on a GPU
            return moe_gate(x, self.weight, self.bias, self.topk, self.score_func, self.gate_temp,
                            self.norm_topk_prob, self.route_scale)
        scores = self.scores(x)
        if indices is None:
            bias = self.bias
            if image_mask is not None and self.bias_vl is not None:
                bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, bias)
            indices = (scores + bias).detach().topk(self.topk, dim=-1).indices
        elif indices.shape != (x.size(0), self.topk):
            raise ValueError(f"replayed routing must be [{x.size(0)}, {self.topk}] expert ids, got {tuple(indices.shape)}")
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and self.topk > 1:
            weights = weights / (small_sum(weights, -1, keepdim=True) + 1e-20)  # literal 1e-20, not norm_eps
        return weights * self.route_scale, indices, scores


class Expert(nn.Module):
    """SwiGLU: w2( silu(min(w1 v, L)) * clamp(w3 v, -L, L) ), routing weight applied before w2."""

    def __init__(self, dim: int, inter: int, kind: str, dtype: torch.dtype, swiglu_limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter, kind, dtype)
        self.w2 = Linear(inter, dim, kind, dtype)
        self.w3 = Linear(dim, inter, kind, dtype)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        shared = self.w1.quantizes_input and self.w3.quantizes_input      # one activation QDQ for w1 and w3
        xq = qdq_fp8(x) if shared else x
        gate, up = self.w1(xq, input_quantized=shared), self.w3(xq, input_quantized=shared)
        q2 = self.w2.quantizes_input
        h = expert_act(gate, up, weights, self.limit, q2, x.dtype)         # w2's input, QDQ'd when w2 quantizes
        return self.w2(h, input_quantized=q2)


def held(lin: Linear):
    """A Linear's weight as held (the Parameter itself when dense: no property lookups on the decode path)."""
    w = lin._parameters.get("weight")
    return w if w is not None else lin.stored_weight()


class MoE(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype: torch.dtype):
        super().__init__()
        n_experts, topk = cfg.moe_shape(layer_id)
        self.layer, self.n_experts, self.dim = layer_id, n_experts, cfg.dim
        self.gate = Gate(cfg, n_experts, topk, dtype)
        kind = cfg.expert_dtype or "bf16"                          # routed experts' storage (null: bf16)
        self.experts = nn.ModuleList(
            [Expert(cfg.dim, cfg.moe_inter_dim, kind, dtype, cfg.swiglu_limit) for _ in range(n_experts)])
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, lin_kind(cfg), dtype, cfg.swiglu_limit)

    def fused_weights(self):
        """(w1s, w3s, w2s, quant_in, quant_mid) for `moe_experts` (routed experts, then the shared one) when every
        expert's Linears agree on the activation QDQ, have no bias and no expert has forward hooks; else None. Each
        weight as held: the dense Parameter, or a `PackedWeight` view of the checkpoint bytes (the op's kernels
        decode them in registers).
        Checked on every call (flags and hooks can change), through the modules' own dicts: this runs once per
        layer and decode step, where nn.Module attribute lookups would cost ~200 per layer."""
        mods = (*self.experts._modules.values(), self.shared_experts)
        lins = [(m._modules["w1"], m._modules["w3"], m._modules["w2"]) for m in mods]
        for mod in (*mods, *(w for ls in lins for w in ls)):
            if mod._forward_pre_hooks or mod._forward_hooks or mod._parameters.get("bias") is not None:
                return None
        q_in = {w.quantizes_input for w1, w3, _ in lins for w in (w1, w3)}
        q_mid = {w2.quantizes_input for _, _, w2 in lins}
        if len(q_in) != 1 or len(q_mid) != 1:
            return None
        w1s, w3s, w2s = ([held(ls[i]) for ls in lins] for i in range(3))
        return w1s, w3s, w2s, q_in.pop(), q_mid.pop()

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None, record: dict | None = None,
                routes: dict | None = None, route_log: dict | None = None) -> torch.Tensor:
        """x [B,T,D] -> [B,T,D]. Routed outputs accumulate in fp32 in ascending expert id, shared expert last.
        With `record` (a dict), the routing (indices [B,T,K], weights [B,T,K]) is kept under ("experts", layer);
        `routes` {layer: ids [B,T,K]} replaces this layer's selection; `route_log` (a dict) receives its ids."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        given = None if routes is None or self.layer not in routes else routes[self.layer].reshape(-1, self.gate.topk)
        weights, indices, _ = self.gate(x, None if image_mask is None else image_mask.reshape(-1),
                                        None if given is None else given.to(x.device, torch.long))
        if route_log is not None:
            route_log[self.layer] = indices.view(*shape[:-1], -1)
        if record is not None:
            record[("experts", self.layer)] = (indices.view(*shape[:-1], -1), weights.view(*shape[:-1], -1))
        fused = self.fused_weights() if fused_moe(x) else None
        if fused is not None:
            y = moe_experts(x, indices, weights, *fused[:3], self.shared_experts.limit, *fused[3:])
        else:
            y = self.module_loop(x, indices, weights)
        return y.view(shape)

    def module_loop(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts through their own modules (any hooks, quantization flags, batch size): x [N,D] -> [N,D]."""
        return moe_combine(x, indices, weights, self.n_experts, lambda e, xe, w: self.experts[e](xe, w),
                           self.shared_experts)
