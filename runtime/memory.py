"""Memory arithmetic shared by the compiler's plan, `llmc inspect` and the runtime's KV sizing.

The estimate: usable = total × gpu_memory_utilization; KV = usable − weights − activation peak −
CUDA-graph pool. The activation peak of one step at max_num_batched_tokens is dominated by the
widest intermediate (gate_up) and the float32 logits of the sampled rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llmc.runtime.artifact import ModelConfig, ParallelPlan, RuntimeDefaults, dtype_num_bytes
from llmc.runtime.parallel.layout import all_rank_layouts, kv_bytes_per_token

GIB = 1 << 30
# Both are assumed allowances, not measured here yet: the runtime neither captures graphs nor profiles
# memory so far, so the estimate is only as good as these two numbers.
GRAPH_POOL_BYTES = 256 << 20  # what captured decode graphs would keep
CUDA_CONTEXT_BYTES = 512 << 20  # CUDA context + cuBLAS workspaces, outside torch's allocator


@dataclass(frozen=True)
class MemoryEstimate:
    total_bytes: int
    usable_bytes: int
    weight_bytes: int
    activation_bytes: int
    graph_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    num_kv_blocks: int
    num_kv_tokens: int
    max_concurrent_seqs: float  # sequences of max_model_len that fit at once

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def fits(self) -> bool:
        return self.max_concurrent_seqs >= 1


def activation_peak_bytes(model: ModelConfig, num_tokens: int, num_logit_rows: int) -> int:
    """Peak bytes of live activations in one forward over num_tokens (float32 logits for num_logit_rows)."""
    elt = dtype_num_bytes(model.dtype)
    q_kv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    # Residual + hidden + the widest of (qkv, gate_up + its SiLU·mul output) live at once.
    widest = max(q_kv + model.num_heads * model.head_dim, 3 * model.intermediate_size)
    per_token = (2 * model.hidden_size + widest) * elt
    logits = num_logit_rows * model.vocab_size * 4 * 2  # logits and the sampler's probabilities
    return num_tokens * per_token + logits


def estimate(
    model: ModelConfig,
    weight_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    total_bytes: int,
    utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    use_graphs: bool,
) -> MemoryEstimate:
    usable = int(total_bytes * utilization)
    activations = activation_peak_bytes(model, max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens))
    graphs = GRAPH_POOL_BYTES if use_graphs else 0
    kv = max(0, usable - weight_bytes - activations - graphs - CUDA_CONTEXT_BYTES)
    num_blocks = kv // (kv_bytes_per_token * block_size)
    num_tokens = num_blocks * block_size
    return MemoryEstimate(
        total_bytes=total_bytes,
        usable_bytes=usable,
        weight_bytes=weight_bytes,
        activation_bytes=activations,
        graph_bytes=graphs,
        kv_bytes=num_blocks * block_size * kv_bytes_per_token,
        kv_bytes_per_token=kv_bytes_per_token,
        num_kv_blocks=num_blocks,
        num_kv_tokens=num_tokens,
        max_concurrent_seqs=num_tokens / max_model_len,
    )


def estimate_per_rank(model: ModelConfig, parallel: ParallelPlan, weight_bytes_per_rank: list[int], kv_dtype: str,
                      runtime: RuntimeDefaults, total_bytes: int) -> list[MemoryEstimate]:
    """The estimate of every rank: its weights, and KV for its heads of its layers. The rank with the
    fewest KV tokens bounds the engine (every rank holds the same blocks)."""
    return [
        estimate(
            model, weight_bytes_per_rank[layout.rank], kv_bytes_per_token(model, layout, dtype_num_bytes(kv_dtype)),
            runtime.block_size, total_bytes, runtime.gpu_memory_utilization, runtime.max_num_batched_tokens,
            runtime.max_num_seqs, runtime.max_model_len, use_graphs=not runtime.enforce_eager,
        )
        for layout in all_rank_layouts(model, parallel)
    ]


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode buckets: dense at small sizes (1, 2, 4, 8), then every 8 up to 256, every 16 above."""
    sizes = [1, 2, 4, 8]
    size = 16
    while size <= max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    sizes = [s for s in sizes if s < max_num_seqs]
    return sizes + [max_num_seqs]
