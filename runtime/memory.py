"""Memory arithmetic shared by the compiler's plan, `llmc inspect` and the runtime's KV sizing.

KV cache = total × gpu_memory_utilization − weights − other − activation peak − CUDA-graph allowance,
where "other" is what is in use outside torch's allocator (the CUDA context, kernel modules, NCCL;
on a shared GPU, other processes). `plan_kv` is that one subtraction. The compiler and
`llmc inspect` feed it estimates (`estimate`); a one-rank runtime feeds it measurements taken at
start (runtime/memory_profile.py): the weights as loaded, the peak of one profiling forward at
max_num_batched_tokens, and `other` from torch.cuda.mem_get_info. Both hold back the same graph
allowance: graph memory can only be measured after capture, which needs the KV cache allocated.
The activation peak of one step is dominated by the widest intermediate (gate_up) and the float32
logits (and the sampler's probabilities) of the sampled rows.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from llmc.kernels.attention import decode_split, max_prefill_blocks, prefill_queries_per_block
from llmc.kernels.mla_attention import CUDA_EXPAND_MIN_QUERIES, absorbed_split_bytes, expanded_bytes
from llmc.runtime.artifact import (ModelConfig, ParallelPlan, RuntimeDefaults, dtype_num_bytes,
                                   rank_weights_path, read_safetensors_header, state_dtypes)
from llmc.runtime.parallel.layout import RankLayout, all_rank_layouts, kv_bytes_per_token

if TYPE_CHECKING:
    from llmc.runtime.eagle_head import EagleHeadConfig

GIB = 1 << 30
MIB = 1 << 20
logger = logging.getLogger("llmc")
# The estimate's "other": the CUDA context and kernel modules of one process (the runtime measures it).
CUDA_CONTEXT_BYTES = 512 * MIB
# The CUDA-graph allowance (benchmarks/memory_check.py measures what capture takes; the runtime logs
# it and warns above the allowance): a base (cuBLAS's workspace for the capture stream, the padding
# rows' scratch KV block), a share per captured graph (its kernel nodes), and, in the pool the smaller
# graphs reuse, the largest graph's intermediates and the decode attention's partition buffers.
# 96 MiB: an H100 (CUDA 13) took 106 MiB for only 4 graphs of the 6-layer ref model (session 32), where a
# 64 MiB base allowed 82; the per-graph share below matters little at that size.
GRAPH_BASE_BYTES = 96 * MIB
# Per captured graph and decoder layer: fitted on an H200 to 108 MiB measured for 11 graphs of a 6-layer
# model and ~460 MiB for 35 graphs of a 32-layer (Llama-3-8B-shaped) one, both with room to spare.
GRAPH_BYTES_PER_GRAPH_LAYER = 768 * 1024
GRAPH_BYTES_PER_PIECE = 64 * 1024  # one piecewise graph (a layer's kernels) beyond the pool it shares
DEFAULT_NUM_SMS = 132  # what the estimate assumes (H100, H200); the runtime asks its GPU
# The longest context a step may have to replay the whole-forward graphs (runtime/mixed_graphs.py's MAX_CONTEXT, its
# module docstring says why); here, as the plan sizes the latent MLA kernel's split in them by it.
WHOLE_GRAPH_MAX_CONTEXT = 2048


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's GPU memory plan, estimated (compiler, `llmc inspect`) or measured (the runtime)."""

    total_bytes: int
    usable_bytes: int  # total × gpu_memory_utilization
    weight_bytes: int
    other_bytes: int  # in use outside torch's allocator: CUDA context, kernel modules, other processes
    activation_bytes: int  # peak of one step at max_num_batched_tokens, logits and probabilities included
    graph_bytes: int  # allowance for the captured decode graphs (0 when eager)
    kv_bytes: int
    kv_bytes_per_token: int
    num_kv_blocks: int
    num_kv_tokens: int
    max_concurrent_seqs: float  # sequences of max_model_len that fit at once
    # runtime.num_kv_blocks fixes the cache whatever the room: the KV fields above are then its size, and
    # this is the tokens the memory would have left for it (None: the cache is the room)
    room_kv_tokens: int | None = None
    # a hybrid model's per-request states (max_num_seqs + 1 slots at artifact.state_dtypes: linear_state_bytes_per_slot)
    state_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def fits(self) -> bool:
        return self.max_concurrent_seqs >= 1

    @property
    def over_room(self) -> bool:
        """A cache fixed by num_kv_blocks that is larger than the memory has room for."""
        return self.room_kv_tokens is not None and self.num_kv_tokens > self.room_kv_tokens

    def describe(self) -> str:
        """One line: the subtraction, in GiB."""
        gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        states = f", hybrid states {gib(self.state_bytes)}" if self.state_bytes else ""
        return (f"{gib(self.total_bytes)} × {self.usable_bytes / self.total_bytes:.2f} = {gib(self.usable_bytes)}, "
                f"minus weights {gib(self.weight_bytes)}{states}, other {gib(self.other_bytes)} (CUDA context, other "
                f"processes), activations {gib(self.activation_bytes)}, CUDA graphs {gib(self.graph_bytes)} "
                f"leaves {gib(self.kv_bytes)} of KV cache")


def activation_peak_bytes(model: ModelConfig, num_tokens: int, num_logit_rows: int) -> int:
    """Peak bytes of live activations in one forward over num_tokens (float32 logits for num_logit_rows)."""
    elt = dtype_num_bytes(model.dtype)
    q_kv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    # Residual + hidden + the widest of (qkv, gate_up + its SiLU·mul output) live at once.
    widest = max(q_kv + model.num_heads * model.head_dim, 3 * model.intermediate_size, moe_workspace_per_token(model),
                 mla_attention_per_token(model), linear_attention_per_token(model))
    per_token = (2 * model.hidden_size + widest) * elt
    logits = num_logit_rows * model.vocab_size * 4 * 2  # logits and the sampler's probabilities
    return num_tokens * per_token + logits


def linear_attention_per_token(model: ModelConfig) -> int:
    """Elements (of the model dtype) a Gated DeltaNet layer keeps live per token: its in_qkvz output (conv_dim + value
    width), the conv's output (conv_dim), the rule's float32 output and, for a prefill's pieces of CHUNKED_FROM tokens
    or more on CUDA, the chunked kernels' float32 scratch (value heads × (key dim + value dim + CHUNK):
    kernels/recurrent_triton.delta_rule_chunked); Qwen3.5-9B's 49K, more than its MLP's 37K. 0 without such layers."""
    if not model.linear_attention_layers:
        return 0
    from llmc.kernels.recurrent import CHUNK

    heads, key_dim, value_dim = model.linear_num_value_heads, model.linear_key_head_dim, model.linear_value_head_dim
    conv_dim = 2 * model.linear_num_key_heads * key_dim + heads * value_dim
    float32 = 4 // dtype_num_bytes(model.dtype)  # (elements of the model dtype per float32)
    return 2 * conv_dim + heads * value_dim + float32 * heads * (value_dim + (key_dim + value_dim + CHUNK))


def mla_attention_per_token(model: ModelConfig) -> int:
    """Elements DeepSeek's latent attention keeps live per token in its absorbed form (kernels/mla_attention.py, every
    decode row's): q (num_heads × head_dim), q_nope · W_UK and the kernel's output latent (num_heads × kv_lora_rank
    each), and that times W_UV (num_heads × v_head_dim) at once; V3's 128 heads: 172K, more than its MoE's 157K.
    0 without MLA."""
    if not model.is_mla:
        return 0
    return model.num_heads * (model.head_dim + 2 * model.kv_lora_rank + model.v_head_dim)


def mla_expanded_bytes(model: ModelConfig, num_tokens: int, max_model_len: int, num_heads: int | None = None) -> int:
    """Bytes DeepSeek's latent attention allocates in its expanded form for a step of num_tokens queries, over
    num_heads heads (a tensor-parallel rank's; None: the model's), beyond what activation_peak_bytes counts per token
    (q and the output): one chunk of the context expanded (kv_b's output, keys, latents), the queries' float32 running
    output and log-sum-exp and one call's partials (mla_attention.expanded_bytes). A long context is expanded chunk
    by chunk, so this holds for any context; the decode and whole-forward graphs never expand, so only the eager
    steps' activation term holds it (estimate, and the measured plan beside its profiled prompt's). A chunk holds at
    most max_model_len keys. 0 without MLA, and where no step computes CUDA_EXPAND_MIN_QUERIES queries (a budget of
    fewer tokens: every row runs absorbed on CUDA)."""
    if not model.is_mla or num_tokens < CUDA_EXPAND_MIN_QUERIES:
        return 0
    return expanded_bytes(min(num_tokens, max_model_len), num_heads or model.num_heads, model.qk_nope_head_dim,
                          model.qk_rope_head_dim, model.v_head_dim, model.kv_lora_rank, dtype_num_bytes(model.dtype),
                          max_model_len)


def moe_workspace_per_token(model: ModelConfig) -> int:
    """Elements an MoE layer keeps live per token: the fused kernel's gate_up output and its SiLU·mul
    (3 × moe_intermediate_size per routed copy), the down output per copy, the router's float32
    probabilities (counted as 2 elements each), the sorted-pair ids, and w8a8-fp8 experts' FP8 input
    copies (gate_up's per pair at most, down's per pair: one byte each, half an element) with their
    float32 row scales; a shared expert's gate_up output, its SiLU·mul and its output (3 × its width + hidden).
    0 for a dense model."""
    if not model.moe_layers:
        return 0
    top_k, hidden, inter = model.num_experts_per_tok, model.hidden_size, model.moe_intermediate_size
    fp8_inputs = -(-top_k * (hidden + inter) // 2) + 4 * top_k
    shared = 3 * model.shared_expert_intermediate_size + hidden if model.shared_expert_intermediate_size else 0
    return top_k * (3 * inter + hidden) + 2 * model.num_experts + 2 * top_k + fp8_inputs + shared


def decode_split_bytes(model: ModelConfig, num_rows: int, max_context_len: int, num_sms: int,
                       layout: RankLayout | None = None) -> int:
    """Bytes one layer's decode attention over num_rows query rows allocates for splitting max_context_len keys
    (0 where it does not split), over the heads of `layout` (a tensor-parallel rank's share; None: the model's):
    the paged kernel's float32 (acc, m, l) per head and partition (attention_triton, merged in the kernel);
    DeepSeek's latent MLA kernel's float32 partials of kv_lora_rank values per head and partition and its merge by
    torch ops (mla_attention.absorbed_split_bytes: its own split and heads per program). A rank's split is its own:
    fewer heads a row fill fewer programs, so more rows split."""
    num_heads, num_kv_heads = (model.num_heads, model.num_kv_heads) if layout is None else (
        layout.num_heads, layout.num_kv_heads)
    if model.is_mla:
        return absorbed_split_bytes(num_rows, num_heads, model.kv_lora_rank, max_context_len, num_sms,
                                    dtype_num_bytes(model.dtype))
    return paged_split_bytes(num_rows, num_heads, num_kv_heads, model.head_dim, max_context_len, num_sms)


def paged_split_bytes(num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, max_context_len: int,
                      num_sms: int) -> int:
    """The paged decode kernel's float32 (acc, m, l) per head and partition for num_rows rows splitting
    max_context_len keys (attention_triton's split); 0 where it does not split."""
    partitions = decode_split(num_rows * num_kv_heads, max_context_len, num_sms)[0]
    return num_rows * partitions * num_heads * (head_dim + 2) * 4 if partitions > 1 else 0


def graph_allowance_bytes(model: ModelConfig, batch_sizes: list[int], max_model_len: int,
                          num_sms: int = DEFAULT_NUM_SMS, layout: RankLayout | None = None, block_size: int = 16) -> int:
    """What captured decode graphs of these batch sizes are allowed to take (0 for none). Graphs
    split the decode attention's keys as for max_model_len: the split's buffers of the size whose split
    takes the most (decode_split_bytes, over the heads of `layout` where given; the pool keeps one
    layer's, which the next layer reuses). Their static block-table buffer holds a row of max_model_len's
    blocks per sequence of the largest size (int32: 2.5 MiB at 64 rows of DeepSeek-V2's 163840 tokens in 16-token
    blocks, which a V2-Lite-shaped capture on an H200 overran the allowance by, session 47)."""
    if not batch_sizes:
        return 0
    partitions = max(decode_split_bytes(model, size, max_model_len, num_sms, layout) for size in batch_sizes)
    table = max(batch_sizes) * -(-max_model_len // block_size) * 4
    return (GRAPH_BASE_BYTES + len(batch_sizes) * model.num_layers * GRAPH_BYTES_PER_GRAPH_LAYER
            + activation_peak_bytes(model, max(batch_sizes), 0) + partitions + table)


def draft_graph_allowance_bytes(head: EagleHeadConfig, itemsize: int, batch_sizes: list[int],
                                num_speculative_tokens: int, max_model_len: int, block_size: int,
                                num_sms: int = DEFAULT_NUM_SMS) -> int:
    """What an EAGLE head's captured draft steps (runtime/eagle_graphs.py) of these batch sizes may take, its weights
    `itemsize` bytes an element (0 for none, or k = 1: no step): per graph its k - 1 one-layer steps' kernel nodes
    (GRAPH_BYTES_PER_GRAPH_LAYER each); the static buffers of the largest size (k drafts, k - 1 positions, slots and
    context lengths, a hidden state and a block table row of max_model_len a row); one step's intermediates at that
    size in the pool (the concatenated input, q/k/v, attention output, MLP, as activation_peak_bytes counts a layer,
    and logits over the draft vocabulary in float32, the widest: an EAGLE-1 head's, through the model's head); the
    attention's split for max_model_len keys (paged_split_bytes, at the size that splits most); the head cache's
    scratch block (its padding rows' slot)."""
    k = num_speculative_tokens
    if not batch_sizes or k < 2:
        return 0
    top, steps, hidden = max(batch_sizes), k - 1, head.hidden_size
    static = top * (8 * k + steps * (8 + 8 + 4) + hidden * itemsize + -(-max_model_len // block_size) * 4)
    intermediates = top * ((4 * hidden + _head_layer_widest(head)) * itemsize + head.draft_vocab_size * 4)
    split = max(paged_split_bytes(size, head.num_heads, head.num_kv_heads, head.head_dim, max_model_len, num_sms)
                for size in batch_sizes)
    scratch = block_size * head.kv_bytes_per_token(itemsize)
    return len(batch_sizes) * steps * GRAPH_BYTES_PER_GRAPH_LAYER + static + intermediates + split + scratch


def _head_layer_widest(head: EagleHeadConfig) -> int:
    """The widest of an EAGLE head's layer's intermediates per row, in elements: q/k/v beside the attention's output,
    or gate_up with its SiLU · mul (as activation_peak_bytes counts a model's layer)."""
    q_kv = (head.num_heads + 2 * head.num_kv_heads) * head.head_dim
    return max(q_kv + head.num_heads * head.head_dim, 3 * head.intermediate_size)


def absorb_graph_allowance_bytes(head: EagleHeadConfig, itemsize: int, batch_sizes: list[int],
                                 num_speculative_tokens: int, max_model_len: int, block_size: int) -> int:
    """What an EAGLE head's captured absorb of decode verify steps (runtime/eagle_absorb_graphs.py) of these batch sizes
    may take, its weights `itemsize` bytes an element (0 for none): per graph one layer's kernel nodes
    (GRAPH_BYTES_PER_GRAPH_LAYER); the static buffers of the largest size `top`, k + 1 rows a request (token ids,
    positions, slots, aux row index: int64; the gathered aux rows, the model's (EAGLE-3: 3 x target hidden; EAGLE-1: the
    hidden size) and the attention's output; top + 1 block-table rows of max_model_len and context lengths; the int32
    prefill index; per request its kept row, draft and hidden state); the layer's intermediates over those rows (fc's
    output and as the draft graphs count a row: the concatenated input, q/k/v, attention output, MLP) and the kept rows'
    float32 logits over the draft vocabulary; the head cache's scratch block where no draft graphs count it (k = 1).
    The prefill kernel does not split keys: no split buffers."""
    if not batch_sizes:
        return 0
    top, k, hidden = max(batch_sizes), num_speculative_tokens, head.hidden_size
    rows = top * (k + 1)
    aux_width = 3 * head.target_hidden_size if head.method == "eagle3" else head.target_hidden_size
    blocks = max_prefill_blocks(rows, top, prefill_queries_per_block(head.num_heads // head.num_kv_heads))
    static = (rows * (4 * 8 + (aux_width + head.num_heads * head.head_dim) * itemsize)
              + (top + 1) * (-(-max_model_len // block_size) * 4 + 4) + (2 * (top + 1) + 2 * blocks) * 4
              + top * (8 + 8 + hidden * itemsize))
    intermediates = rows * (5 * hidden + _head_layer_widest(head)) * itemsize + top * (hidden * itemsize + head.draft_vocab_size * 4)
    scratch = block_size * head.kv_bytes_per_token(itemsize) if k < 2 else 0
    return len(batch_sizes) * GRAPH_BYTES_PER_GRAPH_LAYER + static + intermediates + scratch


# Token counts captured: powers of two and the midpoints between them, up to vLLM's default 512.
PIECEWISE_CAPTURE_SIZES = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def piecewise_sizes(max_capture_size: int, max_num_batched_tokens: int) -> list[int]:
    """The token counts the piecewise graphs of prefill and mixed steps (runtime/piecewise_graphs.py)
    are captured for: PIECEWISE_CAPTURE_SIZES below the top, then the top itself, the smaller of
    max_capture_size and max_num_batched_tokens (no step has more tokens than the budget)."""
    top = min(max_capture_size, max_num_batched_tokens)
    return sorted({size for size in PIECEWISE_CAPTURE_SIZES if size < top} | {top})


def planned_piece_sizes(runtime: RuntimeDefaults) -> list[int]:
    """The token counts one rank with these options captures graphs of prefill and mixed steps for
    (piecewise, or whole with cudagraph_mode FULL), where it captures graphs at all; none with
    enforce_eager, a cudagraph_mode without them, or cpu_offload_gb (its copies hang on the layers'
    forward hooks, which the graphs do not call)."""
    modes = runtime.graph_modes
    if runtime.enforce_eager or not (modes.has_piecewise or modes.has_full_mixed) or runtime.cpu_offload_gb:
        return []
    return piecewise_sizes(modes.max_cudagraph_capture_size, runtime.max_num_batched_tokens)


def piecewise_allowance_bytes(model_config: ModelConfig, sizes: list[int]) -> int:
    """What the cut graphs may take: the static buffers (ids, positions and slots, q and the
    attention's output, the hidden states), the pool's intermediates of one step of the largest size
    (two pieces' worth at most: activation_peak_bytes' per-token count twice over), and the
    graph objects (GRAPH_BYTES_PER_PIECE each). An 8B-shaped model's 12 sizes x 33 pieces took
    44-134 MiB on an H200 (bf16, FP8 W8A8; benchmarks/RESULTS.md, session 33) against 143 here. The
    whole-forward graphs of cudagraph_mode FULL (runtime/mixed_graphs.py) hold the same kernels in one
    graph per size, beside the same buffers and one step's intermediates: the same bound."""
    if not sizes:
        return 0
    top = max(sizes)
    elt = dtype_num_bytes(model_config.dtype)
    static = top * (3 * 8 + (2 * model_config.num_heads * model_config.head_dim + model_config.hidden_size) * elt)
    return (static + 2 * activation_peak_bytes(model_config, top, 0)
            + len(sizes) * (model_config.num_layers + 1) * GRAPH_BYTES_PER_PIECE)


def verify_graph_sizes(runtime: RuntimeDefaults, piece_sizes: list[int]) -> list[int]:
    """The token counts of the whole-forward graphs (runtime/mixed_graphs.py) a runner captures beside its piecewise
    graphs for speculative decoding's verify steps (ModelRunner NOTE (verify graphs)): the piecewise sizes, under
    cudagraph_mode FULL_AND_PIECEWISE with a `speculative` config; else none."""
    modes = runtime.graph_modes
    if runtime.speculative is None or not (modes.has_piecewise and modes.has_full_decode):
        return []
    return piece_sizes


def prefill_graph_allowance_bytes(model_config: ModelConfig, runtime: RuntimeDefaults, sizes: list[int],
                                  num_sms: int = DEFAULT_NUM_SMS) -> int:
    """What the graphs of prefill and mixed steps of `sizes` tokens may take: piecewise_allowance_bytes,
    and with cudagraph_mode FULL (runtime/mixed_graphs.py) their block-table buffer besides, a row per
    sequence a captured step may hold (~16 MB at 512 sequences of 128K tokens in 16-token blocks); with the verify
    steps' whole-forward graphs beside piecewise ones (verify_graph_sizes), both. A whole-forward graph of DeepSeek's
    latent MLA runs every token row through the absorbed kernel, which splits the keys of few rows as for the graphs'
    context bound (WHOLE_GRAPH_MAX_CONTEXT): that split's buffers too (decode_split_bytes, at the size with the most;
    the paged attention's indexed prefill kernel does not split)."""
    allowance = piecewise_allowance_bytes(model_config, sizes)
    whole = sizes if runtime.graph_modes.has_full_mixed else verify_graph_sizes(runtime, sizes)
    if whole and not runtime.graph_modes.has_full_mixed:
        allowance += piecewise_allowance_bytes(model_config, whole)
    if whole:
        allowance += (min(runtime.max_num_seqs, max(whole)) + 1) * -(-runtime.max_model_len // runtime.block_size) * 4
    if whole and model_config.is_mla:
        bound = min(runtime.max_model_len, WHOLE_GRAPH_MAX_CONTEXT)
        allowance += max(decode_split_bytes(model_config, size, bound, num_sms) for size in whole)
    return allowance


def warn_over_allowance(what: str, used_bytes: int, allowance_bytes: int, remedy: str) -> None:
    """A warning where captured graphs took more GPU memory than the plan held back for them."""
    if used_bytes > allowance_bytes:
        logger.warning("%s took %.1f MiB more than the %.1f MiB held back for them: the engine uses that much beyond "
                       "gpu_memory_utilization; lower it, or %s", what, (used_bytes - allowance_bytes) / MIB,
                       allowance_bytes / MIB, remedy)


def plan_kv(total_bytes: int, utilization: float, weight_bytes: int, other_bytes: int, activation_bytes: int,
            graph_bytes: int, kv_bytes_per_token: int, block_size: int, max_model_len: int,
            state_bytes: int = 0) -> MemoryEstimate:
    """The KV cache that fits in total × utilization beside the rest (a hybrid's states, state_bytes, among it), in
    whole blocks."""
    usable = int(total_bytes * utilization)
    kv = max(0, usable - weight_bytes - state_bytes - other_bytes - activation_bytes - graph_bytes)
    num_blocks = kv // (kv_bytes_per_token * block_size)
    num_tokens = num_blocks * block_size
    return MemoryEstimate(
        total_bytes=total_bytes,
        usable_bytes=usable,
        weight_bytes=weight_bytes,
        other_bytes=other_bytes,
        activation_bytes=activation_bytes,
        graph_bytes=graph_bytes,
        kv_bytes=num_tokens * kv_bytes_per_token,
        kv_bytes_per_token=kv_bytes_per_token,
        num_kv_blocks=num_blocks,
        num_kv_tokens=num_tokens,
        max_concurrent_seqs=num_tokens / max_model_len,
        state_bytes=state_bytes,
    )


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
    piece_graph_bytes: int = 0,
    num_heads: int | None = None,
    state_bytes: int = 0,
) -> MemoryEstimate:
    """The plan before the GPU is seen: the activation formula (with DeepSeek's expanded workspace over num_heads
    heads, a rank's; None: the model's), CUDA_CONTEXT_BYTES for other, and the graph
    allowance for the buckets the compiler plans (decode graphs with use_graphs; the graphs of prefill and mixed steps,
    prefill_graph_allowance_bytes, given); state_bytes: a hybrid's states (estimate_per_rank: max_num_seqs + 1 slots
    at artifact.state_dtypes)."""
    activations = (activation_peak_bytes(model, max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens))
                   + mla_expanded_bytes(model, max_num_batched_tokens, max_model_len, num_heads))
    graphs = (graph_allowance_bytes(model, cuda_graph_batch_sizes(max_num_seqs), max_model_len, block_size=block_size)
              if use_graphs else 0)
    graphs += piece_graph_bytes
    return plan_kv(total_bytes, utilization, weight_bytes, CUDA_CONTEXT_BYTES, activations, graphs,
                   kv_bytes_per_token, block_size, max_model_len, state_bytes)


def linear_state_bytes_per_slot(model: ModelConfig, conv_dtype: str, recurrent_dtype: str) -> int:
    """A hybrid model's states of one request slot, conv states in conv_dtype and recurrent states in recurrent_dtype
    (artifact.state_dtypes): each linear-attention layer's (runtime/models/gated_deltanet.py) conv state [conv_dim,
    kernel - 1] and recurrent state [value heads, key dim, value dim]; each Mamba-2 layer's (runtime/models/mamba2.py)
    conv state [conv_dim, kernel - 1] and SSM state [heads, head_dim, d_state]; each short-conv layer's (LFM2,
    runtime/models/short_conv.py) conv state [hidden, kernel - 1]; the runner holds max_num_seqs + 1 slots. 0 for
    other models."""
    if not model.is_hybrid:
        return 0
    conv, recurrent = dtype_num_bytes(conv_dtype), dtype_num_bytes(recurrent_dtype)
    total = 0
    if model.linear_attention_layers:
        conv_dim = 2 * model.linear_num_key_heads * model.linear_key_head_dim + (
            model.linear_num_value_heads * model.linear_value_head_dim)
        total += len(model.linear_attention_layers) * (
            conv_dim * (model.linear_conv_kernel_dim - 1) * conv
            + model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim * recurrent)
    if model.mamba_layers:
        total += len(model.mamba_layers) * (
            model.mamba_conv_dim * (model.mamba_conv_kernel - 1) * conv
            + model.mamba_num_heads * model.mamba_head_dim * model.mamba_d_state * recurrent)
    if model.short_conv_layers:
        total += len(model.short_conv_layers) * model.hidden_size * (model.short_conv_kernel - 1) * conv
    return total


def estimate_per_rank(model: ModelConfig, parallel: ParallelPlan, weight_bytes_per_rank: list[int], kv_dtype: str,
                      runtime: RuntimeDefaults, total_bytes: int) -> list[MemoryEstimate]:
    """The estimate of every rank: its weights, and KV for its heads of its layers. The rank with the
    fewest KV tokens bounds the engine (every rank holds the same blocks). Parallel ranks are planned
    without graphs; one rank with runtime.compilation_config's (runtime/model_runner.py)."""
    one_rank = parallel.world_size == 1
    decode_graphs = one_rank and not runtime.enforce_eager and runtime.graph_modes.has_full_decode
    # (a hybrid model captures decode graphs only: runtime/model_runner.py)
    piece_sizes = planned_piece_sizes(runtime) if one_rank and not model.is_hybrid else []
    states = (runtime.max_num_seqs + 1) * linear_state_bytes_per_slot(model, *state_dtypes(runtime, model.dtype))
    estimates = [
        estimate(
            model, weight_bytes_per_rank[layout.rank], kv_bytes_per_token(model, layout, dtype_num_bytes(kv_dtype)),
            runtime.block_size, total_bytes, runtime.gpu_memory_utilization, runtime.max_num_batched_tokens,
            runtime.max_num_seqs, runtime.max_model_len, use_graphs=decode_graphs,
            piece_graph_bytes=prefill_graph_allowance_bytes(model, runtime, piece_sizes), num_heads=layout.num_heads,
            state_bytes=states,
        )
        for layout in all_rank_layouts(model, parallel)
    ]
    if runtime.num_kv_blocks is None:
        return estimates
    tokens = runtime.num_kv_blocks * runtime.block_size  # what the engine allocates, without a profile
    return [replace(e, num_kv_blocks=runtime.num_kv_blocks, num_kv_tokens=tokens, kv_bytes=tokens * e.kv_bytes_per_token,
                    max_concurrent_seqs=tokens / runtime.max_model_len, room_kv_tokens=e.num_kv_tokens)
            for e in estimates]


def least_room(estimates: list[MemoryEstimate]) -> MemoryEstimate:
    """The rank whose KV cache bounds the engine (every rank holds the same blocks): the fewest KV tokens,
    and with a cache fixed by num_kv_blocks (the same on every rank) the least room for it."""
    return min(estimates, key=lambda e: (e.num_kv_tokens, e.room_kv_tokens or 0))


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode buckets: dense at small sizes (1, 2, 4, 8), then every 8 up to 256, every 16 above."""
    sizes = [1, 2, 4, 8]
    size = 16
    while size <= max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    sizes = [s for s in sizes if s < max_num_seqs]
    return sizes + [max_num_seqs]


# ---- what the memory knobs buy (kv_cache_dtype, cpu_offload_gb) ----------------------------------------

NUM_STAGING_SLOTS = 2  # offloaded layers stream through two GPU buffers: one computes while the next loads


@dataclass(frozen=True)
class OffloadPlan:
    """cpu_offload_gb on one rank: whole decoder layers (positions in the rank's layer order), spread
    evenly over the stack so each copy overlaps the resident layers before it, as many as fit."""

    layers: list[int]
    offloaded_bytes: int  # weights that live in pinned host memory
    staging_bytes: int  # GPU buffers they stream through (up to NUM_STAGING_SLOTS layers)

    @property
    def gpu_bytes_saved(self) -> int:
        return max(0, self.offloaded_bytes - self.staging_bytes)


def plan_offload(layer_bytes: list[int], cpu_offload_bytes: int) -> OffloadPlan:
    if cpu_offload_bytes <= 0 or not layer_bytes:
        return OffloadPlan([], 0, 0)
    num_layers, largest = len(layer_bytes), max(layer_bytes)
    count = min(num_layers, cpu_offload_bytes // largest)
    layers = [i for i in range(num_layers) if (i + 1) * count // num_layers > i * count // num_layers]
    return OffloadPlan(layers, sum(layer_bytes[i] for i in layers), min(count, NUM_STAGING_SLOTS) * largest)


def knob_table(model: ModelConfig, parallel: ParallelPlan, weight_bytes_per_rank: list[int],
               layer_bytes_per_rank: list[list[int]], runtime: RuntimeDefaults, total_bytes: int,
               offload_gibs: list[float]) -> list[dict]:
    """KV tokens and sequences of max_model_len that fit with kv_cache_dtype auto vs fp8, for each
    cpu_offload_gb in offload_gibs (the rank with the least room bounds them all)."""
    rows = []
    runtime = replace(runtime, num_kv_blocks=None)  # what each knob buys is room: a fixed cache does not move
    for offload_gib in offload_gibs:
        plans = [plan_offload(layers, int(offload_gib * GIB)) for layers in layer_bytes_per_rank]
        weights = gpu_weight_bytes(weight_bytes_per_rank, layer_bytes_per_rank, offload_gib)
        for kv_cache_dtype, kv_dtype in (("auto", model.dtype), ("fp8", "float8_e4m3fn")):
            estimate = least_room(estimate_per_rank(model, parallel, weights, kv_dtype, runtime, total_bytes))
            rows.append({"kv_cache_dtype": kv_cache_dtype, "cpu_offload_gb": offload_gib,
                         "offloaded_layers": len(plans[0].layers), "weight_bytes": estimate.weight_bytes,
                         "num_kv_tokens": estimate.num_kv_tokens, "max_concurrent_seqs": estimate.max_concurrent_seqs})
    return rows


def gpu_weight_bytes(weight_bytes_per_rank: list[int], layer_bytes_per_rank: list[list[int]],
                     cpu_offload_gb: float) -> list[int]:
    """Each rank's weight bytes on its GPU once cpu_offload_gb of them live in host memory (the offloaded
    layers leave; their staging buffers stay)."""
    plans = [plan_offload(layers, int(cpu_offload_gb * GIB)) for layers in layer_bytes_per_rank]
    return [w - p.gpu_bytes_saved for w, p in zip(weight_bytes_per_rank, plans)]


def fit_suggestion(rows: list[dict]) -> str:
    """What to set when the current plan does not fit one sequence: the knob rows that do, in words."""
    fitting = [r for r in rows if r["max_concurrent_seqs"] >= 1]
    if not fitting:
        return "even kv_cache_dtype fp8 with cpu_offload_gb does not fit one sequence: lower max_model_len or quantize"
    best = min(fitting, key=lambda r: (r["cpu_offload_gb"], r["kv_cache_dtype"] == "fp8"))
    knobs = (["kv_cache_dtype fp8"] if best["kv_cache_dtype"] == "fp8" else []) + (
        [f"cpu_offload_gb {best['cpu_offload_gb']:g}"] if best["cpu_offload_gb"] else [])
    return (f"set {' and '.join(knobs)}: {best['num_kv_tokens']:,} KV tokens = "
            f"{best['max_concurrent_seqs']:.1f} sequences of max_model_len")


def layer_bytes_per_rank(root: Path, model: ModelConfig, parallel: ParallelPlan) -> list[list[int]]:
    """Bytes of each decoder layer each rank holds, from the safetensors headers of the ranks' weights in
    the artifact at `root` ({name: {"data_offsets": [begin, end], ...}})."""
    headers = [read_safetensors_header(root / rank_weights_path(r)) for r in range(parallel.world_size)]
    result = []
    for layout, header in zip(all_rank_layouts(model, parallel), headers, strict=True):
        sizes = dict.fromkeys(layout.layers, 0)
        for name, entry in header.items():
            parts = name.split(".")
            if parts[0] == "layers" and isinstance(entry, dict) and int(parts[1]) in sizes:
                begin, end = entry["data_offsets"]
                sizes[int(parts[1])] += end - begin
        result.append(list(sizes.values()))
    return result
