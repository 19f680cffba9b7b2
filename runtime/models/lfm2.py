"""Liquid AI LFM2 (Lfm2ForCausalLM, model_type lfm2: LFM2-350M / 700M / 1.2B / 2.6B): Llama's pre-norm layers
(operator_norm before the mixer, ffn_norm before the SwiGLU feed_forward: w1 gate, w3 up, w2 down), each mixer either
GQA attention with per-head q/k RMSNorms (q_layernorm / k_layernorm: Qwen3's qk_norm) and rotary, its o_proj named
out_proj, or ("conv" layers, ModelConfig.short_conv_layers) a gated short convolution in the attention's place
(runtime/models/short_conv.py: conv.in_proj / conv.out_proj as attn.conv_in / attn.conv_out, quantizable; conv.conv
dense), its conv state in slots as Qwen3.5's DeltaNet's. The final norm is model.embedding_norm (transformers applies
it after the last layer, whatever its name). The feed-forward's width is derived from intermediate_size
(compiler/hf_checkpoint._lfm2_config).

LFM2-MoE (Lfm2MoeForCausalLM, model_type lfm2_moe: LFM2-8B-A1B) is the same decoder with its first num_dense_layers
feed-forwards dense (intermediate_size wide, not derived) and the rest a mixture of experts stored as Mixtral's
(feed_forward.gate, feed_forward.experts.{e}.w1 / w3 / w2) whose router is DeepSeek-V3's without groups
(moe.deepseek_route): sigmoid scores, the top-k chosen with feed_forward.expert_bias, weighted by the scores without
it, renormalised where norm_topk_prob, times routed_scaling_factor; no shared expert."""

from dataclasses import replace

from llmc.runtime.models.spec import LLAMA_GLOBALS, FusedLinear, ModelSpec, MoeSpec

SHORT_CONV = (  # a conv layer's linears, in its layers only (runtime/models/short_conv.py)
    FusedLinear("attn.conv_in", ("conv.in_proj",), "column", "input_norm"),
    FusedLinear("attn.conv_out", ("conv.out_proj",), "row", "attn.conv_in"),
)

SPEC = ModelSpec(
    family="lfm2",
    architectures=("Lfm2ForCausalLM",),
    model_types=("lfm2",),
    layer_linears=(
        FusedLinear("attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column", "input_norm"),
        FusedLinear("attn.o", ("self_attn.out_proj",), "row", "attn.qkv"),
        *SHORT_CONV,
        FusedLinear("mlp.gate_up", ("feed_forward.w1", "feed_forward.w3"), "column", "post_attn_norm"),
        FusedLinear("mlp.down", ("feed_forward.w2",), "row", "mlp.gate_up"),
    ),
    layer_norms={"input_norm": "operator_norm", "post_attn_norm": "ffn_norm"},
    qk_norms={"attn.q_norm": "self_attn.q_layernorm", "attn.k_norm": "self_attn.k_layernorm"},
    global_tensors={**LLAMA_GLOBALS, "norm.weight": "model.embedding_norm.weight"},
)

MOE_SPEC = replace(
    SPEC,
    family="lfm2_moe",
    architectures=("Lfm2MoeForCausalLM",),
    model_types=("lfm2_moe",),
    moe=MoeSpec(router="feed_forward.gate", expert_prefix="feed_forward.experts.{}.", gate="w1", up="w3", down="w2",
                score_bias="feed_forward.expert_bias"),
)
