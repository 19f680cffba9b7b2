"""Tensor and pipeline sharding at build time: the plan, and each rank's slice of every weight.

The plan (`plan_parallel`) checks that the model splits — the tensor size divides the attention
heads, the KV heads (or is a multiple of them: KV heads are then replicated), the MLP width, and
every row-parallel linear's quantization groups — and splits the layers into pipeline stages of
balanced bytes. What each rank holds is `runtime/parallel/layout.py`'s `RankLayout`, the same
function the runtime builds its module from.

Slicing happens on the unpacked weights (float, or `QuantizedWeight` levels and scales) after
quantization and before packing: quantizing the whole weight first keeps a T-rank build's numbers
identical to the 1-rank build's, and packing each slice on its own gives every rank well-formed
tensors. Fused linears are sliced member by member (q, k, v; gate, up) and re-concatenated, so each
rank's `qkv` is [its q heads; its k heads; its v heads]. Biases follow their linears (`shard_bias`: a row-parallel
one on tensor rank 0 alone), attention sinks their heads.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from llmc.compiler.convert import LayerWeights, UnpackedLinear
from llmc.compiler.recipe import ParallelConfig
from llmc.errors import RecipeError
from llmc.quant.formats import QuantizedWeight, default_g_idx
from llmc.runtime.artifact import ModelConfig, ParallelPlan
from llmc.runtime.models.spec import ModelSpec, expert_of, format_key
from llmc.runtime.parallel.layout import (
    RankLayout, all_rank_layouts, experts_of_rank, holds_row_bias, num_kv_heads_per_rank, padded_vocab_size,
)

# ---- the plan -------------------------------------------------------------------------------------


def plan_parallel(parallel: ParallelConfig, config: ModelConfig, spec: ModelSpec, module_formats: dict[str, dict],
                  tensor_bytes: list[tuple[str, int]]) -> ParallelPlan:
    """The parallel plan of a recipe, or a RecipeError saying what does not split and what would.

    `tensor_bytes`: (name, bytes) of every tensor of the unsharded artifact, for balancing stages.
    """
    tensor, pipeline = parallel.tensor, parallel.pipeline
    expert = _check_expert(parallel, config)
    problems = tensor_split_problems(config, spec, module_formats, tensor, expert)
    if problems:
        valid = [t for t in range(1, config.num_heads + 1)
                 if not tensor_split_problems(config, spec, module_formats, t, t if expert > 1 else 1)]
        raise RecipeError(f"parallel.tensor: {problems[0]}; valid tensor sizes for this model and quantization: "
                          + ", ".join(map(str, valid)))
    if pipeline > config.num_layers:
        raise RecipeError(f"parallel.pipeline: {pipeline} stages for {config.num_layers} layers; "
                          f"use at most {config.num_layers} (each stage holds at least one layer)")
    plan = ParallelPlan(
        tensor=tensor,
        pipeline=pipeline,
        stage_layers=balance_stages(config, tensor_bytes, pipeline),
        num_heads_per_rank=config.num_heads // tensor,
        num_kv_heads_per_rank=num_kv_heads_per_rank(config, tensor),
        intermediate_size_per_rank=config.intermediate_size // tensor,
        vocab_size_per_rank=padded_vocab_size(config.vocab_size, tensor) // tensor,
        expert=expert,
    )
    if not config.moe_layers:
        return plan
    return dataclasses.replace(plan, rank_experts=[experts_of_rank(layout) for layout in all_rank_layouts(config, plan)])


def _check_expert(parallel: ParallelConfig, config: ModelConfig) -> int:
    """parallel.expert: 1, or the tensor size (whole experts over the tensor ranks), dividing the experts."""
    expert = parallel.expert
    if expert == 1:
        return 1
    if not config.moe_layers:
        raise RecipeError(f"parallel.expert: {expert} needs a mixture-of-experts model ({config.architecture} is "
                          "dense); remove it")
    if expert != parallel.tensor:
        raise RecipeError(f"parallel.expert: {expert} must equal parallel.tensor ({parallel.tensor}): experts are "
                          f"spread over the tensor-parallel ranks (vLLM's enable_expert_parallel); set tensor: {expert}")
    if config.num_experts % expert:
        raise RecipeError(f"parallel.expert: {expert} does not divide the model's {config.num_experts} experts; "
                          f"use one of {[e for e in range(1, config.num_experts + 1) if config.num_experts % e == 0]}")
    return expert


def tensor_split_problems(config: ModelConfig, spec: ModelSpec, module_formats: dict[str, dict], tensor: int,
                          expert: int = 1) -> list[str]:
    """Why `tensor` ranks cannot split this model (empty: they can); `expert` > 1: experts stay whole."""
    problems = []
    if config.moe_layers and expert == 1 and config.moe_intermediate_size % tensor:
        problems.append(f"{tensor} does not divide the experts' MLP width {config.moe_intermediate_size} "
                        "(or set parallel.expert to spread whole experts)")
    if config.moe_layers and (config.shared_expert_intermediate_size or 0) % tensor:
        problems.append(f"{tensor} does not divide the shared expert's MLP width {config.shared_expert_intermediate_size}")
    if config.num_heads % tensor:
        problems.append(f"{tensor} does not divide the model's {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= tensor and kv % tensor) or (kv < tensor and tensor % kv):
        problems.append(f"{tensor} neither divides the model's {kv} KV heads nor is a multiple of them")
    if config.intermediate_size % tensor:
        problems.append(f"{tensor} does not divide the MLP width {config.intermediate_size}")
    if problems:
        return problems
    return _group_problems(config, module_formats, tensor, expert)


def _group_problems(config: ModelConfig, module_formats: dict[str, dict], tensor: int, expert: int) -> list[str]:
    """Row-parallel linears whose quantization groups a split into `tensor` parts would cut."""
    if tensor == 1:
        return []
    in_features = {"attn.o": config.num_heads * (config.v_head_dim if config.is_mla else config.head_dim),
                   "mlp.down": config.intermediate_size,
                   "moe.experts.down": config.moe_intermediate_size,
                   "moe.shared.down": config.shared_expert_intermediate_size}
    row_parallel = ("attn.o", "mlp.down", "moe.shared.down") + (("moe.experts.down",) if expert == 1 else ())
    problems = []
    for index in range(config.num_layers):
        for name in config.layer_linears(index):
            if name not in row_parallel:
                continue
            module = f"layers.{index}.{name}"
            fmt = module_formats[module]
            size, per_rank = in_features[name], in_features[name] // tensor
            if fmt.get("has_g_idx"):
                problems.append(f"{tensor} would split {module} (row-parallel), whose act-order groups (g_idx) "
                                "are not contiguous; only tensor 1 keeps them whole")
            group_size = fmt["block_size"][1] if fmt["format"] == "w8a8-fp8-block" else fmt.get("group_size", -1)
            if group_size != -1 and per_rank % group_size:
                problems.append(
                    f"{tensor} would cut the quantization groups of {module} (row-parallel): its {size} input "
                    f"features split into {per_rank} per rank, which group_size {group_size} does not divide"
                )
    return problems


def balance_stages(config: ModelConfig, tensor_bytes: list[tuple[str, int]], pipeline: int) -> list[list[int]]:
    """Contiguous runs of layers, one per stage, minimising the largest stage's bytes.

    The first stage also carries the embedding, the last the final norm and lm_head (with tied
    embeddings, a copy of the embedding as lm_head). Dynamic programming over split points.
    """
    num_layers = config.num_layers
    layer_bytes = [0] * num_layers
    embed = head = 0
    for name, num_bytes in tensor_bytes:
        if name.startswith("layers."):
            layer_bytes[int(name.split(".")[1])] += num_bytes
        elif name.startswith("embed."):
            embed += num_bytes
        else:
            head += num_bytes
    if config.tie_word_embeddings and pipeline > 1:
        head += embed
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(stage: int, start: int, end: int) -> int:
        extra = (embed if stage == 0 else 0) + (head if stage == pipeline - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[s][i]: (largest stage bytes, split points) placing layers [0, i) on stages [0, s]
    best = {(0, i): (cost(0, 0, i), [i]) for i in range(1, num_layers + 1)}
    for stage in range(1, pipeline):
        for end in range(stage + 1, num_layers + 1):
            options = [(max(best[(stage - 1, mid)][0], cost(stage, mid, end)), best[(stage - 1, mid)][1] + [end])
                       for mid in range(stage, end)]
            best[(stage, end)] = min(options, key=lambda option: option[0])
    bounds = [0] + best[(pipeline - 1, num_layers)][1]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(pipeline)]


# ---- one rank's slice -----------------------------------------------------------------------------


def shard_layer(layer: LayerWeights, layout: RankLayout, config: ModelConfig, spec: ModelSpec) -> LayerWeights:
    """The rank's slice of one (quantized, unpacked) layer; the layer itself on a single tensor rank."""
    if layout.tp_size == 1:
        return layer
    linears = {}
    for name, weight in layer.linears.items():
        expert = expert_of(name)
        if expert is not None and layout.num_local_experts < config.num_experts:  # expert parallel: whole experts
            if layout.expert_start <= expert < layout.expert_start + layout.num_local_experts:
                linears[name] = weight
        elif spec_parallel(spec, name) == "replicated":  # (MLA's q_a and kv_a)
            linears[name] = weight
        elif spec_parallel(spec, name) == "column":
            linears[name] = take_rows(weight, column_rows(config, layout, format_key(name)))
        else:
            start, end = row_columns(config, layout, format_key(name))
            linears[name] = take_columns(weight, start, end, f"layers.{layer.index}.{name}")
    biases = {name: shard for name, bias in layer.biases.items()
              if (shard := shard_bias(name, bias, layout, config, spec)) is not None}
    norms = dict(layer.norms)
    if "attn.sinks" in norms:  # gpt-oss: the rank's heads' sinks
        norms["attn.sinks"] = norms["attn.sinks"][layout.head_start:layout.head_start + layout.num_heads]
    if config.qk_norm_full_width:  # OLMo 2: q_norm / k_norm span q's / k's rows: the rank's heads' share of each
        q_rows, k_rows, _ = column_rows(config, layout, "attn.qkv")
        k_offset = config.num_heads * config.head_dim
        norms["attn.q_norm"] = norms["attn.q_norm"][q_rows[0]:q_rows[1]]
        norms["attn.k_norm"] = norms["attn.k_norm"][k_rows[0] - k_offset:k_rows[1] - k_offset]
    return LayerWeights(layer.index, linears, biases, norms)


def shard_bias(name: str, bias: Tensor, layout: RankLayout, config: ModelConfig, spec: ModelSpec) -> Tensor | None:
    """The rank's share of one bias (None: the rank holds none), as the runtime's module holds it (layout.py): a whole
    expert's (expert parallelism) with its expert; the router's whole; a column-parallel linear's (qkv's, a split
    expert's gate_up) split with its rows; a row-parallel linear's (o's, a split expert's down) whole on tensor rank 0
    alone (holds_row_bias), so the all-reduce adds it once."""
    expert = expert_of(name)
    if expert is not None and layout.num_local_experts < config.num_experts:
        return bias if layout.expert_start <= expert < layout.expert_start + layout.num_local_experts else None
    if name == "moe.gate":
        return bias
    if spec_parallel(spec, name) == "column":
        return take_rows(bias, column_rows(config, layout, format_key(name)))
    return bias if holds_row_bias(layout) else None


def shard_global(module: str, weight: UnpackedLinear, layout: RankLayout) -> UnpackedLinear:
    """The rank's rows of the (padded) embedding or lm_head; the final norm whole."""
    if module == "norm" or layout.tp_size == 1:
        return weight
    return take_rows(weight, [(layout.vocab_start, layout.vocab_start + layout.vocab_size)])


def column_rows(config: ModelConfig, layout: RankLayout, name: str) -> list[tuple[int, int]]:
    """Output rows [start, end) of a fused column-parallel linear that the rank holds, member by member."""
    if name == "attn.qkv":
        d = config.head_dim
        q = (layout.head_start * d, (layout.head_start + layout.num_heads) * d)
        kv = (layout.kv_head_start * d, (layout.kv_head_start + layout.num_kv_heads) * d)
        k_offset, v_offset = config.num_heads * d, (config.num_heads + config.num_kv_heads) * d
        return [q, (k_offset + kv[0], k_offset + kv[1]), (v_offset + kv[0], v_offset + kv[1])]
    if name in ("attn.q", "attn.q_b", "attn.kv_b"):  # MLA: the rank's heads (q: head_dim rows each; kv_b: k_nope, v)
        per_head = config.head_dim if name != "attn.kv_b" else config.qk_nope_head_dim + config.v_head_dim
        return [(layout.head_start * per_head, (layout.head_start + layout.num_heads) * per_head)]
    if name == "mlp.gate_up":
        start, end = layout.intermediate_start, layout.intermediate_start + layout.intermediate_size
        return [(start, end), (config.intermediate_size + start, config.intermediate_size + end)]
    if name == "mlp.up":  # an MLP without gate (Arcee, Apertus): its activation is elementwise, its scalars whole
        return [(layout.intermediate_start, layout.intermediate_start + layout.intermediate_size)]
    if name == "moe.experts.gate_up":  # each expert split like the MLP
        start, end = layout.moe_intermediate_start, layout.moe_intermediate_start + layout.moe_intermediate_size
        return [(start, end), (config.moe_intermediate_size + start, config.moe_intermediate_size + end)]
    if name == "moe.shared.gate_up":  # the shared expert split like the MLP
        start, end = layout.shared_intermediate_start, layout.shared_intermediate_start + layout.shared_intermediate_size
        size = config.shared_expert_intermediate_size
        return [(start, end), (size + start, size + end)]
    raise KeyError(f"{name} is not a column-parallel linear")


def row_columns(config: ModelConfig, layout: RankLayout, name: str) -> tuple[int, int]:
    """Input columns [start, end) of a row-parallel linear that the rank holds."""
    if name == "attn.o":  # (MLA: each head's v_head_dim outputs)
        d = config.v_head_dim if config.is_mla else config.head_dim
        return layout.head_start * d, (layout.head_start + layout.num_heads) * d
    if name == "mlp.down":
        return layout.intermediate_start, layout.intermediate_start + layout.intermediate_size
    if name == "moe.experts.down":
        return layout.moe_intermediate_start, layout.moe_intermediate_start + layout.moe_intermediate_size
    if name == "moe.shared.down":
        return layout.shared_intermediate_start, layout.shared_intermediate_start + layout.shared_intermediate_size
    raise KeyError(f"{name} is not a row-parallel linear")


def spec_parallel(spec: ModelSpec, name: str) -> str:
    """"column", "row" or "replicated" (MLA's q_a, kv_a) for a layer linear (an expert's gate_up is column-, its down
    row-parallel)."""
    if expert_of(name) is not None:
        return "column" if name.endswith("gate_up") else "row"
    return spec.layer_linear(name).parallel


def order_down_groups(layer: LayerWeights) -> LayerWeights:
    """The layer with each act-order down projection's input columns put in group order, and its gate_up's
    rows (gate and up alike) in the same order, before sharding and packing. SiLU(gate) · up then comes out
    in the order down's packed columns read, so down needs no gather of its input on every forward (Marlin
    gathers it; the other act-order linears still do, their inputs being the norms' and attention's). Exact:
    gate_up's output rows and down's input columns are permuted alike. Left as it is where down's groups
    are not of equal size (the format refuses those) or are in order already."""
    linears, biases = dict(layer.linears), dict(layer.biases)
    for name, down in layer.linears.items():
        gate_up = name.removesuffix("down") + "gate_up"
        if not name.endswith("down") or gate_up not in linears or not isinstance(down, QuantizedWeight) or down.g_idx is None:
            continue
        order = torch.argsort(down.g_idx.to(torch.int64), stable=True)
        plain = default_g_idx(down.in_features, down.group_size, down.g_idx.device)
        if torch.equal(order, torch.arange(down.in_features, device=order.device)) or not torch.equal(down.g_idx.to(torch.int32)[order], plain):
            continue
        rows = torch.cat([order, order + down.in_features])  # [gate; up]
        linears[gate_up] = select_rows(linears[gate_up], rows)
        if gate_up in biases:
            biases[gate_up] = select_rows(biases[gate_up], rows)
        linears[name] = dataclasses.replace(down, qweight=down.qweight[:, order].contiguous(), g_idx=None)
    return LayerWeights(layer.index, linears, biases, layer.norms)


def take_rows(weight: UnpackedLinear | Tensor, ranges: list[tuple[int, int]]) -> UnpackedLinear:
    """Output rows (dim 0) in `ranges`, concatenated (select_rows)."""
    return select_rows(weight, torch.cat([torch.arange(start, end) for start, end in ranges]))


def select_rows(weight: UnpackedLinear | Tensor, index: Tensor) -> UnpackedLinear:
    """Output rows (dim 0) `index`: of a float tensor, or of every per-row tensor of a quantized weight
    (a per-tensor FP8 scale applies to all rows and stays as it is)."""
    if isinstance(weight, Tensor):
        return weight.index_select(0, index).contiguous()
    is_per_row = weight.scales.shape[0] == weight.out_features
    return QuantizedWeight(
        qweight=weight.qweight.index_select(0, index).contiguous(),
        scales=weight.scales.index_select(0, index).contiguous() if is_per_row else weight.scales,
        zeros=None if weight.zeros is None else weight.zeros.index_select(0, index).contiguous(),
        bits=weight.bits, group_size=weight.group_size, g_idx=weight.g_idx, input_scale=weight.input_scale,
    )


def take_columns(weight: UnpackedLinear, start: int, end: int, module: str) -> UnpackedLinear:
    """Input columns [start, end): of a float tensor, or of a quantized weight's levels with the
    scales (and zeros) of exactly the groups they span — which must not be cut (the plan checks)."""
    if isinstance(weight, Tensor):
        return weight[:, start:end].contiguous()
    group_size = weight.group_size
    is_per_row = group_size == -1  # one scale spans every column (FP8 per channel or per tensor; w8a8-fp8-block: groups)
    if weight.g_idx is not None and not torch.equal(
            weight.g_idx.to(torch.int32), default_g_idx(weight.in_features, group_size, weight.g_idx.device)):
        raise RecipeError(f"{module}: act-order groups (g_idx) cannot be split row-parallel; build with parallel.tensor: 1")
    if not is_per_row and (start % group_size or end % group_size):
        raise RecipeError(f"{module}: columns [{start}, {end}) cut its quantization groups of {group_size}")
    groups = slice(None) if is_per_row else slice(start // group_size, end // group_size)
    return QuantizedWeight(
        qweight=weight.qweight[:, start:end].contiguous(),
        scales=weight.scales[:, groups].contiguous(),
        zeros=None if weight.zeros is None else weight.zeros[:, groups].contiguous(),
        bits=weight.bits, group_size=group_size, g_idx=None, input_scale=weight.input_scale,
    )
