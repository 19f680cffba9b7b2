"""Reading Hugging Face checkpoints: config.json → ModelConfig, and tensors streamed from safetensors.

Tensors are read one at a time through safetensors' lazy `safe_open`, so the model is never held in
memory twice. Single-file and sharded (with model.safetensors.index.json) checkpoints are supported.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from llmc.compiler.vision import llava_names
from llmc.errors import CheckpointError
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models import CLASSIFIER_ARCHITECTURES, spec_for_architecture, supported_architectures
from llmc.runtime.models.spec import ModelSpec

logger = logging.getLogger("llmc")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; point `model` at a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


# Architectures close to a supported one that llmc does not run, with why (one line each).
_REFUSED_ARCHITECTURES = {
    "GemmaForCausalLM": "Gemma 1 is not supported (Gemma2ForCausalLM and Gemma 3's text model, Gemma3ForCausalLM, are)",
    "LlavaOnevisionForConditionalGeneration": "LLaVA-OneVision is not supported; LlavaForConditionalGeneration and "
                                              "LLaVA-NeXT's LlavaNextForConditionalGeneration are",
    "LlavaNextVideoForConditionalGeneration": "LLaVA-NeXT-Video (video input) is not supported; LLaVA-NeXT's image "
                                              "model LlavaNextForConditionalGeneration is",
    "OlmoForCausalLM": "OLMo 1 (non-parametric LayerNorm, clipped q/k/v) is not supported; OLMo 2 (Olmo2ForCausalLM) is",
    "ExaoneForCausalLM": "EXAONE 3 / 3.5 (remote code) is not supported; EXAONE 4.0 (Exaone4ForCausalLM) is",
    "Ernie4_5_ForCausalLM": "ERNIE 4.5's remote-code checkpoints (Ernie4_5_ForCausalLM) are not supported; the "
                            "transformers-native ones (Ernie4_5ForCausalLM, baidu/ERNIE-4.5-*-PT) are",
    "Lfm2VlForConditionalGeneration": "LFM2-VL (image input) is not supported; the text model LFM2 "
                                      "(Lfm2ForCausalLM) is",
}


def model_spec_for(config: dict, model_dir: Path) -> ModelSpec:
    architectures = config.get("architectures") or []
    for arch in architectures:
        spec = spec_for_architecture(arch)
        if spec is not None:
            return spec
    for arch in architectures:
        if arch in _REFUSED_ARCHITECTURES:
            raise CheckpointError(f"{model_dir}: architecture {arch}: {_REFUSED_ARCHITECTURES[arch]}")
    raise CheckpointError(
        f"{model_dir}: architecture {architectures or config.get('model_type')} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )


def _sliding_window(config: dict) -> tuple[int | None, list[int] | None]:
    """(window, the layers that use it: None for every layer), as transformers reads the config: HF's
    `layer_types`, else dense Qwen2/3's `max_window_layers` (layers from it on slide), else every layer
    (Mistral, Mixtral, Qwen3-MoE); `use_sliding_window: false` (Qwen) turns the window off."""
    window = config.get("sliding_window")
    if not window or not config.get("use_sliding_window", True):
        return None, None
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown or len(layer_types) != num_layers:
            raise CheckpointError(f"layer_types {unknown or layer_types}: supported are full_attention and "
                                  f"sliding_attention, one per layer ({num_layers})")
        layers = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    elif config.get("model_type") == "qwen2_moe":  # Qwen2MoeConfig's own rule (every other layer below
        # max_window_layers), read from transformers' config class rather than restated here
        from transformers import Qwen2MoeConfig

        kinds = Qwen2MoeConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")}).layer_types
        layers = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    elif config.get("max_window_layers") is not None and config.get("model_type") in ("qwen2", "qwen3", "dots1"):
        # (Qwen3-MoE's config carries the key too, but its attention windows every layer; Dots1Config fills in
        # layer_types by this rule)
        layers = list(range(config["max_window_layers"], num_layers))
    else:
        return window, None
    if not layers:
        return None, None
    return window, None if len(layers) == num_layers else layers


# What transformers' config classes (and so vLLM, which reads them) take for keys a config.json leaves out.
_HF_CONFIG_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "mixtral": {"max_position_embeddings": 4096 * 32},
    "qwen2": {"max_position_embeddings": 32768, "use_sliding_window": False},
    "qwen3": {"max_position_embeddings": 32768, "use_sliding_window": False},
    "qwen3_moe": {"max_position_embeddings": 32768, "use_sliding_window": False},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 32000},
    "gemma3_text": {"max_position_embeddings": 131072, "sliding_window": 4096, "head_dim": 256, "rms_norm_eps": 1e-6,
                    "num_key_value_heads": 4, "bos_token_id": 2, "eos_token_id": 1,
                    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma2": {"max_position_embeddings": 8192, "sliding_window": 4096, "head_dim": 256, "rms_norm_eps": 1e-6,
               "num_key_value_heads": 4, "bos_token_id": 2, "eos_token_id": 1,
               "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": None, "eos_token_id": 50279},
    "granite": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
                "embedding_multiplier": 1.0, "attention_multiplier": 1.0, "residual_multiplier": 1.0,
                "logits_scaling": 1.0},
    "olmo3": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": None, "eos_token_id": 50279,
              "sliding_window": 4096, "rope_theta": 500000.0},
    "olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": None, "eos_token_id": 50279,
              "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False},
    "cohere": {"max_position_embeddings": 8192, "layer_norm_eps": 1e-5, "bos_token_id": 5, "eos_token_id": 255001,
               "tie_word_embeddings": True, "logit_scale": 0.0625, "attention_bias": False, "use_qk_norm": False},
    "cohere2": {"max_position_embeddings": 8192, "layer_norm_eps": 1e-5, "bos_token_id": 5, "eos_token_id": 255001,
                "tie_word_embeddings": True, "logit_scale": 0.0625, "attention_bias": False, "sliding_window": 4096},
    "glm4": {"max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-7, "num_key_value_heads": 2, "head_dim": 128,
             "attention_bias": True, "bos_token_id": None, "eos_token_id": None},
    "qwen2_moe": {"max_position_embeddings": 32768, "use_sliding_window": False, "rms_norm_eps": 1e-6,
                  "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False, "qkv_bias": True,
                  "shared_expert_intermediate_size": 5632, "moe_intermediate_size": 1408},
}
# SmolLM3Config's (no_rope_layers and layer_types: _smollm3_config, as its __post_init__ fills them in)
_HF_CONFIG_DEFAULTS["smollm3"] = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_key_value_heads": 4,
                                  "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": True,
                                  "rope_theta": 2_000_000.0, "use_sliding_window": False, "sliding_window": None,
                                  "no_rope_layer_interval": 4}
# Exaone4Config's (layer_types: _exaone4_config), SeedOssConfig's and Ernie4_5Config's (rope_theta: its default_theta)
_HF_CONFIG_DEFAULTS["exaone4"] = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "num_key_value_heads": 32,
                                  "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": False,
                                  "sliding_window": 4096, "sliding_window_pattern": 4}
# ArceeConfig's and ApertusConfig's (Apertus's default rope, Llama 3's over 8192 positions: _up_mlp_config)
_HF_CONFIG_DEFAULTS["arcee"] = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "relu2",
                                "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False}
_HF_CONFIG_DEFAULTS["apertus"] = {"max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "hidden_act": "xielu",
                                  "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
_HF_CONFIG_DEFAULTS["seed_oss"] = {"max_position_embeddings": 524288, "rms_norm_eps": 1e-6, "num_key_value_heads": 8,
                                   "head_dim": 128, "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": False,
                                   "attention_bias": True, "attention_out_bias": False, "mlp_bias": False}
_HF_CONFIG_DEFAULTS["ernie4_5"] = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_key_value_heads": 2,
                                   "head_dim": 128, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
                                   "use_bias": False, "rope_theta": 500000.0}
# Ernie4_5_MoeConfig's defaults (no head_dim: hidden_size / num_attention_heads, as its attention reads it)
_HF_CONFIG_DEFAULTS["ernie4_5_moe"] = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                                       "num_key_value_heads": 4, "bos_token_id": 1, "eos_token_id": 2,
                                       "tie_word_embeddings": True,
                                       "use_bias": False, "rope_theta": 500000.0, "moe_intermediate_size": 1536,
                                       "moe_k": 6, "moe_num_experts": 64, "moe_num_shared_experts": 2,
                                       "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1,
                                       "moe_norm_min": 1e-12}
# Ministral3Config's (its default rope_parameters, YaRN with llama_4_scaling_beta 0.1, filled in by _ministral3_config)
_HF_CONFIG_DEFAULTS["ministral3"] = {"max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                                     "head_dim": 128, "bos_token_id": 1, "eos_token_id": 2,
                                     "tie_word_embeddings": False, "sliding_window": None}
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                    "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
_DEEPSEEK_DEFAULTS = {"first_k_dense_replace": 0, "q_lora_rank": 1536, "kv_lora_rank": 512, "n_routed_experts": 64,
                      "n_shared_experts": 2, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                      "routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False, "n_group": None,
                      "topk_group": None, "moe_intermediate_size": 1407, "max_position_embeddings": 2048,
                      "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}
_HF_CONFIG_DEFAULTS["deepseek_v2"] = _DEEPSEEK_DEFAULTS
_HF_CONFIG_DEFAULTS["deepseek_v3"] = {**_DEEPSEEK_DEFAULTS, "first_k_dense_replace": 3, "n_routed_experts": 256,
                                      "n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": None,
                                      "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                                      "moe_intermediate_size": 2048, "max_position_embeddings": 4096,
                                      "bos_token_id": 0, "eos_token_id": 1, "rope_interleave": True}
# Glm4MoeLiteConfig's defaults (GLM-4.7-Flash; mlp_layer_types null: the first layer dense, the rest sparse)
_HF_CONFIG_DEFAULTS["glm4_moe_lite"] = {
    "vocab_size": 154880, "hidden_size": 2048, "num_hidden_layers": 47, "intermediate_size": 10240,
    "moe_intermediate_size": 1536, "num_attention_heads": 20, "num_key_value_heads": 20,
    "n_shared_experts": 1, "n_routed_experts": 64, "routed_scaling_factor": 1.8, "kv_lora_rank": 512,
    "q_lora_rank": 768, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "rope_interleave": True,
    "mlp_layer_types": None, "attention_bias": False, "topk_method": None}
# Mistral4Config's defaults (its default rope_parameters, YaRN x128 with llama_4_scaling_beta 0.1: _mistral4_rope)
_HF_CONFIG_DEFAULTS["mistral4"] = {
    "vocab_size": 131072, "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_attention_heads": 32, "num_key_value_heads": None,
    "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "kv_lora_rank": 256,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 0, "norm_topk_prob": True,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False, "topk_method": None}
_MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                  "llama_4_scaling_beta": 0.1}
# Glm4MoeConfig's defaults (its partial_rotary_factor, 0.5: _glm4_rope)
_HF_CONFIG_DEFAULTS["glm4_moe"] = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                                   "attention_bias": False, "use_qk_norm": False, "moe_intermediate_size": 1408,
                                   "num_experts_per_tok": 8, "n_routed_experts": 128, "n_shared_experts": 1,
                                   "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                                   "first_k_dense_replace": 1, "norm_topk_prob": True, "tie_word_embeddings": False,
                                   "bos_token_id": None, "eos_token_id": None}
# Dots1Config's defaults (head_dim: hidden_size / num_attention_heads, as Qwen3Attention reads a config without one)
_HF_CONFIG_DEFAULTS["dots1"] = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "attention_bias": False,
                                "moe_intermediate_size": 1408, "n_group": 1, "topk_group": 1,
                                "first_k_dense_replace": 0, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                                "sliding_window": 4096, "max_window_layers": 62, "tie_word_embeddings": False,
                                "bos_token_id": None, "eos_token_id": None}
# MiniMaxM2Config's defaults (its partial rotary: the legacy rotary_dim, _minimax_m2_config)
_HF_CONFIG_DEFAULTS["minimax_m2"] = {"max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "head_dim": 128,
                                     "num_key_value_heads": 8, "num_experts_per_tok": 8, "num_local_experts": 256,
                                     "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020,
                                     "rope_theta": 5000000.0}
# GptOssConfig's defaults (its rope_parameters' default, YaRN, is filled in by _gpt_oss_config)
_HF_CONFIG_DEFAULTS["gpt_oss"] = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "head_dim": 64,
                                  "num_key_value_heads": 8, "tie_word_embeddings": False,
                                  "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
                                  "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
                                  "bos_token_id": None, "eos_token_id": None, "rope_theta": 150000.0}
for _type in ("granitemoe", "granitemoeshared"):
    _HF_CONFIG_DEFAULTS[_type] = {**_HF_CONFIG_DEFAULTS["granite"], "num_local_experts": 8, "num_experts_per_tok": 2}
_HF_CONFIG_DEFAULTS["granitemoeshared"]["shared_intermediate_size"] = 0
# GraniteMoeHybridConfig's (layer_types null: every layer Mamba-2; position_embedding_type null: no rotary)
_HF_CONFIG_DEFAULTS["granitemoehybrid"] = {**_HF_CONFIG_DEFAULTS["granitemoe"], "shared_intermediate_size": 1024,
                                           "position_embedding_type": None, "layer_types": None}
# BambaConfig's (attn_layer_indices null: every layer Mamba-2; its rotary over half of each head: _bamba_config)
_HF_CONFIG_DEFAULTS["bamba"] = {"max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                                "attn_layer_indices": None}
# NemotronHConfig's (the older key names, mamba_n_groups ..., as its __post_init__ renames them: _nemotron_h_config)
_HF_CONFIG_DEFAULTS["nemotron_h"] = {"max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "head_dim": 128,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "bos_token_id": 1,
                                     "eos_token_id": 2, "tie_word_embeddings": False, "intermediate_size": 21504,
                                     "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "mamba_num_heads": 128,
                                     "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
                                     "chunk_size": 128, "use_conv_bias": True, "num_nextn_predict_layers": 0,
                                     "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
                                     "moe_shared_expert_intermediate_size": 7688, "n_shared_experts": 1,
                                     "moe_latent_size": None, "routed_scaling_factor": 1.0, "n_group": 1,
                                     "topk_group": 1, "norm_topk_prob": True}
# FalconH1Config's (mamba_d_ssm 1024 whatever mamba_expand says; mamba_d_head "auto": mamba_d_ssm / mamba_n_heads)
_HF_CONFIG_DEFAULTS["falcon_h1"] = {
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "intermediate_size": 14336, "mamba_d_ssm": 1024, "mamba_n_heads": 128,
    "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_norm_before_gate": True,
    "mamba_rms_norm": False, "projectors_bias": False, "attention_bias": False, "mlp_bias": False,
    "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0, "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
    "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5}
_MODEL_TYPE_OF = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                  "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                  "Gemma3ForCausalLM": "gemma3_text", "GraniteForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2",
                  "Olmo3ForCausalLM": "olmo3", "OlmoeForCausalLM": "olmoe", "GraniteMoeForCausalLM": "granitemoe",
                  "GraniteMoeSharedForCausalLM": "granitemoeshared", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "GraniteMoeHybridForCausalLM": "granitemoehybrid", "BambaForCausalLM": "bamba",
                  "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                  "Glm4ForCausalLM": "glm4", "CohereForCausalLM": "cohere", "Cohere2ForCausalLM": "cohere2",
                  "GptOssForCausalLM": "gpt_oss", "Glm4MoeForCausalLM": "glm4_moe",
                  "SmolLM3ForCausalLM": "smollm3", "Exaone4ForCausalLM": "exaone4",
                   "SeedOssForCausalLM": "seed_oss", "Ernie4_5ForCausalLM": "ernie4_5", "Dots1ForCausalLM": "dots1",
                   "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
                   "Ministral3ForCausalLM": "ministral3",
                   "MiniMaxM2ForCausalLM": "minimax_m2", "Qwen3_5ForCausalLM": "qwen3_5_text",
                   "NemotronHForCausalLM": "nemotron_h",
                   "Qwen3_5ForConditionalGeneration": "qwen3_5", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
                   "Mistral4ForCausalLM": "mistral4", "OlmoHybridForCausalLM": "olmo_hybrid",
                   "FalconH1ForCausalLM": "falcon_h1",
                   "ArceeForCausalLM": "arcee", "ApertusForCausalLM": "apertus"}
COHERE_FAMILIES = ("cohere", "cohere2")


def with_hf_defaults(config: dict) -> dict:
    """`config` with the defaults of its transformers config class filled in where a key is absent (an
    explicit null stays null)."""
    model_type = config.get("model_type") or _MODEL_TYPE_OF.get((config.get("architectures") or [None])[0])
    return {**_HF_CONFIG_DEFAULTS.get(model_type, {}), **config}


def model_config_from_hf(config: dict, spec: ModelSpec, dtype: str) -> ModelConfig:
    """Normalise an HF config (old `rope_theta`/`rope_scaling` or new `rope_parameters` keys)."""
    if spec.family == "llama4":  # (Llama4ForConditionalGeneration: its text_config)
        config = _llama4_config(config)
    config = with_hf_defaults(config)
    if spec.family == "gemma3":
        config = _gemma3_config(config)
    elif spec.family == "gemma2":
        config = _gemma2_config(config)
    elif spec.family in UP_MLP_FAMILIES:
        config = _up_mlp_config(config, spec.family)
    else:
        activation = config.get("hidden_act", "silu")
        if activation not in ("silu", "swish"):  # transformers' ACT2FN: both are SiLU
            raise CheckpointError(f"hidden_act {activation!r} is not supported: the runtime's MLP computes SiLU(gate) * up "
                                  "(hidden_act silu)")
    if spec.family == "phi3":
        config = _phi3_rope(config)
    if spec.family in ("glm4", "glm4_moe"):
        config = _glm4_rope(config)
    if spec.family in ("glm4_moe", "dots1"):
        _check_glm4_moe(config, spec.family)
    if spec.family in COHERE_FAMILIES:
        config = _cohere_config(config, spec.family)
    if spec.family in GRANITE_FAMILIES:
        _check_granite(config)
    if spec.family == "granitemoehybrid":
        config = _granite4_config(config)
    if spec.family == "bamba":
        config = _bamba_config(config)
    if spec.family == "nemotron_h":
        config = _nemotron_h_config(config)
    if spec.family == "falcon_h1":
        config = _falcon_h1_config(config)
    olmo = {"olmo2": "OLMo 2", "olmo3": "OLMo 3", "olmoe": "OLMoE"}
    if spec.family in olmo and config.get("attention_bias"):
        raise CheckpointError(f"attention_bias: true is not supported for {olmo[spec.family]} (its q/k/v/o biases: the "
                              "runtime's o has none)")
    if spec.family == "olmoe" and config.get("clip_qkv") is not None:
        raise CheckpointError(f"clip_qkv {config['clip_qkv']}: OLMoE's clamping of q/k/v is not supported; "
                              "published OLMoE checkpoints set it to null")
    if spec.family == "olmo3":
        config = _olmo3_config(config)
    if spec.family in DEEPSEEK_FAMILIES:
        config = _deepseek_config(config, spec.family)
    if spec.family == "gpt_oss":
        config = _gpt_oss_config(config)
    if spec.family == "smollm3":
        config = _smollm3_config(config)
    if spec.family == "exaone4":
        config = _exaone4_config(config)
    if spec.family in ("seed_oss", "ernie4_5", "ernie4_5_moe"):
        config = _seed_oss_ernie_config(config, spec.family)
    if spec.family == "ministral3":
        config = _ministral3_config(config)
    if spec.family == "minimax_m2":
        config = _minimax_m2_config(config)
    if spec.family in QWEN3_5_FAMILIES:
        config = _qwen3_5_config(config)
    if spec.family in LFM2_FAMILIES:
        config = _lfm2_config(config)
    if spec.family == "olmo_hybrid":
        config = _olmo_hybrid_config(config)
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    rope_theta, rope_scaling = _rope(config)
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    sliding_window, sliding_window_layers = _sliding_window(config)
    return ModelConfig(
        family=spec.family,
        architecture=config["architectures"][0],
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v always have biases; Phi-3's linears never do (its modules ignore the key)
        attention_bias=spec.family == "qwen2" or (spec.family == "qwen2_moe" and bool(config["qkv_bias"])) or (
            spec.family != "phi3" and bool(config.get("attention_bias", False))),
        qk_norm=bool(spec.qk_norms) and (spec.family != "glm4_moe" or bool(config["use_qk_norm"])),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=dtype,
        sliding_window=sliding_window,
        sliding_window_layers=sliding_window_layers,
        **(_moe_fields(config, spec.family) if spec.moe is not None and spec.family not in (*DEEPSEEK_ROUTER_FAMILIES,
                                                                                             "llama4") else {}),
        **(_glm4_moe_fields(config) if spec.family in ("glm4_moe", "dots1") else {}),
        **(_ernie4_5_moe_fields(config) if spec.family == "ernie4_5_moe" else {}),
        **(_minimax_m2_fields(config) if spec.family == "minimax_m2" else {}),
        **(config["_qwen3_5"] if spec.family in QWEN3_5_FAMILIES else {}),
        **(_deepseek_fields(config, spec.family) if spec.family in DEEPSEEK_FAMILIES else {}),
        **(_gemma_fields(config, dtype) if spec.family in ("gemma2", "gemma3") else {}),
        **(_gemma3_rope_fields(config) if spec.family in ("gemma3", "olmo3") else {}),
        **(_granite_fields(config) if spec.family in GRANITE_FAMILIES else {}),
        **(config["_mamba"] if spec.family in ("granitemoehybrid", "bamba", "nemotron_h", "falcon_h1") else {}),
        **(config["_nemotron_h"] if spec.family == "nemotron_h" else {}),
        **(config["_falcon_h1"] if spec.family == "falcon_h1" else {}),
        **({"hidden_act": UP_MLP_FAMILIES[spec.family]} if spec.family in UP_MLP_FAMILIES else {}),
        **(config["_lfm2"] if spec.family in LFM2_FAMILIES else {}),
        **(config["_olmo_hybrid"] if spec.family == "olmo_hybrid" else {}),
        # OLMo 2 and 3: only the sub-layers' outputs normed, q/k norms over the whole projections (runtime/models/olmo2.py)
        **({"sandwich_norms": True, "pre_norms": False, "qk_norm_full_width": True}
           if spec.family in ("olmo2", "olmo3") else {}),
        # EXAONE 4: OLMo 2's norm placement with per-head q/k norms (runtime/models/exaone4.py)
        **({"sandwich_norms": True, "pre_norms": False} if spec.family == "exaone4" else {}),
        # Seed-OSS: o_proj's bias where attention_out_bias (runtime/models/seed_oss.py)
        **({"o_bias": bool(config["attention_out_bias"])} if spec.family == "seed_oss" else {}),
        # ERNIE 4.5 (and its MoE): interleaved rotary pairs over the whole head (runtime/models/ernie4_5.py)
        **({"rotary_interleaved": True} if spec.family in ("ernie4_5", "ernie4_5_moe") else {}),
        **({"qk_norm_full_width": True} if spec.family in ("olmoe", "minimax_m2") else {}),  # OLMoE, MiniMax-M2: OLMo 2's
        # q/k norms
        # GLM-4: the sub-layers' outputs normed too, interleaved rotary pairs (runtime/models/glm4.py)
        **({"sandwich_norms": True, "rotary_interleaved": True} if spec.family == "glm4" else {}),
        **(_cohere_fields(config, spec.family) if spec.family in COHERE_FAMILIES else {}),
        **(_gpt_oss_fields(config) if spec.family == "gpt_oss" else {}),
        **(config["_query_temperature"] if spec.family in ("ministral3", "mistral4") else {}),
        **(config["_llama4"] if spec.family == "llama4" else {}),
        # SmolLM3's, EXAONE 4's, Llama 4's (_smollm3_config, _exaone4_config, _llama4_config)
        nope_layers=config.get("_nope_layers", []),
        # Phi-3's, GLM-4's, GLM-4.5's, MiniMax-M2's and Qwen3.5's partial_rotary_factor (_phi3_rope, _glm4_rope,
        # _minimax_m2_config, _qwen3_5_config); the other families' transformers models rotate whole heads
        rotary_dim=config.get("_rotary_dim"),
        **(_classifier_fields(config) if _is_classifier(config) else {}),
    )


def _is_classifier(config: dict) -> bool:
    if config["architectures"][0] in CLASSIFIER_ARCHITECTURES:
        return True
    if config.get("classifier_from_token") is not None:
        raise CheckpointError(f"classifier_from_token makes a sequence classifier; set architectures to one too (e.g. "
                              f"{config['architectures'][0].replace('ForCausalLM', 'ForSequenceClassification')}), "
                              "as vLLM's hf_overrides do")
    return False


CLASSIFIER_FROM_TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")


def classifier_from_token(config: dict) -> tuple[list[str], str] | None:
    """vLLM's conversion of a causal LM into a classifier (hf_overrides classifier_from_token, method,
    is_original_qwen3_reranker): the tokens whose LM-head rows become the classifier's `score`, and how: one
    score from two tokens' softmax (from_2_way_softmax: row[1] - row[0], so its sigmoid is the second token's
    probability of the two; Qwen3-Reranker, mxbai-rerank-v2), or one label per token (no_post_processing).
    None without classifier_from_token."""
    tokens = config.get("classifier_from_token")
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise CheckpointError(f"classifier_from_token {tokens!r}: give a list of tokens (e.g. [\"no\", \"yes\"])")
    method = config.get("method") or ("from_2_way_softmax" if config.get("is_original_qwen3_reranker")
                                      else "no_post_processing")
    if method not in CLASSIFIER_FROM_TOKEN_METHODS:
        raise CheckpointError(f"method {method!r}: classifier_from_token converts by "
                              f"{' or '.join(CLASSIFIER_FROM_TOKEN_METHODS)}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise CheckpointError(f"classifier_from_token {tokens}: from_2_way_softmax takes two tokens (the negative "
                              "one first, e.g. [\"no\", \"yes\"])")
    return tokens, method


def score_from_token_rows(head: torch.Tensor, token_ids: list[int], method: str) -> torch.Tensor:
    """The classifier's `score` [num_labels, hidden] from the LM head's rows of the tokens (classifier_from_token)."""
    rows = head.float()[token_ids]
    return (rows[1] - rows[0]).unsqueeze(0) if method == "from_2_way_softmax" else rows


# sentence-transformers' CrossEncoder activation (config.json's sentence_transformers.activation_fn, or the older
# sbert_ce_default_activation_function) → the classifier activation it names
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}


def _classifier_fields(config: dict) -> dict:
    """A sequence classifier's fields: num_labels and labels from id2label (transformers' default, 2 classes
    LABEL_0 and LABEL_1, where the config has neither), and the activation of its logits by vLLM's rule: a
    sentence-transformers CrossEncoder's activation_fn when the config names one, else transformers' loss for
    problem_type (regression: identity; multi_label_classification: sigmoid), else (single_label_classification
    or none) sigmoid for one label and softmax for more."""
    from_tokens = classifier_from_token(config)
    id2label = config.get("id2label")
    if from_tokens is not None:  # (the tokens name the labels, or one score from two)
        tokens, method = from_tokens
        id2label = {} if method == "from_2_way_softmax" else dict(enumerate(tokens))
        config = {k: v for k, v in config.items() if k != "num_labels"}
    if id2label:
        try:
            by_index = {int(k): str(v) for k, v in id2label.items()}
        except (AttributeError, TypeError, ValueError):
            raise CheckpointError(f"id2label {id2label!r}: expected an object of class index → label name") from None
        if sorted(by_index) != list(range(len(by_index))):
            raise CheckpointError(f"id2label: indices {sorted(by_index)} must be 0..n-1")
        labels = [by_index[i] for i in range(len(by_index))]
    else:
        labels = [f"LABEL_{i}" for i in range(1 if from_tokens else int(config.get("num_labels", 2)))]
    num_labels = len(labels)
    if config.get("num_labels") not in (None, num_labels):
        raise CheckpointError(f"num_labels {config['num_labels']} disagrees with id2label's {num_labels} labels")
    st = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function")
    problem_type = config.get("problem_type")
    if st is not None:
        if st not in _ST_ACTIVATIONS:
            raise CheckpointError(f"sentence-transformers activation_fn {st!r} is not supported; supported: "
                                  f"{', '.join(_ST_ACTIVATIONS)}")
        activation = _ST_ACTIVATIONS[st]
    elif problem_type in (None, "single_label_classification", "multi_label_classification", "regression"):
        activation = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(
            problem_type, "sigmoid" if num_labels == 1 else "softmax")
    else:
        raise CheckpointError(f"problem_type {problem_type!r} is not one of transformers' (regression, "
                              "single_label_classification, multi_label_classification)")
    return {"num_labels": num_labels, "labels": labels, "classifier_activation": activation}


def _is_number(value) -> bool:
    """An int or float from a config.json (not a bool, which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# the families with Granite's multipliers
GRANITE_FAMILIES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid")
GRANITE_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def _check_granite(config: dict) -> None:
    """Granite's four multipliers must be positive numbers; its q/k/v/o and MLP biases (attention_bias, mlp_bias:
    false in published checkpoints) are refused by name, as the runtime's Llama layout has no o_proj/MLP bias."""
    for key in GRANITE_MULTIPLIERS:
        value = config[key]
        if not _is_number(value) or not 0 < value < math.inf:
            raise CheckpointError(f"{key} {value!r}: Granite's multipliers must be positive numbers")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{key}: true is not supported for Granite (its q/k/v/o or MLP biases)")


def _granite4_config(config: dict) -> dict:
    """A Granite 4.0 config as GraniteMoeHybridConfig and its model read it: without experts (num_local_experts 0)
    `intermediate_size`, the MLP's width, is shared_intermediate_size (the MLP is its shared_mlp); with them
    (granite-4.0-h-tiny, h-small) intermediate_size stays the experts' width and shared_mlp is the shared expert of
    every layer's MoE (_moe_fields); `_nope_layers`, every layer unless position_embedding_type is "rope"
    (transformers rotates only then); `_mamba`, the Mamba-2 layers (layer_types mamba / linear_attention; every layer
    where layer_types is absent) and their sizes (mamba_d_head "auto": mamba_expand * hidden_size / mamba_n_heads).
    Refused by name: a position_embedding_type other than rope, nope or null, no attention layer at all,
    mamba_proj_bias, a time_step_limit other than (0, inf), a hidden_act other than silu with Mamba-2 layers."""
    config = {**_HF_CONFIG_DEFAULTS["granitemoehybrid"], **config}  # (whatever its model_type says)
    layers = config["num_hidden_layers"]
    kinds = config["layer_types"] or config.get("layers_block_type") or ["mamba"] * layers
    if any(kind not in ("attention", "full_attention", "mamba", "linear_attention") for kind in kinds):
        raise CheckpointError(f"layer_types {kinds!r}: Granite 4.0's layers are attention or mamba (linear_attention)")
    if len(kinds) != layers:
        raise CheckpointError(f"layer_types has {len(kinds)} entries for {layers} layers")
    mamba = [i for i, kind in enumerate(kinds) if kind in ("mamba", "linear_attention")]
    if len(mamba) == layers:
        raise CheckpointError(f"layer_types {config['layer_types']!r}: every layer Mamba-2 (no attention layer; also "
                              "where layer_types is absent) is not supported; Granite 4.0's hybrids mix attention in")
    config["_mamba"] = _mamba_fields(config, mamba, "Granite 4.0") if mamba else {}
    position = config["position_embedding_type"]
    if position not in ("rope", "nope", None):
        raise CheckpointError(f"position_embedding_type {position!r} is not supported for Granite 4.0; supported: "
                              "rope, nope or null (no rotary)")
    if not config["num_local_experts"]:  # (with experts: intermediate_size is theirs, _moe_fields)
        config["intermediate_size"] = config["shared_intermediate_size"]
    if position != "rope":
        config["_nope_layers"] = list(range(config["num_hidden_layers"]))
    return config


def _bamba_config(config: dict) -> dict:
    """A Bamba config as BambaConfig and its model read it: `_mamba`, every layer not in attn_layer_indices a Mamba-2
    layer (Granite 4.0's mixer and fields: _mamba_fields); its attention layers rotate the leading
    partial_rotary_factor of each head (the rope parameters' own, else 0.5: BambaConfig sets 0.5 whatever the top
    level says; _glm4_rope's reading). Refused by name: no attention layer (attn_layer_indices null or empty), an
    index past the layers, attention_bias / mlp_bias, and _mamba_fields' refusals."""
    layers = config["num_hidden_layers"]
    attention = sorted(set(config["attn_layer_indices"] or []))
    if not attention:
        raise CheckpointError(f"attn_layer_indices {config['attn_layer_indices']!r}: every layer Mamba-2 (no attention "
                              "layer) is not supported; Bamba's checkpoints mix attention in")
    if not all(isinstance(i, int) and 0 <= i < layers for i in attention):
        raise CheckpointError(f"attn_layer_indices {config['attn_layer_indices']!r}: indices must be layers 0 to "
                              f"{layers - 1}")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{key}: true is not supported for Bamba (its q/k/v/o or MLP biases; its "
                                  "checkpoints set it false)")
    mamba = [i for i in range(layers) if i not in attention]
    config = _glm4_rope({k: v for k, v in config.items() if k != "partial_rotary_factor"})
    return {**config, "_mamba": _mamba_fields(config, mamba, "Bamba")}


# Nemotron-H's block kinds: layers_block_type's names, hybrid_override_pattern's characters
_NEMOTRON_H_BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _nemotron_h_config(config: dict) -> dict:
    """A Nemotron-H config as NemotronHConfig and its model read it: the blocks from `layers_block_type` (else
    `hybrid_override_pattern`: M, *, -, E), their number the layers (num_hidden_layers is not read, as transformers);
    `_nemotron_h`, the layers without an MLP (M, *) and without a mixer (-, E), hidden_act relu2 and the E blocks' MoE
    fields (_nemotron_h_moe_fields); `_mamba`, the M
    blocks' Mamba-2 sizes (the older mamba_* key names too); `_nope_layers`, every layer (no rotary); rms_norm_eps
    layer_norm_epsilon. Refused by name: no attention block, q/k/v/o, MLP or Mamba-2 projection biases,
    an intermediate_size that differs per MLP block, a sliding_window, an activation other than relu2 (MLP) / silu
    (Mamba-2), a time_step_limit other than (0, inf). transformers' chunked scan clamps dt below at time_step_min,
    its one-token step does not; vLLM clamps in neither, nor does the runtime (Granite 4.0's mixer)."""
    renamed = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
               "mamba_conv_bias": "use_conv_bias", "mamba_dt_limit": "time_step_limit"}
    config = {**config, **{new: config[old] for old, new in renamed.items() if old in config}}
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if kinds is None:
        pattern = config.get("hybrid_override_pattern") or ""
        if not pattern or set(pattern) - set(_NEMOTRON_H_BLOCKS):
            raise CheckpointError(f"hybrid_override_pattern {pattern!r}: Nemotron-H's blocks are M, *, - or E (or "
                                  "give layers_block_type)")
        kinds = [_NEMOTRON_H_BLOCKS[c] for c in pattern]
    if set(kinds) - set(_NEMOTRON_H_BLOCKS.values()):
        raise CheckpointError(f"layers_block_type {kinds!r}: Nemotron-H's blocks are linear_attention, "
                              "full_attention, mlp or moe")
    if "full_attention" not in kinds:
        raise CheckpointError("layers_block_type: no full_attention (*) block (every mixer Mamba-2) is not supported; "
                              "Nemotron-H's checkpoints mix attention in")
    for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
        if config.get(key):
            raise CheckpointError(f"{key}: true is not supported for Nemotron-H (q/k/v/o, MLP or Mamba-2 in_proj / "
                                  "out_proj biases; its checkpoints set it false)")
    width = config["intermediate_size"]
    if isinstance(width, list):  # (vLLM's per-MLP-block widths)
        if len(set(width)) != 1:
            raise CheckpointError(f"intermediate_size {width}: MLP blocks of different widths are not supported; "
                                  "one width for every block is")
        width = width[0]
    if config.get("sliding_window") is not None:
        raise CheckpointError(f"sliding_window {config['sliding_window']}: Nemotron-H's attention runs over the "
                              "whole context (transformers builds no window); set it null")
    if config["mlp_hidden_act"] != "relu2" or config["mamba_hidden_act"] not in ("silu", "swish"):
        raise CheckpointError(f"mlp_hidden_act {config['mlp_hidden_act']!r}, mamba_hidden_act "
                              f"{config['mamba_hidden_act']!r}: Nemotron-H runs relu2 MLPs and silu Mamba-2 convs only")
    limit = [float(v["__float__"]) if isinstance(v, dict) else float(v)  # (transformers writes inf as an object)
             for v in config.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        raise CheckpointError(f"time_step_limit {limit!r} is not supported for Nemotron-H's Mamba-2 blocks; only "
                              "(0.0, inf) (dt unclamped, as vLLM runs them)")
    layers = len(kinds)
    mamba = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
    heads, head_dim, groups = config["mamba_num_heads"], config["mamba_head_dim"], config["n_groups"]
    if heads % groups:
        raise CheckpointError(f"mamba_num_heads {heads} must be a multiple of n_groups {groups}")
    moe = [i for i, kind in enumerate(kinds) if kind == "moe"]
    return {**config, "num_hidden_layers": layers, "intermediate_size": width,
            "rms_norm_eps": config["layer_norm_epsilon"], "_nope_layers": list(range(layers)),
            "_nemotron_h": {"hidden_act": "relu2",
                            "no_mlp_layers": [i for i, kind in enumerate(kinds) if kind not in ("mlp", "moe")],
                            "no_mixer_layers": [i for i, kind in enumerate(kinds) if kind in ("mlp", "moe")],
                            **(_nemotron_h_moe_fields(config, moe) if moe else {})},
            "_mamba": {"mamba_layers": mamba, "mamba_num_heads": heads, "mamba_head_dim": head_dim,
                       "mamba_n_groups": groups, "mamba_d_state": config["ssm_state_size"],
                       "mamba_conv_kernel": config["conv_kernel"], "mamba_chunk_size": config["chunk_size"],
                       "mamba_conv_bias": bool(config["use_conv_bias"])} if mamba else {}}


def _nemotron_h_moe_fields(config: dict, layers: list[int]) -> dict:
    """Nemotron-H's moe (E) blocks as NemotronHMoE reads the config: n_routed_experts of moe_intermediate_size (relu2,
    no gate), top num_experts_per_tok by DeepSeek-V3's router (NemotronHTopkRouter: sigmoid, e_score_correction_bias,
    n_group / topk_group, norm_topk_prob, routed_scaling_factor), one shared expert of
    moe_shared_expert_intermediate_size. Refused by name: a moe_latent_size (the experts' latent projections),
    n_shared_experts other than 1, scoring_func / topk_method other than sigmoid / noaux_tc."""
    if config["moe_latent_size"] is not None:
        raise CheckpointError(f"moe_latent_size {config['moe_latent_size']}: Nemotron-H's latent MoE projections "
                              "(fc1_latent_proj / fc2_latent_proj) are not supported; set it null (Nemotron 3 Nano's)")
    if config["n_shared_experts"] != 1 or not config["moe_shared_expert_intermediate_size"]:
        raise CheckpointError(f"n_shared_experts {config['n_shared_experts']!r}: Nemotron-H's moe blocks are read with "
                              "one shared expert of moe_shared_expert_intermediate_size (transformers' NemotronHMoE); "
                              "set it to 1")
    scoring, method = config.get("scoring_func"), config.get("topk_method")
    if scoring not in (None, "sigmoid") or method not in (None, "noaux_tc"):
        raise CheckpointError(f"scoring_func {scoring!r}, topk_method {method!r}: transformers' Nemotron-H routes by "
                              "sigmoid with noaux_tc (e_score_correction_bias)")
    experts, groups = config["n_routed_experts"], (config["n_group"], config["topk_group"])
    _check_router_groups(experts, *groups, pairs=True)
    return {"num_experts": experts, "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"], "norm_topk_prob": bool(config["norm_topk_prob"]),
            "moe_layers": layers, "shared_expert_intermediate_size": config["moe_shared_expert_intermediate_size"],
            "router_scoring": "sigmoid", "router_groups": groups[0], "router_topk_groups": groups[1],
            "routed_scaling_factor": float(config["routed_scaling_factor"])}


FALCON_H1_MULTIPLIERS = {"embedding_multiplier": 1, "lm_head_multiplier": 1, "key_multiplier": 1,
                         "attention_in_multiplier": 1, "attention_out_multiplier": 1, "ssm_in_multiplier": 1,
                         "ssm_out_multiplier": 1, "mlp_multipliers": 2, "ssm_multipliers": 5}


def _falcon_h1_config(config: dict) -> dict:
    """A Falcon-H1 config as FalconH1Config and its model read it: `_mamba`, every layer a Mamba-2 mixer (_mamba_fields,
    its width mamba_d_ssm) beside the attention (mamba_with_attention), mamba_rms_norm as given; `_falcon_h1`, the
    embeddings times embedding_multiplier (a Python float in transformers' model: unrounded, as Granite's). The other
    multipliers are folded into the weights (multiplier_fold). Refused by name: a multiplier that is not a finite
    number (mlp_multipliers two, ssm_multipliers five), attention_bias / mlp_bias / projectors_bias, mamba_rms_norm
    with mamba_norm_before_gate true (transformers' eval path norms before the gate, its fused kernel and vLLM gate
    first), and _mamba_fields' refusals (mamba_proj_bias, a time_step_limit, hidden_act)."""
    for key, count in FALCON_H1_MULTIPLIERS.items():
        value = config[key]
        values = value if count > 1 else [value]
        if not isinstance(values, list) or len(values) != count or not all(
                _is_number(v) and math.isfinite(v) for v in values):
            raise CheckpointError(f"{key} {value!r}: Falcon-H1's multipliers are finite numbers"
                                  + (f" ({count} of them)" if count > 1 else ""))
    for key in ("attention_bias", "mlp_bias", "projectors_bias"):
        if config.get(key):
            raise CheckpointError(f"{key}: true is not supported for Falcon-H1 (q/k/v/o, MLP or Mamba-2 out_proj "
                                  "biases; its checkpoints set it false)")
    if config["mamba_rms_norm"] and config["mamba_norm_before_gate"]:
        raise CheckpointError("mamba_rms_norm with mamba_norm_before_gate: true is not supported for Falcon-H1 "
                              "(transformers norms before the gate there, vLLM after it); set mamba_norm_before_gate "
                              "false (the gated norm of Granite 4.0's mixer) or mamba_rms_norm false")
    mamba = _mamba_fields(config, list(range(config["num_hidden_layers"])), "Falcon-H1")
    embed = float(config["embedding_multiplier"])
    return {**config, "_falcon_h1": {"embed_scale": None if embed == 1.0 else embed},
            "_mamba": {**mamba, "mamba_with_attention": True, "mamba_rms_norm": bool(config["mamba_rms_norm"])}}


def _falcon_h1_factors(spec: ModelSpec, config: ModelConfig, hf_config: dict) -> dict[str, float | torch.Tensor]:
    """Falcon-H1's folds (multiplier_fold): each layer's q_proj and v_proj times attention_in_multiplier, k_proj times
    it and key_multiplier (before the rotary, which is linear), o_proj times attention_out_multiplier; mamba.in_proj's
    rows times ssm_in_multiplier and their part's ssm_multipliers entry (transformers' mup_vector: z, x, B, C, dt),
    out_proj times ssm_out_multiplier; gate_proj and down_proj times mlp_multipliers' two; the final norm times
    lm_head_multiplier (as Granite's 1 / logits_scaling). Only factors other than 1."""
    hf = with_hf_defaults(hf_config)
    attn_in, key = float(hf["attention_in_multiplier"]), float(hf["key_multiplier"])
    width, states = config.mamba_num_heads * config.mamba_head_dim, config.mamba_n_groups * config.mamba_d_state
    rows = torch.tensor([float(m) for m in hf["ssm_multipliers"]]).repeat_interleave(
        torch.tensor([width, width, states, states, config.mamba_num_heads])) * float(hf["ssm_in_multiplier"])
    per_layer = {"self_attn.q_proj": attn_in, "self_attn.k_proj": attn_in * key, "self_attn.v_proj": attn_in,
                 "self_attn.o_proj": float(hf["attention_out_multiplier"]), "mamba.in_proj": rows,
                 "mamba.out_proj": float(hf["ssm_out_multiplier"]),
                 "feed_forward.gate_proj": float(hf["mlp_multipliers"][0]),
                 "feed_forward.down_proj": float(hf["mlp_multipliers"][1])}
    factors = {f"{spec.hf_layer_prefix}{i}.{name}.weight": f for i in range(config.num_layers)
               for name, f in per_layer.items()} | {spec.global_tensors["norm.weight"]: float(hf["lm_head_multiplier"])}
    return {name: f for name, f in factors.items() if not (f == 1.0 if isinstance(f, float) else bool((f == 1).all()))}


def _granite_fields(config: dict) -> dict:
    """Granite's runtime fields: the embeddings times embedding_multiplier (a Python float in transformers'
    GraniteModel, so unrounded here too) and attention_multiplier as the attention's scale itself. Its
    residual_multiplier and logits_scaling are folded into the weights (multiplier_fold)."""
    embed = float(config["embedding_multiplier"])
    return {"embed_scale": None if embed == 1.0 else embed, "softmax_scale": float(config["attention_multiplier"])}


def _check_gemma(config: dict, name: str) -> None:
    """What Gemma 2 and 3 configs can say that llmc does not run, refused by name."""
    if config.get("use_bidirectional_attention"):
        raise CheckpointError("use_bidirectional_attention: true (an embedding model's non-causal attention) is not "
                              "supported; llmc serves causal decoders")
    if config.get("attention_bias"):
        raise CheckpointError(f"attention_bias: true is not supported for {name} (q/k/v/o biases)")
    if config.get("hidden_activation") != "gelu_pytorch_tanh":
        raise CheckpointError(f"hidden_activation {config.get('hidden_activation')!r} is not supported for {name}; "
                              "supported: gelu_pytorch_tanh")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = config.get(key)
        if cap is not None and (not _is_number(cap) or not cap > 0):
            raise CheckpointError(f"{key} {cap!r}: a soft cap must be a positive number (null: none)")


def _gemma2_config(config: dict) -> dict:
    """A Gemma 2 config checked (_check_gemma), with `layer_types` as Gemma2Config fills it in when absent
    (published configs have none): layer i slides when (i + 1) % 2, the even layers. One rotary table
    (rope_theta, or rope_parameters) for every layer."""
    _check_gemma(config, "Gemma 2")
    params = config.get("rope_parameters") or {}
    if {"full_attention", "sliding_attention"} & set(params):
        raise CheckpointError(f"rope_parameters {sorted(params)}: Gemma 2 has one rotary table for every layer "
                              "(rope_theta), not one per layer type")
    config = dict(config)
    if config.get("layer_types") is None:
        config["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    return config


def _gemma3_config(config: dict) -> dict:
    """A Gemma 3 text config checked and put in the form the shared reading takes: refused by name where
    llmc cannot run it; `layer_types` from the older `sliding_window_pattern` (layer i slides unless
    (i + 1) % pattern == 0; 6 by default), and the full-attention layers' rope as `rope_parameters`
    (transformers 5 keeps one per layer type; older configs: rope_theta + rope_scaling, and
    rope_local_base_freq for the sliding layers). A final_logit_softcapping (null in Gemma 3 checkpoints) is
    applied as Gemma 2's, as transformers' Gemma3ForCausalLM applies it; an attn_logit_softcapping is refused:
    transformers' Gemma 3 attention (5.x) never applies it, so neither reading would be the reference's."""
    _check_gemma(config, "Gemma 3")
    if config.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"attn_logit_softcapping {config['attn_logit_softcapping']}: transformers' Gemma 3 "
                              "attention does not apply it (Gemma 2's does); Gemma 3 checkpoints set it to null")
    config = dict(config)
    if config.get("layer_types") is None:
        pattern = config.get("sliding_window_pattern") or 6
        config["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    params = config.get("rope_parameters")
    if params is not None and not set(params) <= {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"rope_parameters {sorted(params)}: Gemma 3 keeps one per layer type "
                              "(full_attention, sliding_attention)")
    if params is None:
        full = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    else:
        full = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
    config["rope_parameters"] = full
    config["_rope_parameters_local"] = local
    return config


def _olmo3_config(config: dict) -> dict:
    """An OLMo 3 config in the form the shared reading takes: `layer_types` as Olmo3Config fills it in when absent
    (layer i slides unless (i + 1) % 4 == 0), and its rotary tables as transformers' Olmo3 builds them, one per
    layer type: `rope_parameters` (the full layers': a legacy rope_scaling applies to them only) and the sliding
    layers' (`_rope_parameters_local`: the plain rope at the same theta unless the config gives them their own)."""
    config = dict(config)
    if config.get("layer_types") is None:
        config["layer_types"] = ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    params = config.get("rope_parameters")
    theta = config.get("rope_theta", 500000.0)
    if params is not None and set(params) <= {"full_attention", "sliding_attention"}:
        full = {"rope_theta": theta, **(params.get("full_attention") or {})}
        local = {"rope_type": "default", "rope_theta": theta, **(params.get("sliding_attention") or {})}
    elif params is not None:
        raise CheckpointError(f"rope_parameters {sorted(params)}: OLMo 3 keeps one per layer type "
                              "(full_attention, sliding_attention)")
    else:
        full = {**(config.get("rope_scaling") or {}), "rope_theta": theta}
        local = {"rope_type": "default", "rope_theta": theta}
    config["rope_parameters"] = full
    config["_rope_parameters_local"] = local
    return config


def _gemma_fields(config: dict, dtype: str) -> dict:
    """Gemma 2's and 3's ModelConfig fields (_gemma2_config / _gemma3_config made `config`). The embedding's
    sqrt(hidden_size) is rounded as transformers does it (Gemma2/Gemma3TextScaledWordEmbedding): a float32
    tensor cast to the weights' dtype."""
    embed_scale = torch.tensor(config["hidden_size"] ** 0.5).to(getattr(torch, dtype)).item()
    caps = {key: None if config.get(key) is None else float(config[key])
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {"hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": float(config["query_pre_attn_scalar"]),
            "embed_scale": embed_scale, "sandwich_norms": True, **caps}


def _gemma3_rope_fields(config: dict) -> dict:
    """Gemma 3's sliding layers' own rotary table."""
    local_theta, local_scaling = _rope({"rope_parameters": config["_rope_parameters_local"],
                                        "max_position_embeddings": config.get("max_position_embeddings")})
    return {"rope_local_theta": local_theta, "rope_local_scaling": local_scaling}


def norm_fold(spec: ModelSpec, config: ModelConfig) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """For a family whose RMSNorm scales by (offset + w) (Gemma: 1 + w), a `TensorReader` merge that reads
    every norm tensor (the layers' norms, q/k norms, the final norm) as float32 offset + w: the plain RMSNorm
    weight the runtime's kernels multiply by. Calibration, AWQ's folds (which divide a norm's weight) and the
    artifact all see the folded weight; it is rounded to the model dtype once, when the artifact is written.
    None for the other families."""
    if not spec.norm_weight_offset:
        return None
    layer_norms = [*spec.layer_norms.values(), *(spec.qk_norms.values() if config.qk_norm else [])]
    names = {spec.global_tensors["norm.weight"]} | {
        f"{spec.hf_layer_prefix}{i}.{hf}.weight" for i in range(config.num_layers) for hf in layer_norms}
    offset = spec.norm_weight_offset
    return lambda name, tensor: tensor.float() + offset if name in names else tensor


def _mamba_fields(config: dict, mamba: list[int], name: str) -> dict:
    """The manifest's mamba_* fields of a hybrid (Granite 4.0, Bamba: `name`) whose Mamba-2 layers are `mamba`."""
    if config.get("mamba_proj_bias"):
        raise CheckpointError(f"mamba_proj_bias: true is not supported for {name} (in_proj / out_proj biases; its "
                              "checkpoints set it false)")
    # (transformers writes inf as {"__float__": "Infinity"})
    limit = [float(v["__float__"]) if isinstance(v, dict) else float(v)
             for v in config.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        raise CheckpointError(f"time_step_limit {limit!r} is not supported for {name}'s Mamba-2 layers; only "
                              "(0.0, inf), transformers' default (dt unclamped)")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise CheckpointError(f"hidden_act {config.get('hidden_act')!r} is not supported for {name}'s hybrids: "
                              "the runtime's MLP and the Mamba-2 conv compute SiLU (hidden_act silu)")
    heads = config.get("mamba_n_heads", 128)
    # (Falcon-H1's mamba_d_ssm, where given, in place of mamba_expand * hidden_size)
    width = config.get("mamba_d_ssm") or config.get("mamba_expand", 2) * config["hidden_size"]
    head_dim = config.get("mamba_d_head", "auto")
    head_dim = width // heads if head_dim in ("auto", None) else head_dim
    if head_dim * heads != width:
        raise CheckpointError(f"mamba_d_head {head_dim} * mamba_n_heads {heads} must be the Mamba-2 width (mamba_d_ssm, "
                              f"else mamba_expand * hidden_size) {width}")
    return {"mamba_layers": mamba, "mamba_num_heads": heads, "mamba_head_dim": head_dim,
            "mamba_n_groups": config.get("mamba_n_groups", 1), "mamba_d_state": config.get("mamba_d_state", 256),
            "mamba_conv_kernel": config.get("mamba_d_conv", 4), "mamba_chunk_size": config.get("mamba_chunk_size", 256),
            "mamba_conv_bias": bool(config.get("mamba_conv_bias", True))}


def multiplier_fold(spec: ModelSpec, config: ModelConfig,
                    hf_config: dict) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """For Granite, a `TensorReader` merge that folds the two multipliers the runtime has no field for into the
    weights they follow, in float32 (rounded to the model dtype once, when the artifact is written):
    residual_multiplier into every layer's o_proj and down_proj weight (the sub-layer outputs it scales before
    the residual add are those linears' outputs, and neither has a bias), and 1 / logits_scaling into the final
    norm's weight (logits = norm(x) W^T is linear in that weight, so the fold holds with tied embeddings too).
    Every kernel, graph and parallel path then runs Granite as a Llama, and quantization, calibration and AWQ see
    the folded weights. For Cohere, logit_scale into the final norm's weight as Granite's 1 / logits_scaling. For
    Falcon-H1, its muP multipliers (_falcon_h1_factors: a factor per row of mamba.in_proj). None for the other
    families, and for a Granite whose two multipliers are 1 (a Cohere whose logit_scale is, a Falcon-H1 whose are)."""
    if spec.family in COHERE_FAMILIES:  # Cohere: the logits times logit_scale, into the final norm's weight
        scale = float(with_hf_defaults(hf_config)["logit_scale"])
        norm = spec.global_tensors["norm.weight"]
        return None if scale == 1.0 else (lambda name, tensor: tensor.float() * scale if name == norm else tensor)
    if spec.family == "falcon_h1":
        factors = _falcon_h1_factors(spec, config, hf_config)
        return None if not factors else lambda name, tensor: tensor.float() * (
            factors[name] if isinstance(factors[name], float) else factors[name][:, None]) if name in factors else tensor
    if spec.family not in GRANITE_FAMILIES:
        return None
    config_ = with_hf_defaults(hf_config)
    residual, logits = float(config_["residual_multiplier"]), float(config_["logits_scaling"])
    # the sub-layers' last linears: o_proj, and the MLP's down_proj or (Granite MoE, Granite 4.0) the experts'
    # output_linear and the shared MLP's (Granite 4.0 without experts: shared_mlp.output_linear its MLP's down)
    # (Granite 4.0's Mamba-2 layers: mamba.out_proj in place of o_proj)
    outputs = ("self_attn.o_proj", spec.layer_linear("mlp.down").hf_members[0]) if spec.moe is None else (
        "self_attn.o_proj", spec.moe.fused[1], "shared_mlp.output_linear")
    if spec.family == "granitemoehybrid":
        outputs += ("mamba.out_proj",)
    factors = {} if residual == 1.0 else {
        f"{spec.hf_layer_prefix}{i}.{name}.weight": residual for i in range(config.num_layers) for name in outputs}
    if logits != 1.0:
        factors[spec.global_tensors["norm.weight"]] = 1.0 / logits
    if not factors:
        return None
    return lambda name, tensor: tensor.float() * factors[name] if name in factors else tensor


def fused_expert_tensors(spec: ModelSpec, config: ModelConfig) -> dict[str, Callable]:
    """For a family that stores every expert of a layer in two tensors (Granite MoE, Llama 4: MoeSpec.fused), a
    `TensorReader` derived tensor for each expert's gate, up and down under its per-expert name, read as expert e's
    slice of the fused tensor (only that slice is read; the reader's merge applies to it, as to the fused tensor):
    gate the first moe_intermediate_size rows of input_linear[e], up the rest, down output_linear[e] (Llama 4: columns
    of gate_up_proj[e] and down_proj[e], transposed). {} otherwise."""
    moe = spec.moe
    if moe is None or moe.fused is None:
        return {}
    width, derived = config.moe_intermediate_size, {}
    for i in config.moe_layers:
        layer = f"{spec.hf_layer_prefix}{i}."
        suffix = "" if moe.fused_layout == "llama4" else ".weight"  # (Llama 4's are parameters of the experts module)
        gate_up, down = (f"{layer}{name}{suffix}" for name in moe.fused)
        for e in range(config.num_experts):
            prefix = layer + moe.expert_prefix.format(e)
            if moe.fused_layout == "llama4":  # input-major: gate_up [hidden, 2 * width], down [width, hidden]
                derived[f"{prefix}{moe.gate}.weight"] = lambda r, n=gate_up, e=e: _columns(r.get_index(n, e), 0, width)
                derived[f"{prefix}{moe.up}.weight"] = lambda r, n=gate_up, e=e: _columns(r.get_index(n, e), width, None)
                derived[f"{prefix}{moe.down}.weight"] = lambda r, n=down, e=e: _columns(r.get_index(n, e), 0, None)
                continue
            derived[f"{prefix}{moe.gate}.weight"] = lambda r, n=gate_up, e=e: r.get_index(n, e)[:width]
            derived[f"{prefix}{moe.up}.weight"] = lambda r, n=gate_up, e=e: r.get_index(n, e)[width:]
            derived[f"{prefix}{moe.down}.weight"] = lambda r, n=down, e=e: r.get_index(n, e)
    return derived


def _columns(tensor: torch.Tensor, start: int, stop: int | None) -> torch.Tensor:
    """Columns [start, stop) of an input-major [in, out] tensor as a Linear's [out, in] weight."""
    return tensor[:, start:stop].t().contiguous()


# DeepSeek-V3's layers: GLM-4.7-Flash and Mistral 4 too (their config differences read by _deepseek_config)
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4")
_DEEPSEEK_NAMES = {"deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3", "glm4_moe_lite": "GLM-4.7-Flash",
                   "mistral4": "Mistral 4"}
# routed by moe.deepseek_route (their own MoE fields)
DEEPSEEK_ROUTER_FAMILIES = (*DEEPSEEK_FAMILIES, "glm4_moe", "dots1", "ernie4_5_moe", "minimax_m2", "lfm2_moe",
                            "nemotron_h")


def _deepseek_config(config: dict, family: str) -> dict:
    """A DeepSeek config checked, refusing by name what transformers' DeepseekV2/V3ForCausalLM would not run as its
    config says (or llmc does not build), with the attention's head as the KV cache holds it: head_dim
    qk_nope_head_dim + qk_rope_head_dim (transformers' head_dim is the rope part's), one KV head per query head.
    GLM-4.7-Flash's sparse layers from mlp_layer_types, Mistral 4's rope and query temperature (_glm4_moe_lite_layers,
    _mistral4_rope)."""
    name = _DEEPSEEK_NAMES[family]
    if family == "glm4_moe_lite":
        config = _glm4_moe_lite_layers(config)
    if family == "mistral4":
        config = _mistral4_rope(config)
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{key}: true is not supported for {name} (its attention's or MLPs' biases)")
    if config.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"moe_layer_freq {config['moe_layer_freq']}: transformers' {name} ignores it (every "
                              "layer from first_k_dense_replace on is an MoE); published checkpoints set 1")
    heads = config["num_attention_heads"]
    if (config.get("num_key_value_heads") or heads) != heads:
        raise CheckpointError(f"num_key_value_heads {config['num_key_value_heads']}: {name}'s attention expands one K "
                              f"and V head per query head; set it to num_attention_heads ({heads})")
    if not config.get("kv_lora_rank"):
        raise CheckpointError(f"kv_lora_rank {config.get('kv_lora_rank')!r}: {name}'s attention needs the compressed "
                              "kv's width")
    if config["v_head_dim"] > config["qk_nope_head_dim"] + config["qk_rope_head_dim"]:
        raise CheckpointError(f"v_head_dim {config['v_head_dim']} is wider than the key's qk_nope_head_dim + "
                              "qk_rope_head_dim: the attention's output buffers (the CUDA graphs') are the key's head_dim wide")
    if not config.get("num_experts_per_tok") or not config.get("n_routed_experts"):
        raise CheckpointError(f"{name}: n_routed_experts and num_experts_per_tok must be set (the MoE layers' experts "
                              "and top-k)")
    if family in ("deepseek_v2", "mistral4") and (config.get("num_nextn_predict_layers")
                                                 or config.get("num_mtp_layers")):
        logger.info("%s: the multi-token prediction layers (num_nextn_predict_layers) are not built, as transformers "
                    "skips them (llmc builds DeepSeek-V3's, GLM-4.5's and GLM-4.7-Flash's: compiler/mtp.py)", name)
    return {**config, "head_dim": config["qk_nope_head_dim"] + config["qk_rope_head_dim"],
            "num_key_value_heads": heads}


def _deepseek_fields(config: dict, family: str) -> dict:
    """DeepSeek's MLA and MoE fields (runtime/models/mla.py, moe.deepseek_route). The attention's scale is
    qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a rope scaling (transformers' yarn_apply_mscale).
    V2's router: softmax, top-k greedy or group_limited_greedy, never renormalised (transformers' DeepseekV2TopkRouter
    reads no norm_topk_prob: one set true is refused); V3's and GLM-4.7-Flash's: sigmoid with e_score_correction_bias,
    n_group / topk_group (transformers runs noaux_tc whatever topk_method says), norm_topk_prob; Mistral 4's: softmax
    top-k (no bias) renormalised where norm_topk_prob, its groups only where every group is kept."""
    experts, num_layers = config["n_routed_experts"], config["num_hidden_layers"]
    scoring, method = config.get("scoring_func"), config.get("topk_method")
    name = _DEEPSEEK_NAMES[family]
    if family == "mistral4":
        if scoring not in (None, "softmax") or method not in (None, "greedy"):
            raise CheckpointError(f"scoring_func {scoring!r}, topk_method {method!r}: transformers' Mistral 4 routes "
                                  "by softmax top-k (Mistral4TopkRouter, no score bias)")
        groups = (config["n_group"], config["topk_group"])
        _check_router_groups(experts, *groups, pairs=True)
        if groups[1] < groups[0]:
            raise CheckpointError(f"n_group {groups[0]}, topk_group {groups[1]}: Mistral 4's group-limited routing "
                                  "(groups scored by their two best softmax scores) is not supported; set topk_group "
                                  "to n_group (every group kept, as published checkpoints' 1 and 1)")
        groups = (None, None)  # (every group kept: the plain top-k)
    elif family == "deepseek_v2":
        if scoring not in (None, "softmax") or method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"scoring_func {scoring!r}, topk_method {method!r}: transformers' DeepSeek-V2 routes "
                                  "by softmax, greedy or group_limited_greedy")
        if config.get("norm_topk_prob"):
            raise CheckpointError("norm_topk_prob: true is not supported for DeepSeek-V2: transformers' "
                                  "DeepseekV2TopkRouter does not renormalise (DeepSeek's own code would)")
        groups = (config["n_group"], config["topk_group"]) if method == "group_limited_greedy" else (None, None)
    else:
        if scoring not in (None, "sigmoid") or method not in (None, "noaux_tc"):
            raise CheckpointError(f"scoring_func {scoring!r}, topk_method {method!r}: transformers' {name} routes "
                                  "by sigmoid with noaux_tc")
        groups = (config["n_group"], config["topk_group"])
    if groups[0] is not None:
        _check_router_groups(experts, *groups, pairs=family != "deepseek_v2")
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    _, rope_scaling = _rope(config)
    scale = qk_head_dim ** -0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        factor = rope_scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * rope_scaling["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    shared = config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0)
    return {"num_experts": experts, "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "norm_topk_prob": family != "deepseek_v2" and bool(config.get("norm_topk_prob")),
            "moe_layers": config["_moe_layers"] if "_moe_layers" in config else list(
                range(config["first_k_dense_replace"] or 0, num_layers)),
            "shared_expert_intermediate_size": shared or None,
            "router_scoring": "softmax" if family in ("deepseek_v2", "mistral4") else "sigmoid",
            "router_groups": groups[0], "router_topk_groups": groups[1],
            "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
            "kv_lora_rank": config["kv_lora_rank"], "q_lora_rank": config.get("q_lora_rank") or None,
            "qk_nope_head_dim": config["qk_nope_head_dim"], "qk_rope_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"], "softmax_scale": scale,
            "mla_rope_interleave": family == "deepseek_v2" or bool(config.get("rope_interleave", True))}


def _glm4_moe_lite_layers(config: dict) -> dict:
    """GLM-4.7-Flash's sparse layers (`_moe_layers`) as Glm4MoeLiteDecoderLayer reads them: mlp_layer_types, one dense
    or sparse per layer (by default the first dense, the rest sparse), refused by name where a first_k_dense_replace
    in the config says otherwise (transformers reads only mlp_layer_types; DeepSeek's key says the same of published
    checkpoints); its rotary checked as _mla_rope_dims (over qk_rope_head_dim, transformers' head_dim)."""
    num_layers, kinds = config["num_hidden_layers"], config.get("mlp_layer_types")
    kinds = ["dense"] + ["sparse"] * (num_layers - 1) if kinds is None else kinds
    if not isinstance(kinds, list) or len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
        raise CheckpointError(f"mlp_layer_types {kinds!r}: GLM-4.7-Flash needs one of 'dense' or 'sparse' for each of "
                              f"its {num_layers} layers")
    sparse = [i for i, kind in enumerate(kinds) if kind == "sparse"]
    first = config.get("first_k_dense_replace")
    if first is not None and sparse != list(range(first, num_layers)):
        raise CheckpointError(f"first_k_dense_replace {first} disagrees with mlp_layer_types (sparse layers {sparse}): "
                              "transformers' GLM-4.7-Flash reads mlp_layer_types only; make them agree, or drop "
                              "first_k_dense_replace")
    return {**_mla_rope_dims(config, config["qk_rope_head_dim"], 1.0), "_moe_layers": sparse}


def _mistral4_rope(config: dict) -> dict:
    """Mistral 4's rope as Mistral4Config reads it: its default rope_parameters (YaRN x128 over 8192 positions) where
    the config gives neither rope_parameters nor rope_scaling; the rotary over int(head_dim * partial_rotary_factor)
    dims (default qk_rope_head_dim / head_dim: _mla_rope_dims); `_query_temperature` from llama_4_scaling_beta and
    original_max_position_embeddings (_llama_4_scaling), which its attention requires."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or _MISTRAL4_ROPE)
    temperature = _llama_4_scaling(params, "Mistral4ForCausalLM")
    head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    config = {**{k: v for k, v in config.items() if k != "rope_scaling"}, "rope_parameters": params}
    return {**_mla_rope_dims(config, head_dim, config["qk_rope_head_dim"] / head_dim),
            "_query_temperature": temperature}


def _mla_rope_dims(config: dict, head_dim: int, default: float) -> dict:
    """The config with partial_rotary_factor (the rope parameters', else the top level's, else `default`) taken out,
    refused by name unless int(head_dim * factor), the dims transformers' rotary embedding covers (its head_dim:
    GLM-4.7-Flash's qk_rope_head_dim, Mistral 4's qk_nope_head_dim + qk_rope_head_dim), is qk_rope_head_dim, the dims
    its MLA rotates."""
    key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    params = dict(config.get(key) or {})
    factor = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", default))
    if not _is_number(factor) or int(head_dim * factor) != config["qk_rope_head_dim"]:
        raise CheckpointError(f"partial_rotary_factor {factor!r}: the rotary would cover int({head_dim} * factor) "
                              f"dims, not the qk_rope_head_dim {config['qk_rope_head_dim']} the latent attention "
                              "rotates")
    config = {k: v for k, v in config.items() if k != "partial_rotary_factor"}
    return {**config, key: None if config.get(key) is None else params}


def _check_router_groups(experts: int, groups, topk_groups, pairs: bool) -> None:
    """n_group and topk_group must split the experts evenly into groups (of at least 2 where a group scores by its
    two best experts: `pairs`, DeepSeek-V3's and GLM-4.5's), topk_group of them (at most n_group) chosen from."""
    valid = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (groups, topk_groups))
    if not valid or experts % groups or topk_groups > groups or (pairs and experts // groups < 2):
        raise CheckpointError(f"n_group {groups}, topk_group {topk_groups}: the {experts} experts must split evenly "
                              f"into n_group groups{' of at least 2' if pairs else ''}, of which topk_group (at most "
                              "n_group) are chosen from")


def _check_glm4_moe(config: dict, family: str) -> None:
    """What a GLM-4.5 or dots.llm1 config can say that transformers' Glm4MoeForCausalLM / Dots1ForCausalLM would not run
    as it says, refused by name: a router other than their sigmoid with noaux_tc (they read neither key), no experts;
    dots.llm1's moe_layer_freq other than 1 (Dots1's layers read it no more than DeepSeek-V3's). GLM-4.5's
    multi-token-prediction layer is built apart (compiler/mtp.py)."""
    name = {"glm4_moe": "GLM-4.5", "dots1": "dots.llm1"}[family]
    scoring, method = config.get("scoring_func"), config.get("topk_method")
    if scoring not in (None, "sigmoid") or method not in (None, "noaux_tc"):
        raise CheckpointError(f"scoring_func {scoring!r}, topk_method {method!r}: transformers' {name} routes by "
                              "sigmoid with noaux_tc (e_score_correction_bias)")
    if not config.get("num_experts_per_tok") or not config.get("n_routed_experts"):
        raise CheckpointError(f"{name}: n_routed_experts and num_experts_per_tok must be set (the MoE layers' experts "
                              "and top-k)")
    if family == "dots1" and config.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"moe_layer_freq {config['moe_layer_freq']}: transformers' dots.llm1 ignores it (every "
                              "layer from first_k_dense_replace on is an MoE); published checkpoints set 1")


def _glm4_moe_fields(config: dict) -> dict:
    """GLM-4.5's MoE fields: the layers from first_k_dense_replace on, DeepSeek-V3's router (sigmoid scores chosen
    with e_score_correction_bias within the best topk_group of n_group groups, renormalised where norm_topk_prob,
    times routed_scaling_factor), n_shared_experts shared experts as one of n_shared_experts * moe_intermediate_size."""
    experts, groups = config["n_routed_experts"], (config["n_group"], config["topk_group"])
    _check_router_groups(experts, *groups, pairs=True)
    shared = config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0)
    return {"num_experts": experts, "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"], "norm_topk_prob": bool(config["norm_topk_prob"]),
            "moe_layers": list(range(config["first_k_dense_replace"] or 0, config["num_hidden_layers"])),
            "shared_expert_intermediate_size": shared or None, "router_scoring": "sigmoid",
            "router_groups": groups[0], "router_topk_groups": groups[1],
            "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0)}


def _ernie4_5_moe_fields(config: dict) -> dict:
    """ERNIE 4.5 MoE's fields as Ernie4_5_MoeDecoderLayer and Ernie4_5_MoeTopKRouter read the config: layer i is an MoE
    where (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index (-1: the last
    layer), the softmax router choosing with its moe_statics bias, renormalised by max(sum, moe_norm_min), and
    moe_num_shared_experts shared experts as one. What it cannot say as transformers runs it is refused by name."""
    num_layers = config["num_hidden_layers"]
    keys = ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
    start, end, interval = (config[key] for key in keys)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, interval)) or interval < 1:
        raise CheckpointError(f"moe_layer_start_index {start!r}, moe_layer_end_index {end!r}, moe_layer_interval "
                              f"{interval!r}: ERNIE 4.5 MoE needs integers, the interval at least 1 (lists are the "
                              "vision-language ERNIE's, which is not supported)")
    norm_min = config["moe_norm_min"]
    if not _is_number(norm_min) or norm_min <= 0:
        raise CheckpointError(f"moe_norm_min {norm_min!r}: the router's renormalisation floor must be a positive "
                              "number (published checkpoints: 1e-12)")
    if not config.get("moe_num_experts") or not config.get("moe_k"):
        raise CheckpointError("ERNIE 4.5 MoE: moe_num_experts and moe_k must be set (the MoE layers' experts and "
                              "top-k)")
    if config.get("num_nextn_predict_layers"):
        logger.info("ERNIE 4.5 MoE: the multi-token prediction layers (num_nextn_predict_layers %s, model.mtp_*) are "
                    "not built (transformers' Ernie4_5_MoeForCausalLM skips them)", config["num_nextn_predict_layers"])
    end = num_layers - 1 if end == -1 else end
    layers = [i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end]
    if not layers:
        return {}
    shared = config["moe_intermediate_size"] * (config.get("moe_num_shared_experts") or 0)
    return {"num_experts": config["moe_num_experts"], "num_experts_per_tok": config["moe_k"],
            "moe_intermediate_size": config["moe_intermediate_size"], "norm_topk_prob": True, "moe_layers": layers,
            "shared_expert_intermediate_size": shared or None, "router_scoring": "softmax",
            "router_norm_min": float(norm_min)}


def _minimax_m2_config(config: dict) -> dict:
    """MiniMax-M2's config as MiniMaxM2Config reads it: partial_rotary_factor from the rope parameters, else the top
    level, else the legacy rotary_dim / head_dim (MiniMax's config.json), else the whole head: `_rotary_dim`. Refused by
    name what transformers' MiniMaxM2ForCausalLM would not run as the config says: another scoring_func (it routes by
    sigmoid), a shared expert (shared_intermediate_size), MiniMax-Text-01's linear-attention layers (attn_type_list
    0), no experts."""
    scoring = config.get("scoring_func")
    if scoring not in (None, "sigmoid"):
        raise CheckpointError(f"scoring_func {scoring!r}: transformers' MiniMax-M2 routes by sigmoid with "
                              "e_score_correction_bias")
    if config.get("shared_intermediate_size"):
        raise CheckpointError(f"shared_intermediate_size {config['shared_intermediate_size']}: transformers' "
                              "MiniMax-M2 has no shared expert; published checkpoints set 0")
    if 0 in (config.get("attn_type_list") or []):
        raise CheckpointError("attn_type_list: layers of type 0 (MiniMax-Text-01's lightning linear attention) are not "
                              "supported; MiniMax-M2's layers are all 1 (full attention)")
    if not config.get("num_experts_per_tok") or not config.get("num_local_experts"):
        raise CheckpointError("MiniMax-M2: num_local_experts and num_experts_per_tok must be set (the experts and "
                              "top-k)")
    source = config.get("rope_parameters")
    params = dict(source if source is not None else (config.get("rope_scaling") or {}))
    factor = params.pop("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is None and config.get("rotary_dim") is not None:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        factor = config["rotary_dim"] / head_dim
    params.setdefault("rope_theta", config.get("rope_theta", 5000000.0))
    return {**config, "rope_parameters": params,
            "_rotary_dim": None if factor is None else _partial_rotary_dim(config, factor)}


def _minimax_m2_fields(config: dict) -> dict:
    """MiniMax-M2's MoE fields: every layer sparse, DeepSeek-V3's sigmoid router with e_score_correction_bias and no
    groups, always renormalised, unscaled; no shared expert."""
    return {"num_experts": config["num_local_experts"], "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["intermediate_size"], "norm_topk_prob": True,
            "moe_layers": list(range(config["num_hidden_layers"])), "router_scoring": "sigmoid"}


def _moe_fields(config: dict, family: str) -> dict:
    """Mixtral, Granite MoE: every layer sparse, top-k always renormalised (Granite: the softmax of the top-k logits);
    OLMoE: every layer sparse, renormalised by norm_topk_prob. Qwen3-MoE, Qwen2-MoE: layer i is sparse unless it is
    in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0; renormalised by norm_topk_prob (Qwen3.5-MoE: every
    layer, always: _qwen3_5_config). Qwen2-MoE's and Qwen3.5-MoE's shared expert (gated) and Granite MoE shared's
    (shared_intermediate_size; 0: none) are read with them."""
    num_layers = config["num_hidden_layers"]
    if family == "granitemoehybrid" and not config["num_local_experts"]:  # (Granite 4.0's dense checkpoints)
        return {}
    if family in ("mixtral", "olmoe", "granitemoe", "granitemoeshared", "granitemoehybrid", "gpt_oss"):
        num_experts = config.get("num_local_experts") or config.get("num_experts")
        shared = config.get("shared_intermediate_size") or None if family in (
            "granitemoeshared", "granitemoehybrid") else None
        return {"num_experts": num_experts, "num_experts_per_tok": config["num_experts_per_tok"],
                "moe_intermediate_size": config["intermediate_size"],
                "norm_topk_prob": bool(config["norm_topk_prob"]) if family == "olmoe" else True,
                "moe_layers": list(range(num_layers)), "shared_expert_intermediate_size": shared}
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0  # transformers 5 writes the latter
    step = config.get("decoder_sparse_step", 1)
    only_mlp = set(config.get("mlp_only_layers") or [])
    layers = [i for i in range(num_layers) if i not in only_mlp and num_experts > 0 and (i + 1) % step == 0]
    if not layers:
        return {}
    shared = {"shared_expert_intermediate_size": config["shared_expert_intermediate_size"] or None,
              "shared_expert_gate": bool(config["shared_expert_intermediate_size"])} if family in (
        "qwen2_moe", "qwen3_5_moe", "qwen3_next") else {}
    return {"num_experts": num_experts, "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)), "moe_layers": layers, **shared}


def _rope(config: dict) -> tuple[float, dict | None]:
    params = config.get("rope_parameters")
    if params is None:  # older checkpoints: rope_theta at the top level, optional rope_scaling
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn" and not params.get("original_max_position_embeddings"):
        # transformers' reading: the context the model was trained with is max_position_embeddings
        params["original_max_position_embeddings"] = config.get("max_position_embeddings", 2048)
    if rope_type not in _ROPE_KEYS:
        raise CheckpointError(f"rope_scaling type {rope_type!r} is not supported; supported: default, "
                              f"{', '.join(sorted(_ROPE_KEYS))}")
    required = _ROPE_KEYS[rope_type]
    missing = [key for key in required if params.get(key) is None]
    if missing:
        raise CheckpointError(f"rope_scaling type {rope_type!r} needs {', '.join(missing)} in config.json "
                              f"(it has {sorted(params) or 'no keys'}); fix the checkpoint's config")
    return theta, {"rope_type": rope_type, **params}


def _phi3_rope(config: dict) -> dict:
    """Phi-3's rotary as transformers' Phi3Config reads it: `rope_scaling` (first) or `rope_parameters`, types
    su and yarn meaning longrope, original_max_position_embeddings at the top level. LongRoPE (Phi-3-*-128k,
    Phi-3.5, Phi-4-mini) runs with its short factors, as transformers computes every sequence that stays
    within original_max_position_embeddings, and its attention factor; the context is held to that length
    (rotary.model_context), past which transformers switches the whole sequence to the long factors, which
    keys already in a paged KV cache cannot follow. A partial_rotary_factor (the rope parameters' first, else the
    top level's, as Phi3Config reads it; Phi-4-mini: 0.75 at the top level) rotates the leading
    int(head_dim * factor) dims of each head, the frequencies (and LongRoPE's factors) over those: `_rotary_dim`."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    arch = config["architectures"][0]
    factor = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    config = {**config, "_rotary_dim": _partial_rotary_dim(config, factor)}
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type == "default":
        return {**config, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}
    if rope_type not in ("su", "yarn", "longrope"):
        raise CheckpointError(f"{arch}: rope_scaling type {rope_type!r} is not one Phi-3 has (transformers' Phi3Config "
                              "takes default and longrope); fix the checkpoint's config")
    # transformers gives Phi3Config's own original_max_position_embeddings (default 4096) priority over the
    # rope parameters' (modeling_rope_utils.standardize_rope_params)
    original = config.get("original_max_position_embeddings", 4096)
    if params.get("attention_factor") is None:  # transformers' default: from max_position_embeddings / original
        scale = params.get("factor") or config.get("max_position_embeddings", 4096) / original
        params["attention_factor"] = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    longrope = {"rope_type": "longrope", "rope_theta": theta, **params, "original_max_position_embeddings": original}
    return {**config, "rope_parameters": longrope, "rope_scaling": None}


def _gpt_oss_config(config: dict) -> dict:
    """A gpt-oss config as GptOssConfig reads it: `layer_types` alternating sliding and full (layer i slides when
    (i + 1) % 2) where absent, and its default rope (YaRN x32 over 4096 positions, beta_fast 32, beta_slow 1, not
    truncated) where the config gives neither rope_parameters nor rope_scaling. Its swiglu_limit and swiglu_alpha must
    be positive numbers."""
    config = dict(config)
    for key in ("swiglu_limit", "swiglu_alpha"):
        if not _is_number(config.get(key)) or not config[key] > 0:
            raise CheckpointError(f"{key} {config.get(key)!r}: gpt-oss's clamped SwiGLU needs a positive number")
    if config.get("layer_types") is None:
        config["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096}
    return config


def _gpt_oss_fields(config: dict) -> dict:
    """gpt-oss's runtime fields (runtime/models/gpt_oss.py): attention sinks, o_proj's bias (attention_bias covers
    q/k/v/o), the router's and experts' biases, the experts' clamped SwiGLU."""
    return {"attention_sinks": True, "o_bias": bool(config.get("attention_bias")), "moe_bias": True,
            "swiglu_limit": float(config["swiglu_limit"]), "swiglu_alpha": float(config["swiglu_alpha"])}


def _smollm3_config(config: dict) -> dict:
    """A SmolLM3 config as SmolLM3Config reads it: `no_rope_layers` (one 0 or 1 per layer, 0 a NoPE layer) where
    given, else a NoPE layer every no_rope_layer_interval-th layer, (i + 1) % interval == 0; `layer_types` where
    absent, sliding_attention for the NoPE layers under use_sliding_window with a sliding_window, full_attention for
    the rest; `_nope_layers`, the NoPE layers' indices. Refused by name: attention_bias and mlp_bias (the o_proj's and
    the MLP's biases: the runtime's Llama layout has none; published checkpoints set both false) and sliding layers
    without use_sliding_window and a sliding_window (transformers' eager and SDPA masks would slide them, its flash
    attention would not)."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{key}: true is not supported for SmolLM3 (its attention's or MLP's biases); "
                                  "published checkpoints set it false")
    num_layers = config["num_hidden_layers"]
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config["no_rope_layer_interval"]
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise CheckpointError(f"no_rope_layer_interval {interval!r} must be a positive integer")
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) < num_layers or any(f not in (0, 1) for f in flags[:num_layers]):
        raise CheckpointError(f"no_rope_layers {flags!r}: give one 1 (rotary) or 0 (NoPE) per layer "
                              f"({num_layers})")
    config = dict(config)
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if config.get("layer_types") is None:
        config["layer_types"] = ["sliding_attention" if window and not flags[i] else "full_attention"
                                 for i in range(num_layers)]
    elif "sliding_attention" in config["layer_types"] and not window:
        raise CheckpointError("layer_types has sliding_attention layers but use_sliding_window is false or "
                              "sliding_window null: transformers' attention implementations disagree on whether they "
                              "slide; set use_sliding_window true and a sliding_window, or make them full_attention")
    config["_nope_layers"] = [i for i in range(num_layers) if not flags[i]]
    return config


def _exaone4_config(config: dict) -> dict:
    """An EXAONE 4 config as Exaone4Config and Exaone4Attention read it: `layer_types` where absent, every
    sliding_window_pattern-th layer full and the rest sliding ((i + 1) % pattern; Exaone4Config's rule), all full
    without a sliding_window; `_nope_layers`, the full layers when there is a sliding_window (transformers rotates q
    and k only where sliding_window is null or the layer slides). Refused by name: a sliding_window_pattern other than
    a positive integer where layer_types is absent, and a sliding_window with no sliding layer (transformers would run
    every layer without rotary, vLLM every layer with it)."""
    config = dict(config)
    num_layers, window = config["num_hidden_layers"], config.get("sliding_window")
    if config.get("layer_types") is None:
        pattern = config.get("sliding_window_pattern")
        if window is not None and (not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1):
            raise CheckpointError(f"sliding_window_pattern {pattern!r}: give a positive integer (every pattern-th layer "
                                  "full) or layer_types, one full_attention or sliding_attention per layer")
        config["layer_types"] = ["sliding_attention" if window is not None and (i + 1) % pattern else "full_attention"
                                 for i in range(num_layers)]
    if window is not None and "sliding_attention" not in config["layer_types"]:
        raise CheckpointError(f"sliding_window {window} with no sliding_attention layer: transformers runs every layer "
                              "without rotary then, vLLM every layer with it; set sliding_window null (every layer "
                              "full, with rotary) or make some layers sliding_attention")
    if window is not None:
        config["_nope_layers"] = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    return config


def _ministral3_config(config: dict) -> dict:
    """A Ministral 3 config as Ministral3Config and its attention read it: its default rope_parameters (YaRN) where
    the config gives neither rope_parameters nor rope_scaling; `_query_temperature`, the ModelConfig fields of its q
    scale, 1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings)) (both from the rope
    parameters, which transformers requires) in every layer; no biases and one window for every layer whatever
    attention_bias or layer_types say (its modules read neither)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or _MINISTRAL3_ROPE)
    temperature = _llama_4_scaling(params, "Ministral3ForCausalLM")
    config = {k: v for k, v in config.items() if k not in ("rope_scaling", "layer_types")}
    return {**config, "rope_parameters": params, "attention_bias": False, "_query_temperature": temperature}


def _llama_4_scaling(params: dict, arch: str) -> dict:
    """The query temperature of Ministral 3's and Mistral 4's rope parameters (popped from `params`, with their copy
    of max_position_embeddings, which is no rope parameter) as ModelConfig fields: q times 1 + llama_4_scaling_beta *
    log(1 + floor(position / original_max_position_embeddings)), both of which transformers' attention requires."""
    beta, original = params.pop("llama_4_scaling_beta", None), params.get("original_max_position_embeddings")
    if not _is_number(beta) or not _is_number(original) or original <= 0:
        raise CheckpointError(f"{arch}: rope_parameters llama_4_scaling_beta {beta!r} and "
                              f"original_max_position_embeddings {original!r}: its query scale needs both (numbers, "
                              "the second positive); fix the checkpoint's config")
    params.pop("max_position_embeddings", None)
    return {"query_temperature_beta": float(beta), "query_temperature_floor": float(original)}


QWEN3_5_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
QWEN3_5_CG = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def _qwen3_5_config(config: dict) -> dict:
    """A Qwen3.5 text config as transformers' Qwen3_5TextConfig (Qwen3.5-MoE: Qwen3_5MoeTextConfig) fills it in
    (layer_types from full_attention_interval,
    partial_rotary_factor 0.25), flat, its layer kinds and DeltaNet sizes as ModelConfig fields (`_qwen3_5`), the
    partial rotary as `_rotary_dim`. The M-RoPE keys (mrope_section, mrope_interleaved) are dropped: a text token's
    three positions are one, so the interleaved sections rotate it as the plain rotary. Refused by name:
    attention_bias, layer kinds other than linear_attention and full_attention, a hidden_act other than SiLU (the
    MLP's and the conv's). Qwen3_5ForConditionalGeneration: its text_config (its language model, served as text; the
    top level's tie_word_embeddings and eos_token_id where the text config has none). Qwen3.5-MoE: every layer's MLP
    sparse, its top-k always renormalised (transformers reads neither decoder_sparse_step, mlp_only_layers nor
    norm_topk_prob for it: other values refused by name), a gated shared expert of shared_expert_intermediate_size
    (positive); intermediate_size (no dense MLP) is moe_intermediate_size. Qwen3-Next (Qwen3NextConfig): its MoE
    fields as Qwen2-MoE's (_moe_fields), its fused DeltaNet projections regrouped at read (qwen3_next_tensors)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    arch = config["architectures"][0]
    moe = arch.startswith("Qwen3_5Moe")
    text = config.get("text_config") if arch in QWEN3_5_CG else config
    if not isinstance(text, dict):
        raise CheckpointError(f"{arch}: config.json needs a text_config (its language model's config)")
    if arch in QWEN3_5_CG:
        text = {**{k: config[k] for k in ("tie_word_embeddings", "eos_token_id") if k in config}, **text}
    if moe:
        _check_qwen3_5_moe(text, arch)
    reader = Qwen3NextConfig if arch == "Qwen3NextForCausalLM" else Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    try:
        unread = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "intermediate_size") if moe else ()
        parsed = reader(**{k: v for k, v in text.items()
                           if k not in ("architectures", "model_type", "transformers_version", *unread)}).to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{arch}: the config is not one transformers' {reader.__name__} reads ({e})") from None
    if moe:
        parsed = {**parsed, "intermediate_size": parsed["moe_intermediate_size"], "norm_topk_prob": True}
        parsed.pop("decoder_sparse_step", None)
        parsed.pop("mlp_only_layers", None)
    if parsed.get("attention_bias"):
        raise CheckpointError(f"{arch}: attention_bias: true is not supported (Qwen3.5 checkpoints set it false)")
    if parsed.get("hidden_act") not in ("silu", "swish"):
        raise CheckpointError(f"{arch}: hidden_act {parsed.get('hidden_act')!r} is not supported: the runtime's MLP "
                              "and the DeltaNet's conv compute SiLU (hidden_act silu)")
    kinds = parsed["layer_types"]
    if len(kinds) != parsed["num_hidden_layers"] or not set(kinds) <= {"linear_attention", "full_attention"}:
        raise CheckpointError(f"{arch}: layer_types {kinds}: one of linear_attention or full_attention per layer")
    params = dict(parsed.get("rope_parameters") or {})
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    factor = params.pop("partial_rotary_factor", parsed.get("partial_rotary_factor", 0.25))
    fields = {"linear_attention_layers": [i for i, kind in enumerate(kinds) if kind == "linear_attention"],
              "attn_output_gate": True,
              **{key: parsed[key] for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                              "linear_value_head_dim", "linear_conv_kernel_dim")}}
    parsed = {**parsed, "architectures": config["architectures"], "rope_parameters": params,
              "eos_token_id": text.get("eos_token_id", parsed.get("eos_token_id")), "_qwen3_5": fields}
    return {**parsed, "_rotary_dim": _partial_rotary_dim(parsed, factor)}


def _olmo_hybrid_config(config: dict) -> dict:
    """An OLMo Hybrid config as transformers' OlmoHybridConfig fills it in (layer_types: every fourth layer full
    attention; the DeltaNet's heads and dims from num_attention_heads and hidden_size), flat, its layer kinds and
    DeltaNet fields as ModelConfig fields (`_olmo_hybrid`: the DeltaNet layers also pre_norm_layers, Llama's norms;
    the gated norm's eps 1e-5, as OlmoHybridGatedDeltaNet builds it whatever rms_norm_eps). A null rope_theta is its
    NoPE form (OlmoHybridModel builds no rotary then, as for the published checkpoints): rope_on_full_layers false,
    every attention layer rotated by nothing. Refused by name: attention_bias, layer kinds other than linear_attention
    and full_attention (a hidden_act other than SiLU, the MLP's and the conv's, is refused as for every family)."""
    from transformers import OlmoHybridConfig

    arch = config["architectures"][0]
    try:
        parsed = OlmoHybridConfig(**{k: v for k, v in config.items() if k not in (
            "architectures", "model_type", "transformers_version")}).to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{arch}: the config is not one transformers' OlmoHybridConfig reads ({e})") from None
    if parsed.get("attention_bias"):
        raise CheckpointError(f"{arch}: attention_bias: true is not supported (OLMo Hybrid's q/k/v/o biases: the "
                              "runtime's o has none)")
    kinds = parsed["layer_types"]
    if len(kinds) != parsed["num_hidden_layers"] or not set(kinds) <= {"linear_attention", "full_attention"}:
        raise CheckpointError(f"{arch}: layer_types {kinds}: one of linear_attention or full_attention per layer")
    params = dict(parsed.get("rope_parameters") or {})
    nope = params.get("rope_theta") is None
    linear = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
    fields = {"linear_attention_layers": linear, "pre_norm_layers": linear, "linear_norm_eps": 1e-5,
              "linear_allow_neg_eigval": bool(parsed["linear_allow_neg_eigval"]),
              "sandwich_norms": True, "pre_norms": False, "qk_norm_full_width": True,
              **({"rope_on_full_layers": False} if nope else {}),
              **{key: parsed[key] for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                              "linear_value_head_dim", "linear_conv_kernel_dim")}}
    return {**parsed, "architectures": config["architectures"], "_olmo_hybrid": fields,
            "rope_parameters": {"rope_theta": 10000.0} if nope else params}  # (NoPE: a theta no layer reads)


def olmo_hybrid_tensors(spec: ModelSpec, config: ModelConfig, stored: set[str]) -> dict[str, Callable]:
    """For OLMo Hybrid, a `TensorReader` derived tensor for each Gated DeltaNet's Qwen3.5 names, which the rest of the
    build reads: in_proj_qkv (q_proj, k_proj, v_proj's rows), in_proj_z (g_proj), in_proj_b (b_proj), in_proj_a
    (a_proj), out_proj (o_proj), norm (o_norm). Where the checkpoint (its `stored` names) holds the layers as
    save_pretrained writes them and the published checkpoints do (OLMo-core's names, which transformers' conversion
    mapping renames at load), also transformers' names of them: input_layernorm (attention_layer_norm),
    post_attention_layernorm (feedforward_layer_norm, in every layer) and conv1d (q_conv1d, k_conv1d and v_conv1d's
    channels). {} for another family."""
    if config.family != "olmo_hybrid":
        return {}
    derived = {}
    for i in range(config.num_layers):
        layer = f"{spec.hf_layer_prefix}{i}."
        renamed = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}
        for theirs, olmo_core in renamed.items():
            if f"{layer}{theirs}.weight" not in stored and f"{layer}{olmo_core}.weight" in stored:
                derived[f"{layer}{theirs}.weight"] = lambda r, name=f"{layer}{olmo_core}.weight": r.get(name)
        if i not in config.linear_attention_layers:
            continue
        hf = f"{layer}linear_attn."
        if f"{hf}conv1d.weight" not in stored:
            derived[f"{hf}conv1d.weight"] = lambda r, hf=hf: torch.cat(
                [r.get(f"{hf}{name}_conv1d.weight") for name in ("q", "k", "v")])
        derived[f"{hf}in_proj_qkv.weight"] = lambda r, hf=hf: torch.cat(
            [r.get(f"{hf}{name}.weight") for name in ("q_proj", "k_proj", "v_proj")])
        for ours, theirs in (("in_proj_z", "g_proj"), ("in_proj_b", "b_proj"), ("in_proj_a", "a_proj"),
                             ("out_proj", "o_proj"), ("norm", "o_norm")):
            derived[f"{hf}{ours}.weight"] = lambda r, name=f"{hf}{theirs}.weight": r.get(name)
    return derived


LFM2_FAMILIES = ("lfm2", "lfm2_moe")


def _lfm2_config(config: dict) -> dict:
    """An LFM2 config as transformers' Lfm2Config (LFM2-MoE: Lfm2MoeConfig) and its model read it, flat: layer_types
    (else full_attn_idxs, else every layer attention; LFM2-MoE: layer_types needed), tie_embedding and block_ff_dim
    (the older keys) read by Lfm2Config; rms_norm_eps is norm_eps; `intermediate_size`, the feed-forward's width as
    Lfm2MLP derives it (block_auto_adjust_ff_dim: int(2 I / 3), then, with a block_ffn_dim_multiplier, int(multiplier *
    that) rounded up to block_multiple_of; LFM2-MoE's dense layers read intermediate_size as it is); no biases in the
    attention (Lfm2Attention has none); `_lfm2`, the conv layers and conv_L_cache (LFM2-MoE: and its MoE fields,
    _lfm2_moe_fields). Refused by name: conv_bias (the short convs' in_proj / conv / out_proj biases), layer kinds
    other than conv and full_attention, every layer conv (no attention layer)."""
    from transformers import Lfm2Config, Lfm2MoeConfig

    arch = config["architectures"][0]
    moe = arch == "Lfm2MoeForCausalLM"
    reader = Lfm2MoeConfig if moe else Lfm2Config
    if moe and config.get("layer_types") is None:
        raise CheckpointError(f"{arch}: layer_types is needed (one of conv or full_attention per layer; "
                              "transformers' LFM2-MoE reads no full_attn_idxs)")
    try:
        parsed = reader(**{k: v for k, v in config.items()
                           if k not in ("architectures", "model_type", "transformers_version")}).to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{arch}: the config is not one transformers' {reader.__name__} reads ({e})") from None
    if parsed["conv_bias"]:
        raise CheckpointError(f"{arch}: conv_bias: true is not supported (biases on the conv layers' in_proj, conv and "
                              "out_proj); published LFM2 checkpoints set it false")
    layers, kinds = parsed["num_hidden_layers"], parsed["layer_types"]
    if len(kinds) != layers or not set(kinds) <= {"conv", "full_attention"}:
        raise CheckpointError(f"{arch}: layer_types {kinds}: one of conv or full_attention per layer ({layers})")
    if "full_attention" not in kinds:
        raise CheckpointError(f"{arch}: layer_types {kinds}: every layer conv (no full_attention layer) is not "
                              "supported; LFM2's checkpoints mix attention layers in")
    width = parsed["intermediate_size"]
    if not moe and parsed["block_auto_adjust_ff_dim"]:
        width = int(2 * width / 3)
        multiplier, multiple = parsed["block_ffn_dim_multiplier"], parsed["block_multiple_of"]
        if multiplier is not None:
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    fields = {"short_conv_layers": [i for i, kind in enumerate(kinds) if kind == "conv"],
              "short_conv_kernel": parsed["conv_L_cache"], **(_lfm2_moe_fields(parsed, arch) if moe else {})}
    flat = {k: v for k, v in parsed.items() if k not in ("layer_types", "rope_scaling", "rope_theta")}
    return {**flat, "architectures": [arch], "rms_norm_eps": parsed["norm_eps"], "intermediate_size": width,
            "attention_bias": False, "hidden_act": "silu", "_lfm2": fields}


def _lfm2_moe_fields(parsed: dict, arch: str) -> dict:
    """LFM2-MoE's MoE fields (Lfm2MoeConfig's, parsed): layers from num_dense_layers on sparse, each num_experts of
    moe_intermediate_size, DeepSeek-V3's sigmoid router with its score bias (expert_bias) and no groups, renormalised
    where norm_topk_prob, times routed_scaling_factor. Refused by name: use_expert_bias false, no sparse layer."""
    if not parsed["use_expert_bias"]:
        raise CheckpointError(f"{arch}: use_expert_bias false is not supported (the runtime's sigmoid router always "
                              "chooses with a score bias); published LFM2-MoE checkpoints set it true")
    layers, dense = parsed["num_hidden_layers"], parsed["num_dense_layers"]
    if not 0 <= dense < layers:
        raise CheckpointError(f"{arch}: num_dense_layers {dense}: needs 0 up to num_hidden_layers - 1 ({layers - 1}); "
                              "with no sparse layer it is the dense LFM2 (Lfm2ForCausalLM)")
    return {"num_experts": parsed["num_experts"], "num_experts_per_tok": parsed["num_experts_per_tok"],
            "moe_intermediate_size": parsed["moe_intermediate_size"], "norm_topk_prob": bool(parsed["norm_topk_prob"]),
            "moe_layers": list(range(dense, layers)), "router_scoring": "sigmoid",
            "routed_scaling_factor": float(parsed["routed_scaling_factor"])}


def _check_qwen3_5_moe(text: dict, arch: str) -> None:
    """What a Qwen3.5-MoE config can say that transformers' Qwen3_5MoeTextConfig does not read (every layer is sparse,
    the top-k always renormalised), refused by name where it asks otherwise; experts and a shared expert needed."""
    if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"{arch}: mlp_only_layers {text.get('mlp_only_layers')!r} / decoder_sparse_step "
                              f"{text.get('decoder_sparse_step')!r}: every Qwen3.5-MoE layer is sparse (transformers "
                              "reads neither); drop them")
    if text.get("norm_topk_prob") is False:
        raise CheckpointError(f"{arch}: norm_topk_prob false: transformers' Qwen3.5-MoE router renormalises the top-k "
                              "weights always (it reads no norm_topk_prob); set it to true")
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        value = text.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise CheckpointError(f"{arch}: {key} {value!r}: Qwen3.5-MoE needs a positive integer")


def qwen3_next_tensors(spec: ModelSpec, config: ModelConfig) -> dict[str, Callable]:
    """For Qwen3-Next, a `TensorReader` derived tensor for each Gated DeltaNet's in_proj_qkv, in_proj_z, in_proj_b and
    in_proj_a (Qwen3.5's names, which the rest of the build reads), each regrouped from the fused in_proj_qkvz rows
    [key head g: (q_g, k_g, v_g, z_g)] (v_g, z_g: the g-th group of num_value_heads / num_key_heads value heads) and
    in_proj_ba's [key head g: (b_g, a_g)], as transformers' fix_query_key_value_ordering splits them. {} otherwise."""
    if config.family != "qwen3_next":
        return {}
    groups, key = config.linear_num_key_heads, config.linear_key_head_dim
    value = config.linear_num_value_heads // groups * config.linear_value_head_dim  # one group's v (and z) rows
    per_group = config.linear_num_value_heads // groups  # one group's b (and a) rows
    derived = {}
    for i in config.linear_attention_layers:
        hf = f"{spec.hf_layer_prefix}{i}.linear_attn."

        def parts(r, name, sizes, hf=hf):
            fused = r.get(f"{hf}{name}.weight")
            return [p.flatten(0, 1) for p in fused.unflatten(0, (groups, -1)).split(sizes, dim=1)]

        qkvz, ba = (key, key, value, value), (per_group, per_group)
        derived |= {f"{hf}in_proj_qkv.weight": lambda r, f=parts: torch.cat(f(r, "in_proj_qkvz", qkvz)[:3]),
                    f"{hf}in_proj_z.weight": lambda r, f=parts: f(r, "in_proj_qkvz", qkvz)[3],
                    f"{hf}in_proj_b.weight": lambda r, f=parts: f(r, "in_proj_ba", ba)[0],
                    f"{hf}in_proj_a.weight": lambda r, f=parts: f(r, "in_proj_ba", ba)[1]}
    return derived


LLAMA4_CG = "Llama4ForConditionalGeneration"


def _llama4_config(config: dict) -> dict:
    """A Llama 4 config (Llama4ForCausalLM's, or Llama4ForConditionalGeneration's text_config: its language model,
    served as text only) as transformers' Llama4TextConfig fills it in, flat, with its layers' kinds as ModelConfig
    fields (`_llama4`) and `_nope_layers` (no_rope_layers' zeros): interleaved rotary pairs; a weightless q/k L2 norm on
    the rope layers (use_qk_norm); on the NoPE layers, where attn_temperature_tuning, q times 1 + attn_scale * log(1 +
    floor((position + 1) / floor_scale)); the MoE layers (moe_layers), their experts intermediate_size wide beside a
    shared expert as wide, routed by the top logit's sigmoid scaling the expert's input; dense layers
    intermediate_size_mlp wide; attention_chunk_size and the layers that attend in chunks of it (layer_types'
    chunked_attention: by default the rope layers).
    Refused by name: num_experts_per_tok above 1, attention_bias (o_proj's bias too), layer kinds transformers does
    not have, chunked_attention layers without a chunk size."""
    from transformers import Llama4TextConfig

    arch = config["architectures"][0]
    text = config.get("text_config") if arch == LLAMA4_CG else config
    if not isinstance(text, dict):
        raise CheckpointError(f"{arch}: config.json needs a text_config (its language model's config)")
    try:
        parsed = Llama4TextConfig(**{k: v for k, v in text.items()
                                     if k not in ("architectures", "model_type", "transformers_version")}).to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{arch}: the text config is not one transformers' Llama4TextConfig reads "
                              f"({e})") from None
    num_layers, top_k = parsed["num_hidden_layers"], parsed["num_experts_per_tok"]
    if top_k != 1:
        raise CheckpointError(f"{arch}: num_experts_per_tok {top_k}: llmc runs Llama 4's router (the chosen expert's "
                              "input scaled by its score) with one expert per token, as every published Llama 4; set 1")
    if parsed.get("attention_bias"):
        raise CheckpointError(f"{arch}: attention_bias: true is not supported (its o_proj bias with q/k/v's); "
                              "published checkpoints set it false")
    kinds = parsed["layer_types"]
    if len(kinds) != num_layers or not set(kinds) <= {"full_attention", "chunked_attention"}:
        raise CheckpointError(f"{arch}: layer_types {kinds}: give full_attention or chunked_attention for each of the "
                              f"{num_layers} layers")
    if "chunked_attention" in kinds and not parsed["attention_chunk_size"]:
        raise CheckpointError(f"{arch}: layer_types has chunked_attention layers but attention_chunk_size is "
                              f"{parsed['attention_chunk_size']!r}; give the chunk size, or make them full_attention")
    rope = [bool(flag) for flag in parsed["no_rope_layers"][:num_layers]]
    nope = [i for i in range(num_layers) if not rope[i]]
    fields = {"rotary_interleaved": True, "num_experts": parsed["num_local_experts"], "num_experts_per_tok": 1,
              "moe_intermediate_size": parsed["intermediate_size"], "norm_topk_prob": False,
              "moe_layers": sorted(parsed["moe_layers"]), "router_scoring": "sigmoid_input",
              "shared_expert_intermediate_size": parsed["intermediate_size"],
              "qk_l2_norm_layers": [i for i in range(num_layers) if rope[i]] if parsed["use_qk_norm"] else [],
              "attention_chunk_size": parsed["attention_chunk_size"] if "chunked_attention" in kinds else None,
              "attention_chunk_layers": [i for i, kind in enumerate(kinds) if kind == "chunked_attention"] or None}
    if parsed["attn_temperature_tuning"] and nope:
        fields |= {"query_temperature_beta": float(parsed["attn_scale"]),
                   "query_temperature_floor": float(parsed["floor_scale"]), "query_temperature_offset": 1.0,
                   "query_temperature_layers": nope}
    flat = {k: v for k, v in parsed.items() if k not in ("layer_types", "rope_scaling")}
    tied = bool(parsed.get("tie_word_embeddings") or (arch == LLAMA4_CG and config.get("tie_word_embeddings")))
    return {**flat, "architectures": [arch], "intermediate_size": parsed["intermediate_size_mlp"],
            "tie_word_embeddings": tied, "_nope_layers": nope, "_llama4": fields}


# Llama's decoder with an MLP without gate, down(act(up(x))), and the one activation each runs
UP_MLP_FAMILIES = {"arcee": "relu2", "apertus": "xielu"}
APERTUS_ROPE = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # ApertusConfig's default (theta 12e6)


def _up_mlp_config(config: dict, family: str) -> dict:
    """Arcee's and Apertus's config as ArceeConfig / ApertusConfig read it: Apertus's default rope (Llama 3's scaling,
    theta 1.2e7) where the config gives neither rope_parameters nor rope_scaling, its theta 1.2e7 where rope_theta is
    absent. Refused by name: another hidden_act (their MLP takes any of transformers' activations; the runtime runs
    Arcee's relu2 and Apertus's xielu), attention_bias and mlp_bias (the runtime's o and MLP have no bias)."""
    name = {"arcee": "Arcee", "apertus": "Apertus"}[family]
    want = UP_MLP_FAMILIES[family]
    if config.get("hidden_act") != want:
        raise CheckpointError(f"hidden_act {config.get('hidden_act')!r} is not supported for {name}: the runtime runs "
                              f"its MLP without gate with {want} only (the published checkpoints')")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{key}: true is not supported for {name} (the runtime's o_proj and MLP have no "
                                  "bias); published checkpoints set it false")
    if family == "apertus" and config.get("rope_parameters") is None:
        config = {**config, "rope_theta": config.get("rope_theta", 12000000.0)}
        if config.get("rope_scaling") is None:
            config["rope_scaling"] = dict(APERTUS_ROPE)
    return config


def _seed_oss_ernie_config(config: dict, family: str) -> dict:
    """Seed-OSS's and ERNIE 4.5's (dense and MoE) biases as the runtime holds them: Seed-OSS's q/k/v (attention_bias)
    and o (attention_out_bias, ModelConfig.o_bias); ERNIE's use_bias (every linear's) as attention_bias. The MLP's
    biases (Seed-OSS's mlp_bias, ERNIE's use_bias) are refused by name: the runtime's MLP has none."""
    if family == "seed_oss":
        if config.get("mlp_bias"):
            raise CheckpointError("mlp_bias: true is not supported for Seed-OSS (the MLP's biases: the runtime's MLP "
                                  "has none); published checkpoints set it false")
        return config
    if config.get("use_bias"):
        name = "ERNIE 4.5 MoE" if family == "ernie4_5_moe" else "ERNIE 4.5"
        raise CheckpointError(f"use_bias: true is not supported for {name} (biases on every linear, the MLP's too: "
                              "the runtime's MLP has none); published checkpoints set it false")
    return {**config, "attention_bias": False}


def _cohere_config(config: dict, family: str) -> dict:
    """Cohere's and Cohere 2's config as their config classes read it: layer_norm_eps as the norms' eps; Cohere 2's
    layer_types from the older sliding_window_pattern (every pattern-th layer full, default 4) where absent. q/k
    norms (Cohere's use_qk_norm) and biases (attention_bias: o_proj's too) are refused by name."""
    arch = config["architectures"][0]
    if config.get("use_qk_norm"):
        raise CheckpointError(f"{arch}: use_qk_norm (Cohere's per-head LayerNorms of q and k) is not supported")
    if config.get("attention_bias"):
        raise CheckpointError(f"{arch}: attention_bias: true is not supported (its o_proj bias: the runtime's o has "
                              "none)")
    if not _is_number(config.get("logit_scale")):
        raise CheckpointError(f"{arch}: logit_scale {config.get('logit_scale')!r} must be a number")
    config = {**config, "rms_norm_eps": config["layer_norm_eps"]}
    if family == "cohere2" and config.get("layer_types") is None and config.get("sliding_window"):
        pattern = config.get("sliding_window_pattern", 4)
        config["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    return config


def _cohere_fields(config: dict, family: str) -> dict:
    """Cohere's LayerNorm, parallel block and interleaved rotary (runtime/models/cohere.py); Cohere 2's rotary on the
    sliding layers only: their table (the local one) is the rope's, the full layers' rotates by 0."""
    fields = {"layer_norm": True, "parallel_block": True, "rotary_interleaved": True}
    if family == "cohere2":
        theta, scaling = _rope(config)
        fields |= {"rope_on_full_layers": False, "rope_local_theta": theta, "rope_local_scaling": scaling}
    return fields


def _partial_rotary_dim(config: dict, factor) -> int | None:
    """The rotated dims of each head under a partial_rotary_factor, int(head_dim * factor) as transformers truncates
    it; None for the whole head."""
    arch = config["architectures"][0]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if not _is_number(factor) or not 0 < factor <= 1:
        raise CheckpointError(f"{arch}: partial_rotary_factor {factor!r} must be a number in (0, 1]")
    rotary_dim = int(head_dim * factor)  # transformers' truncation
    if rotary_dim < 2 or rotary_dim % 2 or head_dim % 2:
        raise CheckpointError(f"{arch}: partial_rotary_factor {factor} rotates {rotary_dim} of head_dim {head_dim}'s "
                              "dims; the rotation needs an even number of them, at least 2, of an even head_dim")
    return None if rotary_dim == head_dim else rotary_dim


def _glm4_rope(config: dict) -> dict:
    """GLM-4's rotary as Glm4Config reads it: partial_rotary_factor from the rope parameters (transformers 5's
    rope_parameters, else the older rope_scaling), else the top level (GLM-4-0414's config.json), else 0.5 (the
    config class's default): `_rotary_dim`; the rest of the rope parameters as every family's (_rope)."""
    source = config.get("rope_parameters")
    params = dict(source if source is not None else (config.get("rope_scaling") or {}))
    factor = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return {**config, "rope_parameters": params, "_rotary_dim": _partial_rotary_dim(config, factor)}


def interleaved_rotary_permutation(head_dim: int, rotary_dims: int) -> torch.Tensor:
    """[head_dim] int64: the old dim of each head's new dim, moving the interleaved rotary pairs (2i, 2i + 1) of the
    leading rotary_dims (GLM-4's, Cohere's) to the rotate-half layout over the whole head, (i, i + head_dim / 2), and
    the pass-through dims to the pairs after them, in order (ModelConfig.rotary_interleaved)."""
    half_passed = (head_dim - rotary_dims) // 2
    passed = torch.arange(rotary_dims, head_dim)
    return torch.cat((torch.arange(0, rotary_dims, 2), passed[:half_passed],
                      torch.arange(1, rotary_dims, 2), passed[half_passed:]))


def partial_rotary_permutation(head_dim: int, rotary_dims: int) -> torch.Tensor:
    """[head_dim] int64: the old dim of each head's new dim, moving the rotate-half pairs (i, i + rotary_dims / 2) of
    the leading rotary_dims (GLM-4.5's) to (i, i + head_dim / 2), the rotate-half layout over the whole head, and the
    pass-through dims to the pairs after them, in order (ModelConfig.rotary_rows_permuted)."""
    half, half_passed = rotary_dims // 2, (head_dim - rotary_dims) // 2
    return torch.cat((torch.arange(half), torch.arange(rotary_dims, rotary_dims + half_passed),
                      torch.arange(half, rotary_dims), torch.arange(rotary_dims + half_passed, head_dim)))


def rotary_row_permutation(config: ModelConfig) -> torch.Tensor | None:
    """[head_dim] int64: the permutation rotary_fold gives each head's q/k rows (ModelConfig.rotary_rows_permuted):
    interleaved pairs (GLM-4, Cohere, ERNIE 4.5: interleaved_rotary_permutation) or GLM-4.5's rotate-half over the
    leading rotary_dim (partial_rotary_permutation; MiniMax-M2's, Qwen3.5's and Bamba's alike); None where the checkpoint's rows are the
    runtime's. An FP8 import moves the rows' scales with it (compiler/import_quantized.py)."""
    if config.rotary_interleaved:
        return interleaved_rotary_permutation(config.head_dim, config.rotary_dims)
    if config.family in ("glm4_moe", "minimax_m2", "bamba", *QWEN3_5_FAMILIES) and config.rotary_rows_permuted:
        return partial_rotary_permutation(config.head_dim, config.rotary_dims)
    return None


def rotary_fold(spec: ModelSpec, config: ModelConfig) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """For a model whose checkpoint rotates other pairs than the runtime's rotate-half over the whole head
    (rotary_row_permutation), a `TensorReader` merge that reads q_proj's and k_proj's weights and biases, and the
    q_norm / k_norm weights (GLM-4.5's per head, MiniMax-M2's over all heads: an RMS over the same elements in another
    order is unchanged by the permutation), with each head's
    rows permuted: q.k is unchanged (one permutation of both), and the runtime rotates whole heads, the pass-through
    pairs by a table of cos 1, sin 0. Qwen3.5's q_proj (attn_output_gate): each head's q rows are permuted, its gate
    rows (which scale the attention's output, not rotated) are not. None for the other families."""
    perm = rotary_row_permutation(config)
    if perm is None:
        return None
    names = {f"{spec.hf_layer_prefix}{i}.self_attn.{module}.{kind}" for i in range(config.num_layers)
             for module in ("q_proj", "k_proj", "q_norm", "k_norm") for kind in ("weight", "bias")}

    def permute(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in names:
            return tensor
        if config.attn_output_gate and ".q_proj." in name:  # [heads, (q, gate), head_dim, ...]: q's rows only
            heads = tensor.unflatten(0, (-1, 2, config.head_dim))
            return torch.stack((heads[:, 0, perm], heads[:, 1]), dim=1).flatten(0, 2)
        return tensor.unflatten(0, (-1, config.head_dim))[:, perm].flatten(0, 1)
    return permute


# what each rope scaling type reads (as transformers' computations of them)
_ROPE_KEYS = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def checkpoint_dtype(config: dict) -> str:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    if name not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"checkpoint dtype {name!r} is not supported; set `dtype` in the recipe")
    return name


class TensorReader:
    """Lazy access to the tensors of a checkpoint, by HF name, one at a time. `merge` (the recipe's LoRA
    adapters, compiler/lora.py) changes a tensor as it is read: every step of the build sees the merged weights."""

    def __init__(self, model_dir: Path, merge: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 derived: dict[str, Callable[[TensorReader], torch.Tensor]] | None = None):
        """derived: tensors the checkpoint does not hold, made from ones it does (a converted classifier's
        `score`: score_from_token_rows), by name."""
        self.model_dir = model_dir
        self.merge = merge
        self.derived = derived or {}
        self.location = _tensor_locations(model_dir)  # HF tensor name → file
        # a LLaVA checkpoint (compiler/vision.py): its language model's tensors by the causal LM's names; its
        # vision tower's and projector's by their artifact names (vision_names → the checkpoint's names)
        self._checkpoint_names: dict[str, str] = {}
        self._all_locations = self.location
        self.vision_names: dict[str, str] = {}
        if (llava := llava_names(list(self.location))) is not None:
            self._checkpoint_names, self.vision_names = llava
            self.location = {name: self.location[source] for name, source in self._checkpoint_names.items()}
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def release(self) -> None:
        """Close the shard files read so far (the build calls it after each layer). A file stays mapped
        while it is open, and the pages of it already read count in the process's resident memory: kept
        open for the whole build, they grew it by the checkpoint's size. The next `get` reopens a file."""
        self._stack.close()
        self._stack, self._handles = ExitStack(), {}

    def names(self) -> list[str]:
        return list(self.location)

    def has(self, name: str) -> bool:
        return name in self.location or name in self.derived

    def get(self, name: str) -> torch.Tensor:
        if name in self.derived:
            return self.derived[name](self)
        if name not in self.location:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        tensor = self._handle(name).get_tensor(self._checkpoint_names.get(name, name))
        return tensor if self.merge is None else self.merge(name, tensor)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """tensor[index] of a stored tensor, reading only that slice (an expert of Granite MoE's fused experts), merged
        as `get` merges the whole tensor (the merges are elementwise by name: folds, offsets)."""
        if name not in self.location:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        tensor = self._handle(name).get_slice(self._checkpoint_names.get(name, name))[index]
        return tensor if self.merge is None else self.merge(name, tensor)

    def get_source(self, source: str) -> torch.Tensor:
        """A tensor by the checkpoint's own name (a LLaVA vision tower's), as stored."""
        return self._file(self._all_locations[source]).get_tensor(source)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, read from the file's header (no data)."""
        if name not in self.location:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        return tuple(self._handle(name).get_slice(self._checkpoint_names.get(name, name)).get_shape())

    def dtype_name(self, name: str) -> str:
        """A tensor's safetensors dtype ("BF16", "F8_E4M3", ...), read from the file's header (no data)."""
        if name not in self.location:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        return self._handle(name).get_slice(self._checkpoint_names.get(name, name)).get_dtype()

    def _handle(self, name: str):
        return self._file(self.location[name])

    def _file(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]

    def source_files(self) -> list[Path]:
        return sorted(set(self._all_locations.values()))


def _tensor_locations(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise CheckpointError(f"{model_dir}: shard files listed in {INDEX_NAME} are missing: {missing}")
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found pickle weights {pickles[:3]}: convert them to safetensors first)" if pickles else ""
        raise CheckpointError(f"{model_dir}: no .safetensors weights{hint}")
    locations = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                locations[name] = path
    return locations
