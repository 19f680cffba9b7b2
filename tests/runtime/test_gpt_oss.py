"""gpt-oss (GptOssForCausalLM) against transformers' own model in float32: logits at every position with chunked prefill,
greedy decoding batched continuously, a prefix-cache hit; each of its own parts (attention sinks, the clamped SwiGLU,
the router's and experts' biases, the sliding layers) shown to matter; an RTN W4A16 build against transformers run on
its own weights; the published MXFP4 layout (written here by the test's own packer, checked against transformers'
dequantizer) read exactly; pipeline, tensor and expert parallel 2 against one rank, and what each rank holds; how
configs are read; the refusals. The Triton kernels' sinks: tests/kernels/test_attention.py."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.gpt_oss_checkpoint import E2M1_VALUES, dequantize_mxfp4
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RecipeError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import gpt_oss
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import honour_swiglu_config, make_hf_checkpoint
from tests.runtime.hf_oracle import build_float32, build_quantized, check_against_oracle, write_config

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "ck", "gpt_oss")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("gpt_oss_art") / "art")


@pytest.fixture(scope="module")
def split_artifact(checkpoint, tmp_path_factory):
    """A recipe's parallel block (and quantization) → the float32 artifact of `checkpoint` built with them (once per
    module)."""
    root, built = tmp_path_factory.mktemp("gpt_oss_split"), {}

    def artifact(parallel: dict, quantization: dict | None = None):
        key = "-".join(f"{k}{v}" for k, v in parallel.items()) + ("-rtn" if quantization else "")
        if key not in built:
            recipe = {"quantization": quantization} if quantization else {}
            built[key] = build_float32(checkpoint, root / (key or "one"), parallel=parallel, **recipe)
        return built[key]
    return artifact


def _score_ids(checkpoint, hf_encode):
    return hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 140))  # 50 positions: past the 8-token window


def _hf_with(checkpoint, **changes):
    """transformers' float32 model of `checkpoint` with parameters changed in place (name suffix → function)."""
    from transformers import AutoModelForCausalLM

    model = honour_swiglu_config(AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                                      attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            for suffix, change in changes.items():
                if name.endswith(suffix):
                    p.copy_(change(p))
    return model.eval()


@torch.inference_mode()
def test_logits_greedy_and_prefix_cache_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits at 50 positions prefilled in chunks of 16 (1e-4), 24 greedy tokens of three prompts batched continuously,
    and 8 greedy tokens of a 40-token prompt twice, the second time with its first two blocks from the prefix cache:
    transformers' float32 model's."""
    from tests.conftest import hf_model

    token_ids = _score_ids(checkpoint, hf_encode)
    expected = hf_logits(checkpoint, token_ids)
    with LLM(artifact, enable_prefix_caching=True, **ENGINE) as llm:
        got = llm.engine.score(token_ids)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        want = hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens)
        assert all(len(set(tokens)) > 4 for tokens in want)  # not a model that repeats one token
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == want
        prompt = token_ids[:40]
        short = SamplingParams(temperature=0, max_tokens=8)
        first, second = (llm.generate([{"prompt_token_ids": prompt}], short)[0] for _ in range(2))
    ids = torch.tensor([prompt])
    expected = hf_model(checkpoint).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                             do_sample=False)[0, 40:].tolist()
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    assert second.num_cached_tokens == 32


@torch.inference_mode()
def test_each_gpt_oss_part_matters(checkpoint, artifact, hf_encode):
    """transformers' model without its sinks (-inf), with an unbinding swiglu_limit, without the router's or experts'
    biases, or with every layer full-attention is far from the artifact's logits (which equal the unchanged model's:
    the test above): each part is computed, not just read."""
    token_ids = _score_ids(checkpoint, hf_encode)
    with LLM(artifact, **ENGINE) as llm:
        ours = llm.engine.score(token_ids)
    ids = torch.tensor([token_ids])
    variants = {"sinks": _hf_with(checkpoint, **{"self_attn.sinks": lambda p: torch.full_like(p, -torch.inf)}),
                "router bias": _hf_with(checkpoint, **{"router.bias": torch.zeros_like}),
                "expert biases": _hf_with(checkpoint, **{"gate_up_proj_bias": torch.zeros_like,
                                                         "down_proj_bias": torch.zeros_like}),
                "limit": _hf_with(checkpoint)}
    for layer in variants["limit"].model.layers:
        layer.mlp.experts.limit = 1e9
    full = _hf_with(checkpoint)
    full.config.layer_types = ["full_attention"] * 3
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    variants["window"] = full
    for what, model in variants.items():
        assert (model(ids).logits[0] - ours).abs().max() > 0.05, what


def _gpt_oss_state(artifact) -> dict[str, torch.Tensor]:
    """The artifact's weights as GptOssForCausalLM's state dict: each linear and expert dequantized by the formats'
    oracle (quant/reference.py), q/k/v split, each expert's gate and up rows put back into gate_up_proj's interleaved
    columns and its projections transposed to transformers' input-major [E, in, out]."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model, modules = manifest["model"], manifest["quant"]["modules"]
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")

    def weight(name: str, expert: int | None = None) -> torch.Tensor:
        params = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")
                  and k != name + ".bias"}
        if expert is not None:
            params = {k: v[expert] for k, v in params.items()}
        return dequantize(make_format(modules[name], torch.float32), params).float()

    def interleave(gate_up: torch.Tensor) -> torch.Tensor:  # [..., gate; up] on the last dim → gate, up alternating
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.stack((gate, up), dim=-1).flatten(-2)

    q, kv = model["num_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"]
    state = {"model.embed_tokens.weight": tensors["embed.weight"].float(), "lm_head.weight": tensors["lm_head.weight"].float(),
             "model.norm.weight": tensors["norm.weight"].float()}
    for i in range(model["num_layers"]):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        names = ("q_proj", "k_proj", "v_proj")
        for name, w, b in zip(names, weight(ours + "attn.qkv").split([q, kv, kv]),
                              tensors[ours + "attn.qkv.bias"].float().split([q, kv, kv])):
            state |= {f"{hf}self_attn.{name}.weight": w, f"{hf}self_attn.{name}.bias": b}
        state |= {hf + "self_attn.o_proj.weight": weight(ours + "attn.o"),
                  hf + "self_attn.o_proj.bias": tensors[ours + "attn.o.bias"].float(),
                  hf + "self_attn.sinks": tensors[ours + "attn.sinks.weight"].float(),
                  hf + "input_layernorm.weight": tensors[ours + "input_norm.weight"].float(),
                  hf + "post_attention_layernorm.weight": tensors[ours + "post_attn_norm.weight"].float(),
                  hf + "mlp.router.weight": tensors[ours + "moe.gate.weight"].float(),
                  hf + "mlp.router.bias": tensors[ours + "moe.gate.bias"].float()}
        experts = range(model["num_experts"])
        gate_up = torch.stack([weight(ours + "moe.experts.gate_up", e).t() for e in experts])  # [E, hidden, 2 * width]
        state |= {hf + "mlp.experts.gate_up_proj": interleave(gate_up),
                  hf + "mlp.experts.gate_up_proj_bias": interleave(tensors[ours + "moe.experts.gate_up.bias"].float()),
                  hf + "mlp.experts.down_proj": torch.stack([weight(ours + "moe.experts.down", e).t() for e in experts]),
                  hf + "mlp.experts.down_proj_bias": tensors[ours + "moe.experts.down.bias"].float()}
    return state


def _oracle_on(checkpoint, state):
    from transformers import AutoModelForCausalLM

    oracle = honour_swiglu_config(AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                                       attn_implementation="eager"))
    missing, unexpected = oracle.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return oracle.eval()


def test_rtn_w4a16_build_is_transformers_on_its_weights(checkpoint, artifact, tmp_path, data_dir, hf_encode):
    """RTN W4A16 (groups of 32), every decoder linear and expert quantized, the biases and sinks not: transformers'
    model holding the artifact's dequantized weights gives its logits (1e-4) and greedy tokens; the float build's
    state read back the same way is the checkpoint's own (the mapping itself is right)."""
    original = _hf_with(checkpoint).state_dict()
    for name, tensor in _gpt_oss_state(artifact).items():
        torch.testing.assert_close(tensor, original[name], atol=0, rtol=0, msg=name)
    out = build_quantized(checkpoint, tmp_path, data_dir, {"method": "rtn", "bits": 4, "group_size": 32})
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quant"]["modules"]["layers.0.moe.experts.down"]["format"] == "w4a16"
    with LLM(out, device="cpu", max_num_batched_tokens=16) as llm:
        check_against_oracle(llm, _oracle_on(checkpoint, _gpt_oss_state(out)), checkpoint, hf_encode, PROMPTS)


def test_gptq_build_is_transformers_on_its_weights(checkpoint, tmp_path, data_dir, hf_encode):
    """GPTQ W4 (groups of 32), calibrated through the runtime's expert-by-expert path (each expert on its routed
    tokens, biases and clamped SwiGLU included): transformers on its dequantized weights gives its logits and
    greedy tokens."""
    out = build_quantized(checkpoint, tmp_path, data_dir, {"method": "gptq", "bits": 4, "group_size": 32})
    with LLM(out, device="cpu", max_num_batched_tokens=16) as llm:
        check_against_oracle(llm, _oracle_on(checkpoint, _gpt_oss_state(out)), checkpoint, hf_encode, PROMPTS)


def test_awq_folds_keep_the_function(checkpoint, tmp_path, data_dir, hf_encode, monkeypatch):
    """AWQ with every searched scale forced to random powers of two gives the RTN build's logits exactly: each fold
    (into the norms, the router's columns, v's rows) is undone where it is made, and no expert's down is folded into
    its up rows (the clamped SwiGLU is not linear in them)."""
    from tests.runtime.hf_oracle import awq_and_rtn_logits

    searched = []  # min_expert_tokens 1: every expert's down is searched (and would be folded) where it could be
    awq, rtn = awq_and_rtn_logits(checkpoint, tmp_path, _score_ids(checkpoint, hf_encode), monkeypatch, data_dir,
                                  searched, min_expert_tokens=1)
    assert len(searched) == 3 * 2  # per layer: qkv, the experts' gate_up (o: GQA has no fold; no expert's down)
    torch.testing.assert_close(awq, rtn, atol=1e-5, rtol=1e-5)


RTN_W4 = {"method": "rtn", "bits": 4, "group_size": 32, "report": False}


@pytest.mark.parametrize("parallel, quantization, tolerance", [  # (tp2 and ep2 hold the biases' rule by default)
    pytest.param({"pipeline": 2}, None, 1e-5, id="pp2", marks=pytest.mark.slow),
    pytest.param({"tensor": 2}, None, 1e-4, id="tp2"),
    pytest.param({"tensor": 2, "expert": 2}, None, 1e-4, id="ep2", marks=pytest.mark.slow),
    pytest.param({"tensor": 2}, RTN_W4, 1e-4, id="tp2-w4a16", marks=pytest.mark.slow)])
def test_parallel_matches_one_rank(checkpoint, artifact, split_artifact, hf_encode, parallel, quantization, tolerance):
    """Pipeline parallel 2 (whole layers per rank: the biases and sinks move with them), tensor parallel 2 (heads,
    their q/k/v biases and sinks split; the experts split on their width; o's and the experts' down biases on rank 0
    alone; float32, and RTN W4A16 in groups of 32 against the one-rank RTN build) and expert parallel 2 (whole experts,
    each with its biases): one rank's logits and greedy tokens of three prompts batched continuously. Logits within
    1e-5 for the pipeline (the same sums: equal here), 1e-4 for the two-way splits, whose all-reduce adds the ranks'
    float32 partial sums in another order (up to 2.8e-5 here); o's and the experts' down biases held on both ranks
    (added twice) move them by ~4."""
    split = split_artifact(parallel, quantization)
    one = artifact if quantization is None else split_artifact({}, quantization)
    token_ids = _score_ids(checkpoint, hf_encode)
    prompts = [{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS]
    runs = []
    for art in (split, one):
        with LLM(art, **ENGINE) as llm:
            runs.append((llm.engine.score(token_ids), [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]))
    (scores, tokens), (one_scores, one_tokens) = runs
    torch.testing.assert_close(scores, one_scores, atol=tolerance, rtol=tolerance)
    assert tokens == one_tokens


def test_tensor_and_expert_parallel_ranks_hold_their_share(artifact, split_artifact):
    """What each rank's file holds, against the one-rank artifact: under tensor parallel 2, rank t the sinks and q/k/v
    bias rows of its heads, its half of every expert's gate_up bias (gate and up rows alike), the router's weight and
    bias whole, and o's and the experts' down biases only on rank 0; under expert parallel 2, rank t its experts'
    gate_up and down biases whole, the manifest's rank_experts saying which (and o's bias on rank 0 alone)."""
    whole = load_file(artifact / "rank-00" / "weights.safetensors")
    model = json.loads((artifact / "manifest.json").read_text())["model"]
    d, heads, kv_heads = model["head_dim"], model["num_heads"], model["num_kv_heads"]
    width = model["moe_intermediate_size"]
    tp, ep = split_artifact({"tensor": 2}), split_artifact({"tensor": 2, "expert": 2})
    for rank in range(2):
        mine = load_file(tp / f"rank-{rank:02d}" / "weights.safetensors")
        h, kv, w = heads // 2, kv_heads // 2, width // 2
        q_rows = range(rank * h * d, (rank + 1) * h * d)
        k_rows = [heads * d + rank * kv * d + i for i in range(kv * d)]
        v_rows = [(heads + kv_heads) * d + rank * kv * d + i for i in range(kv * d)]
        gate_up_rows = list(range(rank * w, (rank + 1) * w)) + list(range(width + rank * w, width + (rank + 1) * w))
        for i in range(model["num_layers"]):
            p = f"layers.{i}."
            assert torch.equal(mine[p + "attn.sinks.weight"], whole[p + "attn.sinks.weight"][rank * h:(rank + 1) * h])
            assert torch.equal(mine[p + "attn.qkv.bias"], whole[p + "attn.qkv.bias"][[*q_rows, *k_rows, *v_rows]])
            gate_up = p + "moe.experts.gate_up.bias"
            assert torch.equal(mine[gate_up], whole[gate_up][:, gate_up_rows])
            for name in ("moe.gate.weight", "moe.gate.bias"):
                assert torch.equal(mine[p + name], whole[p + name])
            for name in ("attn.o.bias", "moe.experts.down.bias"):
                assert (p + name in mine) == (rank == 0), (rank, name)
                if rank == 0:
                    assert torch.equal(mine[p + name], whole[p + name])
        mine = load_file(ep / f"rank-{rank:02d}" / "weights.safetensors")
        experts = read_manifest(ep).parallel.rank_experts[rank]
        assert experts == [2 * rank, 2 * rank + 1]
        for i in range(model["num_layers"]):
            p = f"layers.{i}."
            for name in ("moe.experts.gate_up.bias", "moe.experts.down.bias"):
                assert torch.equal(mine[p + name], whole[p + name][experts])
            assert (p + "attn.o.bias" in mine) == (rank == 0)


# ---- MXFP4 -------------------------------------------------------------------------------------------------------


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own MXFP4 packer: weight [..., in] (in a multiple of 32) → (blocks [..., in / 32, 16] uint8, scales
    [..., in / 32] uint8), each group of 32 scaled by the power of two that puts its largest magnitude in [4, 8)
    (E8M0, biased by 127), each value rounded to the nearest E2M1 value (OCP MX spec), two a byte, the first in the
    low nibble."""
    groups = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(2.0 ** -100))) - 2  # 6 * 2^e >= max > 4 * 2^e
    values = torch.tensor(E2M1_VALUES)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - values).abs().argmin(-1).to(torch.uint8)  # ties to the lower code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_the_mxfp4_reader_is_transformers_dequantizer():
    """Random blocks and scales (every code, scales 2^-10 .. 2^10) read by dequantize_mxfp4 equal transformers'
    convert_moe_packed_tensors (which also transposes to [E, in, out]); the test's packer round-trips E2M1 values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 138, (3, 8, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=0, rtol=0)
    again = pack_mxfp4(ours)
    torch.testing.assert_close(dequantize_mxfp4(*again), ours, atol=0, rtol=0)


def write_mxfp4_checkpoint(source, dest):
    """A copy of float checkpoint `source` in the published layout: every expert weight packed (pack_mxfp4) into
    `{name}_blocks` / `{name}_scales` (output-major), quantization_config mxfp4 as openai/gpt-oss-20b's; and a float
    copy holding transformers' dequantization of those blocks (the reference)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(source, dest)
    reference = dest.with_name(dest.name + "-dequantized")
    shutil.copytree(source, reference)
    tensors = load_file(source / "model.safetensors")
    packed, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(tensor.transpose(1, 2))  # [E, out, in]
            packed |= {name + "_blocks": blocks, name + "_scales": scales}
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        else:
            packed[name] = dequantized[name] = tensor
    save_file(packed, dest / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    config = read_hf_config(source)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dest / "config.json").write_text(json.dumps(config))
    return dest, reference


def test_an_mxfp4_checkpoint_builds_as_its_dequantized_weights(checkpoint, tmp_path, hf_logits, hf_encode, caplog):
    """The MXFP4 checkpoint's float32 build holds exactly what a float checkpoint of transformers' dequantization of
    it builds to (one log line says the experts were dequantized), and its logits are that model's (1e-4); an RTN W8
    build of it is the RTN W8 build of the dequantized checkpoint, tensor for tensor."""
    mxfp4, reference = write_mxfp4_checkpoint(checkpoint, tmp_path / "mxfp4")
    with caplog.at_level(logging.INFO, logger="llmc"):
        ours = build_float32(mxfp4, tmp_path / "a")
    assert sum("MXFP4 experts (6 tensors) are dequantized" in r.message for r in caplog.records) == 1
    theirs = build_float32(reference, tmp_path / "b")
    a, b = load_file(ours / "rank-00" / "weights.safetensors"), load_file(theirs / "rank-00" / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rtn = {"quantization": {"method": "rtn", "bits": 8, "group_size": 32, "report": False}}
    a = load_file(build_float32(mxfp4, tmp_path / "a8", **rtn) / "rank-00" / "weights.safetensors")
    b = load_file(build_float32(reference, tmp_path / "b8", **rtn) / "rank-00" / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    token_ids = _score_ids(checkpoint, hf_encode)
    with LLM(ours, **ENGINE) as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(reference, token_ids), atol=1e-4, rtol=1e-4)


# ---- configs and refusals ----------------------------------------------------------------------------------------


def test_the_manifest_says_what_gpt_oss_is(checkpoint, artifact):
    """The manifest's model: its own fields, and the parameter count of transformers' model (sinks and biases
    included); format 1.23."""
    from llmc.runtime.artifact import FORMAT_VERSION
    from tests.conftest import hf_model

    manifest = read_manifest(artifact)
    model = manifest.model
    assert (model.family, model.attention_sinks, model.o_bias, model.moe_bias, model.attention_bias) == \
        ("gpt_oss", True, True, True, True)
    assert (model.swiglu_limit, model.swiglu_alpha, model.sliding_window, model.sliding_window_layers) == \
        (1.0, 1.702, 8, [0, 2])
    assert model.rope_scaling["rope_type"] == "yarn" and model.rope_scaling["truncate"] is False
    assert model.num_parameters == sum(p.numel() for p in hf_model(checkpoint).parameters())
    assert manifest.format_version == FORMAT_VERSION == "1.47"


def test_inspect_names_what_gpt_oss_adds(artifact):
    from click.testing import CliRunner

    from llmc.cli import cli

    result = CliRunner().invoke(cli, ["inspect", str(artifact)])
    assert result.exit_code == 0, result.output
    rows = {line.split(maxsplit=1)[0]: line.split(maxsplit=1)[1] for line in result.output.splitlines() if line.strip()}
    assert "q/k/v/o biases, attention sinks (a learned softmax column per head), sliding window 8 on 2 of 3 layers" \
        in rows["attention"]
    assert rows["experts"] == ("4 per MoE layer, top-2 renormalised, width 64, MoE layers [0, 1, 2], biased router "
                               "and experts, clamped SwiGLU (limit 1, alpha 1.702)")
    # a float32 artifact is larger than 16-bit weights, not "saved 0 B" (its linears and experts twice as large)
    assert "saved" not in rows and " than 16-bit weights (tensors are 2" in rows["larger"]


def test_config_read_as_gptossconfig_reads_it(checkpoint):
    """Keys a config leaves out take GptOssConfig's defaults: alternating sliding / full layers, YaRN x32 over 4096
    positions untruncated, swiglu_limit 7 and alpha 1.702, q/k/v/o biases; a legacy rope_scaling is read as well."""
    from transformers import GptOssConfig

    config = read_hf_config(checkpoint)
    for key in ("layer_types", "rope_parameters", "swiglu_limit", "swiglu_alpha", "attention_bias", "sliding_window"):
        config.pop(key)
    ours = model_config_from_hf(config, gpt_oss.SPEC, "float32")
    theirs = GptOssConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    assert ours.sliding_window == theirs.sliding_window == 128
    assert ours.sliding_window_layers == [i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention"]
    params = dict(theirs.rope_parameters)
    assert ours.rope_theta == params.pop("rope_theta") == 150000.0
    assert ours.rope_scaling == params
    assert (ours.swiglu_limit, ours.swiglu_alpha, ours.o_bias) == (theirs.swiglu_limit, theirs.swiglu_alpha, True)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size, ours.norm_topk_prob) == \
        (theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size, True)
    from llmc.compiler.hf_checkpoint import with_hf_defaults

    defaults, hf_defaults = with_hf_defaults({"model_type": "gpt_oss"}), GptOssConfig()
    for key, value in defaults.items():  # every default llmc fills in is the config class's
        expected = hf_defaults.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(hf_defaults, key)
        assert value == expected, key
    legacy = {**config, "rope_theta": 150000.0, "rope_scaling": {**params}}
    assert model_config_from_hf(legacy, gpt_oss.SPEC, "float32").rope_scaling == params


def test_a_config_without_dtype_builds_in_the_stored_dtype(checkpoint, tmp_path):
    """The published config.json names no torch_dtype: `dtype: auto` takes the embedding's stored dtype (bfloat16),
    not float32."""
    source = write_config(checkpoint, tmp_path / "bf16")
    config = read_hf_config(source)
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (source / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, source / "model.safetensors",
              metadata={"format": "pt"})
    out = tmp_path / "out"
    build(recipe_from_dict({"model": str(source), "output": str(out)}), show_progress=False)
    assert json.loads((out / "manifest.json").read_text())["model"]["dtype"] == "bfloat16"


def test_what_gpt_oss_refuses(checkpoint, artifact, tmp_path):
    """One line each: a quantization_config other than mxfp4, an mxfp4 key the reader does not take, import, ONNX, a
    swiglu_limit that is not a number, `llmc export`."""
    from llmc.compiler.export import export_artifact
    from llmc.errors import ArtifactError

    with pytest.raises(ArtifactError, match="architecture GptOssForCausalLM; export writes"):
        export_artifact(artifact, tmp_path / "exported")

    def refused(error, match, recipe=None, **changes):
        source = write_config(checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes)
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(CheckpointError, "quant_method 'bitsandbytes' is not supported",
            quantization_config={"quant_method": "bitsandbytes"})
    refused(CheckpointError, r"quantization_config \['dequantize'\]",
            quantization_config={"quant_method": "mxfp4", "dequantize": True})
    refused(CheckpointError, "import is not supported for gpt-oss", {"quantization": {"method": "import"}})
    refused(RecipeError, r"mixture-of-experts models \(GptOssForCausalLM\) are not exported to ONNX",
            {"target": {"device": "onnx-cpu"}})
    refused(CheckpointError, "swiglu_limit 'x'", swiglu_limit="x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_gpt_oss_on_the_gpu_matches_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, graphs,
                                                free_gpu):
    """The float32 artifact on CUDA (the Triton attention kernels with sinks: prefill, chunked prefill, decode; the
    fused Triton MoE with the experts' biases and the clamped SwiGLU; with and without CUDA graphs): transformers'
    float32 logits (2e-3, the other MoE families' GPU tolerance) and greedy tokens of three prompts batched
    continuously."""
    token_ids = _score_ids(checkpoint, hf_encode)
    expected = hf_logits(checkpoint, token_ids)
    with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16,
             enforce_eager=not graphs) as llm:
        model = llm.engine.runner.model
        assert all(layer.moe.runs_fused() for layer in model.layers.values())
        torch.testing.assert_close(llm.engine.score(token_ids).cpu(), expected, atol=2e-3, rtol=2e-3)
        want = hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens)
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == want
