"""TII Falcon-H1 (FalconH1ForCausalLM, model_type falcon_h1: Falcon-H1-0.5B ... 34B, Falcon-H1R). Every layer runs
Llama's attention (rotary over whole heads) and a Mamba-2 mixer (runtime/models/mamba2.py, Granite 4.0's, `mamba.*`
as attn.mamba_in / attn.mamba_out, its state in slots) in parallel on input_layernorm's output, their outputs summed
(ModelConfig.mamba_with_attention: decoder.AttentionAndMamba2), then a SwiGLU `feed_forward` after pre_ff_layernorm;
the final norm `model.final_layernorm`. Its muP multipliers are folded into the weights at build
(compiler/hf_checkpoint.multiplier_fold: attention_in / key / attention_out, ssm_in / ssm_multipliers / ssm_out,
mlp_multipliers, lm_head_multiplier) but embedding_multiplier, the embeddings' scale (ModelConfig.embed_scale: a
prompt given as embeddings is not scaled, as transformers'). mamba_rms_norm false (ModelConfig.mamba_rms_norm): the
mixer's output y silu(z), no gated norm (compiler/hf_checkpoint._falcon_h1_config). Its tensors are named as Bamba's: its
spec is Bamba's under its own names."""

from dataclasses import replace

from llmc.runtime.models.bamba import SPEC as BAMBA

SPEC = replace(BAMBA, family="falcon_h1", architectures=("FalconH1ForCausalLM",), model_types=("falcon_h1",))
