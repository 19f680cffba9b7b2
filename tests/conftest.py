"""Suite-wide fixtures: tiny random-weight Hugging Face checkpoints and a transformers oracle.

Test files cannot import each other (pytest runs with ``--import-mode=importlib``), so every
helper here is reachable through a fixture:

* ``hf_checkpoint_factory`` -> :func:`make_hf_checkpoint`
* ``tiny_llama``, ``tiny_llama3_rope``, ``tiny_mistral``, ``tiny_qwen2``, ``tiny_qwen3``, ``tiny_phi3``,
  ``tiny_llama_sharded`` -> ``Path`` of one session-wide checkpoint each
* ``tiny_checkpoint`` -> ``(family, Path)``, parametrised over every dense family
* ``tiny_mixtral``, ``tiny_qwen3_moe`` -> ``Path``; ``tiny_any_checkpoint`` -> ``(family, Path)`` over the dense and MoE families;
  ``upcycled_mixtral`` -> ``Path`` (ref-llama-12m's trained weights as a 4-expert Mixtral)
* ``tiny_gemma3``, ``tiny_gemma2``, ``tiny_granite``, ``tiny_olmo2``, ``tiny_smollm3`` -> ``Path`` (OTHER_FAMILIES: each
  has its own test file)
* ``tiny_glm4``, ``tiny_cohere2``, ``tiny_cohere`` -> ``Path`` (tests/runtime/test_glm4_cohere.py)
* ``hf_greedy`` -> :func:`hf_greedy`, ``hf_logits`` -> :func:`hf_logits`,
  ``hf_encode`` -> :func:`hf_encode` (the exact prompt ids ``hf_greedy`` feeds the model)
* ``repo_root``, ``data_dir``, ``peer_checkpoint_dir``, ``ref_model_dir`` -> ``Path``
* ``ref_artifact_128`` -> ``Path`` (ref-llama-12m built in float32, max_model_len 128; session-wide, read only)
* ``free_gpu``: after the test, collect garbage and empty torch's CUDA cache
* ``forward_step`` -> :func:`forward_step` (a model step's ids and ForwardBatch, from sequences)

The checkpoints are written exactly as ``save_pretrained`` writes them (transformers 5 writes
``rope_parameters``; pass ``legacy_rope_keys=True`` for the older ``rope_theta`` + ``rope_scaling``
keys that published checkpoints carry).  Every weight is random, including the RMSNorm weights
and biases that transformers initialises to 1 and 0, so that a loader that drops them, or an
engine that ignores them, disagrees with transformers.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import json
import shutil
import threading
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

# What addopts selects (pyproject.toml): the default run, which pytest_cmdline_main splits over processes.
DEFAULT_MARKEXPR = "not slow and not gpu"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest` over the whole default selection runs in LLMC_TEST_PROCESSES processes (default 2) where pytest-xdist
    is installed (the `dev` extra) and the machine has that many CPUs: whole test files to a process (--dist
    loadfile), so a file's module fixtures are built once. 10:39 against 19:08 in one process on a 2-core machine
    (session 47). Left as asked: named files or tests, another -m (gpu tests share one device), -n, -p no:xdist,
    LLMC_TEST_PROCESSES=1, --pdb / --trace, --collect-only. Runs before xdist's own hook (a conftest registers after
    the installed plugins), which turns the count into worker processes."""
    processes = int(os.environ.get("LLMC_TEST_PROCESSES", "2"))
    if (config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None) is None
            and not hasattr(config, "workerinput") and config.args_source != pytest.Config.ArgsSource.ARGS
            and config.option.markexpr == DEFAULT_MARKEXPR and processes > 1 and (os.cpu_count() or 1) >= processes
            and not (config.option.collectonly or config.option.usepdb or config.option.trace)):  # (xdist refuses pdb)
        config.option.numprocesses, config.option.dist = processes, "loadfile"

# Small models on a small shared CPU: torch's intra-op threads cost more in contention than they
# gain, and subprocesses (the CLI, the server) inherit the setting through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# After every engine step, check that the scheduler, the engine's maps, the persistent-batch rows and
# the block pool agree (runtime/engine_faults.py); servers started by tests inherit it. Not on a GPU
# machine: there the memory plan gives millions of KV blocks and the block check is O(blocks) a step.
if not torch.cuda.is_available():
    os.environ.setdefault("LLMC_CHECK_INVARIANTS", "1")
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parent.parent
REF_MODEL_DIR = REPO_ROOT / "checkpoints" / "ref-llama-12m"
PEER_DIR = REPO_ROOT / "checkpoints" / "peer-gptq-w4a16-g128"
DATA_DIR = REPO_ROOT / "data"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

FAMILIES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3")
# Mixture-of-experts families: not in FAMILIES (the dense-family tests do not run them), own fixtures below.
MOE_FAMILIES = ("mixtral", "qwen3_moe")
# Families with their own test files (not in FAMILIES: the dense-family tests do not run them).
OTHER_FAMILIES = ("gemma3", "gemma2", "granite", "olmo2", "smollm3")
# Families tested in tests/runtime/test_more_families.py (fixture: more_family_checkpoint)
MORE_FAMILIES = ("olmo3", "olmoe", "granitemoe", "granitemoeshared", "qwen2_moe")
# Families tested in tests/runtime/test_glm4_cohere.py (fixture: tiny_glm4)
GLM_COHERE_FAMILIES = ("glm4", "cohere2", "cohere")

BOS_ID, EOS_ID, PAD_ID = 0, 1, 4

# Common to every family.  Vocabulary = the reference tokenizer's, so its tokenizer can be copied in.
_BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)

# Per family: transformers config class name, and overrides of _BASE_CONFIG.
_FAMILY_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope": (
        "LlamaConfig",
        {
            # head_dim 16, theta 1e4: wavelengths 2*pi*1e4**(2i/16) = 6.3, 19.9, 62.8, 199, ...
            # With original_max_position_embeddings 64, low_freq_factor 1 and high_freq_factor 4,
            # i=0 is kept, i=1,2 (16 < wavelength < 64) are smoothed, i>=3 are divided by 8:
            # all three branches of the llama3 rule are exercised.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": (
        "Qwen2Config",
        {
            "rope_theta": 1_000_000.0,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
        },
    ),
    "qwen3": (
        "Qwen3Config",
        {
            # head_dim != hidden_size / num_attention_heads (= 16): q_proj is 64 -> 128.
            "head_dim": 32,
            "use_sliding_window": False,
            "sliding_window": None,
        },
    ),
    # 4 experts, top-2 (always renormalised), every layer sparse.
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96,
                                  "sliding_window": None}),
    # 3 layers: 0 and 2 sparse, 1 dense (mlp_only_layers); top-2 of 4 NOT renormalised (norm_topk_prob
    # False, the config's default); q/k norms and head_dim 32 as qwen3.
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "num_hidden_layers": 3, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                                     "norm_topk_prob": False, "head_dim": 32, "use_sliding_window": False,
                                     "sliding_window": None}),
    # q/k/v stored as one qkv_proj, gate/up as one gate_up_proj; head_dim 32 != hidden / heads (Phi3Attention
    # reads the key when the config has it); no sliding window (Phi3Config's default).
    "phi3": ("Phi3Config", {"head_dim": 32, "sliding_window": None}),
    # Gemma 3 text: hidden 96 (sqrt(96) is not a float32 integer: the embedding scale's rounding shows),
    # head_dim 32 with query_pre_attn_scalar 24 (the scale is not head_dim's), 3 layers sliding / full /
    # sliding with an 8-token window, and two rotary tables: sliding layers theta 1e4 unscaled, the full
    # layer theta 1e6 with linear scaling x4. Tied embeddings, GELU-tanh MLP, sandwich norms, q/k norms.
    "gemma3": ("Gemma3TextConfig", {"hidden_size": 96, "head_dim": 32, "query_pre_attn_scalar": 24,
                                    "num_hidden_layers": 3, "sliding_window": 8, "tie_word_embeddings": True,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                    "hidden_activation": "gelu_pytorch_tanh",
                                    "rope_parameters": {
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                           "rope_theta": 1_000_000.0}}}),
    # Gemma 2: Gemma 3's shape (hidden 96, head_dim 32, query_pre_attn_scalar 24, 3 layers sliding / full /
    # sliding with an 8-token window, GQA 4/2, tied, GELU-tanh, sandwich norms) without q/k norms, one rotary
    # table (theta 1e4), and soft caps small enough to matter on this model: attention scores reach ~4 and
    # logits ~2.5 uncapped (tests/runtime/test_gemma2.py checks that they would pass the caps).
    "gemma2": ("Gemma2Config", {"hidden_size": 96, "head_dim": 32, "query_pre_attn_scalar": 24,
                                "num_hidden_layers": 3, "sliding_window": 8, "tie_word_embeddings": True,
                                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 1.5}),
    # Granite: the Llama shape (hidden 64, GQA 4/2, 2 layers, untied; tests/runtime/test_granite.py builds a tied
    # copy) with its four multipliers far from 1 and from what they replace (head_dim^-0.5 = 0.25), so that
    # dropping any one of them moves the logits clearly (test_granite.py checks it).
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "attention_multiplier": 0.05,
                                  "residual_multiplier": 0.3, "logits_scaling": 5.0}),
    # OLMo 2: the Llama shape (hidden 64, GQA 4/2: q_norm 64 wide, k_norm 32, 2 layers, untied) with no pre-norms, the
    # sub-layers' outputs normed (post_attention_layernorm, post_feedforward_layernorm) and q/k norms over the whole
    # projections; every norm weight random (1 + 0.1 randn), so that a per-head q/k norm or a norm in the wrong place
    # disagrees with transformers (tests/runtime/test_olmo2.py checks the first).
    "olmo2": ("Olmo2Config", {}),
    # OLMo 3: OLMo 2's shape with 3 layers sliding / full / sliding over an 8-token window, and two rotary tables
    # as Olmo3Config keeps them: the full layer's linearly scaled x4, the sliding layers' plain (theta 1e4 both).
    "olmo3": ("Olmo3Config", {"num_hidden_layers": 3, "sliding_window": 8,
                              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                              "rope_parameters": {
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0}}}),
    # OLMoE: 4 experts of width 96, top-2 not renormalised (norm_topk_prob false, OLMoE's own), full-width q/k norms
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96,
                              "norm_topk_prob": False}),
    # Granite MoE: granite's multipliers, 4 fused experts of width 96, top-2 (softmax of the top-k logits); the shared
    # variant adds a shared MLP of width 64
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96,
                                        "embedding_multiplier": 12.0, "attention_multiplier": 0.05,
                                        "residual_multiplier": 0.3, "logits_scaling": 5.0}),
    "granitemoeshared": ("GraniteMoeSharedConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                    "intermediate_size": 96, "shared_intermediate_size": 64,
                                                    "embedding_multiplier": 12.0, "attention_multiplier": 0.05,
                                                    "residual_multiplier": 0.3, "logits_scaling": 5.0}),
    # Qwen2-MoE: 3 layers, 0 and 2 sparse (4 experts of width 64, top-2, not renormalised), 1 dense; a gated shared
    # expert of width 96; q/k/v biases
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "shared_expert_intermediate_size": 96, "num_hidden_layers": 3,
                                     "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": False,
                                     "use_sliding_window": False, "sliding_window": None}),
    # GLM-4: head_dim 32 (q_proj 64 -> 128), partial_rotary_factor 0.5 (16 of each head's dims rotated, in
    # interleaved pairs), q/k/v biases, gate_up_proj fused, the sub-layers' outputs normed
    # (tests/runtime/test_glm4_cohere.py)
    "glm4": ("Glm4Config", {"head_dim": 32, "attention_bias": True,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                                                "partial_rotary_factor": 0.5}}),
    # Cohere 2: 3 layers sliding / full / sliding over an 8-token window (rotary on the sliding ones only), LayerNorm,
    # the parallel block, tied embeddings, logit_scale 0.25 (not Command R7B's 0.0625: the logits stay O(1));
    # Cohere: the same without the window, rotary on every layer
    "cohere2": ("Cohere2Config", {"num_hidden_layers": 3, "sliding_window": 8, "tie_word_embeddings": True,
                                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                  "logit_scale": 0.25, "layer_norm_eps": 1e-5}),
    "cohere": ("CohereConfig", {"tie_word_embeddings": True, "logit_scale": 0.25, "layer_norm_eps": 1e-5}),
}
# DeepSeek (tests/runtime/test_deepseek.py): MLA with 4 heads of 12 + 4 q/k dims and 8 v dims, one dense layer, then MoE
# layers of 8 experts (top 2) and 2 shared ones. V2 without a q_lora_rank, greedy; V2 with one, group-limited; V3 with
# YaRN's mscale terms, sigmoid routing within groups, renormalised and scaled.
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "num_hidden_layers": 3}
_FAMILY_SPECS |= {
    "deepseek_v2": ("DeepseekV2Config", {**_MLA, "q_lora_rank": None, "topk_method": "greedy"}),
    "deepseek_v2_q_lora": ("DeepseekV2Config", {**_MLA, "q_lora_rank": 32, "topk_method": "group_limited_greedy",
                                                "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5}),
    "deepseek_v3": ("DeepseekV3Config", {**_MLA, "q_lora_rank": 32, "n_group": 4, "topk_group": 2,
                                         "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 64, "mscale": 1.0,
                                                             "mscale_all_dim": 0.8}}),
}
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v2_q_lora", "deepseek_v3")
# gpt-oss (tests/runtime/test_gpt_oss.py): head_dim 32 (not hidden / heads), 3 layers sliding / full / sliding over an
# 8-token window, q/k/v/o biases, attention sinks (random: std 1), 4 experts of width 64 with biases, top-2 of a biased
# router, YaRN x4 over 64 positions untruncated, and swiglu_limit 1.0: with LINEAR_STD the gate and up outputs have
# std ~1.6, so the clamps bind on many of them (7.0, the published limit, would hardly ever bind here)
_FAMILY_SPECS["gpt_oss"] = ("GptOssConfig", {
    "head_dim": 32, "num_hidden_layers": 3, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
    "intermediate_size": 64, "swiglu_limit": 1.0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 64}})
# GLM-4.5 MoE (tests/runtime/test_glm4_moe.py): GQA 4/2 of head_dim 32 with q/k/v biases, rotary on the leading 16
# dims of each head (rotate-half over them), one dense layer, then 2 MoE layers of 8 experts of width 32 (top 2) in 2
# groups of which 1 is chosen, renormalised and scaled by 2.5, beside one shared expert; q/k norms (use_qk_norm: the
# tests build a copy without them), one multi-token-prediction layer named in the config (the tests write its tensors)
_FAMILY_SPECS["glm4_moe"] = ("Glm4MoeConfig", {
    "head_dim": 32, "attention_bias": True, "use_qk_norm": True, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}})

# SmolLM3 (tests/runtime/test_smollm3.py): 4 layers, NoPE every second one (no_rope_layer_interval 2: layers 1 and 3
# rotate neither q nor k), tied embeddings as SmolLM3-3B's; the test file writes an untied and a sliding copy
_FAMILY_SPECS["smollm3"] = ("SmolLM3Config", {"num_hidden_layers": 4, "no_rope_layer_interval": 2,
                                              "tie_word_embeddings": True})

# EXAONE 4, Seed-OSS, ERNIE 4.5 (tests/runtime/test_exaone4_seed_ernie.py). EXAONE 4: OLMo 2's norm placement with
# per-head q/k norms, 4 layers sliding / full / sliding / full over an 8-token window (the full layers NoPE, as
# Exaone4Attention runs them with a sliding_window). Seed-OSS: head_dim 32, q/k/v and o biases (attention_out_bias).
# ERNIE 4.5: head_dim 32, interleaved rotary over the whole head, tied embeddings (its default).
_FAMILY_SPECS["exaone4"] = ("Exaone4Config", {"num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 2})
_FAMILY_SPECS["seed_oss"] = ("SeedOssConfig", {"head_dim": 32, "attention_bias": True, "attention_out_bias": True,
                                               "mlp_bias": False})
_FAMILY_SPECS["ernie4_5"] = ("Ernie4_5Config", {"head_dim": 32, "tie_word_embeddings": True, "use_bias": False})
EXAONE_SEED_ERNIE_FAMILIES = ("exaone4", "seed_oss", "ernie4_5")
# dots.llm1 (tests/runtime/test_dots1.py): Qwen3's attention (GQA 4/2 of head_dim 32, q/k norms, no biases), one
# dense layer, then 2 MoE layers of 8 experts of width 32 (top 2) in 2 groups of which 1 is chosen, renormalised and
# scaled by 2.5, beside 2 shared experts (one of width 64); no sliding window (the test file writes a sliding copy)
_FAMILY_SPECS["dots1"] = ("Dots1Config", {
    "head_dim": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "sliding_window": None})
# ERNIE 4.5 MoE (tests/runtime/test_ernie4_5_moe.py): dense ERNIE's attention (head_dim 32, interleaved rotary, tied),
# 4 layers of which 1 and 3 are MoE ((i + 1) % moe_layer_interval 2 == 0 from moe_layer_start_index 1): 8 experts of
# width 32, top 2, beside 2 shared experts (one of width 64); 0 and 2 dense MLPs (the base intermediate_size)
_FAMILY_SPECS["ernie4_5_moe"] = ("Ernie4_5_MoeConfig", {
    "head_dim": 32, "tie_word_embeddings": True, "use_bias": False, "num_hidden_layers": 4, "moe_num_experts": 8,
    "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
    "moe_layer_end_index": -1, "moe_layer_interval": 2})
# Ministral 3 (tests/runtime/test_ministral3.py): 3 layers, head_dim 16, YaRN over original_max_position_embeddings 8
# (x32: the 256 positions of the builds) whose llama_4_scaling_beta 0.3 scales q by 1 + 0.3 log(1 + floor(position /
# 8)): every 8 positions a new factor, 1 below 8
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 8,
                   "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3}
_FAMILY_SPECS["ministral3"] = ("Ministral3Config", {"head_dim": 16, "num_hidden_layers": 3,
                                                    "rope_parameters": MINISTRAL3_ROPE})
# Llama 4 text (tests/runtime/test_llama4.py): 4 layers, head_dim 16, interleaved rotary with llama3 scaling (as
# llama3_rope's, all three branches), layer 2 NoPE (no_rope_layers) with its q tempered by 1 + 0.3 log(1 + floor((p +
# 1) / 8)), the weightless q/k norm on the others; MoE on layers 1 and 3 (interleave_moe_layer_step 2: 4 experts of
# width 64, top 1, beside a shared expert as wide), dense layers 128 wide; chunked attention on the rope layers in
# chunks of 12 (not a multiple of the cache's 16-slot blocks or of the 16-token prefill chunks), context 1024
LLAMA4_TEXT = {"head_dim": 16, "num_hidden_layers": 4, "no_rope_layers": [1, 1, 0, 1], "floor_scale": 8,
               "attn_scale": 0.3, "interleave_moe_layer_step": 2, "num_local_experts": 4, "num_experts_per_tok": 1,
               "intermediate_size": 64, "intermediate_size_mlp": 128, "attention_chunk_size": 12,
               "max_position_embeddings": 1024, "use_qk_norm": True,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}
_FAMILY_SPECS["llama4"] = ("Llama4TextConfig", LLAMA4_TEXT)
# MiniMax-M2 (tests/runtime/test_minimax_m2.py): GQA 4/2 of head_dim 32 with q/k norms over the whole projections
# (128 and 64 wide) and a partial rotary over 16 of each head's 32 dims (the legacy rotary_dim, as MiniMax's
# config.json), 2 layers of 8 experts of width 32 (top 2, renormalised), stored as Mixtral's (block_sparse_moe)
_FAMILY_SPECS["minimax_m2"] = ("MiniMaxM2Config", {
    "head_dim": 32, "rotary_dim": 16, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2})
# Qwen3.5 (tests/runtime/test_qwen3_5.py): the hybrid layer_types [linear, linear, full, linear]; the full layer GQA 4/2
# of head_dim 32 with its output gate and a partial rotary over 8 of 32 dims (partial_rotary_factor 0.25); the Gated
# DeltaNet 2 key heads of 16 serving 4 value heads of 16, conv kernel 4
_FAMILY_SPECS["qwen3_5"] = ("Qwen3_5TextConfig", {
    "head_dim": 32, "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]})
# Qwen3.5-MoE (tests/runtime/test_qwen3_5_moe.py): Qwen3.5's layers and sizes, every MLP 4 experts of width 32 (top 2,
# always renormalised) beside a gated shared expert of width 64 (no intermediate_size: Qwen3_5MoeTextConfig has none)
_FAMILY_SPECS["qwen3_5_moe"] = ("Qwen3_5MoeTextConfig", {
    **_FAMILY_SPECS["qwen3_5"][1], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64})
# Qwen3-Next (tests/runtime/test_qwen3_5_moe.py): Qwen3.5-MoE's layers and sizes with its fused in_proj_qkvz /
# in_proj_ba, layer 1 a dense MLP (mlp_only_layers) 128 wide, the top 2 not renormalised (norm_topk_prob false)
_FAMILY_SPECS["qwen3_next"] = ("Qwen3NextConfig", {
    **_FAMILY_SPECS["qwen3_5_moe"][1], "mlp_only_layers": [1], "decoder_sparse_step": 1, "norm_topk_prob": False})
# Granite 4.0 (tests/runtime/test_granitemoehybrid.py): its attention-only form (granite-4.0-micro's), 3 layers, no
# experts, the MLP its shared_mlp 96 wide (not intermediate_size's 128, which the model never reads), rotary
# (position_embedding_type rope; the test builds a NoPE copy) and granite's multipliers
_FAMILY_SPECS["granitemoehybrid"] = ("GraniteMoeHybridConfig", {
    **_FAMILY_SPECS["granite"][1], "num_hidden_layers": 3, "layer_types": ["attention"] * 3, "num_local_experts": 0,
    "shared_intermediate_size": 96, "position_embedding_type": "rope"})
# Bamba (tests/runtime/test_bamba.py): test_granite4_hybrid's [mamba, attention, mamba] layers and Mamba-2 sizes (8
# heads of 16 in 2 groups, d_state 16, a conv of 4, chunks of 8) with the attention layer rotating the leading half of
# each head (BambaConfig's partial_rotary_factor 0.5) and a dense SwiGLU MLP 128 wide in every layer
_FAMILY_SPECS["bamba"] = ("BambaConfig", {
    "num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8})

# Nemotron-H (tests/runtime/test_nemotron_h.py): the blocks M - * M - - (Mamba-2, MLP, attention, Mamba-2 after it,
# two MLPs in a row), attention GQA 4/2 of head_dim 16 without rotary, relu2 MLPs 96 wide, Mamba-2 of 8 heads of 16 in
# 2 groups, d_state 16, a conv of 4, chunks of 8 (as Granite 4.0's hybrid test)
_FAMILY_SPECS["nemotron_h"] = ("NemotronHConfig", {
    "hybrid_override_pattern": "M-*M--", "num_hidden_layers": 6, "head_dim": 16, "intermediate_size": 96,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
    "chunk_size": 8})

# LFM2 (tests/runtime/test_lfm2.py): layers conv / full_attention / conv, the short conv of 3 taps (conv_L_cache), the
# attention GQA 4/2 with per-head q/k norms; the feed-forward int(2 * 128 / 3) = 85 wide, times 1.5 = 127, rounded up to
# 128 (block_multiple_of 32); LFM2's norm_eps (it reads no rms_norm_eps)
_FAMILY_SPECS["lfm2"] = ("Lfm2Config", {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
                                        "conv_L_cache": 3, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.5,
                                        "norm_eps": 1e-5})
# LFM2-MoE (tests/runtime/test_lfm2.py): LFM2's layers and sizes, layer 0's feed-forward dense (num_dense_layers 1;
# intermediate_size 128 as it is), layers 1 and 2 8 experts of width 32, top 2 of a sigmoid router chosen with
# expert_bias (a buffer: the test writes random values), renormalised, times 1.5
_FAMILY_SPECS["lfm2_moe"] = ("Lfm2MoeConfig", {
    "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "conv_L_cache": 3, "norm_eps": 1e-5,
    "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "routed_scaling_factor": 1.5, "norm_topk_prob": True, "use_expert_bias": True})

# GLM-4.7-Flash (tests/runtime/test_glm4_moe_lite_mistral4.py): DeepSeek's tiny MLA with v_head_dim as wide as the key
# (16, GLM-4.7-Flash's 256 = 192 + 64), mlp_layer_types sparse / dense / sparse (no first_k_dense_replace: transformers
# reads mlp_layer_types), V3's router in 4 groups of which 2 are chosen, renormalised, scaled by 1.8, one MTP layer
# named in the config (tests/runtime/test_spec_mtp_glm4_moe_lite.py writes its tensors). Mistral 4: the
# same MLA (v 8 wide) with one dense layer, a softmax router (renormalised, scaled by 1.5, one group), YaRN x32 over
# original_max_position_embeddings 8 (mscale_all_dim 1: the softmax scale's term) whose llama_4_scaling_beta 0.3 scales
# q by 1 + 0.3 log(1 + floor(position / 8)); transformers 5 saves its experts fused
_MLA_NO_DENSE = {k: v for k, v in _MLA.items() if k != "first_k_dense_replace"}
_FAMILY_SPECS["glm4_moe_lite"] = ("Glm4MoeLiteConfig", {
    **_MLA_NO_DENSE, "q_lora_rank": 32, "v_head_dim": 16, "mlp_layer_types": ["sparse", "dense", "sparse"],
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.8, "norm_topk_prob": True, "num_nextn_predict_layers": 1})
MISTRAL4_ROPE = {**MINISTRAL3_ROPE, "partial_rotary_factor": 0.25}
_FAMILY_SPECS["mistral4"] = ("Mistral4Config", {**_MLA, "q_lora_rank": 32, "n_group": 1, "topk_group": 1,
                                                "routed_scaling_factor": 1.5, "norm_topk_prob": True,
                                                "rope_parameters": MISTRAL4_ROPE})
MLA_MOE_FAMILIES = ("glm4_moe_lite", "mistral4")
# OLMo Hybrid (tests/runtime/test_olmo_hybrid.py): Qwen3.5's layer_types [linear, linear, full, linear] and DeltaNet
# sizes (2 key heads of 16 serving 4 value heads of 16, conv kernel 4; beta times 2: linear_allow_neg_eigval's default),
# the full layer OLMo 3's (GQA 4/2, q/k norms over the whole projections, its sub-layers' outputs normed) with no rotary
# (rope_theta null: the published checkpoints' NoPE; the test builds a rotary copy)
_FAMILY_SPECS["olmo_hybrid"] = ("OlmoHybridConfig", {
    "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rope_theta": None,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]})
# Falcon-H1 (tests/runtime/test_falcon_h1.py): 2 layers, each GQA 4/2 of head_dim 16 beside a Mamba-2 mixer of width
# mamba_d_ssm 128 (8 heads of 16 in 2 groups, d_state 16, a conv of 4, chunks of 8), mamba_rms_norm false (the mixer's
# output y silu(z)); every muP multiplier away from 1 (each part of ssm_multipliers its own)
FALCON_H1_MULTIPLIERS = {"embedding_multiplier": 2.0, "lm_head_multiplier": 0.75, "key_multiplier": 0.5,
                         "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.2,
                         "ssm_out_multiplier": 0.7, "mlp_multipliers": [1.2, 0.9],
                         "ssm_multipliers": [0.9, 1.1, 0.8, 1.25, 0.6]}
_FAMILY_SPECS["falcon_h1"] = ("FalconH1Config", {
    "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_chunk_size": 8, "mamba_rms_norm": False, **FALCON_H1_MULTIPLIERS})
# Arcee AFM and Apertus (tests/runtime/test_arcee_apertus.py): Llama's GQA 4/2 with MLPs without gate 96 wide. Arcee:
# relu2, YaRN x4 over 64 positions (AFM-4.5B's rope is YaRN); Apertus: xIELU (each layer's alpha_p / alpha_n random,
# beta 0.5 and eps -1e-6 ApertusConfig's), per-head q/k norms, Llama 3's rope scaling over 64 positions (llama3_rope's)
_FAMILY_SPECS["arcee"] = ("ArceeConfig", {"hidden_act": "relu2", "intermediate_size": 96, "rope_parameters": {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}})
_FAMILY_SPECS["apertus"] = ("ApertusConfig", {"hidden_act": "xielu", "intermediate_size": 96, "rope_parameters": {
    "rope_theta": 10000.0, **_FAMILY_SPECS["llama3_rope"][1]["rope_scaling"]}})
UP_MLP_FAMILIES = ("arcee", "apertus")


def register_mistral4() -> None:
    """transformers 5 maps Mistral4Config to no AutoModelForCausalLM class (its checkpoints load through Mistral 3's
    wrapper): Mistral4ForCausalLM registered for it, so that the tests' checkpoints write and load as the others'.
    transformers 5.17 (the GPU machine's) skips registering a config class of its own: there the mapping's extra
    entries take it directly (what `register` writes in 5.24)."""
    from transformers import AutoModelForCausalLM, Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4ForCausalLM

    AutoModelForCausalLM.register(Mistral4Config, Mistral4ForCausalLM, exist_ok=True)
    if Mistral4Config not in AutoModelForCausalLM._model_mapping:
        AutoModelForCausalLM._model_mapping._extra_content[Mistral4Config] = Mistral4ForCausalLM

# Weight scales (measured over 3 seeds x 5 prompts x 48 greedy tokens per family): RMSNorm makes
# every sub-layer input O(1); with std 0.2 a projection of a width-64 input has std ~1.6, the
# residual stream has rms ~4 after layer 0, attention entropy is ~1.5 nats against ~3 for uniform
# (qwen3 ~2.65: its q_norm/k_norm cap the scores), logits have std ~4 (tied qwen2: ~2.4), and
# 48 greedy tokens contain 40+ distinct ids.  The smallest top-1/top-2 logit gap seen along the
# greedy paths is ~2e-4, so float32 engines match token for token; bf16 ones may not.
EMBED_STD = 0.5
TIED_EMBED_STD = 0.3  # tied: also the lm_head; larger makes greedy repeat the previous token
LINEAR_STD = 0.2  # every projection: q.k/sqrt(d) has std ~2.5, attention is far from uniform
LM_HEAD_STD = 0.5
NORM_JITTER = 0.1  # norm weights = 1 + NORM_JITTER * randn
BIAS_STD = 0.1


def _config_for(family: str, config_overrides: dict[str, Any]):
    import transformers

    if family not in _FAMILY_SPECS:
        known = (FAMILIES + MOE_FAMILIES + OTHER_FAMILIES + MORE_FAMILIES + GLM_COHERE_FAMILIES
                 + EXAONE_SEED_ERNIE_FAMILIES + ("ministral3", "llama4", "qwen3_5", "qwen3_5_moe",
                                                                       "qwen3_next", "granitemoehybrid", "bamba",
                                                                       "nemotron_h", "lfm2", "lfm2_moe", "olmo_hybrid",
                                                                       "falcon_h1")
                 + MLA_MOE_FAMILIES + UP_MLP_FAMILIES)
        raise ValueError(f"unknown family {family!r}; expected one of {known}")
    cls_name, family_kwargs = _FAMILY_SPECS[family]
    kwargs = {**_BASE_CONFIG, **family_kwargs, **config_overrides}
    if "rope_parameters" in kwargs:
        # Caller gave the transformers-5 form: it supersedes the legacy pair.
        kwargs.pop("rope_theta", None)
        kwargs.pop("rope_scaling", None)
    if cls_name in ("Gemma3TextConfig", "Gemma2Config"):
        kwargs.pop("hidden_act")  # Gemma reads hidden_activation
    if cls_name == "Qwen3_5MoeTextConfig":
        kwargs.pop("intermediate_size")
    if cls_name == "NemotronHConfig":  # (its own names: layer_norm_epsilon, mlp_hidden_act; no rotary)
        for key in ("rms_norm_eps", "rope_theta", "hidden_act"):
            kwargs.pop(key)
    if cls_name == "Mistral4Config":
        register_mistral4()
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [cls_name.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    return config


@torch.no_grad()
def _randomise_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter, including the constant-initialised norms and biases."""
    gen = torch.Generator().manual_seed(seed)

    def randn_like(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)

    # named_parameters() yields a tied lm_head/embedding once (under the embedding's name).
    for name, p in model.named_parameters():
        if name.endswith((".bias", "_bias")):  # (gpt-oss's experts: gate_up_proj_bias, down_proj_bias)
            p.copy_(BIAS_STD * randn_like(p))
        elif name.endswith(".A_log"):  # a Gated DeltaNet's decay rates A in [0.05, 0.5]: the state lasts several tokens
            p.copy_((0.05 + 0.45 * torch.rand(p.shape, generator=gen)).log())
        elif name.endswith(("mamba.D", "mixer.D")):  # a Mamba-2 layer's skip weight per head [heads]
            p.copy_(randn_like(p))
        elif name.endswith(("conv1d.weight", "conv.conv.weight")):  # a depthwise conv [channels, 1, kernel] (LFM2's)
            p.copy_(0.5 * randn_like(p))
        elif name.endswith((".act_fn.alpha_p", ".act_fn.alpha_n")):  # Apertus's xIELU: softplus'd, ~N(0, 1) before
            p.copy_(randn_like(p))
        elif name.endswith(".sinks"):  # gpt-oss's attention sinks: logits of the scores' size
            p.copy_(randn_like(p))
        elif "norm" in name:  # input/post_attention_layernorm, model.norm, q_norm, k_norm (Gemma: scaled by 1 + w)
            p.copy_(1.0 + NORM_JITTER * randn_like(p))
        elif "embed_tokens" in name or name == "model.embeddings.weight":  # (Nemotron-H's: embeddings)
            tied = model.get_output_embeddings().weight is p
            # Gemma multiplies its embeddings by sqrt(hidden_size), Granite by embedding_multiplier: the rows it
            # feeds the first layer get the std
            scale = getattr(model.get_input_embeddings(), "scalar_embed_scale", None) or \
                getattr(model.config, "embedding_multiplier", 1.0)
            p.copy_((TIED_EMBED_STD if tied else EMBED_STD) / scale * randn_like(p))
        elif name.startswith("lm_head"):
            p.copy_(LM_HEAD_STD * randn_like(p))
        elif p.dim() == 2 or (p.dim() == 3 and ".experts." in name):  # MoE: experts stacked [E, out, in]
            p.copy_(LINEAR_STD * randn_like(p))
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(p.shape)}: decide how to randomise it")


def _rewrite_legacy_rope_keys(config_path: Path, style: Any) -> None:
    """Replace ``rope_parameters`` by the older ``rope_theta`` + ``rope_scaling`` keys.

    ``style`` True: ``rope_scaling = {"rope_type": ..., ...}`` (Llama 3.1 / Qwen2.5 style);
    ``style`` "type": ``rope_scaling = {"type": ..., ...}`` (the still older spelling).
    ``rope_scaling`` is ``null`` when the rope is the default one, as published configs have it.
    """
    cfg = json.loads(config_path.read_text())
    params = dict(cfg.pop("rope_parameters"))
    theta = params.pop("rope_theta")
    # Phi3Config fills in partial_rotary_factor 1.0; published configs leave it out, or keep it at the top level
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        cfg["partial_rotary_factor"] = partial
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default" and not params:
        scaling = None
    else:
        key = "type" if style == "type" else "rope_type"
        scaling = {key: rope_type, **params}
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = scaling
    # alphabetical key order, as transformers writes config.json
    config_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def make_hf_checkpoint(
    path,
    family: str,
    *,
    sharded: bool = False,
    seed: int = 0,
    legacy_rope_keys: bool | str = False,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random float32 Hugging Face checkpoint of ``family`` into ``path``.

    ``family``: one of ``FAMILIES``.  ``config_overrides`` go to the transformers config class
    (``rope_theta``/``rope_scaling`` are accepted and folded into ``rope_parameters`` by
    transformers, as is ``rope_parameters`` itself).  ``sharded=True`` writes several
    ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``;
    otherwise one ``model.safetensors``.  ``legacy_rope_keys`` rewrites config.json to the old
    ``rope_theta`` + ``rope_scaling`` keys (``"type"`` for the ``{"type": ...}`` spelling).
    ``tokenizer`` copies the reference tokenizer files in.  Same ``(family, seed)`` -> same
    weights; ``llama3_rope`` has the weights of ``llama`` for the same seed (unless the config
    overrides change shapes).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model*.safetensors.index.json")):
        stale.unlink()

    config = _config_for(family, config_overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Different families get different weights for the same seed, except that llama3_rope
    # shares llama's weights (same shapes): the two differ only in the rope.
    weights_family = "llama" if family == "llama3_rope" else family
    _randomise_(model, seed * 1000 + list(_FAMILY_SPECS).index(weights_family))  # a family added last moves no other's
    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    # The whole model is ~2.3 MB (two 1 MB vocab matrices); 256 kB shards give 1 shard per
    # vocab matrix plus a few for the layers.
    model.save_pretrained(path, max_shard_size="256kB" if sharded else "1GB")

    if legacy_rope_keys:
        _rewrite_legacy_rope_keys(path / "config.json", legacy_rope_keys)
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copyfile(REF_MODEL_DIR / name, path / name)
    _evict(path)
    return path


# ----------------------------------------------------------------------------------------------
# transformers oracle


_CACHE: dict[tuple, tuple[Any, Any]] = {}
_CACHE_LOCK = threading.RLock()


def _cache_key(path: Path) -> tuple:
    path = Path(path).resolve()
    stamps = tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size)
        for f in sorted(path.iterdir())
        if f.suffix in (".json", ".safetensors")
    )
    return (str(path), stamps)


def _evict(path: Path) -> None:
    resolved = str(Path(path).resolve())
    with _CACHE_LOCK:
        for key in [k for k in _CACHE if k[0] == resolved]:
            del _CACHE[key]


def honour_swiglu_config(model):
    """gpt-oss's experts with the config's swiglu_alpha / swiglu_limit: transformers before 5.18 or so hard-coded
    1.702 and 7.0 in GptOssExperts (5.17 on the GPU machine, session 46), which the tests' checkpoints (limit 1.0, so
    that the clamps bind) do not use; later versions read the config. Returns the model."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "gpt_oss":
        for module in model.modules():
            if hasattr(module, "limit") and hasattr(module, "alpha"):
                module.alpha, module.limit = getattr(config, "swiglu_alpha", 1.702), config.swiglu_limit
    return model


def _load(path) -> tuple[Any, Any]:
    """(model, tokenizer-or-None) for ``path``, loaded once per session (float32, eager)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = _cache_key(path)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            _evict(path)  # the files changed under this path: drop the old model
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, attn_implementation="eager"
            )
            honour_swiglu_config(model)
            model.eval()
            tok = None
            if (Path(path) / "tokenizer.json").exists():
                tok = AutoTokenizer.from_pretrained(str(path))
            hit = _CACHE[key] = (model, tok)
    return hit


def hf_model(path):
    """The cached transformers model for ``path`` (float32, eager attention, eval mode)."""
    return _load(path)[0]


def hf_encode(path, prompt: str) -> list[int]:
    """The prompt ids ``hf_greedy`` feeds the model: the checkpoint's tokenizer, bos prepended."""
    tok = _load(path)[1]
    if tok is None:
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    return list(tok(prompt)["input_ids"])


@torch.inference_mode()
def hf_greedy(path, prompts: Sequence[str] | str, max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy ``generate`` on each prompt, one at a time, no padding.

    Returns only the new token ids per prompt.  Like ``generate``, a sequence stops after the
    first eos, which is included as its last id; otherwise it has ``max_new_tokens`` ids.
    Prompts are tokenized by the checkpoint's tokenizer (bos prepended), see ``hf_encode``.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    model, _ = _load(path)
    out: list[list[int]] = []
    for prompt in prompts:
        ids = torch.tensor([hf_encode(path, prompt)], dtype=torch.long)
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
        )
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x with each token's vector rounded to E4M3 at scale amax / 448 (vLLM's dynamic per-token FP8), dequantized:
    what a w8a8-fp8 linear's dynamic activation quantization does, for transformers models used as oracles."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def fp8_per_token_group(x: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """x with each token's groups of `group_size` columns rounded to E4M3 at scale amax / 448 of the group (the
    block-scaled FP8 GEMM's activations, vLLM's per_token_group_quant_fp8), dequantized."""
    parts = [fp8_per_token(part) for part in x.split(group_size, dim=-1)]
    return torch.cat(parts, dim=-1)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x with each token rounded to int8 at scale amax / 127 (vLLM's dynamic per-token int8: round half to even,
    ±127), dequantized: what a w8a8-int8 linear's activation quantization does, for transformers oracles."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe).clamp(-127, 127) * scale


@torch.inference_mode()
def hf_logits(path, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """float32 logits ``[len(token_ids), vocab]`` of one transformers forward pass (no bos added)."""
    model, _ = _load(path)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    return logits[0].float().clone()


# ----------------------------------------------------------------------------------------------
# fixtures


def forward_step(seqs: Sequence[tuple[list[int], int, list[int]]], device="cpu", block_size: int = 16):
    """(input_ids, ForwardBatch) of one model step over sequences given as (block ids, tokens already
    cached, new token ids): slots from the block ids, block tables padded with block 0."""
    from llmc.runtime.forward_batch import ForwardBatch

    ids, positions, slots, context_lens, query_lens = [], [], [], [], []
    tables = torch.zeros(len(seqs), max(len(blocks) for blocks, _, _ in seqs), dtype=torch.int32)
    for row, (blocks, start, new) in enumerate(seqs):
        ids += new
        positions += range(start, start + len(new))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + len(new))]
        tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        context_lens.append(start + len(new))
        query_lens.append(len(new))
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    batch = ForwardBatch(positions=as_long(positions), slot_mapping=as_long(slots), block_tables=tables.to(device),
                         context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
                         query_lens=query_lens, max_context_len=max(context_lens),
                         logits_indices=torch.arange(len(ids), device=device))
    return as_long(ids), batch


@pytest.fixture(scope="session", name="forward_step")
def _forward_step_fixture():
    return forward_step


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark("bench_e2e"): a script of benchmarks/ imported as a module (they are scripts,
    not a package), fresh on every call."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """``<repo>/data``: calibration text (wikitext2-valid-head.txt) and held-out text (heldout.txt)."""
    return DATA_DIR


@pytest.fixture(scope="session")
def peer_checkpoint_dir() -> Path:
    """``<repo>/checkpoints/peer-gptq-w4a16-g128``: llm-compressor's GPTQ W4A16 g128 of ref-llama-12m."""
    return PEER_DIR


@pytest.fixture(scope="session")
def ref_artifact_128(tmp_path_factory, ref_model_dir) -> Path:
    """ref-llama-12m built unquantized in float32 with max_model_len 128: a small artifact for API tests
    whose engines leave it as they found it (read-only use)."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    out = tmp_path_factory.mktemp("ref128") / "ref"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    return out


@pytest.fixture(scope="session")
def ref_model_dir() -> Path:
    """``<repo>/checkpoints/ref-llama-12m`` (real trained weights, bf16, 3 shards)."""
    if not (REF_MODEL_DIR / "config.json").is_file():
        pytest.skip(f"reference checkpoint {REF_MODEL_DIR} is absent")
    return REF_MODEL_DIR


@pytest.fixture(scope="session")
def hf_checkpoint_factory():
    """:func:`make_hf_checkpoint` (path, family, *, sharded=False, seed=0, legacy_rope_keys=False,
    tokenizer=True, **config_overrides) -> Path."""
    return make_hf_checkpoint


@pytest.fixture(scope="session", name="hf_greedy")
def _hf_greedy_fixture():
    """:func:`hf_greedy` (path, prompts, max_new_tokens) -> list[list[int]]."""
    return hf_greedy


@pytest.fixture(scope="session", name="hf_logits")
def _hf_logits_fixture():
    """:func:`hf_logits` (path, token_ids) -> Tensor[len, vocab] float32."""
    return hf_logits


@pytest.fixture(scope="session", name="hf_encode")
def _hf_encode_fixture():
    """:func:`hf_encode` (path, prompt) -> list[int], the ids hf_greedy uses."""
    return hf_encode


@pytest.fixture(scope="session", name="hf_model")
def _hf_model_fixture():
    """:func:`hf_model` (path) -> the cached transformers model."""
    return hf_model


def _session_checkpoint(tmp_path_factory, family: str, **kwargs) -> Path:
    name = family + ("_sharded" if kwargs.get("sharded") else "")
    return make_hf_checkpoint(tmp_path_factory.mktemp(f"tiny_{name}"), family, **kwargs)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory) -> Path:
    """Same weights as ``tiny_llama`` (seed 0), written as several shards + index."""
    return _session_checkpoint(tmp_path_factory, "llama", sharded=True)


@pytest.fixture(scope="session")
def tiny_llama3_rope(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "llama3_rope")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "phi3")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "gemma3")


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "gemma2")


@pytest.fixture(scope="session")
def tiny_granite(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "granite")


@pytest.fixture(scope="session")
def tiny_olmo2(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "olmo2")


@pytest.fixture(scope="session")
def tiny_smollm3(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "smollm3")


@pytest.fixture(scope="session")
def tiny_glm4(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "glm4")


@pytest.fixture(scope="session")
def tiny_cohere2(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "cohere2")


@pytest.fixture(scope="session")
def tiny_cohere(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "cohere")


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    return _session_checkpoint(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def upcycled_mixtral(tmp_path_factory) -> Path:
    """A Mixtral of ref-llama-12m's trained weights (float32): 4 experts, top-2, each expert the dense
    MLP perturbed by 5% relative noise, a random router — a model whose perplexity on real text means
    something, for quantization tests (a random model's W4 error is dominated by its sharp logits)."""
    from safetensors.torch import load_file, save_file
    from transformers import MixtralConfig

    ref = json.loads((REF_MODEL_DIR / "config.json").read_text())
    path = tmp_path_factory.mktemp("upcycled_mixtral")
    dense = {}
    for shard in sorted(REF_MODEL_DIR.glob("*.safetensors")):
        dense |= {k: v.float() for k, v in load_file(shard).items()}
    gen = torch.Generator().manual_seed(0)
    tensors, num_experts = {}, 4
    for name, t in dense.items():
        if ".mlp." not in name:
            tensors[name] = t
            continue
        prefix, proj = name.split(".mlp.")
        hf = {"gate_proj.weight": "w1", "down_proj.weight": "w2", "up_proj.weight": "w3"}[proj]
        for e in range(num_experts):
            noise = 1 + 0.05 * torch.randn(t.shape, generator=gen)
            tensors[f"{prefix}.block_sparse_moe.experts.{e}.{hf}.weight"] = (t * noise).contiguous()
        if hf == "w1":
            tensors[f"{prefix}.block_sparse_moe.gate.weight"] = 0.1 * torch.randn(num_experts, t.shape[1], generator=gen)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = MixtralConfig(**{k: ref[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                                  "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                                                  "tie_word_embeddings", "rope_parameters")},
                           num_local_experts=num_experts, num_experts_per_tok=2, sliding_window=None, dtype="float32")
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    return path


@pytest.fixture(scope="session", params=FAMILIES + MOE_FAMILIES)
def tiny_any_checkpoint(request) -> tuple[str, Path]:
    """``(family, path)`` for each family, dense and mixture-of-experts, in turn."""
    family = request.param
    return family, request.getfixturevalue(f"tiny_{family}")


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_checkpoint(request) -> tuple[str, Path]:
    """``(family, path)`` for each family in turn (reuses the per-family session fixtures)."""
    family = request.param
    return family, request.getfixturevalue(f"tiny_{family}")


@pytest.fixture
def free_gpu():
    """Give the GPU memory of the test's engines back (the next test's memory plan measures it)."""
    yield
    gc.unfreeze()  # engines freeze the heap when they load
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def llmc_cli(capsys):
    """Run `llmc ARGS...` in this process: (exit code, stderr)."""
    import logging

    from llmc.cli import main

    def run(*args):
        handlers, level = logging.root.handlers[:], logging.root.level
        try:
            with pytest.raises(SystemExit) as exited:
                main([*map(str, args)])
        finally:  # the CLI points the root logger at capsys's stream; give the next test its own back
            logging.root.handlers[:], logging.root.level = handlers, level
        return exited.value.code, capsys.readouterr().err

    return run


@pytest.fixture(autouse=True)
def _unfreeze_gc_heap():
    """An Engine freezes the GC heap when it loads and unfreezes it on close(); tests often drop
    engines without closing them, so the heap is handed back to the collector after every test (and
    the count of engines holding it freezing is reset: those engines are gone)."""
    yield
    from llmc.runtime import engine

    engine._ENGINES_FREEZING = 0
    gc.unfreeze()
