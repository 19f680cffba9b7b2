"""OLMo Hybrid (OlmoHybridForCausalLM, model_type olmo_hybrid: allenai/Olmo-Hybrid-7B): Qwen3.5's hybrid decoder
(runtime/models/qwen3_5.py) with OLMo 3's attention layers. Its `layer_types` mix "linear_attention" layers, a Gated
DeltaNet (runtime/models/gated_deltanet.py) under Llama's norms (input_layernorm before it, post_attention_layernorm
before the MLP: ModelConfig.pre_norm_layers), with "full_attention" layers as OLMo 3's (no pre-norms, the sub-layers'
outputs normed, q/k norms over the whole projections; no output gate, whole-head rotary, or none where rope_theta is
null: ModelConfig.rope_on_full_layers false). Its DeltaNet differs from Qwen3.5's in three ways, read as Qwen3.5's
at build time or switched in the layer: separate q_proj / k_proj / v_proj and a g_proj for the gate z (read as
in_proj_qkv and in_proj_z: hf_checkpoint.olmo_hybrid_tensors, as b_proj / a_proj / o_norm / o_proj are read as
in_proj_b / in_proj_a / norm / out_proj); beta = 2 sigmoid(b) (linear_allow_neg_eigval); its gated RMSNorm's eps 1e-5
whatever rms_norm_eps (linear_norm_eps). Every RMSNorm scales by w (no offset)."""

from llmc.runtime.models.olmo2 import OLMO2_NORMS
from llmc.runtime.models.qwen3_5 import LINEAR_ATTENTION
from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, ModelSpec

SPEC = ModelSpec(
    family="olmo_hybrid",
    architectures=("OlmoHybridForCausalLM",),
    model_types=("olmo_hybrid",),
    layer_linears=LLAMA_LINEARS + LINEAR_ATTENTION,
    layer_norms=OLMO2_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
    pre_norm_layer_norms=LLAMA_NORMS,
)
