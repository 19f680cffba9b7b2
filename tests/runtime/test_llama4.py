"""Llama 4 text (Llama4ForCausalLM; Llama4ForConditionalGeneration served as text) against transformers' own float32
models (tests/conftest.py's checkpoint: 4 layers, interleaved rotary with llama3 scaling, layer 2 NoPE with its q
tempered past position 7 (floor_scale 8, attn_scale 0.3), the weightless q/k norm on the other three, MoE on layers 1
and 3 (4 experts, top 1, the chosen expert's input scaled by its sigmoid score, a shared expert), dense layers twice as
wide, chunked attention on the rope layers in chunks of 12). Logits over a chunked prefill crossing chunk boundaries,
greedy decoding past several chunks and a prefix-cache hit ending mid-chunk on the torch CPU path and on the Triton
kernels (the interpreter: rotary + KV write, attention, fused MoE), what the match rests on, RTN / GPTQ W4 builds on
their own weights, the conditional-generation config form, and what is refused; the CUDA cases are marked gpu."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import interleaved_rotary_permutation
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, ConfigError, RecipeError, RequestError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import TOKENIZER_FILES, make_hf_checkpoint
from tests.runtime.test_artifact_damage import _edit
from tests.runtime.hf_oracle import (build_float32, build_quantized, check_against_oracle, check_against_transformers,
                                     write_config)
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 - a fixture (attention and fused MoE kernels)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama4") / "hf", "llama4")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("llama4_artifact") / "a")


def _score_ids(checkpoint, hf_encode):
    return hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 140))  # 50 positions


@torch.inference_mode()
def test_logits_and_greedy_match_transformers(checkpoint, artifact, hf_greedy, hf_logits, hf_encode):
    """The manifest's reading of the config (NoPE layer 2 tempered at offset 1, the q/k L2 norm on the rope layers,
    MoE layers 1 and 3 routed by sigmoid_input beside a shared expert, dense width intermediate_size_mlp, the rows
    permuted for the interleaved rotary, chunked attention on the rope layers); logits at 54 positions prefilled in
    steps of 16 across chunks of 12 (1e-4) and 16 greedy tokens of three prompts batched two at a time: transformers'
    float32 model's."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.nope_layers, m.query_temperature_beta, m.query_temperature_floor, m.query_temperature_offset,
            m.query_temperature_layers, m.qk_l2_norm_layers, m.qk_norm, m.rotary_interleaved) == (
        "llama4", [2], 0.3, 8.0, 1.0, [2], [0, 1, 3], False, True)
    assert (m.moe_layers, m.num_experts, m.num_experts_per_tok, m.router_scoring, m.moe_intermediate_size,
            m.shared_expert_intermediate_size, m.shared_expert_gate, m.intermediate_size) == (
        [1, 3], 4, 1, "sigmoid_input", 64, 64, False, 128)
    assert (m.attention_chunk_size, m.attention_chunk_layers, m.rope_scaling["rope_type"]) == (12, [0, 1, 3], "llama3")
    with LLM(artifact, **ENGINE) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)
    assert all(len(set(tokens)) > 4 for tokens in hf_greedy(checkpoint, PROMPTS, 16))


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# the CPU torch path, the Triton kernels in the interpreter, and on CUDA eager or under each CUDA graph mode
PATHS = ["torch", "triton", *(pytest.param(f"cuda-{mode}", marks=_GPU) for mode in (
    "eager", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL"))]


def _engine(request, path: str) -> dict:
    """The LLM arguments of a PATHS entry (its fixtures requested), and the logits' tolerance there."""
    if path == "triton":
        request.getfixturevalue("triton_dispatch")
    if not path.startswith("cuda"):
        return ENGINE, 1e-4
    request.getfixturevalue("free_gpu")
    mode = path.removeprefix("cuda-")
    graphs = {"enforce_eager": True} if mode == "eager" else {"compilation_config": {"cudagraph_mode": mode}}
    return {"device": "cuda", "gpu_memory_utilization": 0.3, "max_num_seqs": 2, "max_num_batched_tokens": 16,
            **graphs}, 2e-3


@torch.inference_mode()
@pytest.mark.parametrize("path", [pytest.param("triton", marks=pytest.mark.slow) if path == "triton" else path
                                  for path in PATHS])  # (the Triton path's own test below stays in the default run)
def test_greedy_decoding_past_several_chunks(path, request, checkpoint, artifact, hf_greedy, hf_encode):
    """40 greedy tokens of two prompts batched (to positions past 40 and 50: three and four chunk boundaries crossed
    while decoding), on the torch path, the Triton kernels and on CUDA (-m gpu): transformers' tokens."""
    engine, _ = _engine(request, path)
    prompts = [hf_encode(checkpoint, p) for p in PROMPTS[1:]]
    with LLM(artifact, **engine) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=40))
    expected = hf_greedy(checkpoint, PROMPTS[1:], 40)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(len(p) + len(t) > 40 for p, t in zip(prompts, expected))


@torch.inference_mode()
@pytest.mark.parametrize("path", PATHS)
def test_a_prefix_cache_hit_ending_mid_chunk(path, request, checkpoint, artifact, hf_logits):
    """A prompt whose first 32 tokens (two 16-slot blocks) an earlier prompt cached: its prefill starts at position
    32, inside the chunk [24, 36), whose first keys it reads from the cache, and crosses 36. Its 12 greedy tokens and
    their logprobs (1e-4; 2e-3 on CUDA) are transformers' over the whole sequence."""
    engine, tolerance = _engine(request, path)
    first = list(range(200, 240))
    second = first[:32] + list(range(300, 309))
    with LLM(artifact, **engine) as llm:
        llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=1))
        out = llm.generate([{"prompt_token_ids": second}], SamplingParams(temperature=0, max_tokens=12, logprobs=1))[0]
    assert out.num_cached_tokens == 32
    tokens = out.outputs[0].token_ids
    want = torch.log_softmax(hf_logits(checkpoint, second + tokens)[len(second) - 1 : -1], dim=-1)
    assert tokens == want.argmax(dim=-1).tolist()
    got = torch.tensor([step[token].logprob for step, token in zip(out.outputs[0].logprobs, tokens)])
    torch.testing.assert_close(got, want[torch.arange(len(tokens)), tokens], atol=tolerance, rtol=tolerance)


@torch.inference_mode()
def test_what_the_match_rests_on(checkpoint, tmp_path, hf_logits, hf_encode):
    """transformers without the temperature is the model's below position 7 (the factor is exactly 1 there) and far
    from it past it; with full attention in place of the chunks, the model's within the first chunk (12 positions)
    and far past it; without the q/k norm, or with the router's score on the experts' outputs, far everywhere: each
    is a term the first test matches. The parameter count is transformers'."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama4 import modeling_llama4

    token_ids = _score_ids(checkpoint, hf_encode)
    expected = hf_logits(checkpoint, token_ids)
    flat = hf_logits(write_config(checkpoint, tmp_path / "flat", attn_temperature_tuning=False), token_ids)
    assert torch.equal(flat[:7], expected[:7])
    assert (flat[7:] - expected[7:]).abs().mean() > 0.02 * expected.abs().mean()
    full = hf_logits(write_config(checkpoint, tmp_path / "full", layer_types=["full_attention"] * 4), token_ids)
    assert torch.equal(full[:12], expected[:12])
    assert (full[12:] - expected[12:]).abs().mean() > 0.05 * expected.abs().mean()
    unnormed = hf_logits(write_config(checkpoint, tmp_path / "unnormed", use_qk_norm=False), token_ids)
    assert (unnormed - expected).abs().mean() > 0.05 * expected.abs().mean()
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")

    def output_scaled(self, hidden_states):  # the score on each expert's output (Mixtral's way), not its input
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden_states)
        routed = sum(self.experts(hidden_states.repeat(self.num_experts, 1)).view(self.num_experts, -1,
                                                                                  self.hidden_dim)[e] * scores[:, e:e + 1]
                     for e in range(self.num_experts))
        return self.shared_expert(hidden_states) + routed, logits
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_llama4.Llama4TextMoe, "forward", output_scaled)
        moved = model(input_ids=torch.tensor([token_ids])).logits[0]
    assert (moved - expected).abs().mean() > 0.05 * expected.abs().mean()
    assert read_manifest_model(checkpoint).num_parameters == model.num_parameters()


def read_manifest_model(checkpoint):
    from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
    from llmc.runtime.models import spec_for_architecture

    config = read_hf_config(checkpoint)
    return model_config_from_hf(config, spec_for_architecture(config["architectures"][0]), "float32")


@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_greedy, hf_logits,  # noqa: F811
                                              hf_encode):
    """The Triton rotary + KV-write and attention kernels (the whole-head table over the permuted rows, the NoPE
    layer's identity table) and the fused MoE kernel on the score-scaled inputs with weights 1 (the interpreter):
    transformers' logits at 50 positions in chunks of 16 and 6 greedy tokens of two prompts."""
    with LLM(artifact, **ENGINE) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6),
                                   hf_greedy, hf_logits, hf_encode, 1e-4)
    assert triton_dispatch["rotate_and_write_kv"] and triton_dispatch["fused_moe"]


def _hf_state(artifact) -> dict[str, torch.Tensor]:
    """A Llama 4 artifact's weights as transformers' Llama4ForCausalLM state dict: every linear dequantized by the
    formats' oracle (quant/reference.py), q/k rows permuted back to interleaved pairs, the experts stacked
    input-major (gate_up_proj [E, hidden, 2 * width], down_proj [E, width, hidden])."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model, modules = manifest["model"], manifest["quant"]["modules"]
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    head_dim = model["head_dim"]
    inverse = torch.argsort(interleaved_rotary_permutation(head_dim, head_dim))

    def weight(name: str, expert: int | None = None) -> torch.Tensor:
        params = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
        if expert is not None:
            params = {k: v[expert] for k, v in params.items()}
        return dequantize(make_format(modules[name], torch.float32), params).float()

    def unpermute(rows: torch.Tensor) -> torch.Tensor:
        return rows.unflatten(0, (-1, head_dim))[:, inverse].flatten(0, 1)

    state = {"model.embed_tokens.weight": tensors["embed.weight"], "lm_head.weight": weight("lm_head"),
             "model.norm.weight": tensors["norm.weight"]}
    q, kv = model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim
    for i in range(model["num_layers"]):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        wq, wk, wv = weight(ours + "attn.qkv").split([q, kv, kv])
        state |= {hf + "self_attn.q_proj.weight": unpermute(wq), hf + "self_attn.k_proj.weight": unpermute(wk),
                  hf + "self_attn.v_proj.weight": wv, hf + "self_attn.o_proj.weight": weight(ours + "attn.o"),
                  hf + "input_layernorm.weight": tensors[ours + "input_norm.weight"],
                  hf + "post_attention_layernorm.weight": tensors[ours + "post_attn_norm.weight"]}
        for mlp, theirs in (("mlp.", "feed_forward."), ("moe.shared.", "feed_forward.shared_expert.")):
            if ours + mlp + "down" in modules:
                gate, up = weight(ours + mlp + "gate_up").chunk(2)
                state |= {f"{hf}{theirs}gate_proj.weight": gate, f"{hf}{theirs}up_proj.weight": up,
                          f"{hf}{theirs}down_proj.weight": weight(ours + mlp + "down")}
        if i in model["moe_layers"]:
            experts = range(model["num_experts"])
            state[hf + "feed_forward.experts.gate_up_proj"] = torch.stack(
                [weight(ours + "moe.experts.gate_up", e).t() for e in experts])
            state[hf + "feed_forward.experts.down_proj"] = torch.stack(
                [weight(ours + "moe.experts.down", e).t() for e in experts])
            state[hf + "feed_forward.router.weight"] = tensors[ours + "moe.gate.weight"]
    return {name: tensor.float() for name, tensor in state.items()}


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32}, {"method": "gptq", "bits": 4, "group_size": 32},
    pytest.param({"method": "awq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    # (the experts dense: transformers' stacked experts are no nn.Linear whose inputs a hook could round to FP8)
    {"method": "fp8", "weights": "per_channel", "activations": "dynamic",
     "ignore": ["lm_head", r"re:layers\.\d+\.moe\.experts\..*"]}], ids=["rtn", "gptq", "awq", "fp8"])
def test_a_quantized_build_runs_transformers_on_its_weights(quantization, checkpoint, tmp_path, data_dir, hf_encode):
    """A W4A16 build (every linear and expert: qkv, o, the dense MLP, the shared expert, the experts; GPTQ and AWQ
    calibrated through the MoE layers on the scaled inputs the experts read) and an FP8 one (its linears; each input
    rounded to E4M3 per token in transformers too) against transformers' model holding its dequantized
    weights (q/k rows permuted back, experts stacked input-major): logits over 34 positions (1e-4) and 16 greedy tokens;
    with two experts of a layer swapped in transformers' copy the logits move."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import fp8_per_token

    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    formats = {modules[f"layers.1.{name}"]["format"] for name in ("attn.qkv", "moe.shared.down")}
    experts = {modules[f"layers.1.moe.experts.{name}"]["format"] for name in ("gate_up", "down")}
    fp8 = quantization["method"] == "fp8"
    assert (formats, experts) == (({"w8a8-fp8"}, {"dense"}) if fp8 else ({"w4a16"}, {"w4a16"}))
    state = _hf_state(out)
    oracle = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = oracle.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    oracle.eval()
    if fp8:  # the linears' inputs rounded to E4M3 per token, as the artifact's dynamic activations are (not the
        for name, module in oracle.named_modules():  # router's, an nn.Linear there, never quantized here)
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear) and not name.endswith("router"):
                module.register_forward_pre_hook(lambda _, args: (fp8_per_token(args[0]),))
    with LLM(out, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        check_against_oracle(llm, oracle, checkpoint, hf_encode, PROMPTS, max_tokens=GREEDY.max_tokens)
        token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
        got = llm.engine.score(token_ids)
    for name in ("model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.1.feed_forward.experts.down_proj"):
        state[name] = state[name][[1, 0, 2, 3]]
    oracle.load_state_dict(state, strict=False)
    assert (oracle(torch.tensor([token_ids])).logits[0] - got).abs().max() > 0.1


def _conditional_generation(checkpoint, out):
    """A Llama4ForConditionalGeneration checkpoint (a one-layer vision tower) whose language model holds
    `checkpoint`'s weights, with its tokenizer."""
    from transformers import AutoModelForCausalLM, Llama4Config, Llama4ForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14, "vision_output_dim": 32, "projector_input_dim": 32,
              "projector_output_dim": 32}
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text.config.to_dict(), vision_config=vision))
    model.language_model.load_state_dict(text.state_dict())
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(checkpoint / name, out / name)
    return out


@torch.inference_mode()
def test_conditional_generation_serves_its_language_model(checkpoint, tmp_path, hf_logits, hf_encode):
    """Llama4ForConditionalGeneration's config form (text_config) and weights (language_model.*): its artifact is the
    text model's, scored as the language model of transformers' Llama4ForConditionalGeneration loaded from it scores
    the ids (1e-4), which is the text checkpoint's Llama4ForCausalLM; an image in a request, or limit_mm_per_prompt, is refused by name."""
    from PIL import Image
    from transformers import Llama4ForConditionalGeneration

    source = _conditional_generation(checkpoint, tmp_path / "cg")
    assert not any(k in json.loads((source / "config.json").read_text()) for k in ("hidden_size", "num_hidden_layers"))
    built = build_float32(source, tmp_path / "a")
    m = read_manifest(built).model
    assert (m.architecture, m.family, m.moe_layers, m.nope_layers, m.vocab_size) == (
        "Llama4ForConditionalGeneration", "llama4", [1, 3], [2], 4096)
    token_ids = _score_ids(checkpoint, hf_encode)
    reference = Llama4ForConditionalGeneration.from_pretrained(str(source), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    # (its own forward fails on text alone in transformers 5.24, reading image_outputs from the text model's output)
    want = reference.language_model(input_ids=torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(want, hf_logits(checkpoint, token_ids), atol=1e-5, rtol=1e-5)
    with LLM(built, **ENGINE) as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), want, atol=1e-4, rtol=1e-4)
        with pytest.raises(RequestError, match="vision tower is not built"):
            llm.generate([{"prompt": "Describe <|image|>", "multi_modal_data": {"image": Image.new("RGB", (28, 28))}}], GREEDY)
    with pytest.raises(ConfigError, match="limit_mm_per_prompt: .*vision tower is not built"):
        LLM(built, **ENGINE, limit_mm_per_prompt={"image": 1})


# Llama-4-Scout-17B-16E's text_config in the published form's keys (legacy rope_theta + rope_scaling, llama3 x16 over
# 8192; no_rope_layers empty: transformers' default, every 4th layer NoPE), under a Llama4ForConditionalGeneration
SCOUT_TEXT = {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
              "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
              "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
              "no_rope_layers": [], "attention_chunk_size": 8192, "attn_temperature_tuning": True,
              "floor_scale": 8192, "attn_scale": 0.1, "max_position_embeddings": 10485760, "rms_norm_eps": 1e-05,
              "vocab_size": 202048, "rope_theta": 500000.0, "bos_token_id": 200000, "eos_token_id": [200001, 200007],
              "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192}}


def test_a_scout_config_reads_as_transformers():
    """A Scout-shaped Llama4ForConditionalGeneration config: every layer MoE, every 4th NoPE and tempered (offset 1,
    floor 8192), the q/k norm and chunks of 8192 on the rest, llama3 rope from the legacy keys, the context its 10M
    positions, the text config's tokens; with 4 layers, transformers' parameter count (its model on the meta
    device)."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import model_context_of, spec_for_architecture

    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": SCOUT_TEXT,
              "vision_config": {"model_type": "llama4_vision_model"}, "tie_word_embeddings": False}
    m = model_config_from_hf(config, spec_for_architecture("Llama4ForConditionalGeneration"), "bfloat16")
    assert (m.moe_layers, m.nope_layers, m.query_temperature_layers) == (list(range(48)), list(range(3, 48, 4)),
                                                                         list(range(3, 48, 4)))
    assert m.qk_l2_norm_layers == [i for i in range(48) if i % 4 != 3] and not m.qk_norm
    assert (m.query_temperature_beta, m.query_temperature_floor, m.query_temperature_offset) == (0.1, 8192.0, 1.0)
    assert (m.rope_theta, m.rope_scaling["rope_type"], m.rope_scaling["factor"], m.eos_token_ids) == (
        500000.0, "llama3", 16.0, [200001, 200007])
    assert (m.attention_chunk_size, m.attention_chunk_layers) == (8192, [i for i in range(48) if i % 4 != 3])
    assert model_context_of(m)[0] == 10485760 and m.num_experts == 16
    short = {**SCOUT_TEXT, "num_hidden_layers": 4, "architectures": ["Llama4ForCausalLM"]}
    with torch.device("meta"):
        count = AutoModelForCausalLM.from_config(Llama4TextConfig(**{k: v for k, v in short.items() if k not in (
            "architectures", "model_type")})).num_parameters()
    assert model_config_from_hf(short, spec_for_architecture("Llama4ForCausalLM"), "bfloat16").num_parameters == count


def test_what_llama4_refuses(checkpoint, artifact, tmp_path):
    """Each by name: a context past max_position_embeddings; a context past attention_chunk_size from a manifest
    before 1.34 (which does not say which layers attend in chunks: held to one chunk, as it was built; `llmc inspect`
    says which); a manifest's attention_chunk_layers outside its layers; chunked_attention layers without a chunk
    size; num_experts_per_tok 2; attention_bias; onnx-cpu; `llmc export` (the permuted q/k rows); importing a
    quantized checkpoint (the fused experts)."""
    def refused(error, match, recipe=None, **changes):
        source = write_config(checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoint
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(RecipeError, r"runtime.max_model_len: 2048 exceeds the model's context of 1024 \(max_position_embeddings",
            recipe={"runtime": {"max_model_len": 2048}})
    older = shutil.copytree(artifact, tmp_path / "older")
    _edit(older, lambda d: (d["model"].pop("attention_chunk_layers"), d.update(format_version="1.33"),
                            d["runtime"].update(max_model_len=12)))
    with pytest.raises(ConfigError, match=r"24 exceeds the model's context of 12 \(attention_chunk_size 12: this "
                                          r"artifact \(format before 1.34\) does not say which layers"):
        LLM(older, **ENGINE, max_model_len=24)
    for layers in ([4], [0, 2, 5]):  # (the 4 layers are 0-3)
        bad = shutil.copytree(artifact, tmp_path / f"bad{len(layers)}")
        _edit(bad, lambda d: d["model"].update(attention_chunk_layers=layers))
        with pytest.raises(ArtifactError, match=r"attention_chunk_layers \[.*\] must be layers of the 4"):
            read_manifest(bad)
    from click.testing import CliRunner

    from llmc.cli import cli

    for source, says in ((artifact, "chunked attention in chunks of 12 on 3 of 4 layers"),
                         (older, "chunked attention not run: context held to its chunk of 12")):
        result = CliRunner().invoke(cli, ["inspect", str(source)])
        assert result.exit_code == 0 and says in result.output, result.output
    refused(CheckpointError, "layer_types has chunked_attention layers but attention_chunk_size is None",
            attention_chunk_size=None)
    refused(CheckpointError, "num_experts_per_tok 2: llmc runs Llama 4's router", num_experts_per_tok=2)
    refused(CheckpointError, "attention_bias: true is not supported", attention_bias=True)
    refused(RecipeError, "target.device onnx-cpu: mixture-of-experts models", recipe={"target": {"device": "onnx-cpu"}})
    refused(RecipeError, "target.device onnx-cpu: Llama4ForCausalLM's weightless q/k norm",
            recipe={"target": {"device": "onnx-cpu"}}, moe_layers=[], attn_temperature_tuning=False)
    refused(CheckpointError, "quantization.method import is not supported for Llama4ForCausalLM",
            recipe={"quantization": {"method": "import"}})
    with pytest.raises(ArtifactError, match="Llama4ForCausalLM: the build permuted q_proj's and k_proj's rows"):
        export_artifact(artifact, tmp_path / "export")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_float32_on_the_gpu_matches_transformers(graphs, checkpoint, artifact, hf_greedy, hf_logits, hf_encode,
                                                 free_gpu):
    """The float32 artifact on CUDA (Triton attention, the fused MoE kernel on the scaled inputs, the temperature
    from the positions buffer, with and without CUDA graphs): transformers' logits (2e-3) and greedy tokens."""
    with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16,
             enforce_eager=not graphs) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        check_against_transformers(llm, checkpoint, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
