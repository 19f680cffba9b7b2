"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks top-k experts per token, each a
SiLU-gated MLP, and their outputs are summed with the router's weights.

Every expert's projection is one `ExpertLinears`: the tensors of its LinearFormat (dense, w4a16,
w8a8-fp8, w8a8-fp8-block) stacked on a leading [num_local_experts] dim, so the artifact holds
`moe.experts.gate_up.*` [E, ...] and the fused kernel (kernels/fused_moe.py) reads all experts at once. On CUDA,
dense, w4a16 (gpu layout), w8a8-fp8 and w8a8-fp8-block experts run the fused kernel: one grouped GEMM per projection
(tokens sorted by expert, no host sync, so decode steps capture in CUDA graphs). The plain-torch
path (CPUs, calibration, and formats the kernel does not read: plain-layout / g_idx integer weights,
w8a8-fp8 on GPUs without FP8 tensor cores) loops over the experts that received tokens, calling
each expert's format `apply`.

A shared expert (Qwen2-MoE, Granite MoE shared: ModelConfig.shared_expert_intermediate_size) is a dense SiLU-gated
MLP of ordinary `Linear`s that every token runs, on every path (the fused kernel's and the plain-torch one alike):
its output, times sigmoid(x · shared_gate) where the model has that gate (Qwen2-MoE), is added to the routed
experts' before the all-reduce. Under tensor parallelism it is split like the dense MLP (gate_up columns, down
rows), whether the routed experts are split or whole; the gate is whole on every rank (the sigmoid scales each
rank's partial sum alike).

DeepSeek's routers (ModelConfig.router_scoring, router_groups, routed_scaling_factor: `deepseek_route`) run in float32
on a float32 router weight, as transformers' DeepseekV2/V3TopkRouter: V2 softmax scores, top-k (greedy, or within the
best groups by their best expert); V3 sigmoid scores chosen by score + e_score_correction_bias (moe.gate_bias) within
the best groups by their two best experts' sum, weighted by the scores without the bias, renormalised where
norm_topk_prob; both times routed_scaling_factor. They hand the fused kernel (ids, weights) as the softmax router does.
ERNIE 4.5 MoE's router is V2's softmax chosen by score + its moe_statics bias (moe.gate_bias) as V3's, no groups,
renormalised by max(sum, moe_norm_min) (ModelConfig.router_norm_min), as transformers' Ernie4_5_MoeTopKRouter.

Nemotron-H's experts (Nemotron 3 Nano; ModelConfig.hidden_act relu2, the family's MLP activation) have no gate:
experts.gate_up keeps its name and holds up's rows alone [E, width, hidden], the activation is relu(up)² on every path
(`gated_activation`'s relu2: the fused kernel's, between its two grouped GEMMs, and the plain-torch one); their shared
expert is relu2's too (moe.shared.up, moe.shared.down). Their router is DeepSeek-V3's (`deepseek_route`).

Llama 4's router (router_scoring sigmoid_input, top-k 1) takes the top logit and its sigmoid, which multiplies the
expert's input rather than its output: the hidden state is scaled by its score (in the model dtype, as transformers)
before the routed experts, whose outputs are then weighted by 1, on every path (the fused kernel's, the plain-torch
one, calibration's observers, which see the scaled inputs the experts read); the shared expert reads x unscaled.

gpt-oss (ModelConfig.moe_bias, swiglu_limit): the router's logits take its bias (`moe.gate.bias`), every expert's
gate_up and down add theirs (`ExpertLinears.bias`, [E, out], never quantized), and the experts' activation is the
clamped SwiGLU (fused_moe.gated_activation), on every path: the fused kernel adds the biases in its GEMMs' epilogue.
Under tensor parallelism gate_up's bias is split with its rows; down's, where the experts are split on their width, is
held by tensor rank 0 alone (the all-reduce adds it once); whole experts (expert parallelism) keep theirs.

Under expert parallelism a rank holds experts [expert_start, expert_start + num_local_experts): it
routes every token over all experts (the router is whole on every rank) and computes only its own
experts' share; the ranks' partial sums are all-reduced like a row-parallel MLP's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from llmc.kernels.activation import act_and_mul, act_and_mul_fp8
from llmc.kernels.fp8 import has_fp8_tensor_cores
from llmc.kernels.fused_moe import ExpertWeights, fused_moe_experts, gated_activation
from llmc.quant.formats import (DenseFormat, Fp8BlockFormat, Fp8Format, IntWeightFormat, LinearFormat,
                                dequantizes_once_on_cpu, takes_fp8_activations)
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.layers.linear import Linear
from llmc.runtime.parallel.layout import RankLayout, holds_expert_down_bias, whole_model_layout

# observe(name, x): called with the inputs routed to one expert's linear ("moe.experts.3.down"), [n, in]
ExpertObserver = Callable[[str, Tensor], None]


class ExpertLinears(nn.Module):
    """One projection of every local expert: each tensor of `fmt`'s param_specs with a leading
    [num_experts] dim (buffers named as the format's, so state_dict keys are the artifact's); with `bias_dtype`,
    a `bias` [num_experts, out_features] too (gpt-oss), never quantized."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, fmt: LinearFormat,
                 bias_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features, self.fmt = num_experts, in_features, out_features, fmt
        self.param_names = []
        for name, spec in fmt.param_specs(in_features, out_features).items():
            self.register_buffer(name, torch.empty((num_experts, *spec.shape), dtype=spec.dtype, device="meta"))
            self.param_names.append(name)
        self.has_bias = bias_dtype is not None
        if self.has_bias:
            self.register_buffer("bias", torch.empty(num_experts, out_features, dtype=bias_dtype, device="meta"))
        self.dense: Tensor | None = None  # [num_experts, out, in]: int weights dequantized once, on a CPU

    def params(self) -> dict[str, Tensor]:
        """Every stacked tensor, [num_experts, ...] each."""
        return {name: getattr(self, name) for name in self.param_names}

    def apply_expert(self, expert: int, x: Tensor) -> Tensor:
        """x [n, in_features] through local expert `expert` → [n, out_features] (plus its bias, where it has one)."""
        return self.fmt.apply(x, self._expert_params(expert), self.bias[expert] if self.has_bias else None)

    def _expert_params(self, expert: int) -> dict[str, Tensor]:
        params = {name: getattr(self, name)[expert] for name in self.param_names}
        return params if self.dense is None else {**params, "dense": self.dense[expert]}

    def dense_bytes(self) -> int:
        """As Linear.dense_bytes, for every expert."""
        if not dequantizes_once_on_cpu(self.fmt) or getattr(self, self.param_names[0]).device.type != "cpu":
            return 0
        return self.num_experts * self.out_features * self.in_features * self.fmt.dtype.itemsize

    def dequantize_once(self) -> None:
        """As Linear.dequantize_once, for every expert, one at a time into the stacked tensor."""
        dense = torch.empty(self.num_experts, self.out_features, self.in_features, dtype=self.fmt.dtype)
        for expert in range(self.num_experts):
            dense[expert] = self.fmt.dequantize(self._expert_params(expert), self.in_features)
        self.dense = dense

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, format={self.fmt.spec()}"


class SharedExpert(nn.Module):
    """An MoE layer's shared expert: SiLU(gate) · up, then down (this rank's columns of it under TP; the MoE
    all-reduces its output with the experts'); under hidden_act relu2 (Nemotron-H) relu(up)², then down, its up
    `moe.shared.up` as the dense MLP's `mlp.up`."""

    def __init__(self, config: ModelConfig, formats: dict, prefix: str, dtype: torch.dtype, layout: RankLayout):
        super().__init__()
        size = layout.shared_intermediate_size
        self.relu2 = config.hidden_act == "relu2"
        if self.relu2:
            self.up = Linear(config.hidden_size, size, formats[prefix + "up"], False, dtype)
        else:
            self.gate_up = Linear(config.hidden_size, 2 * size, formats[prefix + "gate_up"], False, dtype)
        self.down = Linear(size, config.hidden_size, formats[prefix + "down"], False, dtype)
        # (relu2: a w8a8-fp8 down quantizes its input itself)
        self.fp8_down_input = not self.relu2 and takes_fp8_activations(formats[prefix + "down"])

    def forward(self, x: Tensor) -> Tensor:
        if self.relu2:
            return self.down(torch.relu(self.up(x)).square())
        return self.down((act_and_mul_fp8 if self.fp8_down_input else act_and_mul)(self.gate_up(x), "silu"))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, formats: dict, prefix: str, dtype: torch.dtype,
                 layout: RankLayout | None = None, tp_group=None):
        super().__init__()
        layout = layout or whole_model_layout(config)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.expert_start, self.num_local_experts = layout.expert_start, layout.num_local_experts
        self.gate = nn.Module()  # the router: never quantized (float32 for DeepSeek: ModelConfig.router_in_float32)
        router_dtype = torch.float32 if config.router_in_float32 else dtype
        self.gate.register_buffer("weight", torch.empty(config.num_experts, config.hidden_size, dtype=router_dtype,
                                                        device="meta"))
        self.has_bias = config.moe_bias  # gpt-oss: the router's and every expert's projections' biases
        if config.moe_bias:
            self.gate.register_buffer("bias", torch.empty(config.num_experts, dtype=router_dtype, device="meta"))
        # gpt-oss's clamped SwiGLU (None: SiLU(gate) * up): `expert_activation`
        self.swiglu = None if config.swiglu_limit is None else (config.swiglu_alpha, config.swiglu_limit)
        # Nemotron-H's experts (hidden_act relu2): no gate, experts.gate_up holds up's rows alone, relu(up)²
        self.relu2 = config.hidden_act == "relu2"
        self.is_deepseek_router = config.router_in_float32
        self.scoring, self.routed_scaling_factor = config.router_scoring, config.routed_scaling_factor
        self.groups, self.topk_groups = config.router_groups, config.router_topk_groups
        self.norm_min = config.router_norm_min
        self.has_score_bias = config.router_score_bias
        if self.has_score_bias:  # DeepSeek-V3's, GLM-4.5's, ERNIE's e_score_correction_bias [num_experts]
            self.gate_bias = nn.Module()
            self.gate_bias.register_buffer("weight", torch.empty(config.num_experts, dtype=torch.float32,
                                                                 device="meta"))
        size = layout.moe_intermediate_size
        self.experts = nn.Module()
        bias_dtype = dtype if config.moe_bias else None
        # down's bias: on tensor rank 0 alone where the experts are split on their width (added once by the all-reduce)
        down_bias_dtype = bias_dtype if holds_expert_down_bias(config, layout) else None
        rows = size if self.relu2 else 2 * size  # (relu2: up's rows alone)
        self.experts.gate_up = ExpertLinears(self.num_local_experts, config.hidden_size, rows,
                                             formats[prefix + "experts.gate_up"], bias_dtype)
        self.experts.down = ExpertLinears(self.num_local_experts, size, config.hidden_size,
                                          formats[prefix + "experts.down"], down_bias_dtype)
        self.has_shared = bool(config.shared_expert_intermediate_size)
        if self.has_shared:
            self.shared = SharedExpert(config, formats, prefix + "shared.", dtype, layout)
        self.has_shared_gate = config.shared_expert_gate
        if self.has_shared_gate:  # never quantized, like the router
            self.shared_gate = nn.Module()
            self.shared_gate.register_buffer("weight", torch.empty(1, config.hidden_size, dtype=dtype, device="meta"))
        self.tp_group = tp_group
        self.observers: list[ExpertObserver] = []  # calibration only (the compiler's hooks)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [num_tokens, hidden] → (weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k] int64):
        softmax over all experts in float32, top-k, renormalised to sum 1 when the config says so (DeepSeek's:
        `deepseek_route`)."""
        if self.is_deepseek_router:
            logits = torch.nn.functional.linear(x.float(), self.gate.weight)
            bias = self.gate_bias.weight if self.has_score_bias else None
            return deepseek_route(logits, self.top_k, self.scoring, bias, self.groups, self.topk_groups,
                                  self.norm_topk_prob, self.routed_scaling_factor, self.norm_min)
        logits = torch.nn.functional.linear(x, self.gate.weight, self.gate.bias if self.has_bias else None)
        if self.scoring == "sigmoid_input":  # Llama 4: the top-k logits' sigmoid, not renormalised
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.sigmoid(top.float()), ids
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.route(x)
        routed = x
        if self.scoring == "sigmoid_input":  # Llama 4 (top-k 1): the expert's input times its score, in the model
            routed, weights = x * weights.to(x.dtype), torch.ones_like(weights)  # dtype; its output weighted by 1
        fused = None if self.observers else fused_expert_weights(x, self.experts.gate_up, self.experts.down)
        if fused is not None:
            out = fused_moe_experts(routed, weights, ids - self.expert_start, *fused, swiglu=self.swiglu,
                                    relu2=self.relu2)
        else:
            out = self.forward_experts(routed, weights, ids)
        if self.has_shared:
            out = out + self.shared_output(x)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)

    def shared_output(self, x: Tensor) -> Tensor:
        """The shared expert's output [num_tokens, hidden] (this rank's partial sum under TP), gated where the model
        has the gate (Qwen2-MoE: times sigmoid(x · shared_gate), in the model dtype as transformers computes it)."""
        out = self.shared(x)
        if self.has_shared_gate:
            out = out * torch.sigmoid(torch.nn.functional.linear(x, self.shared_gate.weight))
        return out

    def runs_fused(self) -> bool:
        """Whether the fused kernel runs this layer on its weights' device (`fused_expert_weights`)."""
        return fused_expert_weights(self.gate.weight, self.experts.gate_up, self.experts.down) is not None

    def expert_activation(self, gate_up: Tensor) -> Tensor:
        """An expert's gate_up output [n, 2 * width] → down's input [n, width] (fused_moe.gated_activation: SiLU(gate)
        * up, or gpt-oss's clamped SwiGLU; Nemotron-H's: up's output [n, width] → relu(up)²)."""
        return gated_activation(gate_up, self.swiglu, self.relu2)

    def forward_experts(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """The plain-torch path: each local expert that received tokens runs on them (a token that
        picked one expert twice gets both weights). [num_tokens, hidden] → [num_tokens, hidden]."""
        out = torch.zeros_like(x)
        local = ids - self.expert_start  # [num_tokens, top_k]; outside [0, num_local_experts): another rank's
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._forward_every_expert(x, weights, local, out)
        for expert in range(self.num_local_experts):
            token, slot = torch.where(local == expert)
            if token.numel() == 0:
                continue
            name = f"moe.experts.{self.expert_start + expert}."
            h = self._observed(name + "gate_up", x[token])
            h = self.expert_activation(self.experts.gate_up.apply_expert(expert, h))
            y = self.experts.down.apply_expert(expert, self._observed(name + "down", h))  # [n, hidden]
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out

    def _forward_every_expert(self, x: Tensor, weights: Tensor, local: Tensor, out: Tensor) -> Tensor:
        """Inside a CUDA-graph capture (formats without the fused kernel): every expert on every token,
        weighted by its routing weight (0 where unrouted), since selecting tokens would sync with the host."""
        for expert in range(self.num_local_experts):
            weight = (weights * (local == expert)).sum(dim=-1, keepdim=True).to(x.dtype)  # [num_tokens, 1]
            h = self.expert_activation(self.experts.gate_up.apply_expert(expert, x))
            y = self.experts.down.apply_expert(expert, h)
            out += y.masked_fill(weight == 0, 0) * weight  # an unrouted token's inf must not become NaN (inf * 0)
        return out

    def _observed(self, name: str, x: Tensor) -> Tensor:
        for observe in self.observers:
            observe(name, x)
        return x


def deepseek_route(logits: Tensor, top_k: int, scoring: str, bias: Tensor | None, groups: int | None,
                   topk_groups: int | None, norm_topk_prob: bool, scaling: float,
                   norm_min: float | None = None) -> tuple[Tensor, Tensor]:
    """DeepSeek's routing of float32 router logits [num_tokens, num_experts] → (weights [num_tokens, top_k] float32,
    ids [num_tokens, top_k] int64). scoring softmax (V2): the top-k of the softmax, among the experts of the best
    `topk_groups` of `groups` groups (a group's score: its best expert's) where groups is set. sigmoid (V3): the
    experts are chosen by sigmoid + `bias` among the best groups (a group's score: the sum of its two best experts'),
    and weighted by their sigmoid (without the bias); softmax with a `bias` (ERNIE 4.5 MoE): chosen by softmax + bias,
    weighted by the softmax. Renormalised to sum 1 where norm_topk_prob (V3; the 1e-20 transformers adds, or ERNIE's
    floor of the sum, `norm_min`), then times `scaling` (routed_scaling_factor)."""
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if groups is not None:
        grouped = choice.view(choice.shape[0], groups, -1)
        group_scores = grouped.max(dim=-1).values if scoring == "softmax" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, topk_groups, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        # outside the chosen groups: 0 for V2's softmax (as transformers), -inf for V3's biased choice
        choice = grouped.masked_fill(~keep.unsqueeze(-1), 0.0 if scoring == "softmax" else float("-inf")).flatten(1)
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if norm_min is None else total.clamp(min=norm_min))
    return weights * scaling, ids


def fused_expert_weights(x: Tensor, gate_up: ExpertLinears,
                         down: ExpertLinears) -> tuple[ExpertWeights, ExpertWeights] | None:
    """gate_up's and down's stacked tensors for the fused Triton MoE on x's device; None where it
    does not apply (CPUs, a projection whose format the kernel does not read: see `expert_weights`,
    w8a8-fp8 on a GPU without FP8 tensor cores), for the expert-by-expert path. Captured in a CUDA
    graph, that path runs every expert on every token (`MoE._forward_every_expert`): the piecewise
    graphs of steps of up to 512 tokens are not captured for such a model (runtime/model_runner.py)."""
    if not x.is_cuda:
        return None
    w_gate_up, w_down = expert_weights(gate_up), expert_weights(down)
    if w_gate_up is None or w_down is None:
        return None
    if {"w8a8-fp8", "w8a8-fp8-block"} & {w_gate_up.kind, w_down.kind} and not has_fp8_tensor_cores(x):
        return None
    return w_gate_up, w_down


def expert_weights(linears: ExpertLinears) -> ExpertWeights | None:
    """One projection's stacked tensors as the fused kernel reads them (with their biases, gpt-oss's): dense, w4a16 in
    the gpu layout, w8a8-fp8 (per-channel or per-tensor weight scales, dynamic or static input), w8a8-fp8-block
    (groups of 32 columns or more); None for the rest (plain-layout or g_idx integer weights, 3 and 8
    bits), which run expert by expert."""
    weights = _expert_weights(linears)
    return weights if weights is None or not linears.has_bias else replace(weights, bias=linears.bias)


def _expert_weights(linears: ExpertLinears) -> ExpertWeights | None:
    fmt, params, num_experts = linears.fmt, linears.params(), linears.num_experts
    if isinstance(fmt, DenseFormat):
        return ExpertWeights(params["weight"])
    if isinstance(fmt, IntWeightFormat) and fmt.is_gpu_layout:
        return ExpertWeights(params["qweight"], "w4a16", params["scales"], params.get("qzeros"), fmt.group_size,
                             linears.in_features)
    if isinstance(fmt, Fp8Format):
        scale = params["weight_scale"].reshape(num_experts, -1).expand(num_experts, linears.out_features)
        input_scale = params["input_scale"].reshape(num_experts) if fmt.is_static_input else None
        return ExpertWeights(params["weight"], "w8a8-fp8", scale.contiguous(), input_scale=input_scale)
    if isinstance(fmt, Fp8BlockFormat) and fmt.group_size >= 32:  # (an FP8 tensor-core dot takes 32 columns or more)
        return ExpertWeights(params["weight"], "w8a8-fp8-block", params["weight_scale"].float().contiguous(),
                             group_size=fmt.group_size)
    return None
