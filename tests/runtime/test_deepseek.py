"""DeepSeek-V2 (with and without a q_lora_rank) and DeepSeek-V3 against transformers' own models (float32): logits at
every position of a chunked prefill and greedy decoding through the paged engine, on the CPU path and on the Triton
path (the latent-attention and fused-MoE kernels under TRITON_INTERPRET=1 on CPU tensors); DeepSeek's routers against
transformers' routers; a quantized build against transformers holding its dequantized weights (the latent cache's own
tests: test_mla_latent.py); how configs are read; the refusals. The V3 checkpoint carries a random e_score_correction_bias (transformers writes
zeros), so the biased choice is checked."""

import json
import math
import os
import re
import shutil

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RecipeError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.models.moe import deepseek_route
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import DEEPSEEK_FAMILIES, make_hf_checkpoint
from tests.runtime.hf_oracle import (awq_and_rtn_logits, build_float32, build_import, build_quantized,
                                     check_against_oracle, check_tensor_parallel, float32_artifacts, write_config)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _random_score_bias(checkpoint) -> None:
    """V3's e_score_correction_bias set to random values of the sigmoid scores' size, so it changes which experts
    are chosen (transformers writes zeros)."""
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(7)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = 0.3 * torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("deepseek"), {}
    for family in DEEPSEEK_FAMILIES:
        made[family] = make_hf_checkpoint(root / family, family)
        if family == "deepseek_v3":
            _random_score_bias(made[family])
    return made


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return float32_artifacts(checkpoints, tmp_path_factory.mktemp("deepseek_artifacts"))


def _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, prompts=PROMPTS, tolerance=1e-4):
    """Logits over 40 positions prefilled in chunks of 16 (to `tolerance`) and greedy tokens of `prompts` batched:
    transformers'."""
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
    torch.testing.assert_close(llm.engine.score(token_ids).cpu(), hf_logits(checkpoint, token_ids), atol=tolerance,
                               rtol=tolerance)
    want = hf_greedy(checkpoint, prompts, GREEDY.max_tokens)
    assert all(len(set(tokens)) > 3 for tokens in want)  # not a model that repeats one token
    outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == want


@torch.inference_mode()
@pytest.mark.parametrize("family", DEEPSEEK_FAMILIES)
def test_logits_and_greedy_match_transformers(family, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode):
    with LLM(artifacts(family), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode)
    assert read_manifest(artifacts(family)).model.family == family.removesuffix("_q_lora")


@torch.inference_mode()
def test_v3_without_rope_interleave(checkpoints, tmp_path, hf_logits, hf_encode):
    """rope_interleave: false (rotate-half over the rope dims as they are) is transformers' too; interleaved it is
    not."""
    checkpoint = write_config(checkpoints["deepseek_v3"], tmp_path / "plain_rope", rope_interleave=False)
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 116))
    with LLM(build_float32(checkpoint, tmp_path / "art"), device="cpu", num_kv_blocks=64) as llm:
        got = llm.engine.score(token_ids)
    torch.testing.assert_close(got, hf_logits(checkpoint, token_ids), atol=1e-4, rtol=1e-4)
    assert (got - hf_logits(checkpoints["deepseek_v3"], token_ids)).abs().max() > 1.0


@pytest.fixture
def triton_dispatch(monkeypatch):
    """The model's latent attention and MoE dispatched to their Triton kernels on CPU tensors (the interpreter), as on
    CUDA; {kernel: calls} counts them."""
    import llmc.kernels.fused_moe as fused_moe
    import llmc.kernels.fused_moe_triton as fused_moe_triton
    import llmc.kernels.mla_attention as mla_attention
    import llmc.kernels.mla_attention_triton as mla_attention_triton
    import llmc.runtime.models.moe as moe

    calls = {"mla_attention": 0, "fused_moe": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(mla_attention, "can_use_triton", lambda *tensors: True)
    monkeypatch.setattr(fused_moe, "can_use_triton", lambda *tensors: True)
    monkeypatch.setattr(moe, "fused_expert_weights",
                        lambda x, gate_up, down: (moe.expert_weights(gate_up), moe.expert_weights(down)))
    monkeypatch.setattr(mla_attention_triton, "mla_absorbed_attention",
                        counted("mla_attention", mla_attention_triton.mla_absorbed_attention))
    monkeypatch.setattr(fused_moe_triton, "fused_moe", counted("fused_moe", fused_moe_triton.fused_moe))
    return calls


@torch.inference_mode()
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "deepseek_v2" else f
                                    for f in DEEPSEEK_FAMILIES])  # (V2 without q_lora: the same kernels' calls)
def test_the_triton_path_matches_transformers(family, checkpoints, artifacts, triton_dispatch, hf_logits, hf_greedy,
                                              hf_encode):
    """The latent-attention kernel (absorbed, over the paged latent cache: prefill chunks and decode rows) and the
    fused MoE kernel (DeepSeek's routing weights) give transformers' logits and greedy tokens."""
    with LLM(artifacts(family), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["mla_attention"] and triton_dispatch["fused_moe"]


def _expand_from(monkeypatch, min_queries: int) -> list[int]:
    """CUDA's expanded form taken from `min_queries` queries on, whatever the context (CUDA_EXPAND_MIN_WORK 0); the
    list the query count of every expanded_attention call is appended to."""
    import llmc.kernels.mla_attention as mla_attention

    expanded, attention = [], mla_attention.expanded_attention
    monkeypatch.setattr(mla_attention, "CUDA_EXPAND_MIN_QUERIES", min_queries)
    monkeypatch.setattr(mla_attention, "CUDA_EXPAND_MIN_WORK", 0)
    monkeypatch.setattr(mla_attention, "expanded_attention",
                        lambda q, *args: expanded.append(q.shape[0]) or attention(q, *args))
    return expanded


@torch.inference_mode()
def test_the_cuda_path_expands_long_chunks_beside_absorbed_rows(checkpoints, artifacts, triton_dispatch, monkeypatch,
                                                                 hf_logits, hf_greedy, hf_encode):
    """The CUDA dispatch (interpreted) with CUDA_EXPAND_MIN_QUERIES lowered to 4, so that this test's prompts and
    16-token chunks count as long: those sequences expanded (the model's kv_b over the cached latents, lower-right
    after the chunks before, sized by the step builder's host context lengths), decode rows and short chunks through
    the absorbed kernel in the same steps; transformers' logits and greedy tokens."""
    expanded = _expand_from(monkeypatch, 4)
    family = DEEPSEEK_FAMILIES[-1]
    with LLM(artifacts(family), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["mla_attention"] and expanded and min(expanded) >= 4


@torch.inference_mode()
def test_long_contexts_expand_in_chunks_of_keys(checkpoints, artifacts, monkeypatch, hf_logits, hf_greedy, hf_encode):
    """The CPU path's expanded form with the context expanded in chunks of 8 keys (EXPAND_MAX_KEY_HEADS lowered to 8
    times the 4 heads): the prefill chunks of 16 after cached ones read contexts of up to 5 chunks, each chunk's
    output merged by its log-sum-exp; transformers' logits (1e-4) and greedy tokens."""
    import llmc.kernels.mla_attention as mla_attention

    family = DEEPSEEK_FAMILIES[-1]
    monkeypatch.setattr(mla_attention, "EXPAND_MAX_KEY_HEADS", 8 * 4)
    calls, attention = [], mla_attention.expanded_attention
    monkeypatch.setattr(mla_attention, "expanded_attention",
                        lambda q, latents, context_len, *args: calls.append((q.shape[0], context_len))
                        or attention(q, latents, context_len, *args))
    with LLM(artifacts(family), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        assert llm.engine.runner.model.layers["0"].attn.num_heads == 4
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert (16, 32) in calls and (8, 40) in calls  # the scored 40 positions' second and third chunks: 4 and 5 chunks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("family", DEEPSEEK_FAMILIES)
def test_on_the_gpu(family, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifacts on CUDA (Triton attention and fused MoE, CUDA graphs): transformers' logits (2e-3, as the
    other MoE families' GPU test) and greedy tokens."""
    with LLM(artifacts(family), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
             max_num_batched_tokens=16) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, tolerance=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_long_prefills_expand_on_the_gpu(checkpoints, artifacts, monkeypatch, hf_logits, hf_greedy, hf_encode,
                                         free_gpu):
    """On CUDA (CUDA graphs on: the piecewise graphs run attention eagerly) with CUDA_EXPAND_MIN_QUERIES lowered to
    64: chunks of 64 queries and more take the expanded form (the model's kv_b, torch's attention, lower-right after
    the chunk before), decode rows and shorter chunks the absorbed kernel in the same steps; transformers' logits
    over 200 positions prefilled in chunks of 128 (2e-3) and greedy tokens of a ~160-token prompt beside a short
    one."""
    expanded = _expand_from(monkeypatch, 64)
    checkpoint = checkpoints["deepseek_v3"]
    token_ids = (hf_encode(checkpoint, PROMPTS[1]) * 20)[:200]
    prompts = [" ".join([PROMPTS[1]] * 12), PROMPTS[0]]
    with LLM(artifacts("deepseek_v3"), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
             max_num_batched_tokens=128) as llm:
        expanded.clear()  # (the memory profile's prompt of 128 expanded too)
        torch.testing.assert_close(llm.engine.score(token_ids).cpu(), hf_logits(checkpoint, token_ids), atol=2e-3,
                                   rtol=2e-3)
        assert expanded == [128] * 3 + [72] * 3  # (3 layers): the second chunk after the first's 128 cached
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(checkpoint, prompts, GREEDY.max_tokens)
    assert len(expanded) > 6


@torch.inference_mode()
@pytest.mark.parametrize("parallel", [{"tensor": 2}, pytest.param({"pipeline": 2}, marks=pytest.mark.slow),
                                      pytest.param({"tensor": 2, "expert": 2}, marks=pytest.mark.slow)])
def test_split_builds_are_one_rank(parallel, checkpoints, artifacts, tmp_path, hf_encode):
    """Tensor parallel 2 (q_a, kv_a and their norms whole on each rank; q_b, kv_b and o split by heads; the MLPs and
    each expert by columns), pipeline 2, expert parallel 2: the one-rank artifact's greedy tokens and logits (5e-5:
    the ranks' partial sums add in another order)."""
    split = check_tensor_parallel(checkpoints["deepseek_v3"], artifacts("deepseek_v3"), tmp_path, hf_encode,
                                  PROMPTS[:2], GREEDY, parallel=parallel, atol=5e-5)  # (ranks sum apart)
    assert read_manifest(split).parallel.world_size == 2


def test_routers_are_transformers_routers():
    """deepseek_route against transformers' DeepseekV2TopkRouter (greedy, group_limited_greedy) and
    DeepseekV3TopkRouter (groups, score bias, renormalised, scaled) on 512 random tokens: the same experts, the same
    weights."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=gen)
    cases = [
        (DeepseekV2TopkRouter, DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                                topk_method="greedy", routed_scaling_factor=1.0), "softmax", None),
        (DeepseekV2TopkRouter, DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                                topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                routed_scaling_factor=16.0), "softmax", (4, 2)),
        (DeepseekV3TopkRouter, DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                                topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
         "sigmoid", (4, 2)),
        (DeepseekV3TopkRouter, DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=1,
                                                topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.446),
         "sigmoid", (1, 1)),
    ]
    for router_class, config, scoring, groups in cases:
        router = router_class(config)
        torch.nn.init.normal_(router.weight, generator=gen)
        bias = None
        if scoring == "sigmoid":
            router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
            bias = router.e_score_correction_bias
        with torch.no_grad():
            logits, want_weights, want_ids = router(x)
        weights, ids = deepseek_route(logits, 3, scoring, bias, *(groups or (None, None)),
                                      scoring == "sigmoid" and config.norm_topk_prob, config.routed_scaling_factor)
        order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
        assert torch.equal(order.values, want_order.values)
        torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices),
                                   atol=1e-6, rtol=1e-6)


def _hf_state(artifact) -> dict[str, torch.Tensor]:
    """A DeepSeek artifact's weights as transformers' in-memory state dict (experts stacked: gate_up_proj, down_proj),
    every linear dequantized by the formats' oracle (quant/reference.py)."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model, modules = manifest["model"], manifest["quant"]["modules"]
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")

    def weight(name: str, expert: int | None = None) -> torch.Tensor:
        params = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
        if expert is not None:
            params = {k: v[expert] for k, v in params.items()}
        return dequantize(make_format(modules[name], torch.float32), params).float()

    state = {"model.embed_tokens.weight": tensors["embed.weight"], "lm_head.weight": tensors["lm_head.weight"],
             "model.norm.weight": tensors["norm.weight"]}
    linears = {"attn.q": "self_attn.q_proj", "attn.q_a": "self_attn.q_a_proj", "attn.q_b": "self_attn.q_b_proj",
               "attn.kv_a": "self_attn.kv_a_proj_with_mqa", "attn.kv_b": "self_attn.kv_b_proj",
               "attn.o": "self_attn.o_proj", "mlp.down": "mlp.down_proj",
               "moe.shared.down": "mlp.shared_experts.down_proj"}
    norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "attn.q_a_norm": "self_attn.q_a_layernorm", "attn.kv_a_norm": "self_attn.kv_a_layernorm",
             "moe.gate": "mlp.gate"}
    for i in range(model["num_layers"]):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        state |= {f"{hf}{theirs}.weight": weight(ours + name) for name, theirs in linears.items()
                  if ours + name in modules}
        state |= {f"{hf}{theirs}.weight": tensors[f"{ours}{name}.weight"] for name, theirs in norms.items()
                  if f"{ours}{name}.weight" in tensors}
        for name, prefix in (("mlp.gate_up", "mlp."), ("moe.shared.gate_up", "mlp.shared_experts.")):
            if ours + name in modules:
                gate, up = weight(ours + name).chunk(2)
                state |= {f"{hf}{prefix}gate_proj.weight": gate, f"{hf}{prefix}up_proj.weight": up}
        if i in model["moe_layers"]:
            experts = range(model["num_experts"])
            state[hf + "mlp.experts.gate_up_proj"] = torch.stack([weight(ours + "moe.experts.gate_up", e)
                                                                  for e in experts])
            state[hf + "mlp.experts.down_proj"] = torch.stack([weight(ours + "moe.experts.down", e) for e in experts])
            if ours + "moe.gate_bias.weight" in tensors:
                state[hf + "mlp.gate.e_score_correction_bias"] = tensors[ours + "moe.gate_bias.weight"]
    return {name: tensor.float() for name, tensor in state.items()}


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    # (the experts dense: transformers' stacked experts are no nn.Linear whose inputs a hook could round to FP8)
    pytest.param({"method": "fp8", "weights": "per_channel", "activations": "dynamic",
                  "ignore": ["lm_head", r"re:layers\.\d+\.moe\.experts\..*"]}, marks=pytest.mark.slow),
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param({"method": "awq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
])
def test_a_quantized_build_runs_transformers_on_its_weights(quantization, checkpoints, tmp_path, hf_encode, data_dir):
    """A quantized V3 build (every linear and expert: q_a, q_b, kv_a, kv_b, o, MLPs, experts; RTN, FP8, GPTQ and AWQ
    calibrated through the MLA layers) against transformers' model holding its dequantized weights (FP8: each layer
    linear's input rounded to E4M3 per token, as its dynamic activations are): logits over 34 positions (1e-4) and 12
    greedy tokens; and the logits again with every step's attention absorbed (W_UK / W_UV dequantized from kv_b's
    format at load; not for FP8, whose kv_b rounds its input only in the expanded form)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import fp8_per_token

    checkpoint = checkpoints["deepseek_v3"]
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    assert "dense" not in (modules["layers.1.attn.kv_b"]["format"], modules["layers.2.moe.shared.down"]["format"])
    assert (modules["layers.2.moe.experts.down"]["format"] == "dense") == (quantization["method"] == "fp8")
    oracle = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = oracle.load_state_dict(_hf_state(out), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    oracle.eval()
    if quantization["method"] == "fp8":
        for name, module in oracle.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear) and not name.endswith("gate"):
                module.register_forward_pre_hook(lambda _, args: (fp8_per_token(args[0]),))
    with LLM(out, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        check_against_oracle(llm, oracle, checkpoint, hf_encode, PROMPTS, max_tokens=GREEDY.max_tokens)
        if quantization["method"] != "fp8":  # the absorbed form's W_UK / W_UV: kv_b's dequantized weights exactly
            for layer in llm.engine.runner.model.layers.values():  # (an FP8 kv_b's input is not rounded there)
                layer.attn.form = "absorbed"
            token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
            torch.testing.assert_close(llm.engine.score(token_ids), oracle(torch.tensor([token_ids])).logits[0],
                                       atol=1e-4, rtol=1e-4)


DEEPSEEK_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                    "up_proj", "down_proj")


def _write_block_fp8(source, dest, skip=()) -> dict[str, torch.Tensor]:
    """`source` as DeepSeek-V3 ships its weights (tests/quant/test_fp8_block_import.py's published definition: E4M3
    levels and float32 `weight_scale_inv` per 128 x 128 block, `quant_method: fp8`), every decoder linear and expert
    but those `skip` matches (modules_to_not_convert, transformers' regex rule) quantized; the router and its score
    bias dense. Returns {HF weight name: its published dequantization}."""
    from tests.quant.test_fp8_block_import import HF_FP8, dequantized, quantize_blocks

    shutil.copytree(source, dest)
    tensors, expected = {}, {}
    for name, weight in load_file(source / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if (module.startswith("model.layers.") and module.rsplit(".", 1)[-1] in DEEPSEEK_LINEARS
                and not any(re.match(pattern, module) for pattern in skip)):
            tensors[name], tensors[module + ".weight_scale_inv"] = levels, scales = quantize_blocks(weight)
            expected[name] = dequantized(levels, scales)
        else:
            tensors[name] = weight
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {**HF_FP8, **({"modules_to_not_convert": list(skip)} if skip else {})}
    (dest / "config.json").write_text(json.dumps(config))
    return expected


@torch.inference_mode()
def test_deepseek_v3_block_fp8_checkpoint_imports(checkpoints, tmp_path, hf_encode):
    """DeepSeek-V3's own checkpoint format (every linear and expert block-FP8) imports as w8a8-fp8-block holding the
    published dequantization exactly (MLA's partial blocks included); with the experts dense, the artifact gives
    transformers' logits with those weights and each layer linear's input rounded to E4M3 per token and 128 inputs
    (as the runtime's dynamic block activations are: transformers' stacked experts take no such hook)."""
    from transformers import AutoModelForCausalLM

    from tests.quant.test_fp8_block_import import fp8_per_token_group

    expected = _write_block_fp8(checkpoints["deepseek_v3"], tmp_path / "fp8")
    artifact = build_import(tmp_path / "fp8", tmp_path / "fp8_art")
    state = _hf_state(artifact)
    for name, weight in expected.items():
        experts = name.split(".mlp.experts.")
        if len(experts) == 2:  # model.layers.1.mlp.experts.3.down_proj.weight → the stacked tensor's expert 3
            expert, projection = experts[1].split(".")[:2]
            stacked = state[f"{experts[0]}.mlp.experts.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"]
            rows = stacked[int(expert)]
            got = rows if projection == "down_proj" else rows.chunk(2)[projection == "up_proj"]
        else:
            got = state[name]
        assert torch.equal(got, weight), name
    assert read_manifest(artifact).quant.modules["layers.1.attn.kv_a"]["format"] == "w8a8-fp8-block"

    checkpoint = tmp_path / "fp8_dense_experts"
    _write_block_fp8(checkpoints["deepseek_v3"], checkpoint, skip=(r"model\.layers\.\d+\.mlp\.experts",))
    artifact = build_import(checkpoint, tmp_path / "art2")
    oracle = AutoModelForCausalLM.from_pretrained(str(checkpoints["deepseek_v3"]), dtype=torch.float32,
                                                  attn_implementation="eager")
    missing, unexpected = oracle.load_state_dict(_hf_state(artifact), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    for name, module in oracle.eval().named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (fp8_per_token_group(args[0]),))
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 116))
    with LLM(artifact, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), oracle(torch.tensor([token_ids])).logits[0],
                                   atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_mtp_layers_are_left_out_and_a_bf16_router_stays_float32(checkpoints, artifacts, tmp_path, caplog):
    """A checkpoint naming a multi-token-prediction layer (num_nextn_predict_layers 1: model.layers.3.*, which
    transformers' forward skips) without all its tensors (no hnorm) builds without it, says so, and gives the same
    logits (a whole one is built apart: tests/runtime/test_spec_mtp_deepseek.py); a bfloat16 build keeps the
    router weight and e_score_correction_bias in float32 (as transformers' _keep_in_fp32_modules_strict)."""
    checkpoint = write_config(checkpoints["deepseek_v3"], tmp_path / "mtp", num_nextn_predict_layers=1)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors |= {name.replace("layers.2.", "layers.3."): t.clone() for name, t in tensors.items()
                if ".layers.2." in name}
    tensors |= {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="llmc"):
        artifact = build_float32(checkpoint, tmp_path / "art")
    assert ("DeepSeek-V3: config num_nextn_predict_layers is 1 but the checkpoint has no model.layers.3.hnorm.weight: "
            "no MTP layer built") in caplog.text
    assert read_manifest(artifact).model.num_layers == 3 and read_manifest(artifact).mtp is None
    token_ids = list(range(100, 120))
    with LLM(artifact, device="cpu", num_kv_blocks=64) as llm, LLM(artifacts("deepseek_v3"), device="cpu",
                                                                    num_kv_blocks=64) as plain:
        torch.testing.assert_close(llm.engine.score(token_ids), plain.engine.score(token_ids), atol=0, rtol=0)
    build(recipe_from_dict({"model": str(checkpoints["deepseek_v3"]), "output": str(tmp_path / "bf16"),
                                   "dtype": "bfloat16", "runtime": {"max_model_len": 256}}), show_progress=False)
    weights = load_file(tmp_path / "bf16" / "rank-00" / "weights.safetensors")
    assert weights["layers.1.moe.gate.weight"].dtype == weights["layers.1.moe.gate_bias.weight"].dtype == torch.float32
    assert weights["layers.1.attn.kv_b.weight"].dtype == torch.bfloat16
    with LLM(tmp_path / "bf16", device="cpu", num_kv_blocks=64) as llm:  # (loading checks every dtype)
        assert llm.generate([{"prompt_token_ids": token_ids}], GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_awq_folds_keep_the_function(family, checkpoints, tmp_path, data_dir, hf_encode, monkeypatch):
    """AWQ forced to fold random scales into W8 layers (every variant but round-to-nearest dropped), each a power of
    two from 1/4 to 4, one per group of 32 input columns: the groups' quantization scales take them exactly, so the
    build is the plain RTN W8 build's function if and only if every fold is undone where it is made: input_norm
    divided once for q (or q_a) and kv_a, q_a_norm for q_b, kv_a_norm for kv_b, each head's v rows of kv_b for o
    (and the MoE's folds, as for every MoE)."""
    token_ids = hf_encode(checkpoints[family], PROMPTS[1]) + list(range(100, 120))
    awq, rtn = awq_and_rtn_logits(checkpoints[family], tmp_path, token_ids, monkeypatch, data_dir, min_expert_tokens=1)
    torch.testing.assert_close(awq, rtn, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_export_round_trips_and_transformers_reads_it(family, checkpoints, artifacts, tmp_path):
    """`llmc export`: the float32 artifact's export is a checkpoint transformers loads (config.json rebuilt from the
    manifest: its DeepSeek keys) to the artifact's logits; an RTN W4 build's (compressed-tensors, one module per MLA
    linear and expert, the router and V3's score bias dense) imports back to the same tensors, bit for bit, and
    logits."""
    from transformers import AutoModelForCausalLM

    from llmc.compiler.export import export_artifact

    token_ids = list(range(100, 130))
    export_artifact(artifacts(family), tmp_path / "dense")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with LLM(artifacts(family), device="cpu", num_kv_blocks=64) as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), exported(torch.tensor([token_ids])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    quantized = build_float32(checkpoints[family], tmp_path / "w4", target={"device": "cpu"},
                              quantization={"method": "rtn", "bits": 4, "group_size": 32, "report": False})
    export_artifact(quantized, tmp_path / "w4_export")
    config = json.loads((tmp_path / "w4_export" / "config.json").read_text())
    assert "model.layers.1.mlp.gate" in config["quantization_config"]["ignore"]
    back = build_import(tmp_path / "w4_export", tmp_path / "back")
    assert read_manifest(back).quant.modules == read_manifest(quantized).quant.modules
    ours, theirs = (load_file(a / "rank-00" / "weights.safetensors") for a in (quantized, back))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    with LLM(quantized, device="cpu", num_kv_blocks=64) as a, LLM(back, device="cpu", num_kv_blocks=64) as b:
        torch.testing.assert_close(a.engine.score(token_ids), b.engine.score(token_ids), atol=0, rtol=0)


def test_configs_read_as_transformers_reads_them(checkpoints):
    """head_dim is the key's (qk_nope + qk_rope; transformers' config says the rope part's), one KV head per query
    head, V3's YaRN scale: qk_head_dim^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2; the MoE layers from
    first_k_dense_replace on, n_shared_experts shared experts as one."""
    spec = spec_for_architecture("DeepseekV3ForCausalLM")
    config = model_config_from_hf(read_hf_config(checkpoints["deepseek_v3"]), spec, "float32")
    assert (config.head_dim, config.num_kv_heads, config.v_head_dim, config.rotary_dims) == (16, 4, 8, 4)
    assert math.isclose(config.softmax_scale, 16 ** -0.5 * (0.1 * 0.8 * math.log(4.0) + 1) ** 2)
    assert config.moe_layers == [1, 2] and config.shared_expert_intermediate_size == 64
    assert (config.router_scoring, config.router_groups, config.router_topk_groups) == ("sigmoid", 4, 2)
    assert config.mla_rope_interleave and not config.is_partial_rotary
    from transformers import AutoModelForCausalLM

    assert config.num_parameters == AutoModelForCausalLM.from_pretrained(
        str(checkpoints["deepseek_v3"])).num_parameters()  # (as `llmc inspect` reports it)
    v2 = model_config_from_hf(read_hf_config(checkpoints["deepseek_v2"]),
                              spec_for_architecture("DeepseekV2ForCausalLM"), "float32")
    assert (v2.q_lora_rank, v2.router_scoring, v2.router_groups, v2.norm_topk_prob) == (None, "softmax", None, False)


def test_what_deepseek_refuses(checkpoints, artifacts, tmp_path):
    def refused(error, match, family="deepseek_v3", recipe=None, **changes):
        checkpoint = write_config(checkpoints[family], tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoints[family]
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(RecipeError, "parallel.tensor: 3 does not divide", recipe={"parallel": {"tensor": 3}})
    refused(RecipeError, "quantization.method int8", recipe={"quantization": {"method": "int8"}})
    refused(RecipeError, "not exported to ONNX", recipe={"target": {"device": "onnx-cpu"}})
    refused(CheckpointError, "moe_layer_freq 2", moe_layer_freq=2)
    refused(CheckpointError, "norm_topk_prob: true is not supported for DeepSeek-V2", "deepseek_v2",
            norm_topk_prob=True)
    refused(CheckpointError, "num_key_value_heads 2", num_key_value_heads=2)
    refused(CheckpointError, "scoring_func 'softmax'", scoring_func="softmax")
    refused(CheckpointError, "topk_method 'noaux_tc'", "deepseek_v2", topk_method="noaux_tc")
    refused(CheckpointError, "attention_bias: true", attention_bias=True)
    refused(CheckpointError, "v_head_dim 32", v_head_dim=32)
    refused(CheckpointError, "n_group 3", n_group=3)
