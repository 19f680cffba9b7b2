"""Block-scaled FP8 checkpoints (w8a8-fp8-block): import from transformers' / DeepSeek-V3's / Qwen3's `quant_method:
fp8` and from compressed-tensors' FP8_BLOCK, export back to FP8_BLOCK, and every refusal.

The checkpoints are written here by the published definition, independently of llmc: per block of 128 x 128
weights from row 0 and column 0 (the last ones partial), scale = absmax / 448 in float64 (1 for an all-zero block,
as transformers' Fp8Quantize), stored as float32, levels = E4M3(w / scale); transformers' layout names the scale
`weight_scale_inv` (it is the dequantization factor: w = weight * scale_inv of its block), compressed-tensors'
`weight_scale`. The oracle is transformers itself: on a CPU it loads the `quant_method: fp8` checkpoint by
dequantizing each linear (FP8 × its block scale, in float32), and runs with each quantized linear's input rounded
to E4M3 per token and 128 inputs (absmax / 448), as llmc's dynamic block activations are.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, RecipeError
from llmc.quant.formats import make_format
from llmc.quant.import_config import parse_quantization_config
from llmc.quant.reference import dequantize
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_import

BLOCK = (128, 128)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SKIPPED = "model.layers.1.mlp.down_proj"  # left dense by modules_to_not_convert / ignore
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
HF_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
# llm-compressor's FP8_BLOCK preset (compressed_tensors/quantization/quant_scheme.py), as QuantizationArgs saves it
FP8_BLOCK_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "block",
                     "block_structure": [128, 128], "dynamic": False, "actorder": None, "observer": "minmax",
                     "observer_kwargs": {}}
FP8_BLOCK_ACTIVATIONS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 128, "strategy": "group",
                         "block_structure": None, "dynamic": True, "actorder": None, "observer": None,
                         "observer_kwargs": {}}


def quantize_blocks(weight: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 levels [out, in], float32 scales [ceil(out / rows), ceil(in / columns)]) by the published definition."""
    w = weight.double()
    rows, columns = block
    scales = torch.empty(-(-w.shape[0] // rows), -(-w.shape[1] // columns), dtype=torch.float64)
    for a in range(scales.shape[0]):
        for b in range(scales.shape[1]):
            absmax = w[a * rows:(a + 1) * rows, b * columns:(b + 1) * columns].abs().max()
            scales[a, b] = absmax / 448.0 if absmax > 0 else 1.0
    scales = scales.float()
    levels = (w / expand(scales.double(), w.shape, block)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return levels, scales


def expand(scales: torch.Tensor, shape, block=BLOCK) -> torch.Tensor:
    """Block scales → one per weight element."""
    return scales.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def dequantized(levels: torch.Tensor, scales: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """The published dequantization, exact in float64, rounded once to float32."""
    return (levels.double() * expand(scales.double(), levels.shape, block)).float()


def fp8_per_token_group(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x with each token's groups of `group` inputs (the last one partial) rounded to E4M3 at absmax / 448."""
    size = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -size % group)).unflatten(-1, (-1, group))
    scale = padded.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    rounded = (padded / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return rounded.flatten(-2)[..., :size]


def write_fp8_checkpoint(source, dest, layout: str, skip=(SKIPPED,)) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`source` with every decoder linear (and expert) but `skip` quantized in blocks, in `layout` "fp8"
    (transformers: weight_scale_inv, quant_method fp8) or "compressed-tensors" (weight_scale, FP8_BLOCK).
    Returns {HF module: (levels, scales)}."""
    shutil.copytree(source, dest)
    tensors, quantized = {}, {}
    scale_name = "weight_scale_inv" if layout == "fp8" else "weight_scale"
    for name, weight in load_file(source / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in LINEARS and module not in skip:
            quantized[module] = quantize_blocks(weight)
            tensors[name], tensors[f"{module}.{scale_name}"] = quantized[module]
        else:
            tensors[name] = weight
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    if layout == "fp8":
        config["quantization_config"] = {**HF_FP8, **({"modules_to_not_convert": list(skip)} if skip else {})}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", *skip, "re:.*mlp[.]gate$"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": FP8_BLOCK_WEIGHTS,
                                          "input_activations": FP8_BLOCK_ACTIVATIONS, "format": "float-quantized"}}}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return quantized


def artifact_weights(artifact) -> dict[str, torch.Tensor]:
    """The artifact's decoder linears as HF modules' float32 weights (each format's dequantization, fused rows split)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    model, tensors = manifest["model"], load_file(artifact / "rank-00" / "weights.safetensors")
    q, kv, inter = model["num_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"], model["intermediate_size"]
    members = {"attn.qkv": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [q, kv, kv]),
               "attn.o": (["self_attn.o_proj"], None), "mlp.gate_up": (["mlp.gate_proj", "mlp.up_proj"], [inter, inter]),
               "mlp.down": (["mlp.down_proj"], None)}
    out = {}
    for i in range(model["num_layers"]):
        for runtime, (names, sizes) in members.items():
            prefix = f"layers.{i}.{runtime}."
            params = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            if not params:
                continue  # an MoE layer's MLP
            weight = dequantize(make_format(manifest["quant"]["modules"][f"layers.{i}.{runtime}"], torch.float32), params)
            for name, part in zip(names, weight.split(sizes) if sizes else [weight], strict=True):
                out[f"model.layers.{i}.{name}"] = part
    return out


def oracle_of(checkpoint, state: dict | None = None, skip=(SKIPPED,)):
    """transformers' float32 model of `checkpoint` (an fp8 one is dequantized on load), optionally with `state`'s
    weights, each quantized linear's input rounded per token and 128 inputs to E4M3."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    if state is not None:
        model.load_state_dict(state, strict=False)
    for name, module in model.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear) and name not in skip:
            module.register_forward_pre_hook(lambda _, args: (fp8_per_token_group(args[0]),))
    return model.eval()


def check_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Logits [positions, vocab] of two runs that round the same activations to E4M3: they agree to ~1e-5 wherever
    no rounding flips, but float32 sums in another order can flip one activation's rounding (one E4M3 step), which
    moved one position by 0.18 on the dense model here with torch's default threads. So: 90% of the positions to
    1e-4 and every one to 0.5 (without the activations' rounding the oracle differs by ~3: 0.5 still catches a
    scale or a block applied wrongly)."""
    differences = (ours - theirs).abs().amax(dim=-1)
    assert (differences <= 1e-4).float().mean() >= 0.9 and differences.max() <= 0.5, differences


@torch.inference_mode()
def check_llm_against(oracle, artifact, token_ids, prompt_ids, num_tokens=16):
    """Logits over token_ids (check_logits) and greedy tokens equal to the oracle's."""
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=16)
    check_logits(llm.engine.score(token_ids), oracle(torch.tensor([token_ids])).logits[0])
    want = oracle.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                           max_new_tokens=num_tokens, do_sample=False)[0, len(prompt_ids):].tolist()
    got = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=num_tokens))
    assert got[0].outputs[0].token_ids == want


@pytest.fixture(scope="module")
def aligned(tmp_path_factory, hf_checkpoint_factory):
    """Qwen3 with hidden 128, intermediate 256 (whole blocks; k/v 64 rows, one block row each): the float
    checkpoint, its transformers FP8 and compressed-tensors FP8_BLOCK copies, their levels and scales, and the
    imports of both."""
    root = tmp_path_factory.mktemp("fp8_block")
    source = hf_checkpoint_factory(root / "float", "qwen3", hidden_size=128, intermediate_size=256)
    quantized = write_fp8_checkpoint(source, root / "hf_fp8", "fp8")
    assert write_fp8_checkpoint(source, root / "ct_fp8", "compressed-tensors").keys() == quantized.keys()
    return {"source": source, "hf": root / "hf_fp8", "ct": root / "ct_fp8", "quantized": quantized,
            "hf_artifact": build_import(root / "hf_fp8", root / "hf_artifact"),
            "ct_artifact": build_import(root / "ct_fp8", root / "ct_artifact")}


def test_transformers_and_the_import_dequantize_to_the_same_weights(aligned):
    """(a) transformers (accelerate installed, no GPU) loads the quant_method fp8 checkpoint dequantized to float32
    nn.Linear weights; llmc's artifact holds w8a8-fp8-block linears whose dequantized weights are those, bit for
    bit, and the published definition's; the module in modules_to_not_convert and lm_head stay dense."""
    import accelerate  # noqa: F401 - transformers' FP8 loader needs it
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(aligned["hf"]), dtype=torch.float32)
    state = hf.state_dict()
    assert type(hf.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # dequantized, not an FP8Linear
    ours = artifact_weights(aligned["hf_artifact"])
    for module, (levels, scales) in aligned["quantized"].items():
        assert torch.equal(state[module + ".weight"], dequantized(levels, scales)), module
        assert torch.equal(ours[module], state[module + ".weight"]), module
    float_tensors = load_file(aligned["source"] / "model.safetensors")
    assert torch.equal(ours[SKIPPED], float_tensors[SKIPPED + ".weight"])
    modules = json.loads((aligned["hf_artifact"] / "manifest.json").read_text())["quant"]["modules"]
    assert modules["layers.0.attn.qkv"] == {"format": "w8a8-fp8-block", "block_size": [128, 128]}
    assert modules["layers.1.mlp.down"]["format"] == modules["lm_head"]["format"] == "dense"


def test_imported_artifact_runs_as_transformers_with_block_activations(aligned, hf_encode):
    """(a) LLM(artifact) against transformers' dequantized model with each quantized linear's input rounded per
    token and 128 inputs (llmc quantizes the activations too): logits (check_logits), 16 greedy tokens equal."""
    token_ids = hf_encode(aligned["source"], PROMPT) + list(range(100, 120))
    check_llm_against(oracle_of(aligned["hf"]), aligned["hf_artifact"], token_ids, hf_encode(aligned["source"], "ROMEO:"))


def test_compressed_tensors_block_imports_the_same_levels_and_scales(aligned):
    """(b) compressed-tensors FP8_BLOCK (weight_scale, the same blocks) imports to the artifact the transformers
    layout gives: the same formats, every tensor equal bit for bit; the rows of a block repeat its scale."""
    hf, ct = (load_file(aligned[k] / "rank-00" / "weights.safetensors") for k in ("hf_artifact", "ct_artifact"))
    assert hf.keys() == ct.keys()
    for name in hf:
        assert torch.equal(hf[name].view(torch.uint8) if hf[name].dtype == torch.float8_e4m3fn else hf[name],
                           ct[name].view(torch.uint8) if ct[name].dtype == torch.float8_e4m3fn else ct[name]), name
    manifests = [json.loads((aligned[k] / "manifest.json").read_text())["quant"]["modules"]
                 for k in ("hf_artifact", "ct_artifact")]
    assert manifests[0] == manifests[1]
    levels_k, scales_k = aligned["quantized"]["model.layers.0.self_attn.k_proj"]
    qkv_scale = ct["layers.0.attn.qkv.weight_scale"]  # rows: q 128, k 64, v 64
    assert torch.equal(qkv_scale[128:192], scales_k.expand(64, -1))
    assert torch.equal(ct["layers.0.attn.qkv.weight"][128:192].view(torch.uint8), levels_k.view(torch.uint8))


def test_export_gives_back_the_fp8_block_checkpoint_and_imports_to_the_same_tensors(aligned, tmp_path):
    """(c) exporting the import writes compressed-tensors' FP8_BLOCK config and, per HF module, the checkpoint's
    own levels and [ceil(out / 128), ceil(in / 128)] scales; importing the export gives the artifact's tensors."""
    out = tmp_path / "export"
    result = export_artifact(aligned["hf_artifact"], out)
    assert result.format == "float-quantized"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == group["format"] == "float-quantized" and group["targets"] == ["Linear"]
    assert group["weights"] == FP8_BLOCK_WEIGHTS and group["input_activations"] == FP8_BLOCK_ACTIVATIONS
    assert set(qc["ignore"]) == {SKIPPED, "lm_head"}
    exported = load_file(out / "model.safetensors")
    for module, (levels, scales) in aligned["quantized"].items():
        assert torch.equal(exported[module + ".weight"].view(torch.uint8), levels.view(torch.uint8)), module
        assert torch.equal(exported[module + ".weight_scale"], scales), module
    back = build_import(out, tmp_path / "back")
    original, again = (load_file(a / "rank-00" / "weights.safetensors") for a in (aligned["hf_artifact"], back))
    assert original.keys() == again.keys()
    assert all(torch.equal(original[n].view(torch.uint8), again[n].view(torch.uint8)) for n in original)


def test_export_refuses_blocks_that_straddle_fused_members(tmp_path, hf_checkpoint_factory):
    """(d) a build quantizes the fused q/k/v in blocks from its row 0: with q and k 96 rows each, k's rows 0..95 (fused
    rows 96..191) straddle two fused blocks, so k has no [128, 128] block scales to write; the export says so."""
    source = hf_checkpoint_factory(tmp_path / "float", "qwen3", hidden_size=128, intermediate_size=256,
                                   num_attention_heads=3, num_key_value_heads=3)
    artifact = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(source), "output": str(artifact), "dtype": "float32",
                            "quantization": {"method": "fp8", "weights": "block"}}), show_progress=False)
    with pytest.raises(ArtifactError, match=r"k_proj: the rows of one of its \[128, 128\] blocks hold different") as err:
        export_artifact(artifact, tmp_path / "export")
    assert "\n" not in str(err.value) and not (tmp_path / "export").exists()


def test_a_build_in_blocks_exports_and_imports_back_bit_for_bit(aligned, tmp_path):
    """(c) method fp8, weights block: export (FP8_BLOCK) then import gives the build's tensors, bit for bit."""
    artifact = tmp_path / "build"
    build(recipe_from_dict({"model": str(aligned["source"]), "output": str(artifact), "dtype": "float32",
                            "target": {"device": "cpu"}, "quantization": {"method": "fp8", "weights": "block"}}),
          show_progress=False)
    export_artifact(artifact, tmp_path / "export")
    back = build_import(tmp_path / "export", tmp_path / "back")
    original, again = (load_file(a / "rank-00" / "weights.safetensors") for a in (artifact, back))
    assert original.keys() == again.keys()
    assert all(torch.equal(original[n].view(torch.uint8), again[n].view(torch.uint8)) for n in original)


def test_partial_blocks_import_as_published(tmp_path, hf_checkpoint_factory, hf_encode):
    """(a) hidden 160 and intermediate 200: the last row and column blocks are partial (gate/up 200 rows: 128 + 72;
    down 200 inputs: 128 + 72; every 160-input linear: 128 + 32). transformers' dequantization divides the rows
    evenly by the scale rows (200 / 2), so it is not the oracle here: the published definition is, run by
    transformers on those weights with the inputs rounded per token and 128 inputs (the last group 32 or 72)."""
    source = hf_checkpoint_factory(tmp_path / "float", "qwen3", hidden_size=160, intermediate_size=200)
    quantized = write_fp8_checkpoint(source, tmp_path / "fp8", "fp8", skip=())
    artifact = build_import(tmp_path / "fp8", tmp_path / "artifact")
    ours = artifact_weights(artifact)
    state = {}
    for module, (levels, scales) in quantized.items():
        state[module + ".weight"] = dequantized(levels, scales)
        assert torch.equal(ours[module], state[module + ".weight"]), module
    token_ids = hf_encode(source, PROMPT) + list(range(100, 120))
    check_llm_against(oracle_of(source, state, skip=()), artifact, token_ids, hf_encode(source, "ROMEO:"))


def _experts_forward_rounded(experts):
    """transformers' Qwen3MoeExperts loop (one F.linear per expert on its tokens) with each expert linear's input
    rounded per token and 128 inputs, as llmc's w8a8-fp8-block experts run on a CPU."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(experts.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                gate, up = torch.nn.functional.linear(fp8_per_token_group(hidden_states[token]),
                                                      experts.gate_up_proj[e]).chunk(2, dim=-1)
                h = torch.nn.functional.linear(fp8_per_token_group(experts.act_fn(gate) * up), experts.down_proj[e])
                out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out
    return forward


@pytest.mark.parametrize("layout", ["fp8", "compressed-tensors"])
def test_qwen3_moe_block_fp8_experts_import_and_generate(layout, tiny_qwen3_moe, tmp_path, hf_encode):
    """(MoE) a Qwen3-MoE checkpoint with every expert in blocks (one module per expert, the router dense) imports
    with w8a8-fp8-block experts; each expert's dequantized weights are the published definition's and, from the
    quant_method fp8 checkpoint, transformers' (which fuses the experts on load, dequantized); LLM(artifact) runs
    as transformers with the experts' and the linears' inputs rounded per token and 128 inputs (without the
    experts' rounding the logits differ by ~2): logits (check_logits), 16 greedy tokens equal."""
    quantized = write_fp8_checkpoint(tiny_qwen3_moe, tmp_path / "ckpt", layout, skip=())
    artifact = build_import(tmp_path / "ckpt", tmp_path / "artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    if layout == "fp8":
        oracle = oracle_of(tmp_path / "ckpt", skip=())
    else:  # transformers reads compressed-tensors through its own package (not installed): the published weights
        oracle = oracle_of(tiny_qwen3_moe, skip=())
        _, unexpected = oracle.load_state_dict(
            {f"{m}.weight": dequantized(*lq) for m, lq in quantized.items() if ".experts." not in m}, strict=False)
        assert not unexpected  # (the experts, fused by transformers, are set below)
    for i in manifest["model"]["moe_layers"]:
        fmt = make_format(manifest["quant"]["modules"][f"layers.{i}.moe.experts.gate_up"], torch.float32)
        assert fmt.name == "w8a8-fp8-block"
        experts = oracle.model.layers[i].mlp.experts
        for e in range(experts.num_experts):
            prefix = f"model.layers.{i}.mlp.experts.{e}."
            stacked = {p: {k: tensors[f"layers.{i}.moe.experts.{p}.{k}"][e] for k in ("weight", "weight_scale")}
                       for p in ("gate_up", "down")}
            gate_up, down = dequantize(fmt, stacked["gate_up"]), dequantize(fmt, stacked["down"])
            published = [dequantized(*quantized[prefix + p]) for p in ("gate_proj", "up_proj", "down_proj")]
            assert torch.equal(gate_up, torch.cat(published[:2])) and torch.equal(down, published[2])
            if layout == "fp8":
                assert torch.equal(experts.gate_up_proj[e], gate_up) and torch.equal(experts.down_proj[e], down)
            else:
                with torch.no_grad():
                    experts.gate_up_proj[e], experts.down_proj[e] = gate_up, down
        experts.forward = _experts_forward_rounded(experts)
    token_ids = hf_encode(tiny_qwen3_moe, PROMPT) + list(range(100, 120))
    check_llm_against(oracle, artifact, token_ids, hf_encode(tiny_qwen3_moe, "ROMEO:"))


def _ct(weights: dict | None = None, activations: dict | None | bool = True) -> dict:
    """A compressed-tensors FP8_BLOCK quantization_config with fields of its weights / input_activations changed
    (activations None: weight-only)."""
    acts = None if activations is None else {**FP8_BLOCK_ACTIVATIONS, **(activations if isinstance(activations, dict) else {})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**FP8_BLOCK_WEIGHTS, **(weights or {})},
                                          "input_activations": acts}}}


REFUSED_CONFIGS = {
    "ue8m0 scales": ({**HF_FP8, "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'.*powers of two"),
    "e5m2": ({**HF_FP8, "fmt": "e5m2"}, "fmt 'e5m2'.*E4M3"),
    "static with blocks": ({**HF_FP8, "activation_scheme": "static"}, "activation_scheme 'static' with weight_block_size"),
    "unknown activation scheme": ({**HF_FP8, "activation_scheme": "tensorwise"}, "activation_scheme 'tensorwise'"),
    "block not a power of two": ({**HF_FP8, "weight_block_size": [128, 96]}, r"weight_block_size \[128, 96\]"),
    "block below 16": ({**HF_FP8, "weight_block_size": [8, 8]}, r"weight_block_size \[8, 8\]"),
    "block of three sizes": ({**HF_FP8, "weight_block_size": [128, 128, 1]}, r"weight_block_size \[128, 128, 1\]"),
    "fp4 experts": ({**HF_FP8, "expert_dtype": "fp4"}, "expert_dtype 'fp4'"),
    "fp8 embeddings": ({**HF_FP8, "modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
    "ct activation groups not the block's columns": (_ct(activations={"group_size": 64}), "group_size 64"),
    "ct activations per token": (_ct(activations={"strategy": "token", "group_size": None}), "strategy 'token'"),
    "ct static activations": (_ct(activations={"dynamic": False}), "dynamic False"),
    "ct block not a power of two": (_ct({"block_structure": [128, 100]}), r"block_structure \[128, 100\]"),
    "ct weight-only blocks": (_ct(activations=None), "weight-only"),
}


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_what_block_fp8_does_not_compute_is_refused_by_name(case):
    """(d) every quantization_config that changes the numbers w8a8-fp8-block computes: one line naming the field."""
    config, pattern = REFUSED_CONFIGS[case]
    with pytest.raises(CheckpointError, match=pattern) as err:
        parse_quantization_config({"quantization_config": config})
    assert "\n" not in str(err.value)


def test_block_configs_parse_as_published():
    """Qwen3's config, DeepSeek-V3's (no fmt), vLLM's ignored_layers, compressed-tensors' older "RxC" block string:
    w8a8-fp8-block [128, 128]; transformers' skip rule (prefix to a module boundary, or suffix) and lm_head dense."""
    for config in (HF_FP8, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                   _ct({"block_structure": "128x128"})):
        assert parse_quantization_config(config).format_spec() == {"format": "w8a8-fp8-block", "block_size": [128, 128]}
    spec = parse_quantization_config({**HF_FP8, "ignored_layers": ["model.layers.1", "o_proj"]})
    assert spec.is_ignored("model.layers.1.mlp.down_proj") and not spec.is_ignored("model.layers.11.mlp.down_proj")
    assert spec.is_ignored("model.layers.3.self_attn.o_proj") and spec.is_ignored("lm_head")
    assert not spec.is_ignored("model.layers.3.self_attn.q_proj")


@pytest.mark.parametrize("damage, pattern", [
    ("scale shape", r"gate_proj.weight_scale_inv has shape \[1, 1\], expected \[2, 1\]"),
    ("no scale", r"up_proj lacks \['weight_scale_inv'\]"),
    ("bf16 weight", "float8_e4m3fn"),
    ("nan scale", "inf or NaN"),
])
def test_damaged_block_tensors_are_one_error_line(damage, pattern, aligned, tmp_path):
    """(d) a block scale of the wrong shape, a missing one, a weight not in FP8, a NaN scale: one line."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(aligned["hf"], ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    layer = "model.layers.0.mlp."
    if damage == "scale shape":
        tensors[layer + "gate_proj.weight_scale_inv"] = tensors[layer + "gate_proj.weight_scale_inv"][:1]
    elif damage == "no scale":
        del tensors[layer + "up_proj.weight_scale_inv"]
    elif damage == "bf16 weight":
        tensors[layer + "down_proj.weight"] = tensors[layer + "down_proj.weight"].to(torch.bfloat16)
    else:
        tensors[layer + "down_proj.weight_scale_inv"][0, 1] = float("nan")
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=pattern) as err:
        build_import(ckpt, tmp_path / "artifact")
    assert "\n" not in str(err.value) and not (tmp_path / "artifact").exists()


@pytest.mark.parametrize("names", ["vllm", "transformers"])
def test_per_tensor_fp8_imports_as_w8a8_fp8(names, aligned, tmp_path):
    """quant_method fp8 without weight_block_size (vLLM's per-tensor FP8, activation_scheme static): each linear's
    scalar weight scale expands to its rows (w8a8-fp8 per channel, fused q/k/v keep their own), the static input
    scales of fused members take their max. transformers' names (weight_scale_inv, activation_scale) read alike."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(aligned["source"], ckpt)
    scale_name, input_name = ("weight_scale", "input_scale") if names == "vllm" else ("weight_scale_inv", "activation_scale")
    tensors, stored = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name, weight in load_file(aligned["source"] / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in LINEARS:
            tensors[name] = weight
            continue
        scale = (weight.double().abs().max() / 448.0).float()
        stored[module] = ((weight.double() / scale.double()).to(torch.float8_e4m3fn), scale, torch.rand((), generator=gen))
        tensors |= {name: stored[module][0], f"{module}.{scale_name}": scale, f"{module}.{input_name}": stored[module][2]}
    save_file(tensors, ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (ckpt / "config.json").write_text(json.dumps(config))
    artifact = build_import(ckpt, tmp_path / "artifact")
    modules = json.loads((artifact / "manifest.json").read_text())["quant"]["modules"]
    assert modules["layers.0.attn.qkv"] == {"format": "w8a8-fp8", "is_per_channel": True, "is_static_input": True}
    weights = load_file(artifact / "rank-00" / "weights.safetensors")
    members = [stored[f"model.layers.0.self_attn.{m}_proj"] for m in "qkv"]
    assert torch.equal(weights["layers.0.attn.qkv.weight"].view(torch.uint8),
                       torch.cat([w for w, _, _ in members]).view(torch.uint8))
    rows = torch.cat([s.expand(w.shape[0]) for w, s, _ in members])
    assert torch.equal(weights["layers.0.attn.qkv.weight_scale"].reshape(-1), rows)
    assert torch.equal(weights["layers.0.attn.qkv.input_scale"].reshape(()), max(i for _, _, i in members))


@pytest.mark.parametrize("checkpoint", ["hf", "ct"])
def test_a_float_build_of_an_fp8_checkpoint_is_refused(checkpoint, aligned, tmp_path):
    """(d) method rtn (or none, fp8, ...) reads `.weight` as float weights: of an FP8 checkpoint those are E4M3
    levels without their scales, so the build refuses and names method import."""
    with pytest.raises(CheckpointError, match="the checkpoint is quantized .* build it with quantization.method: import"):
        build(recipe_from_dict({"model": str(aligned[checkpoint]), "output": str(tmp_path / "a"),
                                "quantization": {"method": "rtn", "bits": 8}}), show_progress=False)


@pytest.mark.parametrize("layout", ["fp8", "compressed-tensors"])
def test_a_block_quantized_lm_head(layout, aligned, tmp_path):
    """compressed-tensors' targets may reach lm_head (ignore without it): it imports in blocks, its scales
    expanded to rows; quant_method fp8 reads lm_head dense (transformers skips it, vLLM never quantizes it), so a
    checkpoint that stores it quantized is refused in one line."""
    ckpt = tmp_path / "ckpt"
    write_fp8_checkpoint(aligned["source"], ckpt, layout, skip=())
    tensors = load_file(ckpt / "model.safetensors")
    levels, scales = quantize_blocks(tensors["lm_head.weight"])
    tensors |= {"lm_head.weight": levels, "lm_head.weight_scale" + ("_inv" if layout == "fp8" else ""): scales}
    save_file(tensors, ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    if layout == "fp8":
        with pytest.raises(CheckpointError, match="lm_head is quantized .* quant_method fp8, whose lm_head llmc reads dense"):
            build_import(ckpt, tmp_path / "artifact")
        return
    config["quantization_config"]["ignore"] = ["re:.*mlp[.]gate$"]
    (ckpt / "config.json").write_text(json.dumps(config))
    artifact = build_import(ckpt, tmp_path / "artifact")
    assert json.loads((artifact / "manifest.json").read_text())["quant"]["modules"]["lm_head"]["format"] == "w8a8-fp8-block"
    weights = load_file(artifact / "rank-00" / "weights.safetensors")
    assert torch.equal(weights["lm_head.weight"].view(torch.uint8), levels.view(torch.uint8))
    assert torch.equal(weights["lm_head.weight_scale"], scales.repeat_interleave(128, 0))
    assert LLM(artifact, device="cpu").generate("ROMEO:", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids


def test_tensor_parallel_splits_whole_column_groups(tmp_path, hf_checkpoint_factory, hf_encode):
    """Row-parallel o and down take their scales' column groups with their columns: an import at tensor 2 (o and
    down 256 inputs: 128 a rank) gives tensor 1's greedy tokens and logits (check_logits: the ranks' partial sums add in
    another order); at hidden 128 a rank would get half a group, which the plan refuses by name."""
    source = hf_checkpoint_factory(tmp_path / "float", "qwen3", hidden_size=256, intermediate_size=256, head_dim=64)
    write_fp8_checkpoint(source, tmp_path / "fp8", "fp8", skip=())
    artifacts = [build_import(tmp_path / "fp8", tmp_path / f"tp{tp}", parallel={"tensor": tp}) for tp in (1, 2)]
    token_ids = hf_encode(source, PROMPT) + list(range(100, 110))
    engine = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}
    greedy = SamplingParams(temperature=0, max_tokens=8)
    results = []
    for artifact in artifacts:
        with LLM(artifact, **engine) as llm:
            results.append((llm.engine.score(token_ids), llm.generate(["ROMEO:"], greedy)[0].outputs[0].token_ids))
    check_logits(results[1][0], results[0][0])
    assert results[1][1] == results[0][1]
    narrow = hf_checkpoint_factory(tmp_path / "narrow", "qwen3", hidden_size=128, intermediate_size=256)
    write_fp8_checkpoint(narrow, tmp_path / "narrow_fp8", "fp8", skip=())
    with pytest.raises(RecipeError, match="would cut the quantization groups of layers.0.attn.o .* group_size 128"):
        build_import(tmp_path / "narrow_fp8", tmp_path / "narrow_tp2", parallel={"tensor": 2})
