"""IBM Granite 3.x (GraniteForCausalLM, model_type granite: granite-3.x-2b/8b-instruct): the Llama layout with
four scalar multipliers in its config (transformers' modeling_granite). `embedding_multiplier` scales the
embeddings (ModelConfig.embed_scale, as Gemma's) and `attention_multiplier` is the attention's scale itself in
place of head_dim^-0.5 (ModelConfig.softmax_scale); `residual_multiplier` (each sub-layer's output times it before
the residual add) and `logits_scaling` (logits divided by it) are folded into the weights as they are read
(compiler/hf_checkpoint.multiplier_fold: o_proj's and down_proj's weights times residual_multiplier, the final
norm's weight divided by logits_scaling), so every kernel and graph runs Granite as a Llama."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec

SPEC = ModelSpec(
    family="granite",
    architectures=("GraniteForCausalLM",),
    model_types=("granite",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    scales_input_embeds=True,  # transformers multiplies inputs_embeds by embedding_multiplier in the forward
)
