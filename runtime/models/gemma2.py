"""Gemma 2 (Gemma2ForCausalLM, model_type gemma2: gemma-2-2b/9b/27b): Gemma 3's layout without the q/k norms
and with one rotary table (rope_theta for every layer) — sandwich norms, every RMSNorm scaling by (1 + w)
(folded into the stored weight at build time), embeddings scaled by sqrt(hidden_size), GELU-tanh gating,
attention scaled by query_pre_attn_scalar^-0.5, a sliding window on alternate layers (layer_types) — plus
logit soft-capping: each attention score s (after the scale, before the mask) becomes
attn_logit_softcapping * tanh(s / attn_logit_softcapping), and each output logit likewise with
final_logit_softcapping (ModelConfig fields, read by compiler/hf_checkpoint.py)."""

from llmc.runtime.models.gemma3 import GEMMA3_NORMS
from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, ModelSpec

SPEC = ModelSpec(
    family="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=GEMMA3_NORMS,  # the same four norms, the same HF names
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    norm_weight_offset=1.0,
)
