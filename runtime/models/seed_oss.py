"""Seed-OSS (SeedOssForCausalLM, model_type seed_oss: ByteDance-Seed/Seed-OSS-36B-*): the Llama decoder with q/k/v
biases (attention_bias, true by default) and, where attention_out_bias is true, an o_proj bias (ModelConfig.o_bias,
gpt-oss's). Its dropouts do nothing at inference. mlp_bias is refused by name (the runtime's MLP has no biases;
published checkpoints set it false)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec

SPEC = ModelSpec(
    family="seed_oss",
    architectures=("SeedOssForCausalLM",),
    model_types=("seed_oss",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
