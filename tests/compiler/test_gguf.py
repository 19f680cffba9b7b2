"""GGUF checkpoints (llama.cpp's format) as a build input, against transformers loading the same file
(`from_pretrained(dir, gguf_file=...)`, which dequantizes and un-permutes): float32 logits and greedy tokens of
F32 / F16 files (llama with its permuted q/k rows, qwen2 with biases and tied embeddings), the tokenizer made from
the GGUF's metadata or given as an HF directory, Q8_0 / Q4_0 kept as llmc's w8a16 / w4a16 by method import, a
k-quant file dequantized then RTN-quantized (the artifact equal to an RTN build of transformers' dequantized
weights), Llama 3's rope_freqs, a LoRA adapter merged, a gguf-split set, and the refusals.

The files are written here the way llama.cpp's converter lays them out: gguf's tensor name map, its writer and its
quantize functions, llama's q/k rows permuted for the interleaved rotary; k-quant blocks are random bytes with
finite scales (gguf-py dequantizes k-quants but does not quantize to them).
"""

import json
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RecipeError
from llmc.quant.formats import make_format
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import make_peft_adapter

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
PROMPT_IDS = [1, 312, 45, 1001, 7, 2048, 99, 3000, 15, 640, 8, 77, 1500, 4000, 23, 5]
# byte offsets of the fp16 scales in a k-quant block (ggml's block_q*_K layouts)
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _converter_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama's q / k rows (per head, rotate-half → interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _converter_rope_freqs(config: dict) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf rope_freqs.weight for a llama3 rope scaling: each frequency's divisor."""
    rope = config["rope_parameters"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _kquant_bytes(shape: tuple[int, int], kind, rng) -> np.ndarray:
    """Random blocks of a k-quant with small finite fp16 scales: [out, in / 256 * block bytes] uint8."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block, size), dtype=np.uint8)
    for offset in K_SCALES[kind]:
        scale = rng.uniform(0.001, 0.004, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(shape[0], -1)


def write_gguf(hf_dir, path, arch: str, types=None, split_max_tensors: int = 0, tokenizer: bool = True,
               architecture: str | None = None, extra_tensors=None, seed: int = 0):
    """The HF checkpoint `hf_dir` as llama.cpp's converter writes it. `types`: {HF-name substring: GGML type}
    (first match; default F32; norms and biases stay F32 but for F64)."""
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(hf_dir / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, architecture or arch, split_max_tensors=split_max_tensors)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if tokenizer:
        tok = json.loads((hf_dir / "tokenizer.json").read_text())
        vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
        tokens = sorted(vocab, key=vocab.get)
        special = {t["content"] for t in tok["added_tokens"]}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in special else 1 for t in tokens])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
        writer.add_bos_token_id(config["bos_token_id"])
        writer.add_eos_token_id(config["eos_token_id"])
        writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(ARCH[arch], config["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
            data = _converter_permute(data, heads if "q_proj" in hf_name else kv_heads)
        kind = next((k for key, k in (types or {}).items() if key in hf_name), Q.F32)
        kind = kind if data.ndim == 2 or kind == Q.F64 else Q.F32
        if kind in K_SCALES:
            writer.add_tensor(name, _kquant_bytes(data.shape, kind, rng), raw_dtype=kind)
        elif kind in (Q.F32, Q.F16, Q.F64):
            writer.add_tensor(name, data.astype({Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64}[kind]))
        else:
            writer.add_tensor(name, gguf.quantize(data, kind), raw_dtype=kind)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _build(model, out, **recipe):
    recipe = {"model": str(model), "output": str(out), "dtype": "float32", "target": {"device": "cpu"},
              "runtime": {"max_model_len": 256}, **recipe}
    return build(recipe_from_dict(recipe), show_progress=False).output


def _transformers(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_llama"), "llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama_f32(llama_dir, tmp_path_factory):
    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "llama-f32.gguf", "llama")


@torch.inference_mode()
def _check_against_transformers(gguf_path, artifact, atol=1e-4):
    """llmc's float32 logits (prefilled in chunks) and greedy tokens equal transformers' on the GGUF."""
    model = _transformers(gguf_path)
    expected = model(torch.tensor([PROMPT_IDS])).logits[0]
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=8)
    torch.testing.assert_close(llm.engine.score(PROMPT_IDS), expected, atol=atol, rtol=atol)
    greedy = model.generate(torch.tensor([PROMPT_IDS[:6]]), max_new_tokens=12, do_sample=False,
                            eos_token_id=None)[0, 6:].tolist()
    out = llm.generate([{"prompt_token_ids": PROMPT_IDS[:6]}], SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy
    assert len(set(greedy)) > 3  # not one repeated token


def test_llama_f32_logits_greedy_and_tokenizer_match_transformers(llama_f32, tmp_path):
    """q/k un-permuted (shown to matter: transformers' model with the rows as stored is far off), the config from
    the metadata, and the tokenizer transformers makes from the GGUF's metadata (its chat template too) copied into the
    artifact."""
    from transformers import AutoTokenizer

    artifact = _build(llama_f32, tmp_path / "a")
    _check_against_transformers(llama_f32, artifact)
    manifest = read_manifest(artifact)
    assert manifest.model.architecture == "LlamaForCausalLM" and manifest.model.num_kv_heads == 2
    assert not manifest.model.tie_word_embeddings and manifest.source["sha256"].keys() == {"llama-f32.gguf"}
    ours = AutoTokenizer.from_pretrained(str(artifact / "tokenizer"))
    theirs = AutoTokenizer.from_pretrained(str(llama_f32.parent), gguf_file=llama_f32.name)
    text = "What light through yonder window breaks?"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and len(theirs(text)["input_ids"]) > 5
    assert ours.chat_template == CHAT_TEMPLATE  # the GGUF's tokenizer.chat_template
    with torch.inference_mode():  # the permutation matters
        model = _transformers(llama_f32)
        for layer in model.model.layers:
            for proj, heads in ((layer.self_attn.q_proj, 4), (layer.self_attn.k_proj, 2)):
                proj.weight.copy_(torch.from_numpy(_converter_permute(proj.weight.numpy(), heads)))
        moved = model(torch.tensor([PROMPT_IDS])).logits[0]
        assert (moved - LLM(artifact, device="cpu").engine.score(PROMPT_IDS)).abs().max() > 1e-2


def test_qwen2_f16_with_an_hf_tokenizer_directory(tmp_path):
    """qwen2: q/k/v biases, tied embeddings (no output.weight), rows not permuted; F16 and BF16 weights; `tokenizer`
    names an HF tokenizer directory (vLLM's --tokenizer), whose files the artifact holds."""
    hf_dir = make_hf_checkpoint(tmp_path / "hf", "qwen2")
    path = write_gguf(hf_dir, tmp_path / "qwen2-f16.gguf", "qwen2", types={"mlp": Q.BF16, "": Q.F16}, tokenizer=False)
    with pytest.raises(CheckpointError, match="holds no tokenizer.*set the recipe's tokenizer"):
        _build(path, tmp_path / "none")
    artifact = _build(path, tmp_path / "a", tokenizer=str(hf_dir))
    _check_against_transformers(path, artifact)
    assert read_manifest(artifact).model.tie_word_embeddings
    assert (artifact / "tokenizer" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()


def test_q8_0_and_q4_0_import_as_the_int_formats(llama_dir, tmp_path):
    """method import keeps Q8_0 (attention) and Q4_0 (MLP) as w8a16 / w4a16, group 32, symmetric: the logits are
    transformers' on the dequantized weights; the Q4_0 embedding and Q8_0 output head are read dense."""
    path = write_gguf(llama_dir, tmp_path / "llama-q.gguf", "llama",
                      types={"self_attn": Q.Q8_0, "mlp": Q.Q4_0, "embed": Q.Q4_0, "lm_head": Q.Q8_0})
    artifact = _build(path, tmp_path / "a", quantization={"method": "import"})
    modules = read_manifest(artifact).quant.modules
    for i in range(2):
        assert {k: modules[f"layers.{i}.attn.{k}"]["format"] for k in ("qkv", "o")} == {"qkv": "w8a16", "o": "w8a16"}
        assert {modules[f"layers.{i}.mlp.{k}"]["format"] for k in ("gate_up", "down")} == {"w4a16"}
        assert all(modules[f"layers.{i}.{m}"]["group_size"] == 32 and modules[f"layers.{i}.{m}"]["symmetric"]
                   for m in ("attn.qkv", "mlp.down"))
    assert modules["lm_head"]["format"] == "dense"
    _check_against_transformers(path, artifact)
    weights, layer = load_file(artifact / "rank-00" / "weights.safetensors"), _transformers(path).model.layers[1]
    for name, members in (("attn.qkv", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up", ("gate_proj", "up_proj"))):
        params = {k.split(".")[-1]: v for k, v in weights.items() if k.startswith(f"layers.1.{name}.")}
        ours = make_format(modules[f"layers.1.{name}"], torch.float32).dequantize(params, 64)
        parent = layer.self_attn if name == "attn.qkv" else layer.mlp
        theirs = torch.cat([getattr(parent, m).weight for m in members])
        assert torch.equal(ours, theirs), name  # the stored levels and scales, exactly
    with pytest.raises(RecipeError, match="dtype: bfloat16 would round"):
        _build(path, tmp_path / "b", dtype="bfloat16", quantization={"method": "import"})
    gpu = _build(path, tmp_path / "gpu", quantization={"method": "import"}, target={"device": "cuda"})
    assert read_manifest(gpu).quant.modules["layers.0.mlp.down"]["layout"] == "gpu"  # the W4A16 kernels' packing
    torch.testing.assert_close(LLM(gpu, device="cpu").engine.score(PROMPT_IDS),
                               LLM(artifact, device="cpu").engine.score(PROMPT_IDS), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_q4_0_import_on_cuda_matches_transformers(llama_dir, tmp_path):
    """The Q4_0 import (group 32, fp16 scales, some negative) through the Triton W4A16 kernels, float16, against
    transformers' float32 forward on the dequantized weights."""
    path = write_gguf(llama_dir, tmp_path / "llama-q4.gguf", "llama", types={"self_attn": Q.Q4_0, "mlp": Q.Q4_0})
    artifact = _build(path, tmp_path / "a", dtype="float16", quantization={"method": "import"},
                      target={"device": "cuda"})
    expected = _transformers(path)(torch.tensor([PROMPT_IDS])).logits[0]
    got = LLM(artifact, device="cuda", gpu_memory_utilization=0.3).engine.score(PROMPT_IDS).float().cpu()
    # float16 activations against float32 ones: on an H200 (session 46) 89 of 65,536 logits were more than 0.02 off,
    # the largest 0.041; every position's argmax the same
    torch.testing.assert_close(got, expected, atol=6e-2, rtol=2e-2)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_k_quants_are_dequantized_then_rtn_quantized(tmp_path, caplog):
    """Q4_K / Q6_K / Q5_K linears (hidden 256: k-quant blocks are 256 wide) dequantized by gguf, then RTN: the
    artifact equals an RTN build of the HF checkpoint transformers makes from the same GGUF; one log line names
    the dequantized types; method import refuses them by name."""
    hf_dir = make_hf_checkpoint(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    path = write_gguf(hf_dir, tmp_path / "llama-k.gguf", "llama",
                      types={"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_K, "mlp": Q.Q4_K,
                             "lm_head": Q.Q6_K, "embed": Q.Q8_0})
    quantization = {"method": "rtn", "bits": 4, "group_size": 64, "report": False}
    with caplog.at_level(logging.INFO, logger="llmc"):
        ours = _build(path, tmp_path / "ours", quantization=quantization)
    said = [r.getMessage() for r in caplog.records if "dequantizing" in r.getMessage()]
    assert len(said) == 1 and all(t in said[0] for t in ("Q4_K (5 tensors)", "Q5_K (1", "Q6_K (2", "Q8_0 (1", "rtn"))
    reference = tmp_path / "transformers-dequantized"  # (save_pretrained refuses a GGUF-loaded model)
    reference.mkdir()
    model = _transformers(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, reference / "model.safetensors")
    config = {**{k: v for k, v in model.config.to_dict().items() if k != "quantization_config"},
              "architectures": ["LlamaForCausalLM"]}
    (reference / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (reference / name).write_bytes((hf_dir / name).read_bytes())
    theirs = _build(reference, tmp_path / "theirs", quantization=quantization)
    a, b = load_file(ours / "rank-00" / "weights.safetensors"), load_file(theirs / "rank-00" / "weights.safetensors")
    assert a.keys() == b.keys() and "layers.0.attn.qkv.qweight" in a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    with pytest.raises(CheckpointError, match=r"q_proj.weight is GGUF Q4_K, which no llmc format holds exactly"):
        _build(path, tmp_path / "imp", quantization={"method": "import"})


@torch.inference_mode()
def test_llama3_rope_freqs_are_read_as_the_published_scaling(tmp_path, caplog):
    """Llama 3.2's rope scaling (factor 32), which llama.cpp's converter keeps only as rope_freqs.weight: the build
    finds the published scaling that gives those divisors (one log line) and the logits are transformers' on the HF
    checkpoint it was converted from (transformers' GGUF loader ignores rope_freqs, so it is no reference here). A
    scaling the divisors do not match, given by hf_overrides, is refused by name."""
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_dir = make_hf_checkpoint(tmp_path / "hf", "llama", rope_scaling=scaling)
    config = json.loads((hf_dir / "config.json").read_text())
    freqs = _converter_rope_freqs(config)
    assert 1 < freqs.max() and freqs.min() == 1  # some frequencies scaled, some kept
    path = write_gguf(hf_dir, tmp_path / "llama32.gguf", "llama", extra_tensors={"rope_freqs.weight": freqs})
    with caplog.at_level(logging.INFO, logger="llmc"):
        artifact = _build(path, tmp_path / "a")
    assert any("rope_freqs.weight is Llama 3's rope scaling" in r.getMessage() for r in caplog.records)
    assert read_manifest(artifact).model.rope_scaling["factor"] == 32.0
    from transformers import AutoModelForCausalLM

    token_ids = PROMPT_IDS + list(range(100, 320))  # far enough for the slowed frequencies to matter
    ours = LLM(artifact, device="cpu").engine.score(token_ids)
    expected = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()(
        torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    unscaled = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert (unscaled.eval()(torch.tensor([token_ids])).logits[0] - ours).abs().max() > 1e-2
    with pytest.raises(CheckpointError, match="rope_freqs.weight .* is not the config's rope_scaling"):
        _build(path, tmp_path / "b", hf_overrides={"rope_scaling": {**scaling, "factor": 8.0}})


def test_a_lora_adapter_merges_into_gguf_weights_as_into_the_hf_checkpoints(llama_dir, llama_f32, tmp_path):
    """The adapter's q/k deltas join the rows un-permuted: the artifact equals the HF checkpoint's LoRA build."""
    adapter = make_peft_adapter(llama_dir, tmp_path / "lora", seed=1, r=4,
                                target_modules=["q_proj", "k_proj", "down_proj"])
    ours = _build(llama_f32, tmp_path / "gguf", adapter=[str(adapter)])
    theirs = _build(llama_dir, tmp_path / "hf", adapter=[str(adapter)])
    a, b = load_file(ours / "rank-00/weights.safetensors"), load_file(theirs / "rank-00/weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    plain = load_file(_build(llama_f32, tmp_path / "plain") / "rank-00/weights.safetensors")
    assert not torch.equal(a["layers.0.attn.qkv.weight"], plain["layers.0.attn.qkv.weight"])  # the adapter counts


def test_a_gguf_split_set_builds_as_the_single_file(llama_dir, llama_f32, tmp_path):
    """gguf-split's NAME-00001-of-0000N.gguf: every file read; another split than the first is refused by name."""
    write_gguf(llama_dir, tmp_path / "llama.gguf", "llama", split_max_tensors=8)
    files = sorted(p.name for p in tmp_path.glob("*.gguf"))
    assert len(files) > 2 and files[0] == f"llama-00001-of-{len(files):05d}.gguf"
    split = _build(tmp_path / files[0], tmp_path / "split")
    single = _build(llama_f32, tmp_path / "single")
    a, b = load_file(split / "rank-00/weights.safetensors"), load_file(single / "rank-00/weights.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in b) and a.keys() == b.keys()
    assert len(read_manifest(split).source["sha256"]) == len(files)
    assert recipe_from_dict({"model": str(tmp_path / files[0])}).output_dir.name == "llama"
    with pytest.raises(CheckpointError, match="point model at the first"):
        _build(tmp_path / files[1], tmp_path / "second")


def test_refusals(llama_dir, tmp_path):
    """Each refused by name before any work: an architecture llmc does not read from GGUF, a tensor type that is no
    weight type, a tensor llmc does not place, import of fused members of different types, a tokenizer key without
    a GGUF model."""
    other = write_gguf(llama_dir, tmp_path / "g.gguf", "llama", architecture="gemma2", tokenizer=False)
    with pytest.raises(CheckpointError, match="GGUF architecture 'gemma2' is not supported; supported: llama, qwen2"):
        _build(other, tmp_path / "a")
    bad = write_gguf(llama_dir, tmp_path / "f64.gguf", "llama", tokenizer=False, types={"model.norm": Q.F64})
    with pytest.raises(CheckpointError, match="output_norm.weight has type F64, which is not a weight type"):
        _build(bad, tmp_path / "b", tokenizer=str(llama_dir))
    mixed = write_gguf(llama_dir, tmp_path / "m.gguf", "llama", tokenizer=False,
                       types={"q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q8_0})
    with pytest.raises(CheckpointError, match=r"layers.0.attn.qkv fuses .* of different GGUF types \['Q4_0', 'Q8_0'\]"):
        _build(mixed, tmp_path / "d", tokenizer=str(llama_dir), quantization={"method": "import"})
    extra = write_gguf(llama_dir, tmp_path / "x.gguf", "llama", tokenizer=False,
                       extra_tensors={"blk.0.attn_rot_embd": np.ones(8, dtype=np.float32)})
    with pytest.raises(CheckpointError, match=r"tensor\(s\) llmc does not read for llama: \['blk.0.attn_rot_embd'\]"):
        _build(extra, tmp_path / "x", tokenizer=str(llama_dir))
    with pytest.raises(CheckpointError, match="tokenizer: .* has no tokenizer files"):
        _build(mixed, tmp_path / "y", tokenizer=str(tmp_path))
    with pytest.raises(RecipeError, match="tokenizer: applies to a .gguf model"):
        recipe_from_dict({"model": str(llama_dir), "tokenizer": str(llama_dir)})
    with pytest.raises(RecipeError, match="model: file .*missing.gguf' does not exist"):
        recipe_from_dict({"model": "models/missing.gguf"})

