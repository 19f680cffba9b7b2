"""SmolLM3 against transformers' own SmolLM3ForCausalLM (float32): a Llama decoder whose NoPE layers (no_rope_layers'
zeros; here every second layer, 1 and 3 of 4) rotate neither q nor k. Logits and log-probabilities at 50 positions
prefilled in chunks, greedy decoding batched continuously and from the prefix cache (tied and untied embeddings, and
with use_sliding_window: the NoPE layers slide), what would differ if the NoPE layers rotated, the onnx-cpu graph
(GroupQueryAttention without rotary on the NoPE layers), an RTN W4A16 build, how the config is read and what is
refused."""

import math

import onnx
import pytest
import torch
from click.testing import CliRunner

from llmc.cli import cli

from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.errors import CheckpointError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import smollm3, spec_for_architecture
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_float32, check_quantized_build, write_config

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def checkpoints(tiny_smollm3, tmp_path_factory):
    """variant → its checkpoint: the tied one (tests/conftest.py's), an untied copy (lm_head of its own) and a copy
    with use_sliding_window over 8 tokens (SmolLM3Config makes its NoPE layers the sliding ones)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("smollm3")
    untied = write_config(tiny_smollm3, root / "untied", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(str(untied), dtype=torch.float32)
    with torch.no_grad():  # (loaded untied, lm_head is a copy of the embedding: give it its own weights)
        head = model.lm_head.weight
        head.copy_(0.5 * torch.randn(head.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(untied)
    sliding = write_config(tiny_smollm3, root / "sliding", use_sliding_window=True, sliding_window=8, layer_types=None)
    return {"tied": tiny_smollm3, "untied": untied, "sliding": sliding}


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    root, built = tmp_path_factory.mktemp("smollm3_artifacts"), {}

    def artifact(variant):
        if variant not in built:
            built[variant] = build_float32(checkpoints[variant], root / variant)
        return built[variant]
    return artifact


def _score_ids(checkpoint, hf_encode):
    return hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 140))  # 50 positions


@torch.inference_mode()
@pytest.mark.parametrize("variant", ["tied", "untied", "sliding"])
def test_logprobs_greedy_and_prefix_cache_match_transformers(variant, checkpoints, artifacts, hf_logits, hf_greedy,
                                                             hf_encode):
    """Logits and log-probabilities at 50 positions prefilled in chunks of 16 (1e-4), 24 greedy tokens of three
    prompts batched continuously, and 8 greedy tokens of a 40-token prompt twice, the second time with its first two
    blocks from the prefix cache: transformers' float32 model's."""
    from tests.conftest import hf_model

    checkpoint = checkpoints[variant]
    model = read_manifest(artifacts(variant)).model
    assert (model.family, model.nope_layers, model.tie_word_embeddings) == ("smollm3", [1, 3], variant != "untied")
    window = (8, [1, 3]) if variant == "sliding" else (None, None)
    assert (model.sliding_window, model.sliding_window_layers) == window
    token_ids = _score_ids(checkpoint, hf_encode)
    expected = hf_logits(checkpoint, token_ids)
    with LLM(artifacts(variant), enable_prefix_caching=True, **ENGINE) as llm:
        got = llm.engine.score(token_ids)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.log_softmax(-1), expected.log_softmax(-1), atol=1e-4, rtol=1e-4)
        want = hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens)
        assert all(len(set(tokens)) > 4 for tokens in want)  # not a model that repeats one token
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == want
        prompt, short = token_ids[:40], SamplingParams(temperature=0, max_tokens=8)
        first, second = (llm.generate([{"prompt_token_ids": prompt}], short)[0] for _ in range(2))
    ids = torch.tensor([prompt])
    expected = hf_model(checkpoint).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                             do_sample=False)[0, 40:].tolist()
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    assert second.num_cached_tokens == 32


@torch.inference_mode()
def test_the_nope_layers_are_what_transformers_leaves_unrotated(checkpoints, artifacts, tmp_path, hf_logits,
                                                               hf_encode):
    """transformers with every layer rotating, or with the other layers NoPE (0 and 2), is far from the model, so the
    comparison above fails if a NoPE layer rotated (its positions reach 49) or the wrong layers skipped the rope; and
    the runtime with its NoPE table swapped for the rope's is as far (the table is what skips it)."""
    checkpoint = checkpoints["tied"]
    token_ids = _score_ids(checkpoint, hf_encode)
    expected = hf_logits(checkpoint, token_ids)
    for index, flags in enumerate(([1, 1, 1, 1], [0, 1, 0, 1])):
        changed = hf_logits(write_config(checkpoint, tmp_path / f"rope_{index}", no_rope_layers=flags), token_ids)
        assert (changed - expected).abs().mean() > 0.05 * expected.abs().mean(), flags
    with LLM(artifacts("tied"), **ENGINE) as llm:
        model = llm.engine.runner.model
        assert torch.equal(model.cos_sin_none[:, :8], torch.ones(model.cos_sin.shape[0], 8))
        assert not model.cos_sin_none[:, 8:].any() and model.cos_sin[1:, 8:].abs().sum() > 0
        model.cos_sin_none = model.cos_sin.clone()  # every layer now rotates by the rope
        rotated = llm.engine.score(token_ids)
    assert (rotated - expected).abs().mean() > 0.05 * expected.abs().mean()


@pytest.mark.parametrize("variant", ["tied", "sliding"])
def test_onnx_graph_matches_transformers(variant, checkpoints, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu build: GroupQueryAttention with do_rotary 0 and no cos/sin tables on the NoPE layers (1 and 3;
    sliding: their local_window_size 8 too), 1 on the others; logits at 50 positions (1e-4) and 24 greedy tokens of
    three prompts are transformers', and so is the text `llmc run` prints."""
    from tests.runtime.hf_oracle import check_against_transformers

    checkpoint = checkpoints[variant]
    artifact = build_float32(checkpoint, tmp_path / "onnx", target={"device": "onnx-cpu"})
    graph = onnx.load(str(artifact / "onnx" / "model.onnx"), load_external_data=False).graph
    attention = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    rotary = [next(a.i for a in node.attribute if a.name == "do_rotary") for node in attention]
    assert rotary == [1, 0, 1, 0] and [bool(node.input[7]) for node in attention] == [True, False, True, False]
    windows = [next((a.i for a in node.attribute if a.name == "local_window_size"), None) for node in attention]
    assert windows == ([None, 8, None, 8] if variant == "sliding" else [None] * 4)
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)
        text = llm.tokenizer.decode(hf_greedy(checkpoint, [PROMPTS[0]], 8)[0])
    result = CliRunner().invoke(cli, ["run", str(artifact), "--prompt", PROMPTS[0], "--max-tokens", "8",
                                      "--temperature", "0"])  # (`llmc run` on the CPU: the edge path)
    assert result.exit_code == 0 and text in result.output, result.output


def test_an_rtn_w4_build_is_transformers_on_its_weights(checkpoints, tmp_path, data_dir, hf_encode):
    """RTN W4A16 (groups of 32, every decoder linear): transformers' model holding the artifact's dequantized weights
    gives its logits (1e-4) and 16 greedy tokens (hf_oracle.check_quantized_build)."""
    check_quantized_build(checkpoints["tied"], tmp_path, data_dir, hf_encode,
                          {"method": "rtn", "bits": 4, "group_size": 32}, PROMPTS)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {spec["format"] for spec in modules.values()} == {"w4a16"} and "layers.3.attn.qkv" in modules


@pytest.fixture(scope="module")
def trained_smollm3(tmp_path_factory):
    """A SmolLM3 of ref-llama-12m's trained weights (float32; the tensor names are Llama's), NoPE on layer 3 of 6
    (SmolLM3Config's default interval, 4): a model whose perplexity on real text means something, for the quantized
    build (a random model's W4 error is dominated by its sharp logits: 7x its perplexity here)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import SmolLM3Config

    from tests.conftest import REF_MODEL_DIR, TOKENIZER_FILES

    path = tmp_path_factory.mktemp("trained_smollm3")
    ref = json.loads((REF_MODEL_DIR / "config.json").read_text())
    tensors = {}
    for shard in sorted(REF_MODEL_DIR.glob("*.safetensors")):
        tensors |= {k: v.float() for k, v in load_file(shard).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = SmolLM3Config(**{k: ref[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                                  "max_position_embeddings", "bos_token_id", "eos_token_id",
                                                  "pad_token_id", "tie_word_embeddings", "rope_parameters")},
                           dtype="float32")
    config.architectures = ["SmolLM3ForCausalLM"]
    config.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    return path


W4 = {"method": "rtn", "bits": 4, "group_size": 32, "report": False}


@torch.inference_mode()
def test_an_rtn_w4_build_of_trained_weights_stays_near_the_float_model(trained_smollm3, tmp_path, repo_root,
                                                                       hf_logits, hf_encode):
    """On 256 tokens of held-out text: the float build's perplexity is transformers' (1e-4 relative), the RTN W4A16
    build's (groups of 32) within 5% of it (measured: 7.00 and 7.14); the onnx-cpu build of the same recipe
    (MatMulNBits beside the NoPE layer's rotary-free attention) gives the torch W4 build's 16 greedy tokens and its
    perplexity within 0.5%."""
    token_ids = hf_encode(trained_smollm3, (repo_root / "data" / "heldout.txt").read_text()[:4000])[:256]
    assert len(token_ids) == 256 and read_hf_config(trained_smollm3)["no_rope_layers"] == [1, 1, 1, 0, 1, 1]

    def perplexity(logits):
        return math.exp(torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(token_ids[1:])).item())
    reference = perplexity(hf_logits(trained_smollm3, token_ids))
    measured, greedy = {}, {}
    for name, device, quantization in (("float", "cpu", None), ("w4", "cpu", W4), ("w4-onnx", "onnx-cpu", W4)):
        out = build_float32(trained_smollm3, tmp_path / name, target={"device": device},
                            **({"quantization": quantization} if quantization else {}))
        with LLM(out, device="cpu", max_num_batched_tokens=64) as llm:
            measured[name] = perplexity(llm.engine.score(token_ids))
            greedy[name] = llm.generate([{"prompt_token_ids": token_ids[:32]}],
                                        SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    assert abs(measured["float"] / reference - 1) < 1e-4, (measured, reference)
    assert abs(measured["w4"] / reference - 1) < 0.05, (measured, reference)
    assert abs(measured["w4-onnx"] / measured["w4"] - 1) < 0.005 and greedy["w4-onnx"] == greedy["w4"], measured


def test_two_tensor_ranks_give_the_one_rank_model(checkpoints, artifacts, tmp_path, hf_encode):
    """Two tensor ranks (each its heads, both reading the NoPE table on layers 1 and 3): the one-rank artifact's greedy
    tokens and logits (5e-5: the all-reduces add the ranks' partial sums in another order)."""
    split = build_float32(checkpoints["tied"], tmp_path / "tp2", parallel={"tensor": 2})
    token_ids = _score_ids(checkpoints["tied"], hf_encode)
    results = []
    for artifact in (split, artifacts("tied")):
        with LLM(artifact, **ENGINE) as llm:
            results.append(([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)],
                            llm.engine.score(token_ids)))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], atol=5e-5, rtol=5e-5)


@torch.inference_mode()
def test_export_says_the_nope_and_sliding_layers_and_imports_back(checkpoints, tmp_path, hf_encode):
    """`llmc export` of an RTN W4 build with sliding NoPE layers: config.json names the NoPE layers (no_rope_layers),
    the window and every layer's type as SmolLM3Config reads them, and its `quantization.method: import` build gives
    the same logits."""
    import json

    from transformers import AutoConfig

    from llmc.compiler.export import export_artifact

    original = build_float32(checkpoints["sliding"], tmp_path / "w4", target={"device": "cpu"}, quantization=W4)
    export_artifact(original, tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert (config["no_rope_layers"], config["use_sliding_window"], config["sliding_window"]) == ([1, 0, 1, 0], True, 8)
    assert AutoConfig.from_pretrained(tmp_path / "exported").layer_types == ["full_attention", "sliding_attention"] * 2
    reimported = build_float32(tmp_path / "exported", tmp_path / "reimported", target={"device": "cpu"},
                               quantization={"method": "import"})
    assert read_manifest(reimported).model == read_manifest(original).model
    token_ids = _score_ids(checkpoints["sliding"], hf_encode)
    scores = []
    for artifact in (original, reimported):
        with LLM(artifact, **ENGINE) as llm:
            scores.append(llm.engine.score(token_ids))
    torch.testing.assert_close(scores[0], scores[1], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["tied", "sliding"])
def test_float32_on_the_gpu_matches_transformers(variant, checkpoints, artifacts, hf_greedy, hf_logits, hf_encode,
                                                 free_gpu):
    """On CUDA (the Triton rotary + KV-write and attention kernels, the CUDA graphs, all reading the NoPE layers'
    identity table): transformers' greedy tokens of three prompts and its logits at 50 positions (2e-3)."""
    checkpoint = checkpoints[variant]
    with LLM(artifacts(variant), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
             max_num_batched_tokens=16) as llm:
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens)
        token_ids = _score_ids(checkpoint, hf_encode)
        torch.testing.assert_close(llm.engine.score(token_ids).cpu(), hf_logits(checkpoint, token_ids), atol=2e-3,
                                   rtol=2e-3)


@torch.inference_mode()
def test_the_calibration_runner_runs_each_layer_as_transformers(tiny_smollm3, hf_model):
    """The layers GPTQ and AWQ calibrate through (compiler/calibration.LayerRunner, its own rotary tables): layers 0
    to 2 (1 NoPE) each give transformers' next hidden states from its own, over 32 positions."""
    from llmc.compiler.calibration import LayerRunner
    from llmc.compiler.convert import read_layer
    from llmc.compiler.hf_checkpoint import TensorReader

    config = _read(read_hf_config(tiny_smollm3))
    states = hf_model(tiny_smollm3)(input_ids=torch.arange(100, 132).view(1, 32), output_hidden_states=True).hidden_states
    runner = LayerRunner(config, seq_len=32, device=torch.device("cpu"))
    with TensorReader(tiny_smollm3) as reader:
        for index in range(3):
            layer = runner.build_layer(read_layer(reader, smollm3.SPEC, config, index))
            assert layer.attn.has_rope == (index != 1)
            torch.testing.assert_close(runner.forward(layer, states[index]), states[index + 1], atol=1e-4, rtol=1e-4)


def test_a_sequence_classifier_equals_transformers(checkpoints, tmp_path):
    """SmolLM3ForSequenceClassification (3 labels) on the NoPE decoder: transformers' class probabilities at the last
    token."""
    from tests.runtime.hf_oracle import check_classifier_as_transformers

    check_classifier_as_transformers(checkpoints["untied"], tmp_path, PROMPTS)


def _read(config: dict):
    return model_config_from_hf(config, smollm3.SPEC, "float32")


def test_config_read_as_smollm3config_reads_it(checkpoints):
    """NoPE layers from no_rope_layers, else every no_rope_layer_interval-th layer; with use_sliding_window and a
    window, layer_types where absent as SmolLM3Config fills it in (the NoPE layers slide); SmolLM3Config's defaults
    for keys left out (rope_theta 2e6, tied); what the runtime cannot run, refused by name."""
    from transformers import SmolLM3Config

    assert spec_for_architecture("SmolLM3ForCausalLM") is smollm3.SPEC
    base = read_hf_config(checkpoints["tied"])
    assert _read(base).nope_layers == [1, 3]
    for changes in ({"no_rope_layers": None, "no_rope_layer_interval": 3, "num_hidden_layers": 7, "layer_types": None},
                    {"no_rope_layers": [0, 0, 1, 1]},
                    {"no_rope_layers": None, "no_rope_layer_interval": 2, "use_sliding_window": True,
                     "sliding_window": 8, "layer_types": None}):
        config = {**base, **changes}
        theirs = SmolLM3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
        ours = _read({k: v for k, v in config.items() if v is not None})
        assert ours.nope_layers == [i for i, flag in enumerate(theirs.no_rope_layers) if not flag], changes
        sliding = [i for i, kind in enumerate(theirs.layer_types) if kind == "sliding_attention"]
        assert (ours.sliding_window_layers or ([] if ours.sliding_window is None else list(range(ours.num_layers)))
                ) == sliding, changes
    bare = {k: v for k, v in base.items() if v is not None and k not in (
        "rope_parameters", "tie_word_embeddings", "no_rope_layers", "no_rope_layer_interval")}
    defaults = _read(bare)
    assert (defaults.rope_theta, defaults.tie_word_embeddings, defaults.nope_layers) == (2e6, True, [3])
    for changes, message in (({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias"),
                             ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
                             ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
                             ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval"),
                             ({"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 8},
                              "use_sliding_window")):
        with pytest.raises(CheckpointError, match=message):
            _read({k: v for k, v in {**base, **changes}.items() if v is not None})


def test_inspect_names_the_nope_layers(artifacts):
    """`llmc inspect` says which share of the layers runs without rotary."""
    result = CliRunner().invoke(cli, ["inspect", str(artifacts("tied"))])
    assert result.exit_code == 0, result.output
    assert "no rotary on 2 of 4 layers (NoPE)" in result.output
