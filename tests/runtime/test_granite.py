"""Granite (GraniteForCausalLM) against transformers' own model (float32): its four multipliers each shown to
matter, logits with chunked prefill, greedy decoding through the paged engine, the folds in the artifact, a tied
lm_head, quantized builds on their own weights, tensor parallelism, ONNX, a LoRA merged before the fold, how the
config is read, and every refusal."""

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import granite
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import (build_float32, check_against_transformers, check_quantized_build, check_tensor_parallel,
                                     hf_model_with_config, write_config)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
# tests/conftest.py's tiny Granite
MULTIPLIERS = {"embedding_multiplier": 12.0, "attention_multiplier": 0.05, "residual_multiplier": 0.3,
               "logits_scaling": 5.0}


@pytest.fixture(scope="module")
def artifact(tiny_granite, tmp_path_factory):
    return build_float32(tiny_granite, tmp_path_factory.mktemp("granite") / "a")


@torch.inference_mode()
def test_logits_match_transformers_and_each_multiplier_matters(tiny_granite, artifact, hf_logits, hf_encode):
    """50 positions prefilled in chunks of 16. transformers' logits with any one multiplier back at 1 (its
    default) differ from the model's by far more than the tolerance: each of the four shapes what is compared."""
    token_ids = hf_encode(tiny_granite, PROMPTS[1]) + list(range(100, 140))
    expected = hf_logits(tiny_granite, token_ids)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=16)
    torch.testing.assert_close(llm.engine.score(token_ids), expected, atol=1e-4, rtol=1e-4)
    assert read_hf_config(tiny_granite)["architectures"] == ["GraniteForCausalLM"]
    for key in MULTIPLIERS:
        dropped = hf_model_with_config(tiny_granite, **{key: 1.0})(torch.tensor([token_ids])).logits[0]
        assert (dropped - expected).abs().mean() > 0.5 * expected.abs().mean(), key  # measured 0.8 to 4


def test_greedy_and_logprobs_match_transformers_with_continuous_batching(tiny_granite, artifact, hf_greedy, hf_encode,
                                                                         hf_logits):
    """Greedy tokens of three prompts batched through the paged engine; the sampled and prompt logprobs are
    log_softmax of transformers' (scaled) logits."""
    expected = hf_greedy(tiny_granite, PROMPTS, GREEDY.max_tokens)
    assert all(len(set(tokens)) > 12 for tokens in expected)  # not a model that repeats one token
    llm = LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": hf_encode(tiny_granite, p)} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    prompt, generated = hf_encode(tiny_granite, PROMPTS[1]), outputs[1].outputs[0].token_ids
    sequence = prompt + generated
    want = torch.log_softmax(hf_logits(tiny_granite, sequence), dim=-1)[:-1]
    want = want.gather(1, torch.tensor(sequence[1:])[:, None])
    got = [entry[token].logprob for entry, token in zip(outputs[1].prompt_logprobs[1:], prompt[1:], strict=True)]
    got += [entry[token].logprob for entry, token in zip(outputs[1].outputs[0].logprobs, generated, strict=True)]
    torch.testing.assert_close(torch.tensor(got)[:, None], want.float(), atol=1e-4, rtol=1e-4)


def test_the_artifact_holds_the_folds_and_the_model_config(tiny_granite, artifact):
    """o_proj and down_proj times residual_multiplier, the final norm divided by logits_scaling, everything else as
    the checkpoint has it; the manifest carries the embedding multiplier and the attention's scale."""
    hf = load_file(tiny_granite / "model.safetensors")
    ours = load_file(artifact / "rank-00" / "weights.safetensors")
    for i in range(2):
        layer = f"model.layers.{i}."
        torch.testing.assert_close(ours[f"layers.{i}.attn.o.weight"], 0.3 * hf[f"{layer}self_attn.o_proj.weight"])
        torch.testing.assert_close(ours[f"layers.{i}.mlp.down.weight"], 0.3 * hf[f"{layer}mlp.down_proj.weight"])
        torch.testing.assert_close(ours[f"layers.{i}.input_norm.weight"], hf[f"{layer}input_layernorm.weight"],
                                   rtol=0, atol=0)
    torch.testing.assert_close(ours["norm.weight"], hf["model.norm.weight"] / 5.0)
    for ours_name, hf_name in (("embed.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        torch.testing.assert_close(ours[ours_name], hf[hf_name], rtol=0, atol=0)
    manifest = read_manifest(artifact)
    model = manifest.model
    assert (model.family, model.embed_scale, model.softmax_scale, model.attention_scale) == \
        ("granite", 12.0, 0.05, 0.05)
    assert (model.query_pre_attn_scalar, model.hidden_act, model.sandwich_norms, model.tie_word_embeddings) == \
        (None, "silu", False, False)
    major, minor = map(int, manifest.format_version.split("."))
    assert (major, minor) >= (1, 8)  # Granite came in 1.8


@torch.inference_mode()
def test_tied_embeddings_take_the_logits_fold(hf_checkpoint_factory, tmp_path, hf_logits, hf_encode):
    """Granite 3.x ties lm_head to the embedding: the logits fold goes into the final norm, never the shared matrix."""
    checkpoint = hf_checkpoint_factory(tmp_path / "tied", "granite", tie_word_embeddings=True)
    out = build_float32(checkpoint, tmp_path / "a")
    hf, ours = load_file(checkpoint / "model.safetensors"), load_file(out / "rank-00" / "weights.safetensors")
    assert "lm_head.weight" not in ours
    torch.testing.assert_close(ours["embed.weight"], hf["model.embed_tokens.weight"], rtol=0, atol=0)
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    expected = hf_logits(checkpoint, token_ids)
    got = LLM(out, device="cpu", max_num_batched_tokens=16).engine.score(token_ids)
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


def test_published_config_keys_read_as_transformers_reads_them(tiny_granite):
    """Keys a config leaves out take GraniteConfig's defaults: every multiplier 1 (an attention scale of 1, not
    head_dim^-0.5; no embedding scale), as transformers' GraniteAttention takes attention_multiplier as is."""
    from transformers import GraniteConfig

    base = {k: v for k, v in read_hf_config(tiny_granite).items() if k not in MULTIPLIERS}
    ours = model_config_from_hf(base, granite.SPEC, "bfloat16")
    theirs = GraniteConfig(**{k: v for k, v in base.items() if k not in ("architectures", "model_type")})
    assert ours.attention_scale == ours.softmax_scale == theirs.attention_multiplier == 1.0
    assert ours.embed_scale is None and theirs.embedding_multiplier == 1.0
    published = model_config_from_hf({**base, "embedding_multiplier": 12, "attention_multiplier": 0.015625},
                                     granite.SPEC, "bfloat16")
    assert (published.embed_scale, published.attention_scale) == (12.0, 0.015625)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    # calibrated: the same code as Gemma 3's (which runs them by default); with -m slow here
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param({"method": "awq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param({"method": "fp8"}, marks=pytest.mark.slow),  # 2 s; tests/compiler covers FP8 linears
], ids=["rtn-w4", "gptq-w4", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_granite_on_their_weights(quantization, tiny_granite, tmp_path, data_dir,
                                                                    hf_encode):
    """Each build is transformers' GraniteForCausalLM run on the artifact's own weights (tests/runtime/hf_oracle.py:
    dequantized, the folds undone, FP8's per-token activation rounding emulated): logits and greedy tokens. The
    quantizers see the folded weights; AWQ also scales the folded o_proj/down_proj's inputs into qkv's and
    gate_up's rows."""
    check_quantized_build(tiny_granite, tmp_path, data_dir, hf_encode, quantization, PROMPTS)


@pytest.mark.slow  # 4 s on 2 cores; Gemma 2's (caps per rank) runs by default
def test_tensor_parallel_matches_one_rank(tiny_granite, artifact, tmp_path, hf_encode):
    """Two ranks: each holds its rows of the folded o_proj/down_proj and its heads, with the same scales."""
    check_tensor_parallel(tiny_granite, artifact, tmp_path, hf_encode, PROMPTS, GREEDY)


def test_onnx_cpu_matches_transformers(tiny_granite, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu graph (onnxruntime) carries the embedding multiplier and the attention's scale; the folds are in
    its weights: transformers' logits and greedy tokens."""
    out = build_float32(tiny_granite, tmp_path / "onnx", target={"device": "onnx-cpu"})
    llm = LLM(out, device="cpu", max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_granite, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


@torch.inference_mode()
def test_a_lora_adapter_is_merged_before_the_fold(tiny_granite, tmp_path, hf_encode):
    """An adapter on o_proj and down_proj (what the residual fold scales): the build gives PEFT's merged model,
    so the fold scaled the merged weight W + BA, not W alone."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_granite), dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"],
                                                       task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if "lora_" in name:  # lora_B starts at zero: give the adapter something to merge
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "adapter")
    token_ids = hf_encode(tiny_granite, PROMPTS[1])
    merged = model.merge_and_unload().eval()
    want = merged(torch.tensor([token_ids])).logits[0]
    assert (want - hf_model_with_config(tiny_granite)(torch.tensor([token_ids])).logits[0]).abs().max() > 0.1
    out = build_float32(tiny_granite, tmp_path / "a", adapter=str(tmp_path / "adapter"))
    with LLM(out, device="cpu") as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid"},
     "layer_types None: every layer Mamba-2"),
    ({"residual_multiplier": 0.0}, "residual_multiplier 0.0: Granite's multipliers must be positive numbers"),
    ({"logits_scaling": -8.0}, "logits_scaling -8.0: Granite's multipliers must be positive numbers"),
    ({"attention_bias": True}, "attention_bias: true is not supported for Granite"),
    ({"mlp_bias": True}, "mlp_bias: true is not supported for Granite"),
], ids=["hybrid", "zero-residual", "negative-logits-scaling", "attention-bias", "mlp-bias"])
def test_what_llmc_does_not_run_is_refused_by_name(tiny_granite, tmp_path, changes, message):
    checkpoint = write_config(tiny_granite, tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_float32(checkpoint, tmp_path / "out")


def test_import_and_export_are_refused_by_name(tiny_granite, artifact, tmp_path):
    """A pre-quantized Granite checkpoint's packed o_proj/down_proj cannot take the residual fold at read time, and
    an export would write folded weights that a Granite checkpoint scales again."""
    with pytest.raises(CheckpointError, match="quantization.method import is not supported for Granite"):
        build_float32(tiny_granite, tmp_path / "imported", quantization={"method": "import"})
    with pytest.raises(ArtifactError, match="cannot export architecture GraniteForCausalLM: the build folded"):
        export_artifact(artifact, tmp_path / "export")


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float32_on_the_gpu_matches_transformers(tiny_granite, artifact, hf_greedy, hf_logits, hf_encode, free_gpu):
    """The Triton attention with Granite's scale (decode, prefill, CUDA graphs), the embedding scale, the folds."""
    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_granite, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()
