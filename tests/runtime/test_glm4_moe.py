"""GLM-4.5 MoE (Glm4MoeForCausalLM) against transformers' own model (float32), with and without use_qk_norm: logits at
every position of a chunked prefill, greedy tokens and their logprobs of prompts batched through the paged engine, on
the CPU path and on the Triton path (the attention and fused-MoE kernels under TRITON_INTERPRET=1 on CPU tensors);
the rotary's row permutation against transformers' apply_rotary_pos_emb; its router against transformers' router; a
W4 build against transformers holding its dequantized weights (and not with its experts reordered); tensor parallelism;
the multi-token-prediction layer built apart; how configs are read; the refusals. The checkpoints carry a random
e_score_correction_bias (transformers writes zeros), so the biased choice within the groups is checked."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, partial_rotary_permutation, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, RecipeError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.models.moe import deepseek_route
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import (MOE_QUANTIZATIONS, MOE_QUANTIZATION_IDS, assert_same_routes, build_quantized,
                                     check_moe_build_as_oracle, check_tensor_parallel, float32_artifacts, moe_hf_state,
                                     write_config)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
KINDS = ("qk_norm", "plain")  # use_qk_norm true (GLM-4.5's) and false (GLM-4.5-Air's)


def _random_score_bias(checkpoint, mtp: bool, bias: str = "e_score_correction_bias") -> None:
    """The router's score bias (the tensors named ...`bias`: e_score_correction_bias, LFM2-MoE's expert_bias; a buffer
    of zeros as transformers initialises it) set to seeded random values of the sigmoid scores' size, so it changes
    which experts (and groups) are chosen; with `mtp`, a multi-token-prediction layer as GLM-4.5 ships it
    (model.layers.3: a decoder layer, eh_proj, enorm, hnorm, shared_head.norm), which transformers' forward does not
    run."""
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(7)
    for name in [n for n in tensors if n.endswith(bias)]:
        tensors[name] = 0.3 * torch.randn(tensors[name].shape, generator=gen)
    if mtp:
        tensors |= {name.replace("layers.2.", "layers.3."): t.clone() for name, t in tensors.items()
                    if ".layers.2." in name}
        tensors |= {"model.layers.3.eh_proj.weight": torch.randn(64, 128, generator=gen),
                    **{f"model.layers.3.{norm}.weight": torch.ones(64)
                       for norm in ("enorm", "hnorm", "shared_head.norm")}}
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe")
    made = {"qk_norm": make_hf_checkpoint(root / "qk_norm", "glm4_moe"),
            "plain": make_hf_checkpoint(root / "plain", "glm4_moe", use_qk_norm=False, num_nextn_predict_layers=0)}
    for kind, checkpoint in made.items():
        _random_score_bias(checkpoint, mtp=kind == "qk_norm")
    return made


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return float32_artifacts(checkpoints, tmp_path_factory.mktemp("glm4_moe_artifacts"))


def _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, prompts=PROMPTS, tolerance=1e-4):
    """Logits over 40 positions prefilled in chunks of 16 (to `tolerance`); greedy tokens of `prompts` batched:
    transformers', each with its logprob: transformers' log-softmax of the logits before it."""
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
    torch.testing.assert_close(llm.engine.score(token_ids).cpu(), hf_logits(checkpoint, token_ids), atol=tolerance,
                               rtol=tolerance)
    want = hf_greedy(checkpoint, prompts, GREEDY.max_tokens)
    assert all(len(set(tokens)) > 3 for tokens in want)  # not a model that repeats one token
    encoded = [hf_encode(checkpoint, p) for p in prompts]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == want
    for prompt, output in zip(encoded, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        logprobs = hf_logits(checkpoint, prompt + tokens[:-1])[len(prompt) - 1:].log_softmax(-1)
        got = torch.tensor([float(step[token]) for step, token in zip(output.outputs[0].logprobs, tokens, strict=True)])
        torch.testing.assert_close(got, logprobs[torch.arange(len(tokens)), tokens], atol=tolerance, rtol=tolerance)


@torch.inference_mode()
@pytest.mark.parametrize("kind", KINDS)
def test_logits_greedy_and_logprobs_match_transformers(kind, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode):
    with LLM(artifacts(kind), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints[kind], hf_logits, hf_greedy, hf_encode)
    model = read_manifest(artifacts(kind)).model
    assert (model.family, model.qk_norm, model.rotary_dim, model.rotary_table_dims) == (
        "glm4_moe", kind == "qk_norm", 16, 32)


@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 16), (12, 4), (8, 8)])
def test_the_permuted_whole_head_rotation_is_glm45s_partial_rotary(head_dim, rotary_dim):
    """q and k rotated by transformers' GLM-4.5 apply_rotary_pos_emb (rotate-half over the leading rotary_dim dims),
    against the runtime's: rows permuted (partial_rotary_permutation), rotate-half over the whole head with the
    head-wide table (cos 1, sin 0 past rotary_dim / 2), rows permuted back."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    from llmc.kernels.rotary import apply_rotary
    from llmc.runtime.layers.rotary import cos_sin_cache

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 17, 63])
    q, k = torch.randn(5, 3, head_dim, generator=gen), torch.randn(5, 3, head_dim, generator=gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    angles = positions[:, None].float() * inv_freq  # transformers' Glm4MoeRotaryEmbedding
    emb = torch.cat((angles, angles), dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    perm = partial_rotary_permutation(head_dim, rotary_dim)
    assert sorted(perm.tolist()) == list(range(head_dim))
    table = cos_sin_cache(rotary_dim, 64, 10000.0, None, head_dim)
    got_q, got_k = apply_rotary(q[..., perm], k[..., perm], positions, table)
    inverse = torch.argsort(perm)
    torch.testing.assert_close(got_q[..., inverse], want_q.transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k[..., inverse], want_k.transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.fixture
def triton_dispatch(monkeypatch):
    """The model's attention (rotary + KV write, paged attention), MoE and state layers (the causal conv, the delta rule
    and its gated norm, the SSD recurrence and its gated norm) dispatched to their Triton kernels on CPU tensors (the
    interpreter), as on CUDA, a prefill's pieces of 8 tokens or more on the chunked delta rule and SSD (kernels/
    recurrent.CHUNKED_FROM, 64 by default: the tests' prefill chunks are shorter); {kernel: calls} counts them."""
    import llmc.kernels.attention as attention
    import llmc.kernels.attention_triton as attention_triton
    import llmc.kernels.fused_moe as fused_moe
    import llmc.kernels.fused_moe_triton as fused_moe_triton
    import llmc.kernels.recurrent as recurrent
    import llmc.kernels.recurrent_triton as recurrent_triton
    import llmc.runtime.models.moe as moe

    calls = {"rotate_and_write_kv": 0, "fused_moe": 0, "causal_conv": 0, "delta_rule": 0, "ssd": 0, "gated_rms_norm": 0,
             "gated_group_norm": 0, "delta_rule_chunked": 0, "ssd_chunked": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(attention, "can_use_triton", lambda *tensors: True)
    monkeypatch.setattr(fused_moe, "can_use_triton", lambda *tensors: True)
    monkeypatch.setattr(recurrent, "can_use_triton", lambda *tensors: True)
    monkeypatch.setattr(recurrent, "CHUNKED_FROM", 8)
    for name in ("causal_conv", "delta_rule", "ssd", "gated_rms_norm", "gated_group_norm", "delta_rule_chunked",
                 "ssd_chunked"):
        monkeypatch.setattr(recurrent_triton, name, counted(name, getattr(recurrent_triton, name)))
    monkeypatch.setattr(moe, "fused_expert_weights",
                        lambda x, gate_up, down: (moe.expert_weights(gate_up), moe.expert_weights(down)))
    monkeypatch.setattr(attention_triton, "rotate_and_write_kv",
                        counted("rotate_and_write_kv", attention_triton.rotate_and_write_kv))
    monkeypatch.setattr(fused_moe_triton, "fused_moe", counted("fused_moe", fused_moe_triton.fused_moe))
    return calls


@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoints, artifacts, triton_dispatch, hf_logits, hf_greedy,
                                              hf_encode):
    """The rotary + KV-write and attention kernels (the whole-head table over the permuted rows, q/k norms before
    them) and the fused MoE kernel (DeepSeek's routing weights) give transformers' logits, greedy tokens and
    logprobs."""
    with LLM(artifacts("qk_norm"), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints["qk_norm"], hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["rotate_and_write_kv"] and triton_dispatch["fused_moe"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("kind", KINDS)
def test_on_the_gpu(kind, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifacts on CUDA (Triton attention over the whole-head table, fused MoE, CUDA graphs):
    transformers' logits (2e-3, as the other MoE families' GPU tests), greedy tokens and logprobs."""
    with LLM(artifacts(kind), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
             max_num_batched_tokens=16) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        _check(llm, checkpoints[kind], hf_logits, hf_greedy, hf_encode, tolerance=2e-3)


def test_the_router_is_transformers_router():
    """deepseek_route against transformers' Glm4MoeTopkRouter (sigmoid, e_score_correction_bias, groups, renormalised
    or not, scaled) on 512 random tokens: the same experts, the same weights."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    check_v3_router(Glm4MoeConfig, Glm4MoeTopkRouter, (((4, 2), True, 2.5), ((1, 1), False, 1.0), ((8, 3), True, 1.0)),
                    seed=0)


def check_v3_router(config_class, router_class, settings, seed: int) -> None:
    """deepseek_route (sigmoid scores chosen with a random e_score_correction_bias) against transformers' DeepSeek-V3
    router `router_class` of 16 experts, top 3, on 512 random tokens, for each ((groups, topk_group), norm_topk_prob,
    routed_scaling_factor) of `settings`: the same experts and weights (assert_same_routes)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 32, generator=gen)
    for groups, norm_topk_prob, scaling in settings:
        config = config_class(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=groups[0],
                              topk_group=groups[1], norm_topk_prob=norm_topk_prob, routed_scaling_factor=scaling)
        router = router_class(config)
        torch.nn.init.normal_(router.weight, generator=gen)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
        with torch.no_grad():
            logits, want_weights, want_ids = router(x)
        weights, ids = deepseek_route(logits, 3, "sigmoid", router.e_score_correction_bias, *groups, norm_topk_prob,
                                      scaling)
        assert_same_routes(weights, ids, want_weights, want_ids)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", MOE_QUANTIZATIONS, ids=MOE_QUANTIZATION_IDS)
def test_a_quantized_build_runs_transformers_on_its_weights(quantization, checkpoints, tmp_path, hf_encode, data_dir):
    """A W4 build (every linear and expert: qkv, o, the dense MLP, the shared expert, the experts; RTN, and GPTQ and
    AWQ calibrated through the MoE layers) and an FP8 one (its linears; each input rounded to E4M3 per token in
    transformers too) against transformers' model holding its dequantized weights (q/k rows permuted back): logits
    over 34 positions (1e-4) and 12 greedy tokens; with layer 1's experts reordered in transformers' copy the
    logits move (the experts are where the artifact's router sends their tokens)."""
    checkpoint = checkpoints["qk_norm"]
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    formats = {modules[f"layers.1.{name}"]["format"] for name in ("attn.qkv", "moe.shared.down")}
    experts = {modules[f"layers.1.moe.experts.{name}"]["format"] for name in ("gate_up", "down")}
    fp8 = quantization["method"] == "fp8"
    assert (formats, experts) == (({"w8a8-fp8"}, {"dense"}) if fp8 else ({"w4a16"}, {"w4a16"}))
    check_moe_build_as_oracle(out, checkpoint, moe_hf_state(out), hf_encode, PROMPTS, fp8, GREEDY.max_tokens)


@torch.inference_mode()
@pytest.mark.parametrize("parallel", [{"tensor": 2}, pytest.param({"pipeline": 2}, marks=pytest.mark.slow),
                                      pytest.param({"tensor": 2, "expert": 2}, marks=pytest.mark.slow)])
def test_split_builds_are_one_rank(parallel, checkpoints, artifacts, tmp_path, hf_encode):
    """Tensor parallel 2 (each rank its heads' permuted q/k rows and biases, the q/k norms whole; every expert, the
    dense MLP and the shared expert split by columns; the router whole), pipeline 2, expert parallel 2 (whole experts
    spread over the ranks): the one-rank artifact's greedy tokens and logits (5e-5, as DeepSeek's: the ranks' partial
    sums add in another order)."""
    split = check_tensor_parallel(checkpoints["qk_norm"], artifacts("qk_norm"), tmp_path, hf_encode, PROMPTS[:2],
                                  SamplingParams(temperature=0, max_tokens=8), parallel=parallel, atol=5e-5)
    assert read_manifest(split).parallel.world_size == 2


@torch.inference_mode()
def test_the_mtp_layer_is_built_apart_and_a_bf16_router_stays_float32(checkpoints, artifacts, tmp_path, caplog):
    """The checkpoint's multi-token-prediction layer (num_nextn_predict_layers 1: model.layers.3.*, which
    transformers' forward skips) is not one of the model's layers: the build keeps it apart, in mtp/ (speculative
    method mtp, tests/runtime/test_spec_mtp.py), and says so; a bfloat16 build keeps the router weight and
    e_score_correction_bias in float32 (as transformers' _keep_in_fp32_modules_strict), the MTP layer's too."""
    with caplog.at_level("INFO", logger="llmc"):
        build(recipe_from_dict({"model": str(checkpoints["qk_norm"]), "output": str(tmp_path / "bf16"),
                                "dtype": "bfloat16", "runtime": {"max_model_len": 256}}), show_progress=False)
    assert "GLM-4.5: the multi-token prediction layer (layer 3) is built into mtp/weights.safetensors" in caplog.text
    assert read_manifest(artifacts("qk_norm")).model.num_layers == 3
    assert read_manifest(artifacts("plain")).mtp is None  # (num_nextn_predict_layers 0)
    weights = load_file(tmp_path / "bf16" / "rank-00" / "weights.safetensors")
    assert not [name for name in weights if name.startswith("layers.3.")]
    mtp = load_file(tmp_path / "bf16" / "mtp" / "weights.safetensors")
    assert mtp["layers.3.moe.gate.weight"].dtype == torch.float32 and mtp["eh_proj.weight"].dtype == torch.bfloat16
    assert weights["layers.1.moe.gate.weight"].dtype == weights["layers.1.moe.gate_bias.weight"].dtype == torch.float32
    assert weights["layers.1.attn.qkv.weight"].dtype == torch.bfloat16
    with LLM(tmp_path / "bf16", device="cpu", num_kv_blocks=64) as llm:  # (loading checks every dtype)
        assert llm.generate([{"prompt_token_ids": list(range(100, 120))}], GREEDY)[0].outputs[0].token_ids


# GLM-4.5-Air's config.json as published (zai-org/GLM-4.5-Air), the keys llmc reads
GLM_45_AIR = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
              "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
              "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408,
              "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1,
              "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8,
              "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "use_qk_norm": False, "vocab_size": 151552,
              "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329}


def test_configs_read_as_transformers_reads_them(checkpoints):
    """The tiny checkpoint's config and GLM-4.5-Air's published one (partial_rotary_factor at the top level, old
    rope_theta): rotary on half of each head's dims over a head-wide table, the MoE layers from first_k_dense_replace
    on, n_shared_experts shared experts as one, V3's router fields; the parameters transformers counts (GLM-4.5-Air
    cut to 2 layers, on the meta device)."""
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    spec = spec_for_architecture("Glm4MoeForCausalLM")
    config = model_config_from_hf(read_hf_config(checkpoints["qk_norm"]), spec, "float32")
    assert (config.rotary_dims, config.rotary_table_dims, config.is_partial_rotary, config.qk_norm) == (16, 32, False,
                                                                                                          True)
    assert config.moe_layers == [1, 2] and config.shared_expert_intermediate_size == 32
    assert (config.router_scoring, config.router_groups, config.router_topk_groups, config.norm_topk_prob,
            config.routed_scaling_factor, config.router_in_float32) == ("sigmoid", 2, 1, True, 2.5, True)
    assert config.num_parameters == AutoModelForCausalLM.from_pretrained(
        str(checkpoints["qk_norm"])).num_parameters()
    air = model_config_from_hf(GLM_45_AIR, spec, "bfloat16")
    assert (air.head_dim, air.rotary_dims, air.rope_theta, air.num_kv_heads, air.attention_bias, air.qk_norm) == (
        128, 64, 1e6, 8, True, False)
    assert (air.num_experts, air.num_experts_per_tok, air.moe_intermediate_size, air.moe_layers[:2],
            air.shared_expert_intermediate_size, air.router_groups) == (128, 8, 1408, [1, 2], 1408, 1)
    assert air.eos_token_ids == [151329, 151336, 151338] and len(air.moe_layers) == 45
    short = {**GLM_45_AIR, "num_hidden_layers": 2}
    hf_config = Glm4MoeConfig(**{k: v for k, v in short.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        count = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    assert model_config_from_hf(short, spec, "bfloat16").num_parameters == count


def test_what_glm45_refuses(checkpoints, artifacts, tmp_path):
    def refused(error, match, recipe=None, **changes):
        checkpoint = write_config(checkpoints["plain"], tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoints["plain"]
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(RecipeError, "not exported to ONNX", recipe={"target": {"device": "onnx-cpu"}})
    refused(RecipeError, "quantization.method int8", recipe={"quantization": {"method": "int8"}})
    refused(CheckpointError, "quantization.method import is not supported for Glm4MoeForCausalLM from gptq",
            recipe={"quantization": {"method": "import"}}, quantization_config={
                "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False})
    refused(CheckpointError, "scoring_func 'softmax'", scoring_func="softmax")
    refused(CheckpointError, "n_group 3, topk_group 1", n_group=3)
    refused(CheckpointError, "n_group 2, topk_group 3", topk_group=3)
    with pytest.raises(ArtifactError, match="Glm4MoeForCausalLM: the build permuted q_proj's and k_proj's rows"):
        export_artifact(artifacts("plain"), tmp_path / "export")


def test_awq_folds_keep_the_function(checkpoints, tmp_path, data_dir, hf_encode, monkeypatch):
    """AWQ forced to fold random power-of-two scales into W8 layers: the build is the RTN W8 build's function if and
    only if every fold is undone where it is made (input_norm for the permuted q/k/v rows, post_attn_norm for the dense
    MLP's or every expert's and the shared expert's gate_up, the router taking its columns back, up rows for down)."""
    from tests.runtime.hf_oracle import awq_and_rtn_logits

    checkpoint = checkpoints["qk_norm"]
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    awq, rtn = awq_and_rtn_logits(checkpoint, tmp_path, token_ids, monkeypatch, data_dir, min_expert_tokens=1)
    torch.testing.assert_close(awq, rtn, atol=1e-4, rtol=1e-4)
