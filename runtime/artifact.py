"""The artifact format: the one boundary between compiler and runtime (DESIGN §2).

```
artifact/
  manifest.json                 Manifest below, as JSON
  tokenizer/                    HF tokenizer files, copied (chat template included)
  rank-00/weights.safetensors   this rank's tensors, already sharded and packed
  vision/weights.safetensors    a vision model's vision tower and projector, dense (LLaVA: 1.13; Gemma 3: 1.14;
                                Mistral 3: 1.17; LLaVA-NeXT: 1.18; Qwen2-VL, Qwen2.5-VL: 1.19; Qwen3-VL: 1.24)
```
The compiler writes a `Manifest`; the runtime reads it. JSON and safetensors only, no pickles.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import ArtifactError
from llmc.runtime import integrity
from llmc.runtime.integrity import read_safetensors_header, sha256_file  # noqa: F401 - part of this module's API
from llmc.runtime.pooling import CONVERTS, RUNNERS, PoolerConfig
from llmc.runtime.spec_decode import SpeculativeConfig
from llmc.schema import opt, parse

# 1.1: plan.w4a16_kernels (1.0 manifests load without it).
# 1.2: manifest_sha256, the digest of the manifest itself (required from 1.2 on; 1.0/1.1 load without it,
#      and are checked against it when they carry one).
# 1.3: target (ONNX models); older manifests load without it.
# 1.4: kv.k_scales / v_scales / scales_source and runtime.kv_cache_dtype / cpu_offload_gb (FP8 KV cache,
#      CPU weight offload); older manifests load without them (auto KV, no scales, no offload).
# 1.5: mixture-of-experts models (model.num_experts ..., parallel.expert / rank_experts); older manifests
#      load without them (dense, no expert parallelism).
# 1.6: Gemma 3 (model.hidden_act, query_pre_attn_scalar, embed_scale, sandwich_norms, rope_local_theta /
#      rope_local_scaling); older manifests load without them (SiLU, head_dim^-0.5, no scale, no extra norms, one rope).
# 1.7: Gemma 2 (family gemma2) and logit soft-capping (model.attn_logit_softcapping / final_logit_softcapping);
#      older manifests load without them (no cap).
# 1.8: Granite (family granite) and model.softmax_scale, the attention's scale given as is (Granite's
#      attention_multiplier); older manifests load without it (query_pre_attn_scalar^-0.5, else head_dim^-0.5).
# 1.9: model.rotary_dim, the rotated dims of each q/k head (partial_rotary_factor < 1: Phi-4-mini); older manifests
#      load without it (None: the whole head).
# 1.10: OLMo 2 (family olmo2), model.pre_norms (false: no input_norm / post_attn_norm, the sub-layers read the
#      residual stream itself) and model.qk_norm_full_width (q_norm / k_norm over the whole q / k projection, not per
#      head); older manifests load without them (pre-norms, per-head q/k norms).
# 1.11: the w8a8-int8 linear format (int8 weights per channel, int8 activations per token at run time) and
#      quant.method int8; older manifests have neither (an older llmc refuses the format by name).
# 1.12: sequence classifiers (model.num_labels, labels, classifier_activation; a `score` tensor in place of lm_head);
#      older manifests load without them (a causal LM).
# 1.13: vision models (LLaVA): the `vision` section and vision/weights.safetensors, and the processor files in
#      tokenizer/; older manifests load without them (a text model).
# 1.14: Gemma 3's vision model: the vision section's mm_tokens_per_image, boi/eoi_token_index and
#      bidirectional_image_attention, its LLaVA-only fields optional; older manifests load without them (LLaVA).
#      The runtime section's enable_prompt_embeds and stream_interval (vLLM's), default false and 1 when absent.
# 1.15: OLMo 3, OLMoE, Granite MoE (plain and shared), Qwen2-MoE (families olmo3, olmoe, granitemoe,
#      granitemoeshared, qwen2_moe) and an MoE layer's shared expert (model.shared_expert_intermediate_size,
#      shared_expert_gate; its linears moe.shared.gate_up / moe.shared.down); older manifests load without them.
# 1.16: the w8a8-fp8-block linear format (FP8 weights in 128 x 128 blocks, scales stored per row and 128 inputs;
#      activations per token and 128 inputs at run time); older manifests do not have it (an older llmc refuses it).
# 1.17: Mistral 3's vision model (Mistral3ForConditionalGeneration) and LLaVA with a Pixtral tower: the vision
#      section's spatial_merge_size and projector_norm_eps, a vision_config of model_type pixtral; older manifests
#      load without them (LLaVA's CLIP, Gemma 3's SigLIP).
# 1.18: LLaVA-NeXT (LlavaNextForConditionalGeneration): the vision section's image_grid_pinpoints (anyres tiling) and
#      an `image_newline` tensor in vision/weights.safetensors; older manifests load without them (no tiling).
# 1.19: Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): the vision
#      section's mrope_section (M-RoPE: the rotary dims' split over temporal, height and width positions) and
#      video_token_index (refused in prompts), a Qwen2-VL / Qwen2.5-VL vision_config whose tower holds its patch
#      merger; older manifests load without them (1-D rotary positions).
# 1.20: DeepSeek-V2 / V3: the model's MLA fields (kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
#      v_head_dim, mla_rope_interleave), DeepSeek's routing (router_scoring, router_groups, router_topk_groups,
#      routed_scaling_factor), float32 `moe.gate` and `moe.gate_bias` tensors; older manifests load with the defaults.
# 1.21: GLM-4 (family glm4) and model.rotary_interleaved (the checkpoint rotates interleaved pairs; the build permuted
#      q/k's rows into the runtime's rotate-half layout over whole heads); Cohere and Cohere 2 (families cohere,
#      cohere2), model.layer_norm (LayerNorm without bias in place of RMSNorm), parallel_block (attention and MLP on
#      one norm's output, summed into the residual) and rope_on_full_layers (false: Cohere 2's full-attention layers
#      have no rotary); older manifests load without them (false, false, false, true).
# 1.22: DeepSeek's latent KV cache (runtime/models/mla.py): kv.latent, one [num_blocks, block_size, kv_lora_rank +
#      qk_rope_head_dim] cache per layer (kv.num_kv_heads 1, kv.head_dim that sum) in place of the expanded K and V;
#      a 1.20 / 1.21 DeepSeek manifest's kv section describes the expanded cache, and the runtime allocates the latent
#      one for it too.
# 1.23: gpt-oss (family gpt_oss): model.attention_sinks (a float32 `attn.sinks` [num_heads] per layer, one more softmax
#      column per head whose value is dropped), o_bias (attn.o's bias), moe_bias (moe.gate.bias, and
#      moe.experts.gate_up.bias / moe.experts.down.bias [E, out]) and swiglu_limit / swiglu_alpha (the experts' clamped
#      SwiGLU); older manifests load without them (none of these).
# 1.24: Qwen3-VL (Qwen3VLForConditionalGeneration): the vision section's mrope_interleaved (M-RoPE's frequencies
#      interleaved over temporal, height and width) and a Qwen3-VL vision_config (its tower holds the patch merger and
#      the deepstack mergers); older manifests load without them (false: Qwen2-VL's contiguous sections).
# 1.25: SmolLM3 (family smollm3) and model.nope_layers (layers whose q and k are not rotated: their table is cos 1,
#      sin 0); older manifests load without it (every layer rotates).
# 1.26: the manifest's `mtp` section (MtpSpec) and its MTP_WEIGHTS: GLM-4.5's multi-token-prediction layer, kept for
#      speculative method mtp; older manifests load without it (no MTP layer).
# 1.27: EXAONE 4.0, Seed-OSS and ERNIE 4.5 dense (families exaone4, seed_oss, ernie4_5), read with fields older
#      formats have (an older llmc refuses the family by name).
# 1.28: DeepSeek-V3's multi-token-prediction layer in the `mtp` section and MTP_WEIGHTS (an MLA + MoE layer, its own
#      latent cache; an older llmc would run it with GQA's cache); older DeepSeek manifests load without it.
# 1.29: dots.llm1 (family dots1: GLM-4.5's fields, Qwen3's attention), read with fields older formats have (an older
#      llmc refuses the family by name).
# 1.30: ERNIE 4.5 MoE (family ernie4_5_moe: a softmax router whose choice takes moe.gate_bias) and
#      model.router_norm_min (its renormalisation's floor, moe_norm_min); older manifests load without it (None).
# 1.31: Ministral 3 (family ministral3) and the query temperature (model.query_temperature_beta, _floor, _offset,
#      _layers: q scaled by position); older manifests load without it (no temperature).
# 1.32: Llama 4 (family llama4), the weightless q/k norm (model.qk_l2_norm_layers), the router that scales the expert's
#      input (router_scoring sigmoid_input) and model.attention_chunk_size (the context held to it); older manifests
#      load without them.
# 1.33: MiniMax-M2 (family minimax_m2: DeepSeek-V3's router fields without groups, OLMo 2's q/k norms, GLM-4.5's
#      permuted partial rotary), read with fields older formats have (an older llmc refuses the family by name).
# 1.34: Llama 4's chunked local attention run (model.attention_chunk_layers: the layers that attend in chunks of
#      attention_chunk_size); a manifest without it (1.32, 1.33) still holds its context to one chunk.
# 1.35: Qwen3.5 (family qwen3_5), the first hybrid model: model.linear_attention_layers (Gated DeltaNet layers with a
#      per-request recurrent state in place of attention: their attn.in_qkvz / attn.out linears, attn.in_ba, attn.conv,
#      attn.A_log, attn.dt_bias, attn.norm tensors; no KV cache) and linear_num_key_heads ... linear_conv_kernel_dim;
#      kv.num_layers counts the layers that hold a cache; model.attn_output_gate (q_proj's rows give each
#      head's q and a sigmoid gate on its output); older manifests load without them (attention in every layer, no gate).
# 1.36: Qwen3.5-MoE (family qwen3_5_moe): Qwen3.5's hybrid fields with Qwen2-MoE's (gated shared expert) in every
#      layer; Qwen3-Next (family qwen3_next) the same fields (an older llmc refuses the families by name).
# 1.37: Granite 4.0's attention-only checkpoints (family granitemoehybrid: Granite's fields, its shared_mlp as the
#      dense MLP), read with fields older formats have (an older llmc refuses the family by name).
# 1.38: Granite 4.0's hybrids (family granitemoehybrid): model.mamba_layers (Mamba-2 layers with a per-request conv
#      and SSM state in place of attention: their attn.mamba_in / attn.mamba_out linears, attn.conv, attn.conv_bias,
#      attn.A_log, attn.dt_bias, attn.D, attn.norm tensors; no KV cache) and mamba_num_heads ... mamba_chunk_size;
#      older manifests load without them (no Mamba-2 layer).
# 1.39: Bamba (family bamba: Granite 4.0's Mamba-2 fields, Llama's attention with a partial rotary, a dense MLP),
#      read with fields older formats have (an older llmc refuses the family by name).
# 1.40: NVIDIA Nemotron-H (family nemotron_h): model.no_mlp_layers (layers that are their attention or Mamba-2 mixer
#      alone) and no_mixer_layers (an MLP alone: no attention, no KV cache), hidden_act relu2 (mlp.up in place of
#      mlp.gate_up, no gate); older manifests load without them (every layer both, a gated MLP).
# 1.41: LFM2 (family lfm2; LFM2-MoE, family lfm2_moe, with DeepSeek-V3's router fields): model.short_conv_layers (gated short-convolution layers with a per-request conv state in
#      place of attention: their attn.conv_in / attn.conv_out linears and attn.conv tensor; no KV cache) and
#      short_conv_kernel; older manifests load without them (no short-conv layer).
# 1.42: GLM-4.7-Flash (family glm4_moe_lite) and Mistral 4 (family mistral4), DeepSeek-V3's fields; the query
#      temperature (Mistral 4's llama_4_scaling_beta) with MLA too (an older llmc refuses the families by name).
# 1.43: Nemotron-H's moe (E) blocks (Nemotron 3 Nano): no_mixer_layers may be MoE layers (an MoE alone), whose experts
#      under hidden_act relu2 have no gate (moe.experts.gate_up holds up's rows alone, [E, width, hidden]) and whose
#      shared expert is moe.shared.up / moe.shared.down; DeepSeek-V3's router fields (an older llmc refuses both).
# 1.44: OLMo Hybrid (family olmo_hybrid): model.pre_norm_layers (with pre_norms false, the layers that have Llama's
#      input_norm / post_attn_norm and no sandwich norms: its Gated DeltaNet layers), linear_allow_neg_eigval (the
#      DeltaNet's beta times 2) and linear_norm_eps (its gated RMSNorm's eps); older manifests load without them (none,
#      false, rms_norm_eps).
# 1.45: TII Falcon-H1 (family falcon_h1): model.mamba_with_attention (the Mamba-2 layers also run the attention on the
#      same normed input, the two outputs summed: attn.qkv / attn.o beside the Mamba-2 tensors, a KV cache too) and
#      model.mamba_rms_norm (false: the SSD output times silu(z), no gated norm and no attn.norm tensor); older
#      manifests load without them (a Mamba-2 layer alone, normed).
# 1.46: Arcee AFM (family arcee: hidden_act relu2 in every layer) and Swiss AI Apertus (family apertus): hidden_act
#      xielu (mlp.up / mlp.down without gate as relu2, and each layer's float32 `mlp.xielu` [4]: the checkpoint's
#      alpha_p, alpha_n, beta, eps), read with fields older formats have (an older llmc refuses them by name).
# 1.47: runtime.mamba_cache_dtype / mamba_ssm_cache_dtype (vLLM's names: a hybrid model's conv and recurrent state
#      dtypes, state_dtypes); older manifests load without them (auto: conv states in the model dtype, recurrent
#      float32, as before).
FORMAT_VERSION = "1.47"
KNOWN_FORMAT_VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.11", "1.12",
                         "1.13", "1.14", "1.15", "1.16", "1.17", "1.18", "1.19", "1.20", "1.21",
                         "1.22", "1.23", "1.24", "1.25", "1.26", "1.27", "1.28", "1.29", "1.30", "1.31", "1.32", "1.33",
                         "1.34", "1.35", "1.36", "1.37", "1.38", "1.39", "1.40", "1.41", "1.42",
                         "1.43", "1.44", "1.45", "1.46", "1.47")
MANIFEST_NAME = "manifest.json"
TOKENIZER_DIR = "tokenizer"
VISION_WEIGHTS = "vision/weights.safetensors"
MTP_WEIGHTS = "mtp/weights.safetensors"  # the MTP layer's tensors (MtpSpec, compiler/mtp.py)
VISION_FEATURE_STRATEGIES = ["default", "full"]
DTYPES = ["float32", "bfloat16", "float16"]
FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3", "granite", "olmo2", "olmo3",
            "olmoe", "granitemoe", "granitemoeshared", "qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4", "cohere",
            "cohere2", "gpt_oss", "glm4_moe", "smollm3", "exaone4", "seed_oss", "ernie4_5", "dots1",
            "ernie4_5_moe", "ministral3", "llama4", "minimax_m2", "qwen3_5",
            "qwen3_5_moe", "qwen3_next", "granitemoehybrid", "bamba", "nemotron_h", "lfm2", "lfm2_moe",
            "glm4_moe_lite", "mistral4", "olmo_hybrid", "falcon_h1", "arcee", "apertus"]
HIDDEN_ACTS = ["silu", "gelu_pytorch_tanh", "relu2", "xielu"]  # the MLP's activation, by transformers' names
GATELESS_ACTS = ("relu2", "xielu")  # an MLP of these is down(act(up(x))): mlp.up, no gate (UP_MLP_LINEARS)
QUANT_METHODS = ["none", "rtn", "gptq", "awq", "fp8", "int8", "import"]
DECODER_LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # every dense decoder layer's, by runtime name
# a Gated DeltaNet layer's in place of attn.qkv / attn.o (Qwen3.5: in_proj_qkv and in_proj_z fused, out_proj)
LINEAR_ATTENTION_LINEARS = ("attn.in_qkvz", "attn.out")
MAMBA_LINEARS = ("attn.mamba_in", "attn.mamba_out")  # a Mamba-2 layer's (Granite 4.0)
UP_MLP_LINEARS = ("mlp.up", "mlp.down")  # an MLP without gate's (GATELESS_ACTS: Nemotron-H, Arcee, Apertus)
SHORT_CONV_LINEARS = ("attn.conv_in", "attn.conv_out")  # a gated short-conv layer's (LFM2: in_proj, out_proj)
# an MoE layer's: one format per projection, shared by its experts (each expert has its own scales)
MOE_LINEARS = ("attn.qkv", "attn.o", "moe.experts.gate_up", "moe.experts.down")
SHARED_EXPERT_LINEARS = ("moe.shared.gate_up", "moe.shared.down")  # an MoE layer's shared expert, where it has one
UP_SHARED_EXPERT_LINEARS = ("moe.shared.up", "moe.shared.down")  # a shared expert without gate's (relu2: Nemotron-H)
# DeepSeek's multi-head latent attention (runtime/models/mla.py) in place of attn.qkv: q (attn.q, or attn.q_a then
# attn.q_b under a q_lora_rank), the compressed kv and the shared rope key (attn.kv_a), the per-head k_nope and v
# (attn.kv_b)
MLA_LINEARS = ("attn.q", "attn.kv_a", "attn.kv_b", "attn.o")
MLA_LORA_Q_LINEARS = ("attn.q_a", "attn.q_b", "attn.kv_a", "attn.kv_b", "attn.o")
ROUTER_SCORINGS = ["softmax", "sigmoid", "sigmoid_input"]  # how an MoE router turns its logits into expert scores
# runtime.kv_cache_dtype (vLLM's names; fp8 = fp8_e4m3) → the KV cache's storage dtype; auto: the compute dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_SCALE_SOURCES = ["none", "calibration", "checkpoint"]
# runtime.mamba_cache_dtype / mamba_ssm_cache_dtype (vLLM's MambaDType): a hybrid model's state dtypes (state_dtypes)
MAMBA_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# a classifier's logits → what it reports: softmax (classes), sigmoid (one score, or multi-label), identity (regression)
CLASSIFIER_ACTIVATIONS = ("softmax", "sigmoid", "identity")


def rank_weights_path(rank: int) -> str:
    return f"rank-{rank:02d}/weights.safetensors"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, normalised from the HF config (one schema for every family)."""

    family: str = opt(choices=FAMILIES)  # "llama" (Llama 1/2/3, Mistral) | "qwen2" | "qwen3" | "phi3" | ... | "gemma2" | "gemma3"
    architecture: str = opt()  # the HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int = opt(min=1)
    hidden_size: int = opt(min=1)
    intermediate_size: int = opt(min=1)
    num_layers: int = opt(min=1)
    num_heads: int = opt(min=1)
    num_kv_heads: int = opt(min=1)
    head_dim: int = opt(min=1)
    rms_norm_eps: float = opt(min_exclusive=0.0)
    rope_theta: float = opt(min_exclusive=0.0)
    rope_scaling: dict | None = opt()  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = opt(min=1)
    tie_word_embeddings: bool = opt()
    attention_bias: bool = opt()  # q/k/v carry biases (qwen2)
    qk_norm: bool = opt()  # per-head RMSNorm on q and k (qwen3)
    bos_token_id: int | None = opt(min=0)
    eos_token_ids: list[int] = opt()
    dtype: str = opt(choices=DTYPES)  # the weights' dtype in the artifact: "float32" | "bfloat16" | "float16"
    sliding_window: int | None = opt(None, min=1)  # Mistral-style local attention window, None = full attention
    # the layers that attend within sliding_window (HF's layer_types, or Qwen2/3's max_window_layers);
    # None: every layer (Mistral, Mixtral)
    sliding_window_layers: list[int] | None = opt(None)
    # Mixture of experts (Mixtral, Qwen3-MoE); None / empty: a dense model.
    num_experts: int | None = opt(None, min=1)  # routed experts per MoE layer
    num_experts_per_tok: int | None = opt(None, min=1)  # top-k of the router
    moe_intermediate_size: int | None = opt(None, min=1)  # each expert's MLP width
    norm_topk_prob: bool = opt(True)  # renormalise the top-k router probabilities to sum to 1
    moe_layers: list[int] = opt([])  # decoder layers whose MLP is the MoE (the rest are dense MLPs)
    # the shared expert of every MoE layer (Qwen2-MoE, Granite MoE shared): a SiLU-gated MLP of this width that every
    # token runs, its output added to the routed experts'; None: none
    shared_expert_intermediate_size: int | None = opt(None, min=1)
    shared_expert_gate: bool = opt(False)  # Qwen2-MoE: the shared expert's output times sigmoid(x · moe.shared_gate)
    # DeepSeek's routing (the defaults are every other family's): scores by softmax (V2) or sigmoid (V3, which also adds
    # moe.gate_bias, e_score_correction_bias, to the scores it chooses by, not to the weights); sigmoid_input (Llama 4):
    # the top-k of the raw logits, each expert's INPUT times the sigmoid of its logit (its output unweighted; top-k 1);
    # router_groups: the experts split into that many groups of which the best router_topk_groups are chosen from (a
    # group's score: its best expert's under softmax, its two best experts' sum under sigmoid), None: no groups; the
    # chosen weights (renormalised where norm_topk_prob) times routed_scaling_factor. DeepSeek's router runs in float32
    # as transformers' (router_in_float32).
    router_scoring: str = opt("softmax", choices=ROUTER_SCORINGS)
    router_groups: int | None = opt(None, min=1)
    router_topk_groups: int | None = opt(None, min=1)
    routed_scaling_factor: float = opt(1.0, min_exclusive=0.0)
    # ERNIE 4.5 MoE's moe_norm_min: the renormalisation divides by max(sum, router_norm_min); None: by sum + 1e-20
    # (DeepSeek's)
    router_norm_min: float | None = opt(None, min_exclusive=0.0)
    # DeepSeek's multi-head latent attention (runtime/models/mla.py; None: the plain q/k/v attention): the compressed
    # kv's width (kv_lora_rank), q's low rank (None: q_proj), each head's q/k dims without and with the rotary
    # (head_dim is their sum) and its v dims (at most head_dim: the attention's output buffers are head_dim wide);
    # the KV cache holds the latent (kv_lora_rank + qk_rope_head_dim per token: KVSpec.latent); mla_rope_interleave:
    # the rotary dims are rotated in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek-V2, V3's rope_interleave)
    kv_lora_rank: int | None = opt(None, min=1)
    q_lora_rank: int | None = opt(None, min=1)
    qk_nope_head_dim: int | None = opt(None, min=1)
    qk_rope_head_dim: int | None = opt(None, min=2)
    v_head_dim: int | None = opt(None, min=1)
    mla_rope_interleave: bool = opt(False)
    # Gemma 2 and 3 (the defaults are every other family's):
    # act(gate) · up; gelu_pytorch_tanh: GELU, tanh form; relu2 (Nemotron-H, Arcee): relu(up)², no gate (mlp.up, not
    # gate_up); xielu (Apertus): xIELU(up) with each layer's learned mlp.xielu scalars, no gate
    hidden_act: str = opt("silu", choices=HIDDEN_ACTS)
    query_pre_attn_scalar: float | None = opt(None, min_exclusive=0.0)  # attention scale its^-0.5 (None: head_dim's)
    embed_scale: float | None = opt(None, min_exclusive=0.0)  # embeddings times this (sqrt(hidden) in the model dtype)
    sandwich_norms: bool = opt(False)  # attn_out_norm / mlp_out_norm on the sub-layers' outputs before the residual add
    # the sliding-window layers' own rotary table (theta, scaling); None: every layer uses rope_theta / rope_scaling
    rope_local_theta: float | None = opt(None, min_exclusive=0.0)
    rope_local_scaling: dict | None = opt(None)
    # logit soft-capping (Gemma 2; None: none): each attention score s (after the scale, before the mask) becomes
    # cap * tanh(s / cap), and so does each output logit (in float32)
    attn_logit_softcapping: float | None = opt(None, min_exclusive=0.0)
    final_logit_softcapping: float | None = opt(None, min_exclusive=0.0)
    # the attention's scale itself, q.k times it before the softmax (Granite's attention_multiplier); None: from
    # query_pre_attn_scalar or head_dim (attention_scale). At most one of the two is set.
    softmax_scale: float | None = opt(None, min_exclusive=0.0)
    # the leading dims of each q/k head that the rotary embedding rotates (rotate-half over them), the rest passed
    # through: int(head_dim * partial_rotary_factor) (Phi-4-mini); None: the whole head. Even, at most head_dim.
    rotary_dim: int | None = opt(None, min=2)
    # GLM-4, Cohere: the checkpoint rotates interleaved pairs (2i, 2i + 1) of the leading rotary_dims; the build
    # permuted each q/k head's rows (weights and biases: hf_checkpoint.rotary_fold) so that pair i sits at
    # (i, i + head_dim / 2), the pass-through dims in the other pairs, and the rotary table is head_dim wide with cos 1,
    # sin 0 past rotary_dims / 2: every kernel rotates whole heads (q.k is the same under one permutation of q's and
    # k's dims)
    rotary_interleaved: bool = opt(False)
    # Cohere: every norm (the layers' and the final one) is a LayerNorm without bias, (x - mean) / sqrt(var + eps) * w,
    # eps rms_norm_eps (the checkpoint's layer_norm_eps), in place of RMSNorm
    layer_norm: bool = opt(False)
    # Cohere: the attention and the MLP both read input_norm's output, and both outputs join the residual stream
    # (x + attn(norm(x)) + mlp(norm(x))); no post_attn_norm
    parallel_block: bool = opt(False)
    # Cohere 2: False: the full-attention layers rotate q and k by nothing (their table is cos 1, sin 0), only the
    # sliding-window layers by the rope (the local table: rope_local_theta, rope_local_scaling)
    rope_on_full_layers: bool = opt(True)
    # SmolLM3: the NoPE layers (its no_rope_layers' zeros), whose q and k are not rotated: they read a table of cos 1,
    # sin 0 (every path that takes a table rotates by it exactly: x * 1 - y * 0 is x); empty: every layer rotates
    nope_layers: list[int] = opt([])
    # OLMo 2: False: no input_norm before the attention nor post_attn_norm before the MLP; each sub-layer reads the
    # residual stream itself and only its output is normed (sandwich_norms' attn_out_norm / mlp_out_norm)
    pre_norms: bool = opt(True)
    # OLMo 2: q_norm / k_norm are RMSNorms over the whole q / k projection (num_heads * head_dim and
    # num_kv_heads * head_dim wide, one variance over every head), not per head (Qwen3, Gemma 3)
    qk_norm_full_width: bool = opt(False)
    # A sequence classifier (HF *ForSequenceClassification): its head is `score` [num_labels, hidden_size], applied to
    # the pooled hidden state, in place of an LM head; it runs as vLLM's pooling runner (convert classify) only.
    # None: a causal LM. labels: HF's id2label in index order; classifier_activation: what turns the head's
    # logits into the reported probabilities or score (runtime/pooling.classifier_activation_of).
    num_labels: int | None = opt(None, min=1)
    labels: list[str] | None = opt(None)
    classifier_activation: str | None = opt(None, choices=list(CLASSIFIER_ACTIVATIONS))
    # gpt-oss (runtime/models/gpt_oss.py; the defaults are every other family's): attention_sinks: each layer's
    # `attn.sinks` [num_heads] (float32) is one more logit in every query row's softmax, its probability dropped (the
    # row's weights sum to less than 1); o_bias: attn.o has a bias; moe_bias: the router (moe.gate.bias) and every
    # expert's gate_up and down have biases; swiglu_limit: the experts compute (clamp(up, -limit, limit) + 1) *
    # g * sigmoid(swiglu_alpha * g), g = clamp(gate, max=limit), in place of SiLU(gate) * up (None: SiLU)
    attention_sinks: bool = opt(False)
    o_bias: bool = opt(False)
    moe_bias: bool = opt(False)
    swiglu_limit: float | None = opt(None, min_exclusive=0.0)
    swiglu_alpha: float | None = opt(None, min_exclusive=0.0)
    # A per-position query temperature (Ministral 3's and Mistral 4's llama_4_scaling_beta, the latter's in MLA; Llama
    # 4's attn_temperature_tuning): in the layers query_temperature_layers lists (None: every layer), q times 1 + beta *
    # log(1 + floor((position + offset) / floor)) (runtime/layers/rotary.query_temperature, from the step's positions
    # on the device); exactly 1 below position floor - offset. None: no temperature
    query_temperature_beta: float | None = opt(None)
    query_temperature_floor: float | None = opt(None, min_exclusive=0.0)
    query_temperature_offset: float = opt(0.0)
    query_temperature_layers: list[int] | None = opt(None)
    # Llama 4 (use_qk_norm): these layers norm each q and k head by x * rsqrt(mean(x^2) + rms_norm_eps), no weight
    # (transformers' Llama4TextL2Norm; after the rotary there, which keeps a head's norm: the same before it)
    qk_l2_norm_layers: list[int] = opt([])
    # Llama 4's chunked local attention: on attention_chunk_layers (its rope layers, transformers' layer_types
    # chunked_attention) a query at p sees keys from floor(p / C) * C on, C = attention_chunk_size. None layers with a
    # size: a manifest before 1.34, which did not run it: its context is held to C (runtime/models.model_context_of)
    attention_chunk_size: int | None = opt(None, min=1)
    attention_chunk_layers: list[int] | None = opt(None)
    # Qwen3.5 (runtime/models/gated_deltanet.py): these layers run a Gated DeltaNet (a causal depthwise conv over q/k/v
    # of linear_conv_kernel_dim, the gated delta rule over a recurrent state [linear_num_value_heads,
    # linear_key_head_dim, linear_value_head_dim] per request, a gated RMSNorm) in place of attention, and hold no KV
    # cache; empty: attention in every layer
    linear_attention_layers: list[int] = opt([])
    linear_num_key_heads: int | None = opt(None, min=1)
    linear_num_value_heads: int | None = opt(None, min=1)
    linear_key_head_dim: int | None = opt(None, min=1)
    linear_value_head_dim: int | None = opt(None, min=1)
    linear_conv_kernel_dim: int | None = opt(None, min=1)
    # OLMo Hybrid's DeltaNet: beta = 2 sigmoid(b) (its allow_neg_eigval: the state's eigenvalues in [-1, 1]), and its
    # gated RMSNorm's own eps (None: rms_norm_eps, Qwen3.5's)
    linear_allow_neg_eigval: bool = opt(False)
    linear_norm_eps: float | None = opt(None, min_exclusive=0.0)
    # OLMo Hybrid (pre_norms false): these layers (its Gated DeltaNet ones) are Llama's nonetheless: input_norm before
    # the mixer, post_attn_norm before the MLP, no sandwich norms; empty: every layer as pre_norms says
    pre_norm_layers: list[int] = opt([])
    # Granite 4.0's hybrids (runtime/models/mamba2.py): these layers run a Mamba-2 mixer (in_proj to z, x, B, C, dt; a
    # causal depthwise conv of mamba_conv_kernel over x, B, C; the SSD recurrence over a state [mamba_num_heads,
    # mamba_head_dim, mamba_d_state] per request, B and C shared by mamba_n_groups groups of heads; a gated RMSNorm per
    # group; out_proj) in place of attention, and hold no KV cache; empty: no Mamba-2 layer
    mamba_layers: list[int] = opt([])
    mamba_num_heads: int | None = opt(None, min=1)
    mamba_head_dim: int | None = opt(None, min=1)
    mamba_n_groups: int | None = opt(None, min=1)
    mamba_d_state: int | None = opt(None, min=1)
    mamba_conv_kernel: int | None = opt(None, min=2)
    mamba_chunk_size: int | None = opt(None, min=1)
    mamba_conv_bias: bool = opt(True)
    # Falcon-H1: each Mamba-2 layer also runs the q/k/v attention on the same normed input (its own KV cache), the two
    # outputs summed before the residual add; false: the Mamba-2 mixer in the attention's place
    mamba_with_attention: bool = opt(False)
    # false (Falcon-H1's mamba_rms_norm false): the SSD output times silu(z), no gated RMSNorm (no attn.norm tensor)
    mamba_rms_norm: bool = opt(True)
    # Nemotron-H's single-mixer blocks: no_mlp_layers are their attention or Mamba-2 mixer alone (input_norm → mixer,
    # no post_attn_norm, no MLP), no_mixer_layers an MLP alone (input_norm → MLP; no attention, no KV cache); empty:
    # every layer both
    no_mlp_layers: list[int] = opt([])
    no_mixer_layers: list[int] = opt([])
    # LFM2 (runtime/models/short_conv.py): these layers run a gated short convolution (in_proj to B, C, x; C times the
    # causal depthwise conv of short_conv_kernel over B x; out_proj) in place of attention, their conv state [hidden,
    # short_conv_kernel - 1] per request, and hold no KV cache; empty: no short-conv layer
    short_conv_layers: list[int] = opt([])
    short_conv_kernel: int | None = opt(None, min=2)
    # Qwen3-Next / Qwen3.5: q_proj gives each head's q then as many gate rows; the attention's output times
    # sigmoid(gate) before o (attn.qkv is 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim rows)
    attn_output_gate: bool = opt(False)

    def __post_init__(self):
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ArtifactError(f"model: swiglu_limit {self.swiglu_limit} and swiglu_alpha {self.swiglu_alpha}: the "
                                "clamped SwiGLU needs both (or neither: SiLU)")
        if not self.pre_norms and not self.sandwich_norms:
            raise ArtifactError("model: pre_norms false needs sandwich_norms (the sub-layers' outputs normed instead)")
        if self.parallel_block and (not self.pre_norms or self.sandwich_norms):
            raise ArtifactError("model: parallel_block needs pre_norms and no sandwich_norms (one norm before both "
                                "sub-layers)")
        if self.pre_norm_layers and (self.pre_norms or any(not 0 <= i < self.num_layers for i in self.pre_norm_layers)):
            raise ArtifactError(f"model: pre_norm_layers {self.pre_norm_layers} need pre_norms false and layers of the "
                                f"{self.num_layers}")
        if self.qk_norm_full_width and not self.qk_norm:
            raise ArtifactError("model: qk_norm_full_width needs qk_norm")
        if self.softmax_scale is not None and self.query_pre_attn_scalar is not None:
            raise ArtifactError(f"model: softmax_scale {self.softmax_scale} and query_pre_attn_scalar "
                                f"{self.query_pre_attn_scalar} both set the attention's scale; keep one")
        if (self.num_labels is None) != (self.classifier_activation is None) or (
                self.labels is not None and len(self.labels) != self.num_labels):
            raise ArtifactError(f"model: a classifier needs num_labels, classifier_activation and (if given) one label "
                                f"per class; got {self.num_labels}, {self.classifier_activation}, {self.labels}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise ArtifactError(f"model: rotary_dim {self.rotary_dim} must be even and at most head_dim "
                                f"{self.head_dim}")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers) or len(set(self.nope_layers)) != len(
                self.nope_layers):
            raise ArtifactError(f"model: nope_layers {self.nope_layers} must be distinct layers of the "
                                f"{self.num_layers}")
        if self.query_temperature_beta is not None and (self.query_temperature_floor is None or any(
                not 0 <= i < self.num_layers for i in self.query_temperature_layers or [])):
            raise ArtifactError(f"model: query_temperature_beta needs query_temperature_floor and layers of the "
                                f"{self.num_layers} (query_temperature_layers {self.query_temperature_layers})")
        if any(not 0 <= i < self.num_layers for i in self.qk_l2_norm_layers) or (self.qk_l2_norm_layers and (
                self.qk_norm or self.is_mla)):
            raise ArtifactError(f"model: qk_l2_norm_layers {self.qk_l2_norm_layers} must be layers of the "
                                f"{self.num_layers} of a q/k/v attention without qk_norm")
        chunked = self.attention_chunk_layers or []
        if (chunked and self.attention_chunk_size is None) or any(not 0 <= i < self.num_layers for i in chunked) or any(
                self.window_of(i) is not None for i in chunked) or (chunked and self.is_mla):
            raise ArtifactError(f"model: attention_chunk_layers {self.attention_chunk_layers} must be layers of the "
                                f"{self.num_layers} of a q/k/v attention without a sliding window, with an "
                                "attention_chunk_size")
        if self.router_scoring == "sigmoid_input" and self.num_experts_per_tok != 1:
            raise ArtifactError(f"model: router_scoring sigmoid_input scales the one chosen expert's input; "
                                f"num_experts_per_tok {self.num_experts_per_tok} must be 1")
        if self.is_mla and (self.qk_nope_head_dim is None or self.qk_rope_head_dim is None or self.v_head_dim is None
                            or self.qk_nope_head_dim + self.qk_rope_head_dim != self.head_dim
                            or self.v_head_dim > self.head_dim or self.num_kv_heads != self.num_heads):
            raise ArtifactError(f"model: MLA needs qk_nope_head_dim + qk_rope_head_dim = head_dim {self.head_dim}, "
                                "v_head_dim at most head_dim and num_kv_heads = num_heads; got "
                                f"{self.qk_nope_head_dim}, {self.qk_rope_head_dim}, {self.v_head_dim}, "
                                f"{self.num_kv_heads}")

        if self.linear_attention_layers and (self.is_mla or self.linear_num_value_heads is None or any(
                getattr(self, key) is None for key in ("linear_num_key_heads", "linear_key_head_dim",
                                                      "linear_value_head_dim", "linear_conv_kernel_dim"))
                or self.linear_num_value_heads % self.linear_num_key_heads
                or any(not 0 <= i < self.num_layers for i in self.linear_attention_layers)):
            raise ArtifactError(f"model: linear_attention_layers {self.linear_attention_layers} need layers of the "
                                f"{self.num_layers}, the linear_* head counts and dims (value heads a multiple of key "
                                "heads) and the q/k/v attention (not MLA)")

        if self.mamba_layers and (self.is_mla or any(getattr(self, key) is None for key in (
                "mamba_num_heads", "mamba_head_dim", "mamba_n_groups", "mamba_d_state", "mamba_conv_kernel",
                "mamba_chunk_size")) or self.mamba_num_heads % self.mamba_n_groups
                or any(not 0 <= i < self.num_layers for i in self.mamba_layers)
                or set(self.mamba_layers) & set(self.linear_attention_layers)):
            raise ArtifactError(f"model: mamba_layers {self.mamba_layers} need layers of the {self.num_layers} (none a "
                                "linear-attention layer), the mamba_* sizes (heads a multiple of groups) and the q/k/v "
                                "attention (not MLA)")
        if self.mamba_with_attention and not self.mamba_layers:
            raise ArtifactError("model: mamba_with_attention needs mamba_layers (the layers that run both)")
        alone = self.no_mlp_layers + self.no_mixer_layers
        stateful = set(self.linear_attention_layers) | set(self.mamba_layers)
        if any(not 0 <= i < self.num_layers for i in alone) or len(set(alone)) != len(alone) or (
                set(self.no_mixer_layers) & stateful) or set(self.no_mlp_layers) & set(self.moe_layers):
            raise ArtifactError(f"model: no_mlp_layers {self.no_mlp_layers} and no_mixer_layers "
                                f"{self.no_mixer_layers} must be distinct layers of the {self.num_layers} (a layer "
                                "without a mixer has no linear-attention or Mamba-2 mixer; one without an MLP is no "
                                "MoE layer)")

        if self.short_conv_layers and (self.is_mla or self.short_conv_kernel is None
                                       or any(not 0 <= i < self.num_layers for i in self.short_conv_layers)
                                       or set(self.short_conv_layers) & set(self.linear_attention_layers
                                                                            + self.mamba_layers)):
            raise ArtifactError(f"model: short_conv_layers {self.short_conv_layers} need layers of the "
                                f"{self.num_layers} (none a linear-attention or Mamba-2 layer), short_conv_kernel and "
                                "the q/k/v attention (not MLA)")

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a per-request state in place of attention: a Gated DeltaNet (runtime/models/
        gated_deltanet.py), a Mamba-2 mixer (runtime/models/mamba2.py) or a short conv (LFM2: runtime/models/
        short_conv.py)."""
        return bool(self.linear_attention_layers or self.mamba_layers or self.short_conv_layers)

    def has_pre_norms(self, index: int) -> bool:
        """Layer `index` has input_norm and post_attn_norm: pre_norms, or one of pre_norm_layers (OLMo Hybrid)."""
        return self.pre_norms or index in self.pre_norm_layers

    def has_sandwich_norms(self, index: int) -> bool:
        """Layer `index` norms its sub-layers' outputs (attn_out_norm, mlp_out_norm): sandwich_norms, but not in
        pre_norm_layers."""
        return self.sandwich_norms and index not in self.pre_norm_layers

    def is_linear_attention_layer(self, index: int) -> bool:
        return index in self.linear_attention_layers

    def is_mamba_layer(self, index: int) -> bool:
        return index in self.mamba_layers

    def is_short_conv_layer(self, index: int) -> bool:
        return index in self.short_conv_layers

    def is_state_layer(self, index: int) -> bool:
        """Layer `index` keeps a per-request state in place of attention (and no KV cache; Falcon-H1's beside it:
        holds_kv)."""
        return index in self.linear_attention_layers or index in self.mamba_layers or index in self.short_conv_layers

    @property
    def gated_mlp(self) -> bool:
        """The dense MLP is act(gate) · up (mlp.gate_up); False: down(act(up(x))) (mlp.up: GATELESS_ACTS)."""
        return self.hidden_act not in GATELESS_ACTS

    def has_mixer(self, index: int) -> bool:
        """Layer `index` has its attention (or linear-attention, Mamba-2) sub-layer: all but no_mixer_layers."""
        return index not in self.no_mixer_layers

    def has_mlp(self, index: int) -> bool:
        """Layer `index` has its MLP (or MoE) sub-layer: all but no_mlp_layers."""
        return index not in self.no_mlp_layers

    def holds_kv(self, index: int) -> bool:
        """Layer `index` holds a KV cache: an attention layer (not a state layer, not an MLP alone); a Mamba-2 layer
        that also runs the attention (mamba_with_attention: Falcon-H1) too."""
        attends = not self.is_state_layer(index) or (self.mamba_with_attention and self.is_mamba_layer(index))
        return attends and self.has_mixer(index)

    @property
    def mamba_conv_dim(self) -> int:
        """A Mamba-2 layer's conv channels: x, B and C."""
        return self.mamba_num_heads * self.mamba_head_dim + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def kv_layers(self) -> list[int]:
        """The layers that hold a KV cache: all but the linear-attention, Mamba-2 and short-conv ones and the MLPs
        alone."""
        return [i for i in range(self.num_layers) if self.holds_kv(i)]

    @property
    def is_classifier(self) -> bool:
        return self.num_labels is not None

    @property
    def is_mla(self) -> bool:
        """DeepSeek's multi-head latent attention (runtime/models/mla.py) in place of the q/k/v attention."""
        return self.kv_lora_rank is not None

    @property
    def router_in_float32(self) -> bool:
        """DeepSeek's (and GLM-4.7-Flash's, Mistral 4's), GLM-4.5's, dots.llm1's, ERNIE 4.5 MoE's, MiniMax-M2's and
        LFM2-MoE's router weight (and their score bias where they have one) is held and run in float32, as transformers
        keeps it (MiniMax-M2's: as vLLM does; LFM2-MoE's: as MiniMax-M2's), and routes by `deepseek_route`; Nemotron-H's
        (its moe blocks: transformers' NemotronHTopkRouter) too."""
        return self.family in ("deepseek_v2", "deepseek_v3", "glm4_moe", "dots1", "ernie4_5_moe", "minimax_m2",
                               "lfm2_moe", "glm4_moe_lite", "mistral4", "nemotron_h")

    @property
    def router_score_bias(self) -> bool:
        """The router chooses by its scores plus moe.gate_bias (e_score_correction_bias), weighting by the scores
        alone: DeepSeek-V3's and GLM-4.5's sigmoid scores, ERNIE 4.5 MoE's softmax ones (its moe_statics)."""
        return self.router_scoring == "sigmoid" or self.family == "ernie4_5_moe"

    @property
    def rotary_dims(self) -> int:
        """The dims of each q/k head the rotary embedding rotates: rotary_dim, else the whole head; MLA: the rope
        part's (qk_rope_head_dim), which the MLA module rotates itself before the cache write."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def rotary_rows_permuted(self) -> bool:
        """Whether the build permuted each q/k head's rows so that rotated pair i sits at (i, i + head_dim / 2), the
        rotate-half layout over the whole head: GLM-4's and Cohere's interleaved pairs (rotary_interleaved), GLM-4.5's
        rotate-half over the leading rotary_dim (families glm4_moe, minimax_m2, qwen3_5, bamba: hf_checkpoint.rotary_fold)."""
        return self.rotary_interleaved or (self.family in ("glm4_moe", "minimax_m2", "qwen3_5", "qwen3_5_moe",
                                                                 "qwen3_next", "bamba")
                                           and self.rotary_dim is not None)

    @property
    def rotary_table_dims(self) -> int:
        """The rotary table's width: rotary_dims, or the whole head where the build moved the rotated pairs over it
        (rotary_rows_permuted: the pass-through pairs' cos 1, sin 0)."""
        return self.head_dim if self.rotary_rows_permuted else self.rotary_dims

    @property
    def is_partial_rotary(self) -> bool:
        """A partial_rotary_factor's leading dims, rotated by the kernels (not MLA's rope part, which its module
        rotates; not GLM-4's or GLM-4.5's, whose table is the whole head's: rotary_table_dims)."""
        return not self.is_mla and self.rotary_table_dims < self.head_dim

    @property
    def attention_scale(self) -> float:
        """What the attention multiplies q.k by: softmax_scale, else query_pre_attn_scalar^-0.5 (Gemma), else
        head_dim^-0.5."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def uses_local_rope(self, index: int) -> bool:
        """Whether layer `index` reads the local rotary table: a sliding-window layer of a model that has one
        (Gemma 3); every other layer reads rope_theta / rope_scaling's."""
        return self.rope_local_theta is not None and self.window_of(index) is not None

    def rotates(self, index: int) -> bool:
        """Whether layer `index` rotates q and k by a rope (SmolLM3's NoPE layers do not: nope_layers)."""
        return index not in self.nope_layers

    def query_temperature_of(self, index: int) -> tuple[float, float, float] | None:
        """Layer `index`'s query temperature (beta, floor, offset): None where its q is not scaled."""
        if self.query_temperature_beta is None or (self.query_temperature_layers is not None
                                                   and index not in self.query_temperature_layers):
            return None
        return self.query_temperature_beta, self.query_temperature_floor, self.query_temperature_offset

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    def window_of(self, index: int) -> int | None:
        """Layer `index`'s attention window (None: the whole context)."""
        if self.sliding_window_layers is not None and index not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def chunk_of(self, index: int) -> int | None:
        """Layer `index`'s attention chunk size (Llama 4's chunked local attention; None: not in chunks)."""
        return self.attention_chunk_size if index in (self.attention_chunk_layers or []) else None

    def layer_linears(self, index: int) -> tuple[str, ...]:
        """The runtime names of layer `index`'s quantizable linears (experts' by projection)."""
        attention = DECODER_LINEARS[:2]
        if self.is_linear_attention_layer(index):
            attention = LINEAR_ATTENTION_LINEARS
        elif self.is_mamba_layer(index):
            attention = DECODER_LINEARS[:2] * self.mamba_with_attention + MAMBA_LINEARS
        elif self.is_short_conv_layer(index):
            attention = SHORT_CONV_LINEARS
        elif self.is_mla:
            attention = MLA_LORA_Q_LINEARS if self.q_lora_rank else MLA_LINEARS
        if not self.has_mixer(index):
            attention = ()
        if not self.has_mlp(index):
            return attention
        if not self.is_moe_layer(index):
            return attention + (DECODER_LINEARS[2:] if self.gated_mlp else UP_MLP_LINEARS)
        shared = SHARED_EXPERT_LINEARS if self.gated_mlp else UP_SHARED_EXPERT_LINEARS
        return attention + MOE_LINEARS[2:] + (shared if self.shared_expert_intermediate_size else ())

    @property
    def mla_parameters(self) -> int:
        """An MLA layer's attention parameters: its linears and its q_a / kv_a norms."""
        h, heads, q = self.hidden_size, self.num_heads, self.num_heads * self.head_dim
        q_params = h * q if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank * (q + 1)
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * (
            heads * (self.qk_nope_head_dim + self.v_head_dim) + 1)
        return q_params + kv + heads * self.v_head_dim * h

    @property
    def num_parameters(self) -> int:
        """Logical parameter count (as the HF model counts it), whatever the storage format."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + q * self.hidden_size + (q + 2 * kv if self.attention_bias else 0)
        attn += self.hidden_size * self.o_bias + self.num_heads * self.attention_sinks
        if self.is_mla:
            attn = self.mla_parameters
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        mlp += 2 * (self.hidden_act == "xielu")  # (xIELU's alpha_p and alpha_n; its beta and eps are buffers)
        qk_norms = (q + kv if self.qk_norm_full_width else 2 * self.head_dim) if self.qk_norm else 0
        pre_norms = (1 if self.parallel_block else 2) * self.pre_norms  # (Cohere: one norm before both sub-layers)
        # (pre_norm_layers: two pre-norms in place of two sandwich norms, as many)
        norms = (pre_norms + 2 * self.sandwich_norms) * self.hidden_size + qk_norms
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        if self.is_classifier:  # (HF's classifier has no LM head, tied or not: its head is `score`)
            lm_head = self.num_labels * self.hidden_size
        num_moe = len(self.moe_layers)
        projections = 2 if self.hidden_act == "relu2" else 3  # (relu2: experts without gate, Nemotron-H's)
        moe = (self.num_experts * (projections * self.hidden_size * self.moe_intermediate_size + self.hidden_size)
               ) if num_moe else 0
        if num_moe and self.moe_bias:  # the router's bias, each expert's gate_up and down biases
            moe += self.num_experts * (1 + 2 * self.moe_intermediate_size + self.hidden_size)
        if num_moe and self.shared_expert_intermediate_size:
            moe += (projections * self.hidden_size * self.shared_expert_intermediate_size
                    + self.hidden_size * self.shared_expert_gate)
        attn += self.hidden_size * q * self.attn_output_gate  # (Qwen3.5's gate rows in q_proj)
        layers = self.num_layers * (attn + norms) + (self.num_layers - num_moe) * mlp + num_moe * moe
        if self.linear_attention_layers:  # its linear-attention layers: a Gated DeltaNet in place of attn and q/k norms
            layers += len(self.linear_attention_layers) * (self.linear_attention_parameters - attn - qk_norms)
        if self.mamba_layers:  # Granite 4.0's Mamba-2 layers: a Mamba-2 mixer in place of attn (Falcon-H1's: beside it)
            layers += len(self.mamba_layers) * (self.mamba_parameters - (0 if self.mamba_with_attention else
                                                                         attn + qk_norms))
        # Nemotron-H's single-mixer layers: one norm each, the other sub-layer absent
        layers -= len(self.no_mlp_layers) * (mlp + self.hidden_size) + len(self.no_mixer_layers) * (
            attn + qk_norms + self.hidden_size)
        if self.short_conv_layers:  # LFM2's conv layers: in_proj [3 hidden, hidden], the conv, out_proj
            conv = self.hidden_size * (4 * self.hidden_size + self.short_conv_kernel)
            layers += len(self.short_conv_layers) * (conv - attn - qk_norms)
        return embed + layers + self.hidden_size + lm_head

    @property
    def linear_attention_parameters(self) -> int:
        """One Gated DeltaNet's parameters (Qwen3.5): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, the conv, A_log,
        dt_bias, the gated norm, out_proj."""
        key = self.linear_num_key_heads * self.linear_key_head_dim
        value = self.linear_num_value_heads * self.linear_value_head_dim
        conv = 2 * key + value
        return (self.hidden_size * (conv + value + 2 * self.linear_num_value_heads) + conv * self.linear_conv_kernel_dim
                + 2 * self.linear_num_value_heads + self.linear_value_head_dim + value * self.hidden_size)

    @property
    def mamba_parameters(self) -> int:
        """One Mamba-2 mixer's parameters (Granite 4.0): in_proj, the conv (and its bias), dt_bias, A_log, D, the
        gated norm (where mamba_rms_norm), out_proj."""
        width, heads = self.mamba_num_heads * self.mamba_head_dim, self.mamba_num_heads
        conv = self.mamba_conv_dim
        return (self.hidden_size * (width + conv + heads) + conv * (self.mamba_conv_kernel + self.mamba_conv_bias)
                + 3 * heads + width * self.mamba_rms_norm + width * self.hidden_size)


@dataclass(frozen=True)
class QuantInfo:
    """What quantization did: the method, and the format spec of every linear module."""

    method: str = opt(choices=QUANT_METHODS)  # "none" | "rtn" | "gptq" | "awq" | "fp8" | "int8" | "import"
    modules: dict[str, dict] = opt()  # runtime module name ("layers.0.attn.qkv") → format spec ({"format": "dense"})
    settings: dict = field(default_factory=dict)  # the recipe's quantization section, for the record
    report: dict = field(default_factory=dict)  # quality numbers measured at build time (perplexity, ...)


@dataclass(frozen=True)
class ParallelPlan:
    """How the model is split: tensor parallel size, pipeline parallel size, layers per stage.

    Rank r = pipeline_rank * tensor + tensor_rank holds `rank-{r:02d}/weights.safetensors`: the
    layers of its stage, and of each of them its tensor rank's share (runtime/parallel/layout.py).
    The per-rank sizes are recorded for `llmc inspect`; the runtime derives them from the model
    and (tensor, stage_layers) with the same function the compiler used. None: an artifact
    built before parallel builds existed (tensor 1).
    """

    tensor: int = opt(1, min=1)
    pipeline: int = opt(1, min=1)
    stage_layers: list[list[int]] = field(default_factory=list)  # stage → decoder layer indices
    num_heads_per_rank: int | None = opt(None, min=1)  # query heads per tensor rank
    num_kv_heads_per_rank: int | None = opt(None, min=1)  # KV heads per tensor rank (replicated when tensor > num_kv_heads)
    intermediate_size_per_rank: int | None = opt(None, min=1)  # MLP columns per tensor rank
    vocab_size_per_rank: int | None = opt(None, min=1)  # embedding / lm_head rows per tensor rank (vocab padded to a multiple of tensor)
    # Expert parallelism (MoE; vLLM's enable_expert_parallel): 1 = each expert split across the tensor
    # ranks like a dense MLP; = tensor: whole experts spread over the tensor ranks.
    expert: int = opt(1, min=1)
    rank_experts: list[list[int]] = field(default_factory=list)  # rank → the experts whose weights it holds (MoE only)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline


@dataclass(frozen=True)
class KVSpec:
    """Shape of one rank's KV cache: per layer, a [num_blocks, block_size, num_kv_heads, head_dim] K and V; latent
    (DeepSeek's MLA): one [num_blocks, block_size, head_dim] cache per layer, num_kv_heads 1 and head_dim
    kv_lora_rank + qk_rope_head_dim, on every rank (runtime/models/mla.py).

    dtype: the storage dtype on a GPU (runtime.kv_cache_dtype resolved: the model's dtype for auto).
    k_scales, v_scales: per decoder layer, the FP8 dequantization scale of its K and V (K = k_scale *
      stored), one per tensor as vLLM and llm-compressor's kv_cache_scheme keep them: amax / FP8 max from
      the build's calibration pass, or the imported checkpoint's. Empty: none known (FP8 then uses 1.0).
    scales_source: "calibration" | "checkpoint" | "none".
    """

    block_size: int = opt(min=1)
    dtype: str = opt(choices=["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
    num_layers: int = opt(min=1)  # the layers that hold a cache (a hybrid's attention layers: ModelConfig.kv_layers)
    num_kv_heads: int = opt(min=1)
    head_dim: int = opt(min=1)
    k_scales: list[float] = opt([])
    v_scales: list[float] = opt([])
    scales_source: str = opt("none", choices=KV_SCALE_SOURCES)
    latent: bool = opt(False)

    @property
    def bytes_per_token(self) -> int:
        return (1 if self.latent else 2) * self.num_layers * self.num_kv_heads * self.head_dim * dtype_num_bytes(
            self.dtype)


@dataclass(frozen=True)
class MultiModalLimits:
    """vLLM's limit_mm_per_prompt: the most items of each modality one prompt may carry (None: no limit). Videos:
    Qwen2-VL's and Qwen2.5-VL's only (other models refuse a video limit above 0, engine.py); no audio model."""

    image: int | None = opt(None, min=0, help="most images in one prompt (0: text only)")
    video: int | None = opt(None, min=0, help="most videos in one prompt (Qwen2-VL, Qwen2.5-VL; others: 0 only)")
    audio: int = opt(0, min=0, max=0, help="no audio model is supported: 0 only")


@dataclass(frozen=True)
class VideoIOKwargs:
    """vLLM's media_io_kwargs video: how a chat's video_url part is sampled (runtime/video_io.py)."""

    num_frames: int = opt(32, min=-1, help="frames kept of each video, spread uniformly (-1: every frame)")


@dataclass(frozen=True)
class MediaIOKwargs:
    """vLLM's media_io_kwargs, the part llmc has: the video loader's num_frames (other modalities' keys are
    refused by name)."""

    video: VideoIOKwargs | None = opt(None, help="the video loader's settings, e.g. {num_frames: 16}")


CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE", "NONE")


def upper_cudagraph_mode(section: dict) -> dict:
    """A runtime section (recipe, flags, LLM keywords) with compilation_config.cudagraph_mode upper-cased,
    as vLLM takes it in any case."""
    config = section.get("compilation_config")
    if not isinstance(config, dict) or not isinstance(config.get("cudagraph_mode"), str):
        return section
    return {**section, "compilation_config": {**config, "cudagraph_mode": config["cudagraph_mode"].upper()}}


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's `compilation_config`, the part llmc has: which steps replay CUDA graphs.

    cudagraph_mode (vLLM's names): FULL_AND_PIECEWISE (the default) replays a whole-forward graph for
    decode steps (runtime/cuda_graphs.py) and, for every other step of up to
    max_cudagraph_capture_size tokens (prefill and mixed steps), graphs of the forward between its
    attentions (runtime/piecewise_graphs.py); FULL_DECODE_ONLY the decode graphs only; FULL the
    decode graphs and whole-forward graphs of the other steps, attention included
    (runtime/mixed_graphs.py: steps of up to max_cudagraph_capture_size tokens whose contexts are at
    most mixed_graphs.MAX_CONTEXT; the others run eagerly); PIECEWISE the cut graphs for every step;
    NONE no graph (as enforce_eager). max_cudagraph_capture_size: the most tokens of a step the cut or
    whole graphs of non-decode steps are captured for (vLLM's default, 512; never above
    max_num_batched_tokens). cudagraph_specialize_lora (vLLM's, default true): under run-time LoRA
    the decode graphs are captured with the LoRA kernels and without them, and a decode step in which
    no request has an adapter replays the one without (prefill and mixed steps keep them).
    """

    cudagraph_mode: str = opt("FULL_AND_PIECEWISE", choices=list(CUDAGRAPH_MODES),
                              help="FULL_AND_PIECEWISE, FULL_DECODE_ONLY, FULL, PIECEWISE or NONE")
    max_cudagraph_capture_size: int = opt(512, min=1, max=65536,
                                          help="most tokens of a prefill or mixed step captured in graphs")
    cudagraph_specialize_lora: bool = opt(True, help="with enable_lora, decode graphs captured twice: with the LoRA "
                                                     "kernels and without, for steps no request's adapter is in")

    @property
    def has_full_decode(self) -> bool:
        return self.cudagraph_mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL")

    @property
    def has_piecewise(self) -> bool:
        return self.cudagraph_mode in ("FULL_AND_PIECEWISE", "PIECEWISE")

    @property
    def has_full_mixed(self) -> bool:
        """Whole-forward graphs of prefill and mixed steps (FULL)."""
        return self.cudagraph_mode == "FULL"


@dataclass(frozen=True)
class RuntimeDefaults:
    """Engine options: the recipe's `runtime` section, baked into the artifact at build time;
    `llmc run` flags and `LLM(**kwargs)` override them by the same names."""

    max_model_len: int | None = opt(None, min=1, help="longest prompt + output, in tokens (default: the model's)")
    # Upper limits: every step buffer, sampler row and CUDA-graph size is allocated up to them, so a value
    # far beyond any GPU's batch would fail in an allocation (a traceback) rather than here, by name.
    max_num_seqs: int = opt(64, min=1, max=65536, help="most sequences running at once")
    max_num_batched_tokens: int = opt(2048, min=1, max=2**24, help="token budget of one engine step")
    long_prefill_token_threshold: int = opt(0, min=0, max=2**24,
                                            help="vLLM's: > 0: at most this many of one request's prompt tokens per "
                                                 "step, leaving room for other requests' chunks; 0: no cap")
    block_size: int = opt(16, choices=[8, 16, 32, 64, 128], help="tokens per KV-cache block")
    gpu_memory_utilization: float = opt(0.9, min_exclusive=0.0, max=1.0, help="fraction of GPU memory to use")
    num_kv_blocks: int | None = opt(None, min=1, alias="num_gpu_blocks_override",
                                    help="exact KV block count; overrides the memory fraction")
    cpu_kv_cache_gib: float = opt(1.0, min_exclusive=0.0, max=65536.0, help="KV-cache size on CPU, in GiB")
    enable_prefix_caching: bool = opt(True, help="reuse the KV of shared prompt prefixes")
    enforce_eager: bool = opt(False, help="never capture CUDA graphs")
    kv_cache_dtype: str = opt("auto", choices=list(KV_CACHE_DTYPES),
                              help="KV-cache storage: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2, with per-layer scales")
    mamba_cache_dtype: str = opt("auto", choices=list(MAMBA_CACHE_DTYPES),
                                 help="a hybrid model's conv and recurrent states (Gated DeltaNet, Mamba-2, short conv): "
                                      "auto (conv states in the model dtype, recurrent states float32), float32, "
                                      "bfloat16 or float16")
    mamba_ssm_cache_dtype: str = opt("auto", choices=list(MAMBA_CACHE_DTYPES),
                                     help="a hybrid model's recurrent states alone (Gated DeltaNet's, Mamba-2's SSM "
                                          "state): auto (as mamba_cache_dtype), float32, bfloat16 (half the bytes "
                                          "a decode step moves) or float16")
    cpu_offload_gb: float = opt(0.0, min=0.0, max=65536.0,
                                help="GiB of weights per GPU kept in pinned host memory, streamed in ahead of their layer")
    async_scheduling: bool = opt(True, help="schedule step N+1 while step N runs (false: one step at a time, for debugging)")
    num_scheduler_steps: int = opt(1, min=1, max=64,
                                   help="decode steps per engine step (multi-step decoding; onnx-cpu artifacts only)")
    seed: int = opt(0, min=0, max=2**63 - 1, help="seed of the random sampler")
    scheduling_policy: str = opt("fcfs", choices=["fcfs", "priority"], help="fcfs, or priority (lower value first)")
    speculative: SpeculativeConfig | None = opt(None, alias="speculative_config",
                                                help="speculative decoding: a draft model, {model: DIR, num_speculative_tokens: 3}, "
                                                     "or n-gram lookup, {method: ngram, num_speculative_tokens: 3}")
    compilation_config: CompilationConfig | None = opt(
        None, help="vLLM's CUDA-graph settings, e.g. {cudagraph_mode: FULL_DECODE_ONLY, max_cudagraph_capture_size: 256}")
    max_logprobs: int = opt(20, min=-1, max=2**31 - 1,
                            help="most logprobs / prompt_logprobs a request may ask (vLLM's; -1: the whole vocabulary)")
    generation_config: str = opt("auto", help="auto: the model's generation_config.json sets the default temperature, "
                                              "top_p, top_k, min_p, repetition_penalty and max_tokens (vLLM's default); "
                                              "vllm: SamplingParams' own defaults; or a folder holding a generation_config.json")
    enable_lora: bool = opt(False, help="run-time LoRA: requests name PEFT adapters (lora_request, the server's "
                                             "--lora-modules), added to the linears per token (runtime/lora.py)")
    max_loras: int = opt(1, min=1, max=1024, help="most LoRA adapters in one step (their slots on the device)")
    max_lora_rank: int = opt(16, min=1, max=1024, help="largest LoRA rank an adapter may have (each slot's size)")
    max_cpu_loras: int | None = opt(None, min=1, help="LoRA adapters kept read in host memory (default: max(max_loras, 8))")
    runner: str = opt("auto", choices=list(RUNNERS), help="generate (text), or pooling: an embedding model (vLLM's "
                                                         "runner; auto: generate)")
    convert: str = opt("auto", choices=list(CONVERTS), help="vLLM's convert: embed serves the model as an embedding model "
                                                           "(as runner pooling); classify and reward are refused")
    pooler_config: PoolerConfig | None = opt(None, alias="override_pooler_config",
                                             help="how embeddings are pooled (runner pooling), e.g. {pooling_type: MEAN, "
                                                  "normalize: false}; default: the checkpoint's sentence-transformers "
                                                  "settings, else LAST with normalization")
    stream_interval: int = opt(1, min=1, max=2**31 - 1,
                               help="vLLM's: a streamed request's output every this many new tokens (the first token "
                                    "and the finish at once); larger values spend less host time per token")
    limit_mm_per_prompt: MultiModalLimits | None = opt(
        None, help="vLLM's: the most images one prompt of a vision model may carry, e.g. {image: 2} (0: text only); "
                   "more is refused by name; default: no limit")
    media_io_kwargs: MediaIOKwargs | None = opt(
        None, help="vLLM's: how chat video_url parts are decoded, e.g. {video: {num_frames: 16}} (Qwen2-VL, "
                   "Qwen2.5-VL, Qwen3-VL; default 32 frames, spread uniformly)")
    enable_prompt_embeds: bool = opt(False, help="requests may give the prompt as embeddings [num_tokens, hidden_size] "
                                                 "(vLLM's prompt_embeds) in place of text or token ids")
    disable_log_stats: bool = opt(False, help="no periodic engine statistics line")
    log_stats_interval: float = opt(10.0, min_exclusive=0.0, help="seconds between engine statistics lines")


    @property
    def graph_modes(self) -> CompilationConfig:
        """compilation_config, or its defaults where the artifact and the caller set none."""
        return self.compilation_config or CompilationConfig()

@dataclass(frozen=True)
class Plan:
    """Decisions made ahead of time for the runtime: graph buckets, the memory estimate, and which
    W4A16 kernel runs each GEMM shape.

    w4a16_kernels: one record per (K, N) per rank of the artifact's w4a16 linears in the gpu layout,
      "KxN" → {"source": "measured" | "heuristic",
               "gpu": the torch.cuda.get_device_name() it was measured on, or None,
               "entries": [[max_m, W4A16Config as a dict, time in µs or None], ...]}
      (the first entry whose max_m >= M applies, the last one beyond). Empty: no such linear, or an
      artifact built before the field existed (the runtime then uses the kernels' default table).
    """

    cuda_graph_batch_sizes: list[int] = opt()
    max_num_batched_tokens: int = opt(min=1)
    weight_bytes_per_rank: list[int] = opt()
    memory: dict = field(default_factory=dict)  # estimate for the target: total, weights, activations, kv
    w4a16_kernels: dict = field(default_factory=dict)


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's image side (LLaVA, LLaVA-NeXT, Gemma 3, Mistral 3, Qwen2-VL, Qwen2.5-VL:
    compiler/vision.py builds it,
    runtime/multimodal.py runs it). Its tensors are in VISION_WEIGHTS, dense in the model dtype: the vision tower's
    under `vision_tower.` (transformers' CLIPVisionModel / SiglipVisionModel / PixtralVisionModel names), the
    projector's under `multi_modal_projector.` (LLaVA: linear_1, linear_2; Gemma 3: mm_soft_emb_norm,
    mm_input_projection_weight; Mistral 3: norm, patch_merger.merging_layer, linear_1, linear_2); LLaVA-NeXT's also
    `image_newline` (the row appended after each row of an image's tiles). Qwen2-VL / Qwen2.5-VL: the whole of
    transformers' vision transformer (its patch merger `merger.` included) under `vision_tower.`, no projector; Qwen3-VL
    the same, its deepstack mergers (`deepstack_merger_list.`) included."""

    architecture: str = opt(choices=["LlavaForConditionalGeneration", "Gemma3ForConditionalGeneration",
                                     "Mistral3ForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                     "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                     "Qwen3VLForConditionalGeneration"])
    # transformers' CLIPVisionConfig (LLaVA) / SiglipVisionConfig (Gemma 3) / PixtralVisionConfig (Mistral 3, LLaVA
    # with model_type pixtral: each image at its own size), as a dict
    vision_config: dict = opt()
    image_token_index: int = opt(min=0)  # the placeholder token an image's embeddings replace, one per image row
    text_hidden_size: int = opt(min=1)  # the projector's output width: the language model's hidden_size
    # LLaVA: the vision tower's hidden state the features are read from (0: the embeddings; negative: from the last
    # layer); "default": the CLS row dropped (one row per patch), "full": every row; the projector's activation
    vision_feature_layer: int | None = opt(None)
    vision_feature_select_strategy: str | None = opt(None, choices=VISION_FEATURE_STRATEGIES)
    projector_hidden_act: str | None = opt(None)
    projector_bias: bool = opt(True)  # its linears carry biases
    # Gemma 3 (format 1.14): rows per image (the projector's average pool), the tokens around an image's rows
    # (<start_of_image> is also the placeholder a prompt writes), and whether an image's tokens attend to each other
    # both ways in the prefill (kernels/attention.py's key limits; the scheduler keeps such an image in one chunk)
    mm_tokens_per_image: int | None = opt(None, min=1)
    boi_token_index: int | None = opt(None, min=0)
    eoi_token_index: int | None = opt(None, min=0)
    bidirectional_image_attention: bool = opt(False)
    # Mistral 3 (format 1.17): the patch merger's side (spatial_merge_size² patches → one row) and the projector's
    # RMSNorm eps (transformers takes the text model's rms_norm_eps); it also reads vision_feature_layer,
    # projector_hidden_act and projector_bias
    spatial_merge_size: int | None = opt(None, min=1)
    projector_norm_eps: float | None = opt(None)
    # LLaVA-NeXT (format 1.18): the resolutions [height, width] an image is resized and padded to (the best fit),
    # each a multiple of the tower's image_size, cut into tiles of that size; it also reads LLaVA's fields
    image_grid_pinpoints: list[list[int]] | None = opt(None)
    # Qwen2-VL, Qwen2.5-VL (format 1.19): M-RoPE's split of the rotary frequencies (head_dim / 2 of them, in order)
    # over the (temporal, height, width) positions of a token (runtime/mrope.py), and the video placeholder the
    # runtime refuses; spatial_merge_size is the tower's patch merger's
    mrope_section: list[int] | None = opt(None)
    video_token_index: int | None = opt(None, min=0)
    # Qwen3-VL (format 1.24): M-RoPE's frequencies interleaved (frequency j reads height where j % 3 == 1 and j <
    # 3 * mrope_section[1], width where j % 3 == 2 and j < 3 * mrope_section[2], temporal otherwise: transformers'
    # Qwen3VLTextRotaryEmbedding) rather than in three contiguous runs
    mrope_interleaved: bool = opt(False)


@dataclass(frozen=True)
class MtpSpec:
    """The checkpoint's multi-token-prediction layer (GLM-4.5's, format 1.26; DeepSeek-V3's, an MLA layer, 1.28;
    compiler/mtp.py builds it, runtime/mtp_head.py runs it under speculative method mtp). Its tensors are in
    MTP_WEIGHTS, dense in the model dtype: the decoder layer under `layers.{layer_index}.` (the runtime's names),
    enorm, hnorm, eh_proj, shared_head.norm, and where the checkpoint has them shared_head.head and embed."""

    layer_index: int = opt(min=1)  # the checkpoint's index of the layer: the model's num_layers
    is_moe: bool = opt()  # its MLP is the model's MoE (else a dense MLP)
    has_head: bool = opt()  # shared_head.head.weight stored; false: the model's lm_head reads its output
    has_embed: bool = opt()  # embed.weight stored; false: the model's embedding


def kernel_source_label(record: dict) -> str:
    """Where one plan.w4a16_kernels record came from: "measured on NVIDIA H200", "heuristic"."""
    return f"measured on {record['gpu']}" if record.get("gpu") else str(record.get("source"))


@dataclass(frozen=True)
class Manifest:
    """The whole of manifest.json. `files` maps every other file's relative path to {sha256, size}.

    The file also holds `manifest_sha256` (format 1.2): the sha256 of the canonical JSON of the rest
    (runtime/integrity.py), written by `to_json` and checked by `read_manifest`; not a field here.
    """

    format_version: str = opt(choices=list(KNOWN_FORMAT_VERSIONS))
    llmc_version: str = opt()
    source: dict = opt()  # {"path", "revision", "sha256": {file: digest}}
    model: ModelConfig = opt()
    quant: QuantInfo = opt()
    parallel: ParallelPlan = opt()
    kv: KVSpec = opt()
    plan: Plan = opt()
    runtime: RuntimeDefaults = opt()
    files: dict[str, dict] = field(default_factory=dict)
    # what the model file is and where it runs; empty: the torch runtime's safetensors (rank-*/).
    # ONNX: {"device": "onnx-cpu", "model_format": "onnx", "onnx": {"model", "opset", "max_positions",
    #        "op_counts", "linears"}} (runtime/onnx_model.py)
    target: dict = field(default_factory=dict)
    vision: VisionSpec | None = opt(None)  # a vision-language model's image side (format 1.13); None: a text model
    mtp: MtpSpec | None = opt(None)  # the MTP layer kept for speculative method mtp (format 1.26; MLA 1.28); None: none

    def to_json(self) -> str:
        data = json.loads(json.dumps(dataclasses.asdict(self), allow_nan=False))  # the types a reader gets back
        data[integrity.DIGEST_KEY] = integrity.manifest_digest(data)
        return json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        """Every section schema-checked (types, ranges, unknown keys), then checked for consistency."""
        data = {k: v for k, v in data.items() if k != integrity.DIGEST_KEY}
        try:
            manifest = parse(cls, data, "", ArtifactError)
        except ArtifactError as e:
            raise ArtifactError(f"manifest.json: {e}; rebuild the artifact") from None
        integrity.check_entries(manifest.files)
        _check_consistency(manifest)
        return manifest


def _check_consistency(m: Manifest) -> None:
    """What the schema cannot say: the sections agree with each other."""
    model, problems = m.model, []
    if model.num_heads % model.num_kv_heads:
        problems.append(f"model.num_heads ({model.num_heads}) is not a multiple of num_kv_heads ({model.num_kv_heads})")
    if not all(0 <= t < model.vocab_size for t in model.eos_token_ids):
        problems.append(f"model.eos_token_ids {model.eos_token_ids} are not all in [0, {model.vocab_size})")
    # (a 1.20 / 1.21 DeepSeek manifest records the expanded cache it ran with)
    is_latent = model.is_mla and (m.kv.latent or m.format_version not in ("1.20", "1.21"))
    want = latent_kv_shape(model) if is_latent else (len(model.kv_layers), model.num_kv_heads, model.head_dim)
    if (m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim) != want or m.kv.latent != is_latent:
        problems.append("kv does not match the model's num_layers (a hybrid model's attention layers), num_kv_heads "
                        "and head_dim (MLA: its latent cache)")
    fp8 = KV_CACHE_DTYPES[m.runtime.kv_cache_dtype]
    if fp8 is not None and m.kv.dtype != fp8:
        problems.append(f"kv.dtype {m.kv.dtype} does not match runtime.kv_cache_dtype {m.runtime.kv_cache_dtype}")
    for name in ("k_scales", "v_scales"):
        scales = getattr(m.kv, name)
        if scales and (len(scales) != model.num_layers or not all(math.isfinite(x) and x > 0 for x in scales)):
            problems.append(f"kv.{name} must hold one finite scale > 0 per layer ({model.num_layers})")
    stages = m.parallel.stage_layers
    if stages and (len(stages) != m.parallel.pipeline or sorted(sum(stages, [])) != list(range(model.num_layers))):
        problems.append(f"parallel.stage_layers does not split the model's {model.num_layers} layers into "
                        f"{m.parallel.pipeline} stage(s)")
    if len(m.plan.weight_bytes_per_rank) != m.parallel.world_size:
        problems.append(f"plan.weight_bytes_per_rank has {len(m.plan.weight_bytes_per_rank)} entries for "
                        f"{m.parallel.world_size} rank(s)")
    for name, spec in m.quant.modules.items():
        if not (isinstance(spec, dict) and isinstance(spec.get("format"), str)):
            problems.append(f"quant.modules[{name!r}] is not a format spec ({{\"format\": ...}})")
            break
    if model.moe_layers and (model.num_experts is None or model.num_experts_per_tok is None
                             or model.moe_intermediate_size is None or not set(model.moe_layers) <= set(range(model.num_layers))):
        problems.append("model.moe_layers needs num_experts, num_experts_per_tok, moe_intermediate_size and layer indices in range")
    linears = [f"layers.{i}.{name}" for i in range(model.num_layers) for name in model.layer_linears(i)]
    if unlisted := [name for name in linears if name not in m.quant.modules]:
        problems.append(f"quant.modules has no format for {unlisted[0]}" + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""))
    model_files = [rank_weights_path(r) for r in range(m.parallel.world_size)] if not m.target else []  # ONNX: its own
    if m.mtp is not None:
        model_files.append(MTP_WEIGHTS)
        if m.mtp.layer_index != model.num_layers:
            problems.append(f"mtp.layer_index {m.mtp.layer_index} is not the model's num_layers {model.num_layers}")
    if m.vision is not None:
        model_files.append(VISION_WEIGHTS)
        if m.vision.text_hidden_size != model.hidden_size or m.vision.image_token_index >= model.vocab_size:
            problems.append("vision.text_hidden_size / image_token_index do not match the model's hidden_size and "
                            "vocab_size")
        needed = {"Gemma3ForConditionalGeneration": ("mm_tokens_per_image", "boi_token_index", "eoi_token_index"),
                  "Mistral3ForConditionalGeneration": ("vision_feature_layer", "projector_hidden_act",
                                                       "spatial_merge_size", "projector_norm_eps"),
                  "LlavaNextForConditionalGeneration": ("vision_feature_layer", "vision_feature_select_strategy",
                                                        "projector_hidden_act", "image_grid_pinpoints"),
                  "Qwen2VLForConditionalGeneration": ("spatial_merge_size", "mrope_section", "video_token_index"),
                  "Qwen2_5_VLForConditionalGeneration": ("spatial_merge_size", "mrope_section", "video_token_index"),
                  "Qwen3VLForConditionalGeneration": ("spatial_merge_size", "mrope_section", "video_token_index"),
                  }.get(m.vision.architecture,
                        ("vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act"))
        if lacking := [key for key in needed if getattr(m.vision, key) is None]:
            problems.append(f"vision.{lacking[0]} is missing (a {m.vision.architecture} needs it)")
    missing = [rel for rel in model_files if rel not in m.files]
    if missing:
        problems.append(f"files lacks {missing[0]}")
    if problems:
        raise ArtifactError(f"manifest.json: {problems[0]}; rebuild the artifact")
    _check_formats(m.quant.modules)


def _check_formats(modules: dict[str, dict]) -> None:
    """Every module's spec is a format this llmc can load (each distinct spec built once)."""
    import torch

    from llmc.errors import LlmcError
    from llmc.quant.formats import make_format

    checked = set()
    for name, spec in modules.items():
        key = json.dumps(spec, sort_keys=True)
        if key in checked:
            continue
        try:
            make_format(spec, torch.float32)
        except (KeyError, TypeError, ValueError, LlmcError) as e:
            raise ArtifactError(f"manifest.json: quant.modules[{name!r}] is not a format this llmc loads ({e}); "
                                "rebuild the artifact") from None
        checked.add(key)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def latent_kv_shape(model: ModelConfig) -> tuple[int, int, int]:
    """An MLA model's kv section (num_layers, num_kv_heads, head_dim): one latent of kv_lora_rank + qk_rope_head_dim
    per token and layer."""
    return model.num_layers, 1, model.kv_lora_rank + model.qk_rope_head_dim


def kv_storage_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The KV cache's dtype name for runtime.kv_cache_dtype: an FP8 dtype, or compute_dtype for auto."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or compute_dtype


def state_dtypes(runtime: RuntimeDefaults, compute_dtype: str) -> tuple[str, str]:
    """A hybrid model's (conv state, recurrent state) dtype names, vLLM's rules with llmc's auto: mamba_cache_dtype
    sets both (auto: conv states in compute_dtype, recurrent states float32, as transformers keeps them; vLLM's auto
    takes what the model's config names, else the model dtype), mamba_ssm_cache_dtype the recurrent state alone (auto: as
    mamba_cache_dtype)."""
    both = runtime.mamba_cache_dtype
    recurrent = runtime.mamba_ssm_cache_dtype if runtime.mamba_ssm_cache_dtype != "auto" else both
    return (compute_dtype if both == "auto" else both), ("float32" if recurrent == "auto" else recurrent)


def dtype_num_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype]


def read_manifest(artifact_dir: str | Path) -> Manifest:
    """Read and check manifest.json: a JSON object, a known format_version, its own digest, every
    section's schema and their consistency. The files it lists are checked where they are used."""
    path = Path(artifact_dir)
    if not path.is_dir():
        raise ArtifactError(f"no artifact at {path}: build one with `llmc build RECIPE`")
    manifest_path = path / MANIFEST_NAME
    st, problem = integrity.regular_file(path, MANIFEST_NAME)
    if st is None:
        what = f"its {MANIFEST_NAME} {problem}" if problem else f"no {MANIFEST_NAME}"
        if not problem and (path / "config.json").is_file():  # what vLLM would serve directly
            raise ArtifactError(f"{path} is a Hugging Face checkpoint, not an llmc artifact ({what}); build one from "
                                f"a recipe naming it (a file holding `model: {path}`, then `llmc build` that file)")
        raise ArtifactError(f"{path} is not an llmc artifact ({what}); build one with `llmc build`")
    try:
        data = integrity.parse_json_strict(manifest_path.read_bytes().decode())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ArtifactError(f"{manifest_path} is not valid JSON ({e}); rebuild the artifact") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{manifest_path}: expected a JSON object, got a {type(data).__name__}; rebuild the artifact")
    _check_format_version(path, data.get("format_version"))
    integrity.check_digest(data, manifest_path, required=data["format_version"] not in ("1.0", "1.1"))
    return Manifest.from_dict(data)


def _check_format_version(path: Path, version) -> None:
    if not isinstance(version, str):
        raise ArtifactError(f"{path}: manifest.json: format_version must be a string such as {FORMAT_VERSION!r}, "
                            f"got {version!r}; rebuild the artifact")
    if version in KNOWN_FORMAT_VERSIONS:
        return
    newer = version.split(".")[0] == FORMAT_VERSION.split(".")[0]
    raise ArtifactError(
        f"{path}: artifact format_version {version!r} is not supported by this llmc "
        f"(reads {', '.join(KNOWN_FORMAT_VERSIONS)}); "
        + ("upgrade llmc, or rebuild it with this version" if newer else "rebuild it with this version of llmc")
    )


def hash_files(root: Path) -> dict[str, dict]:
    """{relative path: {sha256, size}} for every file under root except the manifest (and a verification stamp)."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel not in (MANIFEST_NAME, integrity.STAMP_NAME):
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return files


def verify_files(artifact_dir: str | Path, manifest: Manifest) -> list[str]:
    """Re-hash every file; return one problem line per missing, non-regular, resized or corrupted file."""
    return integrity.verify_files(Path(artifact_dir), manifest.files)


def verify_for_load(artifact_dir: str | Path, manifest: Manifest, rel_paths: list[str]) -> None:
    """Refuse a missing, truncated or changed file among rel_paths, by name (sha256 on the first load,
    a stat stamp after it: runtime/integrity.py)."""
    integrity.verify_for_load(Path(artifact_dir), manifest.files, rel_paths)


def tokenizer_files(manifest: Manifest) -> list[str]:
    return [rel for rel in manifest.files if rel.startswith(TOKENIZER_DIR + "/")]


def write_manifest(root: Path, manifest: Manifest) -> None:
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, root / MANIFEST_NAME)
