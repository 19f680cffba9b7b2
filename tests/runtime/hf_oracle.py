"""What the tests of the families checked against transformers share (Gemma 2, Gemma 3, Granite): a float32
build of a tiny checkpoint, a changed copy of one, and transformers' own model run on an artifact's weights
(the oracle of the quantized builds), with what the build folded into them unfolded."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.hf_checkpoint import read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.models import spec_for_family
from tests.conftest import fp8_per_token, fp8_per_token_group, honour_swiglu_config, int8_per_token


def build_float32(checkpoint, out, **recipe):
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 256}, **recipe}), show_progress=False)
    return out


def float32_artifacts(checkpoints: dict, root):
    """family → the float32 artifact of checkpoints[family] under root, built on first use (a module fixture's)."""
    built = {}

    def artifact(family):
        if family not in built:
            built[family] = build_float32(checkpoints[family], root / family)
        return built[family]
    return artifact


def artifact_fixture(name: str):
    """A module fixture `artifact`: the float32 artifact of the module's `checkpoint` fixture, built in a folder named
    after `name`."""
    @pytest.fixture(scope="module")
    def artifact(checkpoint, tmp_path_factory):
        return build_float32(checkpoint, tmp_path_factory.mktemp(f"{name}_artifacts") / name)
    return artifact


def family_fixtures(name: str, family: str, **config_changes):
    """Module fixtures (`checkpoint`, `artifact`): `family`'s tiny random checkpoint (tests.conftest.make_hf_checkpoint,
    its config changed by `config_changes`) in a folder named `name`, and its float32 artifact; a test module binds
    them by name: `checkpoint, artifact = family_fixtures("lfm2", "lfm2")`."""
    from tests.conftest import make_hf_checkpoint

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory):
        return make_hf_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", family, **config_changes)
    return checkpoint, artifact_fixture(name)


def build_import(checkpoint, out, **recipe):
    """A float32 CPU build of a pre-quantized checkpoint with `quantization.method: import`."""
    return build_float32(checkpoint, out, target={"device": "cpu"}, quantization={"method": "import"}, **recipe)


def write_config(source, dest, **changes):
    """A copy of checkpoint `source` in `dest` with its config.json keys changed."""
    shutil.copytree(source, dest)
    config = {**read_hf_config(source), **changes}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def hf_state_of(artifact, hf_config: dict | None = None, linears: dict | None = None) -> dict[str, torch.Tensor]:
    """The artifact's weights as its transformers model's state dict (Gemma2ForCausalLM, Gemma3ForCausalLM,
    GraniteForCausalLM, GraniteMoeHybridForCausalLM and BambaForCausalLM with their Mamba-2 layers' dense tensors,
    Lfm2ForCausalLM with its conv layers', Lfm2MoeForCausalLM with its router and stacked experts, OlmoHybridForCausalLM
    with its DeltaNet layers' (Llama's norms in them: pre_norm_layers); the q/k rows as the
    artifact holds them, a permuted rotary not undone): each linear dequantized
    by the formats' oracle (quant/reference.py) and split into its HF members, each (1 + w) norm unfolded to w (the
    family's layer norms, and q/k norms where it has them), and Granite's folds (hf_checkpoint.multiplier_fold)
    unfolded with `hf_config`'s multipliers: o_proj, down_proj (and mamba.out_proj) divided by residual_multiplier,
    the final norm times logits_scaling. `linears`, where given, gets {HF module: artifact module} of every decoder
    linear that holds an artifact linear's rows. Granite 4.0's experts stacked as transformers holds them (their
    down and the shared expert's unfolded too). NemotronHForCausalLM: its linears under `mixer` by the spec's names,
    its embeddings and norm_f, its moe blocks' router, score bias and stacked experts (up_proj, down_proj). An MLP
    without gate: its up_proj (Arcee, Apertus) and Apertus's xIELU scalars."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model = manifest["model"]
    spec = spec_for_family(model["family"])
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    q, kv = model["num_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"]
    members = {"attn.qkv": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [q, kv, kv]),
               "attn.o": (["self_attn.o_proj"], None), "mlp.down": (["mlp.down_proj"], None),
               "mlp.up": (["mlp.up_proj"], None),  # (an MLP without gate: Arcee's, Apertus's)
               "mlp.gate_up": (["mlp.gate_proj", "mlp.up_proj"], [model["intermediate_size"]] * 2)}
    offset = spec.norm_weight_offset
    residual, logits = 1.0, 1.0
    if model["family"] in ("granite", "granitemoehybrid"):
        residual, logits = hf_config["residual_multiplier"], hf_config["logits_scaling"]
    if model["family"] == "granitemoehybrid":  # Granite 4.0's MLP: shared_mlp, its gate and up rows in one tensor
        members |= {"mlp.gate_up": (["shared_mlp.input_linear"], None),
                    "mlp.down": (["shared_mlp.output_linear"], None),
                    "moe.shared.gate_up": (["shared_mlp.input_linear"], None),  # (with experts: the shared expert)
                    "moe.shared.down": (["shared_mlp.output_linear"], None)}
    if model["family"] in ("bamba", "falcon_h1"):  # Bamba's and Falcon-H1's MLP: feed_forward
        members |= {"mlp.gate_up": (["feed_forward.gate_proj", "feed_forward.up_proj"],
                                    [model["intermediate_size"]] * 2), "mlp.down": (["feed_forward.down_proj"], None)}
    if model.get("mamba_layers"):
        members |= {"attn.mamba_in": (["mamba.in_proj"], None), "attn.mamba_out": (["mamba.out_proj"], None)}
    dense = MAMBA_DENSE
    if model["family"] in ("lfm2", "lfm2_moe"):  # LFM2's names: out_proj, feed_forward.w1 / w3 / w2, conv.*
        members |= {"attn.o": (["self_attn.out_proj"], None), "mlp.down": (["feed_forward.w2"], None),
                    "mlp.gate_up": (["feed_forward.w1", "feed_forward.w3"], [model["intermediate_size"]] * 2),
                    "attn.conv_in": (["conv.in_proj"], None), "attn.conv_out": (["conv.out_proj"], None)}
        dense = {"attn.conv": "conv.conv.weight", "moe.gate": "feed_forward.gate.weight",
                 "moe.gate_bias": "feed_forward.expert_bias"}  # (and LFM2-MoE's router)
    if model["family"] == "olmo_hybrid":  # its DeltaNet's q, k, v, g, o projections, conv, b / a rows, o_norm
        key = model["linear_num_key_heads"] * model["linear_key_head_dim"]
        value = model["linear_num_value_heads"] * model["linear_value_head_dim"]
        members |= {"attn.in_qkvz": ([f"linear_attn.{n}_proj" for n in "qkvg"], [key, key, value, value]),
                    "attn.out": (["linear_attn.o_proj"], None)}
        dense = {"attn.conv": "linear_attn.conv1d.weight", "attn.A_log": "linear_attn.A_log",
                 "attn.dt_bias": "linear_attn.dt_bias", "attn.norm": "linear_attn.o_norm.weight"}
    embed, final, mamba = "model.embed_tokens.weight", spec.global_tensors["norm.weight"], "mamba."
    if model["family"] == "nemotron_h":  # every block's module is its `mixer`: the spec's members
        from llmc.runtime.artifact import read_manifest
        from llmc.runtime.models.spec import hf_member_rows

        config = read_manifest(artifact).model
        members = {linear.name: (list(linear.hf_members), hf_member_rows(linear, config))
                   for linear in spec.layer_linears}
        embed, final, mamba = "model.embeddings.weight", "model.norm_f.weight", "mixer."
    unfold = {"attn.o": residual, "mlp.down": residual, "attn.mamba_out": residual, "moe.shared.down": residual}
    state = {embed: tensors["embed.weight"].float(), final: (tensors["norm.weight"].float() - offset) * logits}
    if "lm_head.weight" in tensors:
        state["lm_head.weight"] = tensors["lm_head.weight"].float()
    for i in range(model["num_layers"]):
        # (OLMo Hybrid's DeltaNet layers: Llama's norms, pre_norm_layers)
        layer_norms = spec.pre_norm_layer_norms if i in model.get("pre_norm_layers", []) else spec.layer_norms
        norms = {**layer_norms, **(spec.qk_norms if model["qk_norm"] else {})}
        if f"layers.{i}.attn.in_ba.weight" in tensors and model["family"] == "olmo_hybrid":
            prefix = f"model.layers.{i}.linear_attn."
            b, a = tensors[f"layers.{i}.attn.in_ba.weight"].float().chunk(2)
            state |= {prefix + "b_proj.weight": b, prefix + "a_proj.weight": a}
        for runtime, hf in norms.items():
            if f"layers.{i}.{runtime}.weight" in tensors:  # (LFM2's conv layers have no q/k norms)
                state[f"model.layers.{i}.{hf}.weight"] = tensors[f"layers.{i}.{runtime}.weight"].float() - offset
        for runtime, hf in dense.items():  # (a Mamba-2 layer's: Granite 4.0; a short conv's: LFM2)
            if f"layers.{i}.{runtime}.weight" in tensors:
                weight = tensors[f"layers.{i}.{runtime}.weight"].float()
                state[f"model.layers.{i}.{hf.replace('mamba.', mamba)}"] = (
                    weight[:, None] if runtime == "attn.conv" else weight)
        if f"layers.{i}.mlp.xielu.weight" in tensors:  # Apertus's xIELU: alpha_p, alpha_n [1], beta, eps []
            alpha_p, alpha_n, beta, eps = tensors[f"layers.{i}.mlp.xielu.weight"].float()
            state |= {f"model.layers.{i}.mlp.act_fn.{name}": value for name, value in
                      (("alpha_p", alpha_p[None]), ("alpha_n", alpha_n[None]), ("beta", beta), ("eps", eps))}
        for runtime, (names, sizes) in members.items():
            if f"layers.{i}.{runtime}" not in manifest["quant"]["modules"]:  # (not in this layer)
                continue
            prefix = f"layers.{i}.{runtime}."
            params = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            weight = dequantize(make_format(manifest["quant"]["modules"][f"layers.{i}.{runtime}"], torch.float32), params)
            for name, part in zip(names, weight.float().split(sizes) if sizes else [weight.float()], strict=True):
                state[f"model.layers.{i}.{name}.weight"] = part / unfold.get(runtime, 1.0)
                if linears is not None:
                    linears[f"model.layers.{i}.{name}"] = f"layers.{i}.{runtime}"
        if model["family"] in ("granitemoehybrid", "lfm2_moe", "nemotron_h") and i in model.get("moe_layers", []):
            # the experts stacked as transformers holds them (in-memory names), down unfolded (Granite 4.0's)
            lfm2, nemotron = model["family"] == "lfm2_moe", model["family"] == "nemotron_h"
            module = "feed_forward" if lfm2 else "mixer" if nemotron else "block_sparse_moe"
            prefix, moe = f"model.layers.{i}.{module}.", f"layers.{i}.moe."
            if nemotron:  # (its router and score bias; its experts' up without gate)
                state[prefix + "gate.weight"] = tensors[moe + "gate.weight"].float()
                state[prefix + "gate.e_score_correction_bias"] = tensors[moe + "gate_bias.weight"].float()
            elif not lfm2:  # (LFM2-MoE's router and its bias: `dense`)
                state[prefix + "router.weight"] = tensors[moe + "gate.weight"].float()
            first = "up_proj" if nemotron else "gate_up_proj"
            for projection, theirs, scale in (("gate_up", first, 1.0), ("down", "down_proj", residual)):
                params = {k.removeprefix(f"{moe}experts.{projection}."): v for k, v in tensors.items()
                          if k.startswith(f"{moe}experts.{projection}.")}
                form = make_format(manifest["quant"]["modules"][f"{moe}experts.{projection}"], torch.float32)
                state[f"{prefix}experts.{theirs}"] = torch.stack([
                    dequantize(form, {k: v[e] for k, v in params.items()}).float()
                    for e in range(model["num_experts"])]) / scale
    return state


MAMBA_DENSE = {"attn.conv": "mamba.conv1d.weight", "attn.conv_bias": "mamba.conv1d.bias", "attn.A_log": "mamba.A_log",
               "attn.dt_bias": "mamba.dt_bias", "attn.D": "mamba.D", "attn.norm": "mamba.norm.weight"}


def hf_model_on_weights_of(checkpoint, artifact, method: str, state: dict | None = None,
                           linears: dict | None = None):
    """transformers' model of `checkpoint` (float32, eager attention) holding `artifact`'s weights (hf_state_of; or
    `state`, a family's own mapping of them); for an FP8 build each quantized decoder linear's input rounded to E4M3
    per token (per token and 128 columns for a block-scaled one: method "fp8-block"), as its dynamic activations are,
    or at its artifact linear's calibrated input_scale (method "fp8-static"). The quantized linears: `linears` ({HF
    module: artifact module}; hf_state_of's where it maps the weights), else every decoder linear."""
    from transformers import AutoModelForCausalLM

    oracle = honour_swiglu_config(AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                                       attn_implementation="eager"))
    if state is None:
        linears = {}
        state = hf_state_of(artifact, read_hf_config(checkpoint), linears)
    missing, unexpected = oracle.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding, or the artifact's
    oracle.eval()
    tensors = load_file(artifact / "rank-00" / "weights.safetensors") if method == "fp8-static" else {}

    def rounding(name: str):
        if method == "fp8-static":
            scale = tensors[f"{linears[name]}.input_scale"].float()
            return lambda x: (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
        return {"fp8": fp8_per_token, "fp8-block": fp8_per_token_group, "int8": int8_per_token}.get(method)

    round_linear_inputs(oracle, rounding, linears)
    return oracle


def round_linear_inputs(model, rounding, linears: dict | None) -> None:
    """Each quantized decoder linear of transformers' `model` (`linears`' modules; None: every nn.Linear under
    model.layers) takes its input through `rounding(module name)` (None: as it is), as the artifact's quantized
    activations are."""
    for name, module in model.named_modules():
        quantized = name in linears if linears is not None else name.startswith("model.layers.")
        if quantized and isinstance(module, torch.nn.Linear) and (round_input := rounding(name)) is not None:
            module.register_forward_pre_hook(lambda _, args, round_input=round_input: (round_input(args[0]),))


def oracle_method(quantization: dict) -> str:
    """hf_model_on_weights_of's method for a build's `quantization`: fp8 with block weights "fp8-block", with static
    activations "fp8-static"; else the method's name."""
    return quantization["method"] + ("-block" if quantization.get("weights") == "block" else
                                     "-static" if quantization.get("activations") == "static" else "")


def moe_hf_state(artifact, score_bias: str = "mlp.gate.e_score_correction_bias",
                 score_bias_shape: tuple[int, ...] = (-1,)) -> dict[str, torch.Tensor]:
    """An MoE artifact's weights (GLM-4.5, ERNIE 4.5 MoE) as transformers' in-memory state dict (experts stacked:
    gate_up_proj, down_proj), every linear dequantized by the formats' oracle (quant/reference.py), q/k rows, their
    biases and q/k norms permuted back (hf_checkpoint.rotary_row_permutation); the router's score bias under
    `score_bias` in `score_bias_shape` (ERNIE's: mlp.gate.moe_statics.e_score_correction_bias, [1, E])."""
    from llmc.compiler.hf_checkpoint import rotary_row_permutation
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize
    from llmc.runtime.artifact import read_manifest

    manifest = json.loads((artifact / "manifest.json").read_text())
    model, modules = manifest["model"], manifest["quant"]["modules"]
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    head_dim = model["head_dim"]
    permutation = rotary_row_permutation(read_manifest(artifact).model)  # (None: the checkpoint's rows, dots.llm1)
    inverse = torch.arange(head_dim) if permutation is None else torch.argsort(permutation)

    def weight(name: str, expert: int | None = None) -> torch.Tensor:
        params = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
        params.pop("bias", None)
        if expert is not None:
            params = {k: v[expert] for k, v in params.items()}
        return dequantize(make_format(modules[name], torch.float32), params).float()

    def unpermute(rows: torch.Tensor) -> torch.Tensor:
        return rows.unflatten(0, (-1, head_dim))[:, inverse].flatten(0, 1)

    state = {"model.embed_tokens.weight": tensors["embed.weight"], "model.norm.weight": tensors["norm.weight"]}
    if "lm_head.weight" in tensors:  # (else tied to the embedding)
        state["lm_head.weight"] = tensors["lm_head.weight"]
    q, kv = model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim
    norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm", "moe.gate": "mlp.gate",
             "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    for i in range(model["num_layers"]):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        qkv = [("weight", weight(ours + "attn.qkv"))]
        if ours + "attn.qkv.bias" in tensors:
            qkv.append(("bias", tensors[ours + "attn.qkv.bias"]))
        for kind, rows in qkv:
            wq, wk, wv = rows.split([q, kv, kv])
            state |= {f"{hf}self_attn.q_proj.{kind}": unpermute(wq), f"{hf}self_attn.k_proj.{kind}": unpermute(wk),
                      f"{hf}self_attn.v_proj.{kind}": wv}
        state[hf + "self_attn.o_proj.weight"] = weight(ours + "attn.o")
        for name, theirs in norms.items():
            if f"{ours}{name}.weight" in tensors:
                norm = tensors[f"{ours}{name}.weight"]
                state[f"{hf}{theirs}.weight"] = unpermute(norm) if name in ("attn.q_norm", "attn.k_norm") else norm
        for ours_mlp, theirs in (("mlp.", "mlp."), ("moe.shared.", "mlp.shared_experts.")):
            if ours + ours_mlp + "down" in modules:
                gate, up = weight(ours + ours_mlp + "gate_up").chunk(2)
                state |= {f"{hf}{theirs}gate_proj.weight": gate, f"{hf}{theirs}up_proj.weight": up,
                          f"{hf}{theirs}down_proj.weight": weight(ours + ours_mlp + "down")}
        if i in model["moe_layers"]:
            experts = range(model["num_experts"])
            state[hf + "mlp.experts.gate_up_proj"] = torch.stack([weight(ours + "moe.experts.gate_up", e)
                                                                  for e in experts])
            state[hf + "mlp.experts.down_proj"] = torch.stack([weight(ours + "moe.experts.down", e) for e in experts])
            state[hf + score_bias] = tensors[ours + "moe.gate_bias.weight"].reshape(score_bias_shape)
    return {name: tensor.float() for name, tensor in state.items()}


def check_against_transformers(llm, checkpoint, prompts, greedy, hf_greedy, hf_logits, hf_encode, tolerance: float):
    """`llm`'s logits over prompts[1] and 40 more ids (past the tests' windows) against transformers' within
    `tolerance`, and its greedy tokens for every prompt equal to transformers'."""
    token_ids = hf_encode(checkpoint, prompts[1]) + list(range(100, 140))
    torch.testing.assert_close(llm.engine.score(token_ids).cpu(), hf_logits(checkpoint, token_ids), atol=tolerance,
                               rtol=tolerance)
    expected = hf_greedy(checkpoint, prompts, greedy.max_tokens)
    outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def build_quantized(checkpoint, tmp_path, data_dir, quantization: dict):
    """A float32 CPU build of `checkpoint` with `quantization` (what calibrates: on 4 windows of 32 tokens)."""
    calibration = {"data": str(data_dir / "calibration.txt"), "num_samples": 4, "seq_len": 32}
    needs_data = quantization["method"] in ("gptq", "awq") or quantization.get("activations") == "static" or (
        quantization["method"] == "int8" and (quantization.get("algorithm") == "gptq" or quantization.get("smoothquant")))
    return build_float32(checkpoint, tmp_path / "q", target={"device": "cpu"}, quantization={
        **quantization, "report": False, **({"calibration": calibration} if needs_data else {})})


# an FP8 build against transformers with the same roundings (hf_model_on_weights_of): the logits to 2e-3, one position
# to FLIP (Granite 4.0 hybrid's tiny model: every position bit-exact but one, 0.055 off, its last layer's input to
# down at an E4M3 boundary)
FLIP = 0.1
FP8_CHECK = {"tolerance": 2e-3, "flips": 1}


def check_against_oracle(llm, oracle, checkpoint, hf_encode, prompts, max_tokens: int = 16,
                         tolerance: float = 1e-4, flips: int = 0) -> None:
    """`llm`'s logits over prompts[1] and 20 more ids against `oracle`'s (a transformers model) to `tolerance`, and
    its max_tokens greedy tokens of prompts[0] equal to oracle.generate's. `flips`: how many positions may be off by
    up to FLIP instead (an FP8 build: one activation at an E4M3 rounding boundary, which float32 reassociation moves
    to the other side, moves its position's logits by up to a step of E4M3)."""
    from llmc.runtime.sampling_params import SamplingParams

    token_ids = hf_encode(checkpoint, prompts[1]) + list(range(100, 120))
    prompt = hf_encode(checkpoint, prompts[0])
    with torch.inference_mode():
        got, want = llm.engine.score(token_ids).cpu(), oracle(torch.tensor([token_ids])).logits[0]
        off = ((got - want).abs() > tolerance * (1 + want.abs())).any(dim=-1)
        assert int(off.sum()) <= flips, (f"{int(off.sum())} positions off: {off.nonzero().flatten().tolist()}, "
                                         f"by up to {(got - want).abs().amax(-1).tolist()}")
        torch.testing.assert_close(got[~off], want[~off], atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(got[off], want[off], atol=FLIP, rtol=0)
        want = oracle.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=max_tokens, do_sample=False)[0, len(prompt):].tolist()
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens))
    assert got[0].outputs[0].token_ids == want


def _moe_quantizations(ignore: list[str]) -> list:
    """An MoE family's quantized builds checked by check_moe_build_as_oracle: RTN, GPTQ and AWQ (-m slow) W4 of every
    linear and expert, and FP8 of its linears (the experts dense: transformers' stacked experts are no nn.Linear whose
    inputs a hook could round to FP8), `ignore` also left out."""
    import pytest

    return [{"method": "rtn", "bits": 4, "group_size": 32}, {"method": "gptq", "bits": 4, "group_size": 32},
            pytest.param({"method": "awq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
            {"method": "fp8", "weights": "per_channel", "activations": "dynamic",
             "ignore": [*ignore, r"re:layers\.\d+\.moe\.experts\..*"]}]


MOE_QUANTIZATIONS = _moe_quantizations(["lm_head"])
MOE_QUANTIZATIONS_TIED = _moe_quantizations([])  # (a tied lm_head is the embedding's matrix: never quantized)
MOE_QUANTIZATION_IDS = ["rtn-w4", "gptq-w4", "awq-w4", "fp8"]


def hybrid_quantization(method: str, experts: bool = False) -> tuple[dict, str, dict]:
    """A hybrid family's quantized-build case (its test_a_w4_build_runs_transformers_on_its_weights): (the
    quantization, its linears' format, check_against_oracle's tolerance and flips). rtn / gptq: W4 g32 of every
    linear and expert (1e-4); fp8: W8A8 FP8 per channel with per-token activations of its linears, a model with
    experts leaving them dense (MOE_QUANTIZATIONS'), FP8_CHECK."""
    if method == "fp8":
        return (MOE_QUANTIZATIONS[-1] if experts else {"method": "fp8"}), "w8a8-fp8", FP8_CHECK
    return {"method": method, "bits": 4, "group_size": 32}, "w4a16", {"tolerance": 1e-4}


def check_moe_build_as_oracle(out, checkpoint, state: dict, hf_encode, prompts, fp8: bool, max_tokens: int = 12,
                              tolerance: float = 1e-4, moved_layer: int | None = 1, linears: dict | None = None,
                              flips: int = 0) -> None:
    """An MoE artifact `out` on the CPU against transformers' model of `checkpoint` holding `state` (its weights,
    moe_hf_state; a tied lm_head may be missing from it): check_against_oracle's logits and greedy tokens, with FP8
    each decoder linear's input (`linears`' modules, where given) rounded to E4M3 per token in transformers too. With
    `moved_layer`, every expert of that layer moved (their order reversed) in transformers' copy moves the logits: the
    experts are where the artifact's router sends their tokens."""
    from transformers import AutoModelForCausalLM

    from llmc.runtime.llm import LLM

    oracle = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = oracle.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    if missing:
        oracle.tie_weights()
    oracle.eval()
    if fp8:
        round_linear_inputs(oracle, lambda _: fp8_per_token, linears)
    token_ids = hf_encode(checkpoint, prompts[1]) + list(range(100, 120))
    with LLM(out, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        check_against_oracle(llm, oracle, checkpoint, hf_encode, prompts, max_tokens=max_tokens, tolerance=tolerance,
                             flips=flips)
        got = llm.engine.score(token_ids)
    if moved_layer is None:
        return
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.{moved_layer}.mlp.experts.{name}"
        state[key] = state[key].flip(0)
    oracle.load_state_dict(state, strict=False)
    with torch.inference_mode():
        assert (oracle(torch.tensor([token_ids])).logits[0] - got).abs().max() > 0.1


def assert_same_routes(weights, ids, want_weights, want_ids) -> None:
    """A router's top-k (weights, ids) [tokens, k] against transformers' (want_*): the same experts for every token, in
    any order, with the same weights (1e-6)."""
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices),
                               atol=1e-6, rtol=1e-6)


def check_fp8_import(source, checkpoint, tmp_path, hf_encode, prompts, linears: tuple[str, ...], layout: str,
                     state_of, rename) -> dict:
    """A block-FP8 checkpoint of `source` (every decoder linear named as transformers' fp8 block test quantizes them,
    and `linears` too, in `layout`: tests/quant/test_fp8_block_import.write_fp8_checkpoint) imported with
    `quantization.method: import` (build_import): each quantized linear's weight in the artifact (`state_of(artifact)`:
    (transformers' state dict, {HF module: artifact linear}); `rename`: a checkpoint's module name as that state dict
    names it) is the checkpoint's dequantized blocks exactly, and the artifact is transformers' model of `checkpoint`
    on those weights with each linear's input rounded per token and 128 inputs (FP8_CHECK). Returns {renamed module:
    (levels, scales)}."""
    import tests.quant.test_fp8_block_import as fp8_block
    from llmc.runtime.llm import LLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8_block, "LINEARS", (*fp8_block.LINEARS, *linears))
        quantized = fp8_block.write_fp8_checkpoint(source, tmp_path / "fp8", layout, skip=())
    out = build_import(tmp_path / "fp8", tmp_path / "artifact")
    state, hf_linears = state_of(out)
    quantized = {rename(name): q for name, q in quantized.items()}
    for module, (levels, scales) in quantized.items():
        torch.testing.assert_close(state[f"{module}.weight"], fp8_block.dequantized(levels, scales), atol=0, rtol=0,
                                   msg=module)
    oracle = hf_model_on_weights_of(checkpoint, out, "fp8-block", state, hf_linears)
    with LLM(out, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        check_against_oracle(llm, oracle, checkpoint, hf_encode, prompts, max_tokens=12, **FP8_CHECK)
    return quantized


def check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization: dict, prompts,
                          tolerance: float = 1e-4, flips: int = 0):
    """A build with `quantization` (build_quantized) against transformers run on its own weights
    (hf_model_on_weights_of): check_against_oracle's logits (to `tolerance`, `flips`) and 16 greedy tokens."""
    from llmc.runtime.llm import LLM

    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    oracle = hf_model_on_weights_of(checkpoint, out, oracle_method(quantization))
    check_against_oracle(LLM(out, device="cpu", max_num_batched_tokens=16), oracle, checkpoint, hf_encode, prompts,
                         tolerance=tolerance, flips=flips)


def awq_and_rtn_logits(checkpoint, out_dir, token_ids, monkeypatch, data_dir, searched: list | None = None,
                       **quantization) -> tuple[torch.Tensor, torch.Tensor]:
    """(the AWQ W8 g32 build's logits over token_ids, the RTN build's), the AWQ build's scales forced to seeded
    random powers of two (exact in float32) with one variant per layer: the two are equal if and only if every fold
    is undone where it is made. `searched`, where given, collects how many weights each search scaled;
    `quantization`: further fields of both builds."""
    import llmc.compiler.awq_layer as awq_layer
    from llmc.quant.awq import ScaleSearchResult
    from llmc.runtime.llm import LLM

    gen = torch.Generator().manual_seed(0)

    def random_scales(x, weights, quantize, w_mean=None):
        if searched is not None:
            searched.append(len(weights))
        powers = torch.randint(-2, 3, (x.shape[-1] // 32,), generator=gen).repeat_interleave(32)
        return ScaleSearchResult(2.0 ** powers.float(), 1.0, 0.0, 0.0)
    monkeypatch.setattr(awq_layer, "_variants", lambda quantizer, layer: [(False, False)])
    monkeypatch.setattr(awq_layer, "awq_search_scale", random_scales)
    calibration = {"data": str(data_dir / "calibration.txt"), "num_samples": 4, "seq_len": 32}
    logits = {}
    for method in ("awq", "rtn"):
        out = build_float32(checkpoint, out_dir / method, target={"device": "cpu"}, quantization={
            "method": method, "bits": 8, "group_size": 32, "report": False, **quantization,
            **({"calibration": calibration} if method == "awq" else {})})
        with LLM(out, device="cpu", max_num_batched_tokens=32, num_kv_blocks=64) as llm:
            logits[method] = llm.engine.score(token_ids)
    return logits["awq"], logits["rtn"]


def check_tensor_parallel(checkpoint, artifact, tmp_path, hf_encode, prompts, greedy, tensor: int = 2,
                          parallel: dict | None = None, atol: float = 1e-5):
    """A build of `checkpoint` split over ranks (`parallel`, default {"tensor": tensor}) against the one-rank
    `artifact`: the same greedy tokens, logits to `atol` (MoE and MLA models: 5e-5, the ranks' partial sums adding in
    another order). Returns the split artifact."""
    from llmc.runtime.llm import LLM

    parallel = parallel or {"tensor": tensor}
    split = build_float32(checkpoint, tmp_path / "split", parallel=parallel)
    engine = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}
    token_ids = hf_encode(checkpoint, prompts[1]) + list(range(100, 120))
    with LLM(split, **engine) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        scores = llm.engine.score(token_ids)
    with LLM(artifact, **engine) as llm:
        assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        torch.testing.assert_close(scores, llm.engine.score(token_ids), atol=atol, rtol=1e-5)
    return split


def hf_model_with_config(checkpoint, **config_changes):
    """transformers' float32 model of `checkpoint` (eager attention) with config attributes changed: what a
    test compares against to show that a config value matters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint))
    for key, value in config_changes.items():
        setattr(config, key, value)
    return honour_swiglu_config(AutoModelForCausalLM.from_pretrained(str(checkpoint), config=config, dtype=torch.float32,
                                                                     attn_implementation="eager")).eval()


def check_pack_quantized_import(checkpoint, tmp_path, hf_logits, hf_encode, prompt: str):
    """A pack-quantized W4 g32 copy of `checkpoint` (every decoder linear, as llm-compressor saves it) imports, and
    its logits are transformers' on the dequantized twin (to 1e-4)."""
    from llmc.runtime.llm import LLM
    from tests.compiler.test_moe_import import _compress

    dest, twin = tmp_path / "ckpt", tmp_path / "twin"
    for path in (dest, twin):
        shutil.copytree(checkpoint, path)
    tensors, dequantized = {}, {}
    for name, weight in load_file(checkpoint / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            packed, dense = _compress(weight, {"symmetric": True, "group_size": 32, "strategy": "group"})
            tensors |= {f"{name.removesuffix('.weight')}.{k}": v for k, v in packed.items()}
            dequantized[name] = dense.float()
        else:
            tensors[name] = dequantized[name] = weight
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, twin / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False}}}}
    (dest / "config.json").write_text(json.dumps(config))
    out = build_float32(dest, tmp_path / "a", target={"device": "cpu"}, quantization={"method": "import"})
    token_ids = hf_encode(twin, prompt) + list(range(100, 120))
    torch.testing.assert_close(LLM(out, device="cpu").engine.score(token_ids), hf_logits(twin, token_ids),
                               atol=1e-4, rtol=1e-4)


def make_peft_adapter(checkpoint, out, seed, **config):
    """A PEFT LoRA of the checkpoint (peft.LoraConfig(**config)), saved by PEFT's save_pretrained, with random
    non-zero factors (lora_B starts at zero in PEFT: the adapter would change nothing)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def check_classifier_as_transformers(source, tmp_path, prompts) -> None:
    """A 3-label classifier made of the causal checkpoint `source` (make_classifier) built float32 and run on the CPU:
    each prompt's class probabilities equal transformers' at the last token (1e-5)."""
    from transformers import AutoModelForSequenceClassification

    from llmc.runtime.llm import LLM

    checkpoint = make_classifier(source, tmp_path / "hf", 3)
    artifact = build_float32(checkpoint, tmp_path / "a")
    hf = AutoModelForSequenceClassification.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with LLM(artifact, device="cpu", max_num_batched_tokens=16) as llm:
        outputs = llm.classify(prompts)
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        with torch.inference_mode():
            expected = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=1e-5, rtol=1e-5)


def make_classifier(source, dest, num_labels: int, seed: int = 0, **config):
    """A transformers *ForSequenceClassification checkpoint in `dest`: the causal checkpoint `source`'s decoder,
    a random `score` head of `num_labels` (labels named class_i), `config` keys set (problem_type, ...)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(str(source), num_labels=num_labels,
                                           id2label={i: f"class_{i}" for i in range(num_labels)},
                                           label2id={f"class_{i}": i for i in range(num_labels)}, **config)
    model = AutoModelForSequenceClassification.from_pretrained(str(source), config=hf_config, dtype=torch.float32)
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a head that tells the prompts apart
    model.save_pretrained(str(dest))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(dest))
    return dest
