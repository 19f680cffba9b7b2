"""`quantization.method: import` of checkpoints whose lm_head is quantized: GPTQ's `lm_head: true`
(qweight / qzeros / scales / g_idx like every linear) and compressed-tensors config groups that reach
lm_head (pack-quantized int, float-quantized FP8). The oracle does not use llmc's unpackers: each
module's weight is dequantized in float64 here, from the published tensors as the checkpoint stores
them (bit fields read per the formats' own definitions), and transformers runs (in float64) the model
with those weights, lm_head included; for an FP8 head its input is quantized as W8A8 says (per token,
absmax / 448, or the static input_scale). What still cannot be imported is refused in one line."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.import_quantized import _pad_rows
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError
from llmc.quant.formats import QuantizedWeight
from llmc.quant.importers import pack_awq_gemm, pack_gptq, pack_pack_quantized
from llmc.quant.reference import dequantize_weight
from llmc.quant.rtn import rtn_quantize
from llmc.runtime.llm import LLM

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32


def _int_scheme(bits, symmetric, **extra):
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP, **extra}


def _fp8_scheme(static):
    return {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                                  "strategy": "tensor" if static else "token"}}


# kind → (bits, symmetric, act order, which modules are quantized ("all": every linear and lm_head), quantization_config)
KINDS = {
    "gptq-w4-sym": (4, True, False, "all", {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True,
                                            "desc_act": False, "lm_head": True}),
    "gptq-w4-asym-desc-act": (4, False, True, "all", {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                                      "sym": False, "desc_act": True, "lm_head": True}),
    "gptq-w8-sym-v2": (8, True, False, "all", {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "sym": True,
                                               "desc_act": False, "lm_head": True, "checkpoint_format": "gptq_v2"}),
    # targets ["Linear"] with nothing in ignore: lm_head is one of the linears
    "ct-w4-sym": (4, True, False, "all", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                          "ignore": [], "config_groups": {"group_0": {
                                              "targets": ["Linear"], "weights": _int_scheme(4, True)}}}),
    # two groups of one scheme, the second naming lm_head; zero points packed along the output rows
    "ct-w8-asym": (8, False, False, "all", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                            "ignore": [], "config_groups": {
                                                "group_0": {"targets": [r"re:.*self_attn\..*", r"re:.*mlp\..*"],
                                                            "weights": _int_scheme(8, False)},
                                                "group_1": {"targets": ["lm_head"], "weights": _int_scheme(8, False)}}}),
    # FP8 W8A8 on lm_head alone (targets ["lm_head"]): the decoder layers stay dense
    "ct-fp8-dynamic": (8, True, False, "head", {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                "ignore": [], "config_groups": {"group_0": {
                                                    "targets": ["lm_head"], **_fp8_scheme(static=False)}}}),
    "ct-fp8-static": (8, True, False, "head", {"quant_method": "compressed-tensors", "format": "float-quantized",
                                               "ignore": [], "config_groups": {"group_0": {
                                                   "targets": ["lm_head"], **_fp8_scheme(static=True)}}}),
}


def _act_order(weight, bits, symmetric):
    """RTN whose groups follow a random column order, stored as GPTQ's desc_act leaves them (g_idx[i] = the
    group of column i); the order depends only on in_features, so linears sharing an input share it."""
    in_features = weight.shape[1]
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features))
    q = rtn_quantize(weight[:, order], bits, GROUP, symmetric, scale_dtype=torch.float16)
    levels = torch.empty_like(q.qweight)
    levels[:, order] = q.qweight
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // GROUP
    return QuantizedWeight(levels, q.scales, q.zeros, bits, GROUP, g_idx)


def _fp8_tensors(weight, static, gen):
    scale = weight.abs().amax(dim=1, keepdim=True) / 448.0  # E4M3's largest finite value
    tensors = {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    if static:
        tensors["input_scale"] = torch.rand(1, generator=gen) * 0.02 + 0.02
    return tensors


def _write_checkpoint(source, dest, kind, tie=False):
    """`source` quantized by RTN and written in the kind's published layout, lm_head included; returns the
    quantized modules' names."""
    bits, symmetric, act_order, which, qconfig = KINDS[kind]
    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    names = ["lm_head.weight"] + ([n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]
                                  if which == "all" else [])
    for name in names:
        module, weight = name.removesuffix(".weight"), tensors.pop(name)
        if qconfig.get("format") == "float-quantized":
            packed = _fp8_tensors(weight, "static" in kind, gen)
        elif act_order:
            packed = pack_gptq(_act_order(weight, bits, symmetric), is_v1=True)
        elif qconfig["quant_method"] == "gptq":
            q = rtn_quantize(weight, bits, GROUP, symmetric, scale_dtype=torch.float16)
            packed = pack_gptq(q, is_v1=qconfig.get("checkpoint_format") != "gptq_v2")
        else:
            packed = pack_pack_quantized(rtn_quantize(weight, bits, GROUP, symmetric, scale_dtype=torch.bfloat16))
        tensors |= {f"{module}.{k}": v for k, v in packed.items()}
    save_file(tensors, dest / "model.safetensors")
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig,
                                                  **({"tie_word_embeddings": True} if tie else {})}))
    return [n.removesuffix(".weight") for n in names]


# ---- the reference: the published layouts read in float64, without llmc's unpackers ----------------


def _field(words, slot, bits):
    """The unsigned `bits`-bit field number `slot` (little end first) of each int32 word."""
    return (words.to(torch.int64) & 0xFFFFFFFF) >> (bits * slot) & (2**bits - 1)


def _gptq_weight(t, bits, group_size, is_v1):
    """AutoGPTQ / GPTQModel: qweight [in*bits/32, out], input i in word i // (32/bits), field i % (32/bits);
    qzeros [G, out*bits/32] packed the same way along the output; v1 stores zero - 1; w = (q - z) * s."""
    per = 32 // bits
    num_in = t["qweight"].shape[0] * per
    i = torch.arange(num_in)
    levels = _field(t["qweight"][i // per], (i % per)[:, None], bits).double()  # [in, out]
    o = torch.arange(t["scales"].shape[1])
    stored = _field(t["qzeros"][:, o // per], o % per, bits)  # [G, out]
    zeros = ((stored + 1) % 2**bits if is_v1 else stored).double()  # [G, out]
    g_idx = t["g_idx"].long() if "g_idx" in t else i // group_size
    return ((levels - zeros[g_idx]) * t["scales"].double()[g_idx]).T  # [out, in]


def _pack_quantized_weight(t, bits, group_size):
    """compressed-tensors pack-quantized: weight_packed [out, ceil(in/(32/bits))], input i in word i // (32/bits),
    field i % (32/bits), the signed level + 2**(bits-1); weight_zero_point (if any) packed the same way along the
    OUTPUT rows; w = (q - zp) * scale[:, group of i]."""
    per, offset = 32 // bits, 2 ** (bits - 1)
    num_out, num_in = t["weight_shape"].tolist()
    i, o = torch.arange(num_in), torch.arange(num_out)
    signed = _field(t["weight_packed"][:, i // per], i % per, bits).double() - offset  # [out, in]
    g_idx = t["weight_g_idx"].long() if "weight_g_idx" in t else i // group_size
    zp = t.get("weight_zero_point")
    zero = torch.zeros(num_out, 1, dtype=torch.float64) if zp is None else \
        (_field(zp[o // per], (o % per)[:, None], bits).double() - offset)[:, g_idx]
    return (signed - zero) * t["weight_scale"].double()[:, g_idx]


def _reference_weights(ckpt, kind, modules):
    bits, _, _, _, qconfig = KINDS[kind]
    tensors = load_file(ckpt / "model.safetensors")
    out = {}
    for module in modules:
        t = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        if "weight_packed" in t:
            out[module] = _pack_quantized_weight(t, bits, GROUP)
        elif "qweight" in t:
            out[module] = _gptq_weight(t, bits, GROUP, qconfig.get("checkpoint_format") != "gptq_v2")
        else:
            out[module] = t["weight"].double() * t["weight_scale"].double().reshape(-1, 1)
    return out, tensors


def _fp8_input(x, input_scale):
    """W8A8's activation: per token, scale absmax / 448 (llmc's floor on it for an all-zero row), or static."""
    x = x.float()
    if input_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=torch.finfo(torch.float32).tiny * 2**10)
    else:
        scale = input_scale.float()
    return ((x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double() * scale.double())


@pytest.mark.parametrize("kind", list(KINDS))
def test_quantized_lm_head_imports_as_transformers_runs_its_dequantized_weights(kind, tiny_llama, tmp_path, hf_model,
                                                                                hf_encode):
    ckpt, out = tmp_path / "ckpt", tmp_path / "artifact"
    modules = _write_checkpoint(tiny_llama, ckpt, kind)
    build(recipe_from_dict({"model": str(ckpt), "output": str(out), "dtype": "float32", "target": {"device": "cpu"},
                            "quantization": {"method": "import"}}), show_progress=False)
    formats = json.loads((out / "manifest.json").read_text())["quant"]["modules"]
    bits, symmetric, act_order, which, _ = KINDS[kind]
    expected_format = "w8a8-fp8" if "fp8" in kind else f"w{bits}a16"
    assert formats["lm_head"]["format"] == expected_format
    if expected_format != "w8a8-fp8":
        assert (formats["lm_head"]["symmetric"], formats["lm_head"]["has_g_idx"]) == (symmetric, act_order)
    assert formats["layers.0.attn.qkv"]["format"] == (expected_format if which == "all" else "dense")

    weights, stored = _reference_weights(ckpt, kind, modules)
    oracle = copy.deepcopy(hf_model(tiny_llama)).double()
    with torch.no_grad():
        for module, weight in weights.items():
            oracle.get_submodule(module).weight.copy_(weight)
        if "fp8" in kind:
            input_scale = stored.get("lm_head.input_scale")
            oracle.lm_head.register_forward_pre_hook(lambda _, args: (_fp8_input(args[0], input_scale),))
        token_ids = hf_encode(tiny_llama, "The quick brown fox") + list(range(50, 80))
        expected = oracle(torch.tensor([token_ids])).logits[0]
    ours = LLM(out, device="cpu").engine.score(token_ids)
    torch.testing.assert_close(ours.double(), expected, atol=2e-4, rtol=2e-4)


def test_a_cuda_build_of_a_desc_act_head_computes_the_cpu_builds_model(tiny_llama, tmp_path):
    """The cuda target packs the act-order head for the W4A16 kernel (columns permuted into groups, `perm`
    kept); loaded on the CPU, it computes what the plain layout computes."""
    _write_checkpoint(tiny_llama, tmp_path / "ckpt", "gptq-w4-asym-desc-act")
    scores = {}
    for device in ("cuda", "cpu"):
        build(recipe_from_dict({"model": str(tmp_path / "ckpt"), "output": str(tmp_path / device), "dtype": "float32",
                                "target": {"device": device}, "quantization": {"method": "import"}}), show_progress=False)
        head = json.loads((tmp_path / device / "manifest.json").read_text())["quant"]["modules"]["lm_head"]
        assert head.get("layout", "plain") == ("gpu" if device == "cuda" else "plain") and head["has_g_idx"]
        scores[device] = LLM(tmp_path / device, device="cpu").engine.score(list(range(5, 69)))
    torch.testing.assert_close(scores["cuda"], scores["cpu"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gptq-w4-asym-desc-act", "ct-fp8-static"])
def test_padded_head_rows_weigh_zero(kind):
    """Vocabulary rows added for the ranks' split (vocab not divisible by parallel.tensor) weigh exactly 0."""
    weight = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    if "fp8" in kind:
        tensors = _fp8_tensors(weight, True, torch.Generator().manual_seed(0))
        q = QuantizedWeight(tensors["weight"], tensors["weight_scale"], None, 8, -1, input_scale=tensors["input_scale"])
    else:
        q = _act_order(weight, 4, False)
    padded = _pad_rows(q, 12)
    assert padded.out_features == 12 and padded.input_scale is q.input_scale
    assert torch.equal(dequantize_weight(padded)[:10], dequantize_weight(q))
    assert torch.equal(dequantize_weight(padded)[10:], torch.zeros(2, 64))


def _refused(ckpt, tmp_path, match):
    out = tmp_path / "o"
    with pytest.raises(CheckpointError, match=match) as info:
        build(recipe_from_dict({"model": str(ckpt), "output": str(out), "target": {"device": "cpu"},
                                "quantization": {"method": "import"}}), show_progress=False)
    assert "\n" not in str(info.value) and not out.exists()


def test_a_quantized_tied_head_is_refused(tiny_llama, tmp_path):
    _write_checkpoint(tiny_llama, tmp_path / "ckpt", "gptq-w4-sym", tie=True)
    _refused(tmp_path / "ckpt", tmp_path, r"lm_head is quantized \(lm_head\.g_idx, lm_head\.qweight.*tie_word_embeddings")


def test_a_head_the_config_calls_dense_but_is_stored_quantized_is_refused(tiny_llama, tmp_path):
    ckpt = tmp_path / "ckpt"
    _write_checkpoint(tiny_llama, ckpt, "gptq-w4-sym")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["lm_head"] = False
    (ckpt / "config.json").write_text(json.dumps(config))
    _refused(ckpt, tmp_path, r"lm_head is quantized .*quantization_config leaves it dense")


def test_an_awq_checkpoint_with_a_quantized_head_is_refused(tiny_llama, tmp_path):
    """AutoAWQ never quantizes lm_head (it is always in its modules_to_not_convert): a packed head is refused."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS + ("lm_head",)]:
        q = rtn_quantize(tensors.pop(name), 4, GROUP, False, scale_dtype=torch.float16)
        tensors |= {f"{name.removesuffix('.weight')}.{k}": v for k, v in pack_awq_gemm(q).items()}
    save_file(tensors, ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    (ckpt / "config.json").write_text(json.dumps(config))
    _refused(ckpt, tmp_path, r"lm_head is quantized .*quantization_config leaves it dense")


def test_a_head_the_config_calls_quantized_but_is_stored_dense_is_refused(tiny_llama, tmp_path):
    ckpt = tmp_path / "ckpt"
    _write_checkpoint(tiny_llama, ckpt, "ct-fp8-dynamic")
    tensors = load_file(ckpt / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}
    tensors["lm_head.weight"] = load_file(tiny_llama / "model.safetensors")["lm_head.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    _refused(ckpt, tmp_path, r"quantization_config says lm_head is quantized .*holds lm_head\.weight \(dense\)")


@pytest.mark.parametrize("kind", ["ct-w8-asym", "ct-fp8-static"])  # (desc_act's o/down groups cannot split)
def test_tensor_parallel_ranks_hold_their_vocabulary_rows_of_the_head(kind, tiny_llama, tmp_path):
    """parallel.tensor 2: each rank's lm_head is its half of the vocabulary rows of the one-rank artifact's
    (per-row tensors split, a static input_scale whole)."""
    _write_checkpoint(tiny_llama, tmp_path / "ckpt", kind)
    heads = {}
    for tensor in (1, 2):
        out = tmp_path / f"tp{tensor}"
        build(recipe_from_dict({"model": str(tmp_path / "ckpt"), "output": str(out), "dtype": "float32",
                                "target": {"device": "cpu"}, "parallel": {"tensor": tensor},
                                "quantization": {"method": "import"}}), show_progress=False)
        heads[tensor] = [{k: v for k, v in load_file(out / f"rank-{r:02d}" / "weights.safetensors").items()
                          if k.startswith("lm_head.")} for r in range(tensor)]
    whole = heads[1][0]
    assert whole and all(shard.keys() == whole.keys() for shard in heads[2])
    assert heads[2][0]["lm_head.weight" if "fp8" in kind else "lm_head.qweight"].shape[0] == 4096 // 2
    for name, tensor in whole.items():
        halves = [shard[name] for shard in heads[2]]
        is_split = halves[0].shape != tensor.shape
        expected = tensor.chunk(2) if is_split else (tensor, tensor)
        assert all(torch.equal(h.view(torch.uint8) if h.dtype == torch.float8_e4m3fn else h,
                               e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e)
                   for h, e in zip(halves, expected)), name


@pytest.mark.parametrize("vocab", [4068, 4092])  # 4068 % 32 = 4: GPTQModel's qzeros width (vocab // 32 * 4) is 508 words
def test_a_gptq_head_whose_vocabulary_fills_no_whole_qzeros_words_is_refused(vocab, tiny_llama, tmp_path):
    """GPTQ packs qzeros along the output rows in int32 words (32 / bits rows a word): a vocabulary that is not a
    multiple of that cannot hold its zero points (GPTQModel writes vocab // 32 * bits words; vLLM refuses such an
    output size). Refused by name, not a torch error from the unpacker."""
    ckpt = tmp_path / "ckpt"
    _write_checkpoint(tiny_llama, ckpt, "gptq-w4-sym")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:vocab].contiguous()
    for name in ("lm_head.qweight", "lm_head.scales"):
        tensors[name] = tensors[name][:, :vocab].contiguous()
    tensors["lm_head.qzeros"] = tensors["lm_head.qzeros"][:, : vocab // 32 * 4].contiguous()
    save_file(tensors, ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    _refused(ckpt, tmp_path, rf"lm_head: out_features {vocab} is not a multiple of 8 .*qzeros")


def test_a_damaged_quantized_head_is_refused_before_any_layer_is_read(tiny_llama, tmp_path, monkeypatch):
    """The head is written last: its tensors are checked (shapes, dtypes, g_idx range) up front, so a damaged
    head fails the build before the decoder layers are unpacked, not after all of them."""
    from llmc.compiler import import_quantized

    ckpt = tmp_path / "ckpt"
    _write_checkpoint(tiny_llama, ckpt, "gptq-w4-asym-desc-act")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["lm_head.g_idx"][0] = 7  # in_features 64, group 32: groups 0..1
    save_file(tensors, ckpt / "model.safetensors")
    layers_read = []
    read_layer = import_quantized.ImportPacker.read_layer
    monkeypatch.setattr(import_quantized.ImportPacker, "read_layer",
                        lambda self, *args: layers_read.append(args[-1]) or read_layer(self, *args))
    _refused(ckpt, tmp_path, r"lm_head\.g_idx holds groups 0\.\.7")
    assert layers_read == []
