"""gpt-oss (GptOssForCausalLM, model_type gpt_oss: openai/gpt-oss-20b, -120b): the Llama layout with q/k/v/o biases,
attention sinks (a learned logit per head, `self_attn.sinks`, joins every query row's softmax as one more column whose
probability is dropped: ModelConfig.attention_sinks), sliding-window layers (layer_types, alternating sliding and full;
window 128), YaRN rope, and a top-k mixture of experts in every layer. Its router (`mlp.router`) is a Linear with a bias;
the top-k of its logits are softmaxed (the top-k of the softmax, renormalised). Every expert of a layer is stored in
four tensors: `mlp.experts.gate_up_proj` [E, hidden, 2 * width] (input-major; gate and up interleaved in its columns,
gate = [..., ::2], up = [..., 1::2]) with `gate_up_proj_bias` [E, 2 * width], `down_proj` [E, width, hidden] with
`down_proj_bias` [E, hidden]; the published checkpoints hold the two weights in MXFP4 (`*_blocks`, `*_scales`). The
build reads expert e's gate, up and down (and their biases) under Mixtral-like per-expert names, transposed and
de-interleaved, MXFP4 dequantized (compiler/gpt_oss_checkpoint.py). The experts compute a clamped SwiGLU,
(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit) (ModelConfig.swiglu_limit,
swiglu_alpha), in place of SiLU(gate) * up."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec, MoeSpec

SPEC = ModelSpec(
    family="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="mlp.router", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj",
                down="down_proj", fused=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), fused_layout="gpt_oss"),
)
