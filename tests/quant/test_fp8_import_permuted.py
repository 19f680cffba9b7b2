"""FP8 checkpoints of a family whose q/k rows the build permutes into the runtime's rotary layout (GLM-4.5 MoE:
hf_checkpoint.rotary_fold), imported: transformers' block FP8 (`quant_method: fp8`, weight_scale_inv) in 128 x
128 blocks and in 16 x 16 blocks, whose rows the permutation moves across blocks (w8a8-fp8-block keeps one scale per
row, so the scales move with them), and compressed-tensors' per-channel FP8 with dynamic per-token activations.

The checkpoints are written here by the published definitions, independently of llmc (test_fp8_block_import's
quantize_blocks: absmax / 448 per block; per channel: absmax / 448 per output row), every decoder linear, shared expert,
expert and the MTP layer's quantized, the router dense (as zai-org's FP8 releases leave mlp.gate). The oracle is
transformers' Glm4MoeForCausalLM in float32 holding the checkpoint's dequantized weights (the FP8 values x their
scales), each quantized linear's and expert's input rounded to E4M3 as llmc's dynamic activations are. Integer and
GGUF imports of the family are refused by name. GLM-4, Cohere 2 and ERNIE 4.5 (interleaved rotary pairs:
hf_checkpoint.rotary_fold) import the same way, checked in 16 x 16 blocks; MiniMax-M2 (GLM-4.5's permutation under
q/k norms over the whole projections, its experts Mixtral's w1 / w3 / w2) in 128 x 128 and 16 x 16 blocks.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.hf_checkpoint import partial_rotary_permutation
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError
from llmc.runtime.artifact import MTP_WEIGHTS
from tests.conftest import make_hf_checkpoint
from tests.quant.test_fp8_block_import import check_llm_against, dequantized, fp8_per_token_group, quantize_blocks
from tests.runtime.hf_oracle import build_float32, build_import
from tests.runtime.test_glm4_moe import _random_score_bias

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
           "w1", "w3", "w2")  # (MiniMax-M2's experts: Mixtral's names)
PROMPT = "What light through yonder window breaks? It is the east"
CHANNEL_FP8 = {  # llm-compressor's FP8_DYNAMIC preset as QuantizationArgs saves it
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*mlp[.]gate$"],
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                  "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                              "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                        "strategy": "token", "dynamic": True}}}}


def quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 levels [out, in], float32 scales [out, 1]): absmax / 448 per output row, in float64."""
    w = weight.double()
    scales = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12).float()
    return (w / scales.double()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scales


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny GLM-4.5 (q/k norms, partial rotary over 16 of 32 dims, an MTP layer) in float32."""
    checkpoint = make_hf_checkpoint(tmp_path_factory.mktemp("glm4_moe_fp8") / "float", "glm4_moe")
    _random_score_bias(checkpoint, mtp=True)
    return checkpoint


def write_checkpoint(source, dest, kind: str) -> dict[str, torch.Tensor]:
    """`source` with every linear of the decoder layers and the MTP layer in FP8 by `kind` ("block128", "block16":
    quant_method fp8 with that block; "channel": compressed-tensors per channel). Returns {HF module: its weight
    dequantized by the published definition (float32)}."""
    shutil.copytree(source, dest)
    block = {"block128": (128, 128), "block16": (16, 16)}.get(kind)
    tensors, weights = {}, {}
    for name, weight in load_file(source / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in LINEARS or not name.endswith(".weight"):
            tensors[name] = weight
            continue
        if block:
            levels, scales = quantize_blocks(weight, block)
            tensors[name], tensors[f"{module}.weight_scale_inv"] = levels, scales
            weights[module] = dequantized(levels, scales, block)
        else:
            levels, scales = quantize_channels(weight)
            tensors[name], tensors[f"{module}.weight_scale"] = levels, scales
            weights[module] = (levels.double() * scales.double()).float()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = CHANNEL_FP8 if not block else {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return weights


def oracle(source, weights: dict[str, torch.Tensor], group: int | None,
           experts_names: tuple[str, str, str, str] = ("mlp.experts", "gate_proj", "up_proj", "down_proj")):
    """transformers' float32 model of `source` holding `weights` (the experts' fused as transformers stores them; in
    the checkpoint under `experts_names`: their module, gate, up, down), each quantized linear's and expert's input
    rounded to E4M3 per token and `group` inputs (None: the whole row)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager").eval()
    layers = len(model.model.layers)
    dense = {f"{m}.weight": w for m, w in weights.items() if ".experts." not in m and int(m.split(".")[2]) < layers}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected

    def rounded(x):
        return fp8_per_token_group(x, group or x.shape[-1])
    for name, module in model.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (rounded(args[0]),))
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        with torch.no_grad():
            for e in range(experts.num_experts):
                p = f"model.layers.{i}.{experts_names[0]}.{e}."
                experts.gate_up_proj[e] = torch.cat([weights[p + experts_names[1]], weights[p + experts_names[2]]])
                experts.down_proj[e] = weights[p + experts_names[3]]
        experts.forward = _experts_rounded(experts, rounded)
    return model


def _experts_rounded(experts, rounded):
    """transformers' expert loop (one F.linear per expert on its tokens) with each expert linear's input rounded."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(experts.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                gate, up = torch.nn.functional.linear(rounded(hidden_states[token]), experts.gate_up_proj[e]).chunk(2, -1)
                h = torch.nn.functional.linear(rounded(experts.act_fn(gate) * up), experts.down_proj[e])
                out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out
    return forward


def test_block16_permutation_moves_rows_across_blocks():
    """The 16 x 16 case is the one a block layout could not take: GLM-4.5's permutation of a head of 32 rows with 16
    rotary dims sends rows 8..15 to 16..23, out of their 16-row block (so the import must move per-row scales)."""
    perm = partial_rotary_permutation(32, 16)
    assert (perm // 16 != torch.arange(32) // 16).any()
    assert (perm // 128 == torch.arange(32) // 128).all()  # one 128-row block holds whole heads: nothing crosses


@pytest.mark.parametrize("kind", ["block128", "block16", "channel"])
def test_fp8_glm4_moe_imports_and_runs_as_transformers(kind, source, tmp_path, hf_encode, caplog):
    """The import's logits over 46 positions (90% to 1e-4, all to 0.5: test_fp8_block_import.check_logits) and 16
    greedy tokens equal to transformers' on the dequantized weights; the linears kept in the checkpoint's FP8 format (lm_head
    dense); the MTP layer written dense, equal to a float build's of the checkpoint holding the dequantized weights
    (its q/k rows dequantized, then permuted as the float path permutes them), said in the log."""
    weights = write_checkpoint(source, tmp_path / "ckpt", kind)
    with caplog.at_level("INFO", logger="llmc"):
        artifact = build_import(tmp_path / "ckpt", tmp_path / "artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    formats = {name: m["format"] for name, m in manifest["quant"]["modules"].items()}
    assert formats.pop("lm_head") == "dense"
    assert set(formats.values()) == {"w8a8-fp8" if kind == "channel" else "w8a8-fp8-block"}, formats
    assert manifest["mtp"]["layer_index"] == 3 and "multi-token prediction layer is FP8" in caplog.text
    shutil.copytree(source, tmp_path / "dense")
    save_file(load_file(source / "model.safetensors") | {f"{m}.weight": w for m, w in weights.items()},
              tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    mtp = load_file(artifact / MTP_WEIGHTS)
    dense = load_file(build_float32(tmp_path / "dense", tmp_path / "dense-art") / MTP_WEIGHTS)
    assert mtp.keys() == dense.keys() and all(torch.equal(mtp[name], dense[name]) for name in mtp)
    group = {"block128": 128, "block16": 16}.get(kind)
    token_ids = hf_encode(source, PROMPT) + list(range(100, 126))
    check_llm_against(oracle(source, weights, group), artifact, token_ids, hf_encode(source, "ROMEO:"))


@pytest.mark.parametrize("family", ["glm4", "cohere2", "ernie4_5"])
def test_interleaved_rotary_families_import_block_fp8(family, tmp_path, hf_encode):
    """GLM-4, Cohere 2, ERNIE 4.5 (each head's interleaved pairs moved to the rotate-half layout: rows cross 16-row
    blocks) in 16 x 16 blocks: logits and 16 greedy tokens as transformers' on the dequantized weights."""
    source = make_hf_checkpoint(tmp_path / "float", family)
    weights = write_checkpoint(source, tmp_path / "ckpt", "block16")
    artifact = build_import(tmp_path / "ckpt", tmp_path / "artifact")
    token_ids = hf_encode(source, PROMPT) + list(range(100, 126))
    check_llm_against(oracle(source, weights, 16), artifact, token_ids, hf_encode(source, "ROMEO:"))


@pytest.mark.parametrize("kind", ["block128", "block16"])
def test_fp8_minimax_m2_imports_and_runs_as_transformers(kind, tmp_path, hf_encode, caplog):
    """MiniMax-M2 (partial rotary over 16 of 32 dims: rows cross 16-row blocks; q/k norms over the whole projections,
    permuted with the rows; a random e_score_correction_bias beside the dense router) in transformers' block FP8, with
    an MTP module as vLLM finds MiniMax's (num_mtp_modules, layer num_hidden_layers: here a copy of layer 1, in FP8
    too), which the build leaves out and says so: every linear and expert kept in w8a8-fp8-block (lm_head dense);
    logits and 16 greedy tokens as transformers' on the dequantized weights."""
    source = make_hf_checkpoint(tmp_path / "float", "minimax_m2")
    _random_score_bias(source, mtp=False)
    tensors = load_file(source / "model.safetensors")
    mtp = {n.replace(".layers.1.", ".layers.2."): t.clone() for n, t in tensors.items() if ".layers.1." in n}
    save_file(tensors | mtp, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_mtp_modules": 1, "use_mtp": True}, indent=2))
    weights = write_checkpoint(source, tmp_path / "ckpt", kind)
    assert "model.layers.2.self_attn.q_proj" in weights
    assert any(".block_sparse_moe.experts.7.w2" in m for m in weights) and not any(".gate" in m for m in weights)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())  # the published quantization_config's keys
    config["quantization_config"] |= {"fmt": "float8_e4m3fn",
                                      "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config, indent=2))
    with caplog.at_level("INFO", logger="llmc"):
        artifact = build_import(tmp_path / "ckpt", tmp_path / "artifact")
    assert "1 multi-token-prediction modules (num_mtp_modules) are not built" in caplog.text
    formats = {name: m["format"] for name, m in json.loads((artifact / "manifest.json").read_text())[
        "quant"]["modules"].items()}
    assert formats.pop("lm_head") == "dense" and set(formats.values()) == {"w8a8-fp8-block"}, formats
    token_ids = hf_encode(source, PROMPT) + list(range(100, 126))
    model = oracle(source, weights, {"block128": 128, "block16": 16}[kind],
                   ("block_sparse_moe.experts", "w1", "w3", "w2"))
    check_llm_against(model, artifact, token_ids, hf_encode(source, "ROMEO:"))


@pytest.mark.parametrize("qc", [
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
], ids=["gptq", "awq"])
def test_integer_imports_of_the_family_are_refused_by_name(qc, source, tmp_path):
    """Packed integer levels do not take the row permutation: one line naming the format and the architecture."""
    shutil.copytree(source, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    recipe = recipe_from_dict({"model": str(tmp_path / "ckpt"), "output": str(tmp_path / "out"), "dtype": "float32",
                               "target": {"device": "cpu"}, "quantization": {"method": "import"}})
    with pytest.raises(CheckpointError, match=f"import is not supported for Glm4MoeForCausalLM from {qc['quant_method']} "
                                              ".*: the build permutes q_proj's and k_proj's rows"):
        build(recipe)
