"""Llama 4 text (Llama4ForCausalLM, model_type llama4_text; Llama4ForConditionalGeneration's language model served as
text only: Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E). The Llama layout under `feed_forward` with:
interleaved rotary pairs over the whole head (the build permutes q/k rows to rotate-half: rotary_interleaved); NoPE
layers (no_rope_layers' zeros: nope_layers) whose q is tempered by position, 1 + attn_scale * log(1 + floor((position
+ 1) / floor_scale)) (query_temperature_*, offset 1); a weightless L2 norm of each q/k head on the rope layers
(use_qk_norm: qk_l2_norm_layers); MoE layers (moe_layers, or every interleave_moe_layer_step-th) whose router takes
the top logit and scales the expert's input by its sigmoid (router_scoring sigmoid_input), beside a shared expert;
dense layers of width intermediate_size_mlp. The experts are stored fused, `feed_forward.experts.gate_up_proj`
[E, hidden, 2 * width] (input-major, gate columns then up) and `down_proj` [E, width, hidden]: the build reads expert
e's gate, up and down transposed under per-expert names (hf_checkpoint.fused_expert_tensors). Chunked local attention
on layer_types' chunked_attention layers (by default the rope layers: attention_chunk_layers): a query at p sees keys
from floor(p / attention_chunk_size) * attention_chunk_size on (kernels.attention, attention_chunk_size)."""

from llmc.runtime.models.spec import FusedLinear, LLAMA_GLOBALS, LLAMA_NORMS, ModelSpec, MoeSpec, shared_expert_linears

SPEC = ModelSpec(
    family="llama4",
    architectures=("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
    model_types=("llama4_text", "llama4"),
    layer_linears=(
        FusedLinear("attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column", "input_norm"),
        FusedLinear("attn.o", ("self_attn.o_proj",), "row", "attn.qkv"),
        FusedLinear("mlp.gate_up", ("feed_forward.gate_proj", "feed_forward.up_proj"), "column", "post_attn_norm"),
        FusedLinear("mlp.down", ("feed_forward.down_proj",), "row", "mlp.gate_up"),
        *shared_expert_linears(("feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj"),
                               "feed_forward.shared_expert.down_proj"),
    ),
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="feed_forward.router", expert_prefix="feed_forward.experts.{}.", gate="gate_proj", up="up_proj",
                down="down_proj", fused=("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
                fused_layout="llama4"),
)
