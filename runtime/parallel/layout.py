"""What one rank holds: the one function both the compiler (to shard) and the runtime (to build the
rank's module and KV cache) use, so the two can never disagree.

Rank r = pp_rank * tensor + tp_rank. Tensor parallelism splits, within a layer:
  attn.qkv     column-parallel by heads: q heads [tp_rank * Hr, (tp_rank + 1) * Hr); KV heads split
               the same way, or, when tensor > num_kv_heads, replicated so each rank holds the one
               KV head its query heads read (rank t holds KV head t // (tensor / num_kv_heads))
  attn.o       row-parallel: the input columns of the rank's query heads; outputs all-reduced
  mlp.gate_up  column-parallel: gate columns [t * Ir, (t + 1) * Ir) and the same up columns
  mlp.down     row-parallel: input columns [t * Ir, (t + 1) * Ir); outputs all-reduced
  embed        vocab-parallel: rows [t * Vr, (t + 1) * Vr) of the vocabulary padded to tensor * Vr
  lm_head      vocab-parallel, the same rows; the driver gathers the logits
  moe          (MoE layers) the router whole on every rank; with parallel.expert 1 each expert split
               like the MLP (gate_up columns, down rows of its moe_intermediate_size); with
               parallel.expert = tensor, whole experts: rank t holds experts [t * Er, (t + 1) * Er).
               Either way each rank's output is a partial sum, all-reduced like the MLP's.
  biases       (gpt-oss) column-parallel ones (qkv's, each expert's gate_up) split with their rows; a row-parallel
               one (o's; a split expert's down) held and added by tensor rank 0 alone, so the all-reduce adds it
               once (vLLM's RowParallelLinear); whole experts' down biases go with their experts; the router's whole
  sinks        (gpt-oss) the rank's heads' attention sinks
Pipeline parallelism gives each stage a contiguous run of layers: the first stage also holds the
embedding, the last the final norm and lm_head (and, with tied embeddings, the embedding as lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.runtime.artifact import ModelConfig, ParallelPlan


@dataclass(frozen=True)
class RankLayout:
    """One rank's share of the model. Sizes are per rank; head and vocab starts are global indices."""

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layers: tuple[int, ...]  # global decoder layer indices of this rank's stage, in order
    num_heads: int  # query heads: global heads [head_start, head_start + num_heads)
    head_start: int
    num_kv_heads: int  # KV heads: global KV heads [kv_head_start, kv_head_start + num_kv_heads)
    kv_head_start: int
    intermediate_size: int  # MLP columns: [intermediate_start, intermediate_start + intermediate_size)
    intermediate_start: int
    vocab_size: int  # embedding / lm_head rows, padded: [vocab_start, vocab_start + vocab_size)
    vocab_start: int
    has_embed: bool  # the embedding table (first stage; last stage too when tied: it is the lm_head)
    has_head: bool  # final norm and lm_head (last stage)
    num_local_experts: int = 0  # MoE: experts [expert_start, expert_start + num_local_experts) of each MoE layer
    expert_start: int = 0
    moe_intermediate_size: int = 0  # MoE: each held expert's MLP columns on this rank
    moe_intermediate_start: int = 0
    shared_intermediate_size: int = 0  # an MoE's shared expert: its MLP columns on this rank, split like the MLP's
    shared_intermediate_start: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_whole_model(self) -> bool:
        return self.tp_size == 1 and self.pp_size == 1


def padded_vocab_size(vocab_size: int, tensor: int) -> int:
    return -(-vocab_size // tensor) * tensor


def num_kv_heads_per_rank(config: ModelConfig, tensor: int) -> int:
    return max(1, config.num_kv_heads // tensor)


def whole_model_layout(config: ModelConfig) -> RankLayout:
    """The single-rank layout: everything."""
    return rank_layout(config, ParallelPlan(1, 1, [list(range(config.num_layers))]), 0)


def experts_of_rank(layout: RankLayout) -> list[int]:
    """The global indices of the experts whose weights this rank holds (empty for a dense model)."""
    return list(range(layout.expert_start, layout.expert_start + layout.num_local_experts))


def holds_row_bias(layout: RankLayout) -> bool:
    """Whether this rank holds (and adds) a row-parallel linear's bias (o's): tensor rank 0 only, since the
    all-reduce sums the ranks' partial outputs, so the bias is added exactly once."""
    return layout.tp_rank == 0


def holds_expert_down_bias(config: ModelConfig, layout: RankLayout) -> bool:
    """Whether this rank holds its experts' down biases: whole experts (one rank, or expert parallelism: each
    expert's output is its owner's alone) always; experts split on their width (row-parallel down) on tensor
    rank 0 only (`holds_row_bias`)."""
    return layout.moe_intermediate_size == (config.moe_intermediate_size or 0) or holds_row_bias(layout)


def rank_layout(config: ModelConfig, plan: ParallelPlan, rank: int) -> RankLayout:
    """What rank `rank` holds under `plan` (sizes that do not divide are refused by the compiler's plan)."""
    tensor = plan.tensor
    tp_rank, pp_rank = rank % tensor, rank // tensor
    heads = config.num_heads // tensor
    kv_heads = num_kv_heads_per_rank(config, tensor)
    if config.num_kv_heads >= tensor:
        kv_start = tp_rank * kv_heads
    else:  # replicated: tensor / num_kv_heads consecutive ranks share one KV head
        kv_start = tp_rank // (tensor // config.num_kv_heads)
    intermediate = config.intermediate_size // tensor
    vocab = padded_vocab_size(config.vocab_size, tensor) // tensor
    stages = plan.stage_layers or [list(range(config.num_layers))]
    is_last = pp_rank == plan.pipeline - 1
    num_experts, moe_size = config.num_experts or 0, config.moe_intermediate_size or 0
    if plan.expert > 1:  # whole experts over the tensor ranks
        local_experts, expert_start, moe_per_rank, moe_start = num_experts // plan.expert, 0, moe_size, 0
        expert_start = tp_rank * local_experts
    else:  # every expert, each split like the MLP
        local_experts, expert_start, moe_per_rank = num_experts, 0, moe_size // tensor
        moe_start = tp_rank * moe_per_rank
    shared = (config.shared_expert_intermediate_size or 0) // tensor  # (experts whole or split, the shared one splits)
    return RankLayout(
        rank=rank, tp_rank=tp_rank, tp_size=tensor, pp_rank=pp_rank, pp_size=plan.pipeline,
        layers=tuple(stages[pp_rank]),
        num_heads=heads, head_start=tp_rank * heads,
        num_kv_heads=kv_heads, kv_head_start=kv_start,
        intermediate_size=intermediate, intermediate_start=tp_rank * intermediate,
        vocab_size=vocab, vocab_start=tp_rank * vocab,
        has_embed=pp_rank == 0 or (is_last and config.tie_word_embeddings),
        has_head=is_last,
        num_local_experts=local_experts, expert_start=expert_start,
        moe_intermediate_size=moe_per_rank, moe_intermediate_start=moe_start,
        shared_intermediate_size=shared, shared_intermediate_start=tp_rank * shared,
    )


def all_rank_layouts(config: ModelConfig, plan: ParallelPlan) -> list[RankLayout]:
    return [rank_layout(config, plan, rank) for rank in range(plan.world_size)]


def kv_cache_shapes(config: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
    """The cache tensors of one layer: K and V [num_blocks, block_size, num_kv_heads, head_dim]; under MLA one latent
    cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (runtime/models/mla.py), every head's on every
    rank."""
    if config.is_mla:
        return [(num_blocks, block_size, config.kv_lora_rank + config.qk_rope_head_dim)]
    return [(num_blocks, block_size, num_kv_heads, config.head_dim)] * 2


def kv_bytes_per_token(config: ModelConfig, layout: RankLayout, num_bytes: int) -> int:
    """KV-cache bytes one token takes on this rank: K and V of its heads in its layers (MLA: its latent); a hybrid
    model's linear-attention layers hold none."""
    per_layer = sum(shape[-1] * (shape[-2] if len(shape) == 4 else 1)
                    for shape in kv_cache_shapes(config, layout.num_kv_heads, 1, 1))
    return len(kv_layers(config, layout)) * per_layer * num_bytes


def kv_layers(config: ModelConfig, layout: RankLayout) -> list[int]:
    """This rank's layers that hold a KV cache: all of them but a hybrid model's linear-attention and Mamba-2 layers and
    its MLPs alone (Nemotron-H)."""
    return [i for i in layout.layers if config.holds_kv(i)]
