"""EXAONE 4.0 (Exaone4ForCausalLM), Seed-OSS (SeedOssForCausalLM) and ERNIE 4.5 dense (Ernie4_5ForCausalLM) against
transformers' own models (float32, tiny random checkpoints of tests/conftest.py): logits over a chunked prefill and
greedy tokens of a batch on the CPU path, on the Triton path (the rotary + KV-write and attention kernels in Triton's
interpreter on CPU tensors) and through the onnx-cpu graph; an RTN W4A16 build against transformers holding its
dequantized weights; what each mapping rests on (EXAONE's NoPE full layers, Seed-OSS's o_proj bias, ERNIE's interleaved
rotary against its apply_rotary_pos_emb); how the configs are read; every refusal. EXAONE 4 is checked twice: with
its sliding window (layers 0 and 2 slide over 8 tokens and rotate, 1 and 3 are full and NoPE) and without one
(EXAONE-4.0-1.2B's form: every layer full and rotated)."""

import json
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import interleaved_rotary_permutation, model_config_from_hf, read_hf_config
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import (build_float32, build_import, build_quantized, check_against_oracle,
                                     check_against_transformers, float32_artifacts, hf_model_on_weights_of,
                                     hf_state_of, write_config)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}
VARIANTS = ("exaone4", "exaone4_full", "seed_oss", "ernie4_5")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant → its tiny checkpoint: the three families' (tests/conftest.py), and EXAONE 4 without a sliding window
    (every layer full_attention: EXAONE-4.0-1.2B's form; untied: tied, this tiny model's greedy tokens repeat one)."""
    root = tmp_path_factory.mktemp("exaone4_seed_ernie")
    made = {family: make_hf_checkpoint(root / family, family) for family in ("exaone4", "seed_oss", "ernie4_5")}
    made["exaone4_full"] = make_hf_checkpoint(root / "exaone4_full", "exaone4", sliding_window=None,
                                              layer_types=["full_attention"] * 4)
    return made


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return float32_artifacts(checkpoints, tmp_path_factory.mktemp("exaone4_seed_ernie_artifacts"))


# what each variant's manifest says: (family, nope_layers, sliding window and its layers, pre_norms, qk_norm,
# attention_bias, o_bias, rotary_interleaved, tie_word_embeddings)
MANIFEST = {
    "exaone4": ("exaone4", [1, 3], 8, [0, 2], False, True, False, False, False, False),
    "exaone4_full": ("exaone4", [], None, None, False, True, False, False, False, False),
    "seed_oss": ("seed_oss", [], None, None, True, False, True, True, False, False),
    "ernie4_5": ("ernie4_5", [], None, None, True, False, False, False, True, True),
}


@torch.inference_mode()
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_match_transformers(variant, checkpoints, artifacts, hf_greedy, hf_logits, hf_encode):
    """Logits at 50 positions prefilled in chunks of 16 (1e-4; EXAONE's window of 8 is passed many times) and 16
    greedy tokens of three prompts batched two at a time: transformers' float32 model's."""
    manifest = read_manifest(artifacts(variant))
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.nope_layers, m.sliding_window, m.sliding_window_layers, m.pre_norms, m.qk_norm,
            m.attention_bias, m.o_bias, m.rotary_interleaved, m.tie_word_embeddings) == MANIFEST[variant]
    with LLM(artifacts(variant), **ENGINE) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)
    assert all(len(set(tokens)) > 4 for tokens in hf_greedy(checkpoints[variant], PROMPTS, 16))


@torch.inference_mode()
def test_what_the_mappings_rest_on(checkpoints, artifacts, tmp_path, hf_logits, hf_encode):
    """The runtime's EXAONE 4 with its NoPE layers' identity table swapped for the rope's (every layer rotating), and
    transformers' Seed-OSS without its o_proj bias (attention_out_bias false), are far from the models matched above:
    those comparisons fail if the full layers rotated or o's bias were dropped."""
    token_ids = hf_encode(checkpoints["exaone4"], PROMPTS[1]) + list(range(100, 140))
    expected = hf_logits(checkpoints["exaone4"], token_ids)
    with LLM(artifacts("exaone4"), **ENGINE) as llm:
        model = llm.engine.runner.model
        assert model.cos_sin_none is not None and not model.cos_sin_none[:, model.cos_sin.shape[1] // 2:].any()
        model.cos_sin_none = model.cos_sin.clone()
        rotated = llm.engine.score(token_ids)
    assert (rotated - expected).abs().mean() > 0.05 * expected.abs().mean()
    token_ids = hf_encode(checkpoints["seed_oss"], PROMPTS[1]) + list(range(100, 140))
    expected = hf_logits(checkpoints["seed_oss"], token_ids)
    changed = hf_logits(write_config(checkpoints["seed_oss"], tmp_path / "seed", attention_out_bias=False), token_ids)
    assert (changed - expected).abs().mean() > 0.05 * expected.abs().mean()


def test_ernies_interleaved_rotary_is_the_permuted_rotate_half():
    """q and k rotated by transformers' Ernie4_5 apply_rotary_pos_emb (interleaved pairs over the whole head, in
    float32) against the runtime's rotate-half over each head's rows permuted by interleaved_rotary_permutation, then
    permuted back."""
    from transformers.models.ernie4_5.modeling_ernie4_5 import apply_rotary_pos_emb

    from llmc.kernels.rotary import apply_rotary
    from llmc.runtime.layers.rotary import cos_sin_cache

    head_dim, gen = 32, torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 17, 63])
    q, k = torch.randn(5, 3, head_dim, generator=gen), torch.randn(5, 3, head_dim, generator=gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    emb = torch.cat((positions[:, None].float() * inv_freq,) * 2, dim=-1)  # transformers' Ernie4_5RotaryEmbedding
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    perm = interleaved_rotary_permutation(head_dim, head_dim)
    assert perm.tolist() == list(range(0, head_dim, 2)) + list(range(1, head_dim, 2))
    got_q, got_k = apply_rotary(q[..., perm], k[..., perm], positions, cos_sin_cache(head_dim, 64, 10000.0, None))
    inverse = torch.argsort(perm)
    torch.testing.assert_close(got_q[..., inverse], want_q.transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k[..., inverse], want_k.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.fixture
def triton_dispatch(monkeypatch):
    """The attention (rotary + KV write, paged attention) dispatched to its Triton kernels on CPU tensors (the
    interpreter), as on CUDA; counts the rotary + KV-write kernel's calls."""
    import llmc.kernels.attention as attention
    import llmc.kernels.attention_triton as attention_triton

    calls = {"rotate_and_write_kv": 0}
    kernel = attention_triton.rotate_and_write_kv

    def counted(*args, **kwargs):
        calls["rotate_and_write_kv"] += 1
        return kernel(*args, **kwargs)
    monkeypatch.setattr(attention, "can_use_triton", lambda *tensors: True)
    monkeypatch.setattr(attention_triton, "rotate_and_write_kv", counted)
    return calls


@torch.inference_mode()
@pytest.mark.parametrize("variant", ["exaone4", "seed_oss", "ernie4_5"])
def test_the_triton_path_matches_transformers(variant, checkpoints, artifacts, triton_dispatch, hf_greedy, hf_logits,
                                              hf_encode):
    """The Triton rotary + KV-write kernel (EXAONE's NoPE layers by the identity table, ERNIE's permuted rows by the
    whole-head table) and attention kernels (EXAONE's window): transformers' logits and greedy tokens."""
    with LLM(artifacts(variant), **ENGINE) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6),
                                   hf_greedy, hf_logits, hf_encode, 1e-4)
    assert triton_dispatch["rotate_and_write_kv"] > 0


@pytest.mark.parametrize("variant", ["exaone4", "seed_oss", "ernie4_5"])
def test_onnx_cpu_matches_transformers(variant, checkpoints, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu graph (EXAONE: no pre-norms, per-head q/k norms, GroupQueryAttention without rotary on the full
    layers and local_window_size 8 on the sliding ones; Seed-OSS: q/k/v and o biases; ERNIE: the permuted rows
    rotated whole): transformers' logits and greedy tokens."""
    import onnx

    artifact = build_float32(checkpoints[variant], tmp_path / "onnx", target={"device": "onnx-cpu"})
    if variant == "exaone4":
        graph = onnx.load(str(artifact / "onnx" / "model.onnx"), load_external_data=False).graph
        attention = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
        assert [next(a.i for a in node.attribute if a.name == "do_rotary") for node in attention] == [1, 0, 1, 0]
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


def _hf_state(artifact, checkpoint) -> dict:
    """The artifact's weights as transformers' state dict: hf_state_of's, with q/k/v's and o's biases, and ERNIE's
    q_proj / k_proj rows (weights and biases) permuted back out of the runtime's rotate-half layout."""
    state, tensors = hf_state_of(artifact), load_file(artifact / "rank-00" / "weights.safetensors")
    model = read_manifest(artifact).model
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    for i in range(model.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        if model.attention_bias:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), tensors[f"layers.{i}.attn.qkv.bias"].split([q, kv, kv]),
                                  strict=True):
                state[f"{prefix}{name}.bias"] = part.float()
        if model.o_bias:
            state[f"{prefix}o_proj.bias"] = tensors[f"layers.{i}.attn.o.bias"].float()
        if model.rotary_interleaved:
            inverse = torch.argsort(interleaved_rotary_permutation(model.head_dim, model.head_dim))
            for name in ("q_proj.weight", "k_proj.weight"):
                rows = state[prefix + name]
                state[prefix + name] = rows.unflatten(0, (-1, model.head_dim))[:, inverse].flatten(0, 1)
    return state


@pytest.mark.parametrize("method", ["rtn", pytest.param("awq", marks=pytest.mark.slow)])  # AWQ: calibrated, 2-4 s
@pytest.mark.parametrize("variant", ["exaone4", "seed_oss", "ernie4_5"])
def test_a_w4_build_is_transformers_on_its_weights(variant, method, checkpoints, tmp_path, data_dir, hf_encode):
    """RTN and AWQ W4A16 (groups of 32, every decoder linear; AWQ's folds where the family has a norm to take them,
    none before EXAONE's sub-layers): transformers' model holding the artifact's dequantized weights (its biases,
    its norms, ERNIE's rows permuted back) gives its logits (1e-4) and greedy tokens."""
    checkpoint = checkpoints[variant]
    out = build_quantized(checkpoint, tmp_path, data_dir, {"method": method, "bits": 4, "group_size": 32})
    assert read_manifest(out).quant.modules["layers.0.attn.qkv"]["format"] == "w4a16"
    oracle = hf_model_on_weights_of(checkpoint, out, method, _hf_state(out, checkpoint))
    with LLM(out, device="cpu", max_num_batched_tokens=16) as llm:
        check_against_oracle(llm, oracle, checkpoint, hf_encode, PROMPTS)


@pytest.mark.parametrize("variant", ["exaone4", "seed_oss"])
def test_the_sequence_classifier_classifies_as_transformers(variant, checkpoints, tmp_path):
    """Exaone4ForSequenceClassification and SeedOssForSequenceClassification (the causal model's decoder, then
    `score` at the last token) build and give transformers' class probabilities (1e-5)."""
    from tests.runtime.hf_oracle import check_classifier_as_transformers

    check_classifier_as_transformers(checkpoints[variant], tmp_path, PROMPTS)


@pytest.mark.slow  # 2 ranks on the CPU
@pytest.mark.parametrize("variant", ["exaone4", "seed_oss", "ernie4_5"])
def test_tensor_parallel_matches_transformers(variant, checkpoints, tmp_path, hf_greedy, hf_logits, hf_encode):
    """Two ranks (their heads' per-head q/k norms, NoPE layers and windows; q/k/v biases split and o's bias on rank 0
    alone; the permuted rows): transformers' logits (1e-4) and greedy tokens."""
    split = build_float32(checkpoints[variant], tmp_path / "tp2", parallel={"tensor": 2})
    with LLM(split, **ENGINE) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


def _model_config(checkpoint, **changes):
    config = {**read_hf_config(checkpoint), **changes}
    return model_config_from_hf(config, spec_for_architecture(config["architectures"][0]), "float32")


def test_how_the_configs_are_read(checkpoints):
    """EXAONE 4's layer_types where absent, as Exaone4Config fills them in (every sliding_window_pattern-th layer
    full; all full without a window) and its NoPE layers; Seed-OSS's biases as SeedOssConfig defaults them (q/k/v
    yes, o no); ERNIE's defaults (rope_theta 500000, tied embeddings)."""
    from transformers import Exaone4Config

    exaone = checkpoints["exaone4"]
    for pattern in (2, 3, 4):
        kinds = Exaone4Config(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=pattern).layer_types
        model = _model_config(exaone, layer_types=None, sliding_window_pattern=pattern)
        assert model.sliding_window_layers == [i for i, k in enumerate(kinds) if k == "sliding_attention"]
        assert model.nope_layers == [i for i, k in enumerate(kinds) if k == "full_attention"]
    model = _model_config(exaone, layer_types=None, sliding_window=None)
    assert (model.sliding_window, model.nope_layers) == (None, [])
    seed = {k: v for k, v in read_hf_config(checkpoints["seed_oss"]).items()
            if k not in ("attention_bias", "attention_out_bias", "mlp_bias")}
    model = model_config_from_hf(seed, spec_for_architecture("SeedOssForCausalLM"), "float32")
    assert (model.attention_bias, model.o_bias) == (True, False)
    ernie = {k: v for k, v in read_hf_config(checkpoints["ernie4_5"]).items()
             if k not in ("rope_parameters", "tie_word_embeddings", "use_bias")}
    model = model_config_from_hf(ernie, spec_for_architecture("Ernie4_5ForCausalLM"), "float32")
    assert (model.rope_theta, model.tie_word_embeddings, model.attention_bias) == (500000.0, True, False)


def test_what_is_not_run_is_refused_by_name(checkpoints, artifacts, tmp_path):
    """EXAONE 4: a sliding_window with no sliding layer (transformers and vLLM disagree on its rotary), a
    sliding_window_pattern that is not an integer without layer_types; Seed-OSS's mlp_bias and ERNIE's use_bias (the
    MLP's biases), at build time too; importing a pre-quantized ERNIE (its q/k rows are permuted at build); export of
    the three (no export form); EXAONE 3 and ERNIE's remote-code architecture, and ERNIE 4.5 as a sequence
    classifier (transformers has no such class)."""
    exaone = checkpoints["exaone4"]
    with pytest.raises(CheckpointError, match="sliding_window 8 with no sliding_attention layer: transformers runs"):
        _model_config(exaone, layer_types=["full_attention"] * 4)
    with pytest.raises(CheckpointError, match="sliding_window_pattern 'LLLG': give a positive integer"):
        _model_config(exaone, layer_types=None, sliding_window_pattern="LLLG")
    with pytest.raises(CheckpointError, match="mlp_bias: true is not supported for Seed-OSS"):
        build_float32(write_config(checkpoints["seed_oss"], tmp_path / "seed", mlp_bias=True), tmp_path / "a")
    with pytest.raises(CheckpointError, match="use_bias: true is not supported for ERNIE 4.5"):
        build_float32(write_config(checkpoints["ernie4_5"], tmp_path / "ernie", use_bias=True), tmp_path / "b")
    with pytest.raises(CheckpointError, match="quantization.method import is not supported for Ernie4_5ForCausalLM"):
        build_import(write_config(checkpoints["ernie4_5"], tmp_path / "ernie_awq", quantization_config={
            "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}), tmp_path / "c")
    for variant in ("exaone4", "seed_oss", "ernie4_5"):
        with pytest.raises(ArtifactError, match="cannot export"):
            export_artifact(artifacts(variant), tmp_path / f"export_{variant}")
    for arch, reason in (("ExaoneForCausalLM", "EXAONE 3 / 3.5"), ("Ernie4_5_ForCausalLM", "remote-code"),
                         ("Ernie4_5ForSequenceClassification", "supported")):
        source = tmp_path / arch
        source.mkdir()
        (source / "config.json").write_text(json.dumps({**read_hf_config(exaone), "architectures": [arch]}))
        with pytest.raises(CheckpointError, match=f"architecture .*{arch}.* {reason}"):
            build_float32(source, tmp_path / f"out_{arch}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_on_the_gpu_matches_transformers(variant, checkpoints, artifacts, hf_greedy, hf_logits, hf_encode,
                                                 free_gpu):
    """On CUDA (the Triton rotary + KV-write and attention kernels, the CUDA graphs): transformers' logits (2e-3, as
    the other families' GPU tests) and greedy tokens."""
    with LLM(artifacts(variant), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
             max_num_batched_tokens=16) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
