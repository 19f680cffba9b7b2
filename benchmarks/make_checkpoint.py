"""A random-weight Hugging Face checkpoint with Llama-3.1-8B's shapes (or an MoE's), for speed benchmarks.

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/make_checkpoint.py --out /tmp/ckpt8b

Speed does not depend on the weight values, so the weights are random (normal(0, 0.02) for the
embedding and every linear, RMSNorm weights 1), generated on the GPU when there is one and written as
bf16 safetensors shards of about 5 GB with model.safetensors.index.json, config.json (Llama-3.1-8B's:
llama3 rope scaling, untied embeddings) and generation_config.json. The real Llama-3 tokenizer cannot
be fetched offline, so the tokenizer is built here with `tokenizers`: a word-level vocabulary of exactly
vocab_size entries (ids below 128000 are the words "w0" ... , then Llama-3's special tokens), so every id
the model can sample decodes to text, and any prompt encodes (unknown words map to <unk>).

    --layers N   fewer decoder layers (same widths)
    --tiny       a small config (2 layers, hidden 256, vocab 1024) for CPU tests
    --classifier N   a LlamaForSequenceClassification of N labels (`score` in place of lm_head)
    --arch A     llama (default: Llama-3.1-8B), qwen3-moe (Qwen3-30B-A3B: hidden 2048, 128 experts of
                 width 768, top-8 renormalised, 32 q / 4 kv heads of 128, q/k norms, 48 layers cut to
                 12 by default) or mixtral (Mixtral-8x7B: 8 experts of width 14336, top-2, 32 layers
                 cut to 8 by default) or deepseek-v2-lite (DeepSeek-V2-Lite: latent attention, 64 experts of
                 width 1408, top-6, 2 shared, 27 layers cut to 4 by default) or glm4-moe (GLM-4.5-Air: 96 q / 8 kv
                 heads of 128 with q/k/v biases, rotary on half of each head, layer 0 dense, then 128 experts of
                 width 1408, top-8 by V3's sigmoid router with e_score_correction_bias, 1 shared; 46 layers cut to 4
                 by default; its multi-token-prediction layer left out, as llmc does not build it), ernie4_5-moe
                 (ERNIE-4.5-21B-A3B: 20 q / 4 kv heads of 128, interleaved rotary, tied embeddings, layer 0 dense,
                 then 64 experts of width 1536, top-6 by a softmax router with its moe_statics bias, 2 shared; 28
                 layers cut to 4 by default), llama4 (Llama-4-Maverick-17B-128E's text model: MoE every other
                 layer, 128 experts of width 8192, top 1, a shared expert, every 4th layer NoPE; 48 layers cut to 4
                 by default) or minimax-m2 (MiniMax-M2: 48 q / 8 kv heads of 128 with q/k norms over the whole
                 projections, rotary on 64 of each head's dims, 256 experts of width 1536 in every layer, top-8 by a
                 sigmoid router with e_score_correction_bias; 62 layers cut to 4 by default; its MTP modules left
                 out). The MoE configs are written by transformers' config classes (Qwen3MoeConfig, MixtralConfig,
                 DeepseekV2Config, Glm4MoeConfig, Ernie4_5_MoeConfig, Llama4TextConfig, MiniMaxM2Config); the
                 experts' tensors are named per expert, as the published checkpoints name them
                 (mlp.experts.E.gate_proj / block_sparse_moe.experts.E.w1), Llama 4's fused
                 (feed_forward.experts.gate_up_proj [E, hidden, 2 x width], down_proj). Or qwen3_5 (Qwen3.5-9B's
                 hybrid: transformers' Qwen3_5TextConfig defaults, 24 Gated DeltaNet and 8 gated-attention layers; its
                 tensors named and shaped by transformers' own model built on the meta device).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}
# Qwen3-30B-A3B's and Mixtral-8x7B's config.json values (transformers config-class arguments)
QWEN3_30B_A3B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False}
MIXTRAL_8X7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 8,
                "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False}
# DeepSeek-V2-Lite's (multi-head latent attention: kv_lora_rank 512, no q_lora; 64 routed experts of width 1408, top-6,
# two shared; layer 0 dense; its yarn rope scaling left out: speed and memory do not depend on it)
DEEPSEEK_V2_LITE = {"vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False}
# GLM-4.5-Air's (zai-org/GLM-4.5-Air: partial_rotary_factor 0.5, use_qk_norm false; GLM-4.5 itself sets it, with 160
# experts and 92 layers); num_nextn_predict_layers 0: its MTP layer (model.layers.46) is not written (a build would
# keep it for speculative method mtp; these benchmarks measure the model alone)
GLM_45_AIR = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
              "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
              "attention_bias": True, "use_qk_norm": False, "n_routed_experts": 128, "n_shared_experts": 1,
              "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
              "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}}
# ERNIE-4.5-21B-A3B-PT's (baidu: interleaved rotary over whole heads of 128, tied embeddings, layer 0 dense, then 64
# experts of width 1536, top-6 by a softmax router choosing with its moe_statics bias, 2 shared; its MTP layer left out)
ERNIE_45_21B = {"vocab_size": 103424, "hidden_size": 2560, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4, "moe_num_experts": 64,
                "moe_k": 6, "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": -1,
                "moe_layer_interval": 1, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
                "tie_word_embeddings": True, "use_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
# Llama-4-Maverick-17B-128E's text config (Llama4TextConfig arguments): MoE every other layer (128 experts of width 8192,
# top 1, a shared expert as wide), dense layers 16384 wide, every 4th layer NoPE (its default no_rope_layers), no q/k
# norm, chunks of 8192 (llmc holds the context to them)
LLAMA4_MAVERICK = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                   "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                   "num_local_experts": 128, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                   "use_qk_norm": False, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
                   "floor_scale": 8192, "attn_scale": 0.1, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-05,
                   "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
# MiniMax-M2's (MiniMaxAI/MiniMax-M2; as recalled, not checked against the hub): the legacy rotary_dim (64 of 128),
# its 3 MTP modules not written
MINIMAX_M2 = {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
              "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256,
              "num_experts_per_tok": 8, "rotary_dim": 64, "max_position_embeddings": 196608, "rms_norm_eps": 1e-06,
              "rope_theta": 5000000.0, "tie_word_embeddings": False}
MOE_ARCHS = {  # arch → (config class, published config, layers by default, tiny widths)
    "qwen3-moe": ("Qwen3MoeConfig", QWEN3_30B_A3B, 12, {"moe_intermediate_size": 128, "num_experts": 8,
                                                        "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", MIXTRAL_8X7B, 8, {"intermediate_size": 128, "num_local_experts": 4}),
    "deepseek-v2-lite": ("DeepseekV2Config", DEEPSEEK_V2_LITE, 4, {"moe_intermediate_size": 128, "n_routed_experts": 8,
                                                                   "num_experts_per_tok": 2, "kv_lora_rank": 64,
                                                                   "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                                                                   "v_head_dim": 32, "num_key_value_heads": 4,
                                                                   "intermediate_size": 512}),
    "glm4-moe": ("Glm4MoeConfig", GLM_45_AIR, 4, {"moe_intermediate_size": 128, "n_routed_experts": 8,
                                                  "num_experts_per_tok": 2, "intermediate_size": 512}),
    "ernie4_5-moe": ("Ernie4_5_MoeConfig", ERNIE_45_21B, 4, {"moe_intermediate_size": 128, "moe_num_experts": 8,
                                                            "moe_k": 2, "intermediate_size": 512}),
    "llama4": ("Llama4TextConfig", LLAMA4_MAVERICK, 4, {"intermediate_size": 128, "intermediate_size_mlp": 512,
                                                        "num_local_experts": 8}),
    "minimax-m2": ("MiniMaxM2Config", MINIMAX_M2, 4, {"intermediate_size": 128, "num_local_experts": 8,
                                                      "num_experts_per_tok": 2, "rotary_dim": 32}),
}
# hybrid archs → (config class, layers by default): transformers' defaults for the widths (Qwen3_5TextConfig's are
# Qwen3.5-9B's: hidden 4096, 32 layers, every fourth full attention, the rest Gated DeltaNets of 16 key / 32 value heads
# of 128), the tensors named and shaped as transformers' own model holds them (built on the meta device)
META_ARCHS = {"qwen3_5": ("Qwen3_5TextConfig", 32)}
ARCHS = ("llama", *MOE_ARCHS, *META_ARCHS)
SHARD_BYTES = 5 * 10**9
NUM_SPECIAL = 256  # Llama-3: <|begin_of_text|> = 128000, <|end_of_text|> = 128001, reserved specials to 128255


def make_config(layers: int | None, tiny: bool, arch: str = "llama") -> dict:
    if arch == "llama":
        config = {**LLAMA3_8B, **(TINY if tiny else {})}
    elif arch in META_ARCHS:
        config = meta_arch_config(arch, tiny, layers)
    else:
        config = moe_config(arch, tiny, layers)
    if layers is not None:
        config["num_hidden_layers"] = layers
    first_special = config["vocab_size"] - NUM_SPECIAL  # Llama-3's ids: bos 128000, eos 128001, 128008, 128009
    config["bos_token_id"] = first_special
    config["eos_token_id"] = [first_special + 1, first_special + 8, first_special + 9]
    return config


def moe_config(arch: str, tiny: bool, layers: int | None = None) -> dict:
    """The arch's config.json through its transformers config class (tiny: TINY's widths, few experts; layers: that
    many, else the arch's default, before the class fills in what follows from them: Llama 4's moe_layers)."""
    import transformers

    class_name, published, default_layers, tiny_widths = MOE_ARCHS[arch]
    values = {**published, "num_hidden_layers": layers or default_layers}
    if tiny:
        values |= {key: value for key, value in TINY.items() if key != "intermediate_size"} | tiny_widths
    config = getattr(transformers, class_name)(**values, dtype="bfloat16").to_dict()
    config["architectures"] = [class_name.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    return config


def meta_arch_config(arch: str, tiny: bool, layers: int | None) -> dict:
    import transformers

    class_name, default_layers = META_ARCHS[arch]
    values = {"num_hidden_layers": layers or default_layers, "tie_word_embeddings": False}
    if tiny:
        values |= {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    config = getattr(transformers, class_name)(**values, dtype="bfloat16")
    config.layer_types = config.layer_types[:config.num_hidden_layers]
    config = config.to_dict()
    config["architectures"] = [class_name.replace("TextConfig", "ForCausalLM")]
    return config


def meta_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of transformers' own model of this config (built on the meta device), in its order."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF name → shape, in the order the shards hold them (embedding, layers, norm, lm_head)."""
    if config["model_type"] == "qwen3_5_text":  # (META_ARCHS)
        return meta_shapes(config)
    hidden = config["hidden_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        shapes |= attention_shapes(config, p) | mlp_shapes(config, p, i)
    if "num_labels" in config:  # a sequence classifier's head
        return shapes | {"model.norm.weight": (hidden,), "score.weight": (config["num_labels"], hidden)}
    if config.get("tie_word_embeddings"):  # (ERNIE 4.5: the embedding is the LM head)
        return shapes | {"model.norm.weight": (hidden,)}
    return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (config["vocab_size"], hidden)}


def attention_shapes(config: dict, p: str) -> dict[str, tuple[int, ...]]:
    """One layer's attention tensors: q/k/v/o, or DeepSeek's latent attention (q, the joint kv_a, its norm, kv_b, o)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config["model_type"] == "deepseek_v2":
        latent, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
        nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
        return {p + "self_attn.q_proj.weight": (heads * (nope + rope), hidden),
                p + "self_attn.kv_a_proj_with_mqa.weight": (latent + rope, hidden),
                p + "self_attn.kv_a_layernorm.weight": (latent,),
                p + "self_attn.kv_b_proj.weight": (heads * (nope + v), latent),
                p + "self_attn.o_proj.weight": (hidden, heads * v)}
    head_dim = config.get("head_dim") or hidden // heads  # (ERNIE 4.5 MoE's config has none)
    q, kv = heads * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
              p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q)}
    if config["model_type"] == "glm4_moe":  # q/k/v biases (attention_bias), q/k norms where use_qk_norm
        if config["attention_bias"]:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config["use_qk_norm"]:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    if config["model_type"] == "minimax_m2":  # q/k norms over the whole projections
        shapes |= {p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)}
    return shapes


def dense_mlp_shapes(p: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden),
            p + "down_proj.weight": (hidden, inter)}


def mlp_shapes(config: dict, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's MLP tensors: Llama's dense MLP, Qwen3-MoE's (with its q/k norms), Mixtral's experts or
    DeepSeek's and GLM-4.5's (dense before first_k_dense_replace, then routed experts beside shared ones; GLM-4.5's
    router with its e_score_correction_bias)."""
    hidden, model_type = config["hidden_size"], config["model_type"]
    if model_type == "ernie4_5_moe":
        return ernie_mlp_shapes(config, p, layer)
    if model_type == "llama4_text":  # feed_forward: dense, or fused experts (input-major) beside a shared expert
        if layer not in config["moe_layers"]:
            return dense_mlp_shapes(p + "feed_forward.", hidden, config["intermediate_size_mlp"])
        inter, num_experts = config["intermediate_size"], config["num_local_experts"]
        return {p + "feed_forward.router.weight": (num_experts, hidden),
                p + "feed_forward.experts.gate_up_proj": (num_experts, hidden, 2 * inter),
                p + "feed_forward.experts.down_proj": (num_experts, inter, hidden),
                **dense_mlp_shapes(p + "feed_forward.shared_expert.", hidden, inter)}
    deepseek_like = model_type in ("deepseek_v2", "glm4_moe")
    if model_type == "llama" or (deepseek_like and layer < config["first_k_dense_replace"]):
        return dense_mlp_shapes(p + "mlp.", hidden, config["intermediate_size"])
    if deepseek_like:
        inter, num_experts = config["moe_intermediate_size"], config["n_routed_experts"]
        shapes = {p + "mlp.gate.weight": (num_experts, hidden)}
        if model_type == "glm4_moe":
            shapes[p + "mlp.gate.e_score_correction_bias"] = (num_experts,)
        shapes |= dense_mlp_shapes(p + "mlp.shared_experts.", hidden, inter * config["n_shared_experts"])
        for e in range(num_experts):
            shapes |= dense_mlp_shapes(p + f"mlp.experts.{e}.", hidden, inter)
        return shapes
    num_experts = config["num_local_experts"]  # transformers 5 writes Qwen3-MoE's num_experts under this name too
    if model_type == "qwen3_moe":
        inter, head_dim = config["moe_intermediate_size"], config["head_dim"]
        shapes = {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
                  p + "mlp.gate.weight": (num_experts, hidden)}
        names = ("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj")
    else:
        inter = config["intermediate_size"]
        shapes = {p + "block_sparse_moe.gate.weight": (num_experts, hidden)}
        if model_type == "minimax_m2":  # its score bias beside the router
            shapes[p + "block_sparse_moe.e_score_correction_bias"] = (num_experts,)
        names = ("block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3", "block_sparse_moe.experts.{}.w2")
    for e in range(num_experts):
        gate, up, down = (p + name.format(e) + ".weight" for name in names)
        shapes |= {gate: (inter, hidden), up: (inter, hidden), down: (hidden, inter)}
    return shapes


def ernie_mlp_shapes(config: dict, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """ERNIE 4.5 MoE's: layer i an MoE where (i + 1) % moe_layer_interval == 0 within [moe_layer_start_index,
    moe_layer_end_index], its router's bias under mlp.moe_statics [1, E], as the published checkpoints hold it."""
    hidden, inter, num_experts = config["hidden_size"], config["moe_intermediate_size"], config["moe_num_experts"]
    if (layer + 1) % config["moe_layer_interval"] or not (
            config["moe_layer_start_index"] <= layer <= config["moe_layer_end_index"]):
        return dense_mlp_shapes(p + "mlp.", hidden, config["intermediate_size"])
    shapes = {p + "mlp.gate.weight": (num_experts, hidden),
              p + "mlp.moe_statics.e_score_correction_bias": (1, num_experts)}
    if config["moe_num_shared_experts"]:
        shapes |= dense_mlp_shapes(p + "mlp.shared_experts.", hidden, inter * config["moe_num_shared_experts"])
    for e in range(num_experts):
        shapes |= dense_mlp_shapes(p + f"mlp.experts.{e}.", hidden, inter)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("A_log"):  # a Gated DeltaNet's decay: A in [1, 16], as Qwen3-Next's init draws it
        return torch.empty(shape, dtype=torch.bfloat16, device=device).uniform_(0.0, 2.77, generator=generator).cpu()
    if name.endswith("e_score_correction_bias"):  # float32, as GLM-4.5 stores it (transformers keeps it so)
        return torch.zeros(shape, dtype=torch.float32)
    tensor = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=generator)
    return tensor.cpu()


def write_weights(config: dict, out: Path, device: torch.device, seed: int) -> int:
    """Write the shards and the index; returns the total bytes."""
    generator = torch.Generator(device).manual_seed(seed)
    shapes = tensor_shapes(config)
    groups, group, group_bytes = [], [], 0  # names per shard, cut at ~SHARD_BYTES
    for name, shape in shapes.items():
        size = 2 * torch.Size(shape).numel()
        if group and group_bytes + size > SHARD_BYTES:
            groups.append(group)
            group, group_bytes = [], 0
        group.append(name)
        group_bytes += size
    groups.append(group)
    weight_map, total = {}, 0
    for index, names in enumerate(groups):
        filename = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: random_tensor(name, shapes[name], generator, device) for name in names}
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(names, filename)
        print(f"  {filename}: {len(names)} tensors", flush=True)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return total


def special_tokens() -> list[str]:
    names = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL - 2)]
    names[8], names[9] = "<|eom_id|>", "<|eot_id|>"  # 128008, 128009 in Llama-3.1
    return names


def write_tokenizer(config: dict, out: Path) -> None:
    """A word-level tokenizer with exactly vocab_size ids: <unk>, words w1.., then the special tokens.
    <unk> is an ordinary token to transformers (not in tokenizer_config), so it decodes as text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    num_words = config["vocab_size"] - NUM_SPECIAL
    specials = special_tokens()
    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, num_words)}
    vocab |= {name: num_words + i for i, name in enumerate(specials)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    bos = specials[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, num_words)])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": specials[1],
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": bos, "eos_token": specials[1]}))


def make_checkpoint(out: Path, layers: int | None = None, tiny: bool = False, device: str | None = None,
                    seed: int = 0, arch: str = "llama", classifier: int | None = None) -> dict:
    """Write the checkpoint into `out` (created); returns {"seconds", "bytes", "config"}. classifier: a
    LlamaForSequenceClassification of that many labels (its `score` head in place of lm_head)."""
    start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = make_config(layers, tiny, arch)
    if classifier is not None:  # pad: the last special id, which no benchmark prompt holds
        config |= {"architectures": ["LlamaForSequenceClassification"], "num_labels": classifier,
                   "pad_token_id": config["vocab_size"] - 1}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(config, out)
    total = write_weights(config, out, device, seed)
    return {"seconds": round(time.perf_counter() - start, 1), "bytes": total, "config": config}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory (created)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: llama 32, qwen3-moe 12, mixtral 8, "
                        "deepseek-v2-lite 4, glm4-moe 4, ernie4_5-moe 4, llama4 4, minimax-m2 4, qwen3_5 32; 2 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a small config for CPU tests")
    parser.add_argument("--device", default=None, help="where the random numbers are drawn (default: cuda if available)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="llama, qwen3-moe, mixtral, deepseek-v2-lite, "
                        "glm4-moe, ernie4_5-moe, llama4, minimax-m2 or qwen3_5")
    parser.add_argument("--classifier", type=int, default=None, metavar="N",
                        help="llama only: a LlamaForSequenceClassification of N labels")
    args = parser.parse_args(argv)
    if args.classifier is not None and args.arch != "llama":
        parser.error("--classifier makes a LlamaForSequenceClassification: use it with --arch llama")
    result = make_checkpoint(args.out, args.layers, args.tiny, args.device, args.seed, args.arch, args.classifier)
    print(f"wrote {args.out}: {result['bytes'] / 1e9:.2f} GB of weights, "
          f"{result['config']['num_hidden_layers']} layers, in {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
