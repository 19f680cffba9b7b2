"""Qwen3.5 (Qwen3_5ForCausalLM), the first hybrid model, against transformers' own model (float32) on a tiny random
checkpoint whose layer_types are [linear, linear, full, linear]: logits at every position of a prefill in chunks of 16
(each Gated DeltaNet's conv and recurrent state carried across chunks in its slot), greedy tokens and logprobs of
prompts of different lengths batched through the paged engine with fewer seats than prompts, the same under preemption
by recompute (a tiny KV cache) and with n > 1; an abort mid-stream gives its slot back (the request that takes it next
starts from zero state); the delta rule's chunked and one-step forms against transformers' torch functions; an RTN W4
build against transformers holding its dequantized weights; the refusals; the full layer's attention on the Triton
kernels (the interpreter on CPU tensors); -m gpu: CUDA (eager)."""

import json
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import partial_rotary_permutation
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, ConfigError, RecipeError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.artifact import read_manifest
from llmc.runtime.cuda_graphs import StaticInputs
from llmc.runtime.engine import Engine
from llmc.runtime.llm import LLM
from llmc.runtime.models.gated_deltanet import chunked_delta_rule, l2_normalize, recurrent_delta_rule
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_quantized, write_config
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)


checkpoint, artifact = family_fixtures("qwen3_5", "qwen3_5")
# the hybrid families' preemption test cases: a KV cache of 5 blocks (requests preempted and prefilled again from zero
# state), or prefill chunks of 5 tokens (each chunk continuing from the state its slot holds)
PREEMPTION_CASES = pytest.mark.parametrize("options", [{"num_kv_blocks": 5, "max_model_len": 64},
                                                      {"max_num_batched_tokens": 5}], ids=["preemption", "chunks-of-5"])


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest says which layers are linear attention, the gate and the partial rotary."""
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        runner = llm.engine.runner
        assert len(runner.kv_caches) == 1  # the full-attention layer's alone
        assert runner.model.layers["0"].attn.recurrent_state.shape == (3, 4, 16, 16)  # max_num_seqs + 1 slots
        assert not llm.engine.options.enable_prefix_caching
    model = read_manifest(artifact).model
    assert (model.family, model.linear_attention_layers, model.attn_output_gate, model.rotary_dim,
            model.rotary_rows_permuted, model.kv_layers) == ("qwen3_5", [0, 1, 3], True, 8, True, [2])


@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """The full layer's rotary + KV write and paged attention on their Triton kernels (the rows permuted to a whole-head
    table, the output gate after them), and the state layers' (the conv, the delta rule or Mamba-2's recurrence) over
    chunked prefills and decodes (a prefill's pieces of 8 tokens or more on the chunked kernels, the triton_dispatch
    fixture's CHUNKED_FROM): transformers' logits, greedy tokens and logprobs. (Other hybrid families call this.)"""
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["rotate_and_write_kv"] and triton_dispatch["causal_conv"]
    model = read_manifest(artifact).model
    if model.linear_attention_layers:  # (a Gated DeltaNet's three kernels)
        assert triton_dispatch["delta_rule"] and triton_dispatch["gated_rms_norm"]
        assert triton_dispatch["delta_rule_chunked"]
    if model.mamba_layers:  # (a Mamba-2 mixer's)
        assert triton_dispatch["ssd"] and triton_dispatch["gated_group_norm"] and triton_dispatch["ssd_chunked"]


class StaticDecodeSteps:
    """CudaGraphs' replay without the capture, on the CPU: each decode step loaded into the graphs' static buffers
    (runtime/cuda_graphs.StaticInputs: state slots included, padding rows on the scratch block and scratch state slot)
    padded to 4 rows, and the model run on them."""

    def __init__(self, runner, scratch_block: int):
        self.model, self.num_replays = runner.model, 0
        self.inputs = StaticInputs(4, 16, scratch_block, 16, torch.device("cpu"), runner.scratch_state_slot)

    def can_run(self, batch) -> bool:
        return batch.is_decode and batch.num_seqs <= 4

    def run(self, input_ids, batch):
        self.inputs.load(input_ids, batch, 4)
        self.num_replays += 1
        return self.model(self.inputs.input_ids, self.inputs.batch(4, 256))[: batch.num_seqs]


@torch.inference_mode()
def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """What a decode graph replays (runtime/cuda_graphs.py), on the CPU: decode steps of 1 to 3 sequences padded to 4
    rows whose padding rows write the scratch state slot: transformers' greedy tokens and logprobs; then with the first
    request finishing first (a later step's padding row is where a running request's row was)."""
    encoded = [hf_encode(checkpoint, p) for p in PROMPTS]
    lengths = [3, 12, 8]
    with LLM(artifact, device="cpu", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        runner = llm.engine.runner
        runner.graphs = StaticDecodeSteps(runner, scratch_block=63)  # (the 3 prompts take fewer than 63 blocks)
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded],
                               [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
        assert runner.graphs.num_replays > 0 and runner.scratch_state_slot == 3
    assert [o.outputs[0].token_ids for o in outputs] == [
        _hf_tokens(checkpoint, ids, n) for ids, n in zip(encoded, lengths, strict=True)]


@torch.inference_mode()
@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """3 prompts on 3 seats with 5 KV blocks (of 16 tokens) for 3 sequences of up to 2 blocks: requests are preempted
    and prefilled again from zero state; or chunks of 5 tokens (each chunk's conv reads the chunk before's last 3
    inputs from the conv state); greedy tokens as transformers', no block or row left held."""
    encoded = [hf_encode(checkpoint, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(artifact, device="cpu", max_num_seqs=3, **{"num_kv_blocks": 64, **options}) as llm:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded], params)
        stats = llm.stats()
        engine = llm.engine
        assert (stats["num_preemptions"] > 0) == ("num_kv_blocks" in options)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert sorted(engine._free_rows) == list(range(3))
    want = [_hf_tokens(checkpoint, ids, 16) for ids in encoded]
    assert [o.outputs[0].token_ids for o in outputs] == want


@torch.inference_mode()
def test_n_above_1_and_an_abort_mid_stream(checkpoint, artifact, hf_encode):
    """n = 2 samples of top_k 1 (each sequence its own prefill and state) both transformers' greedy tokens; a request
    aborted after 3 tokens gives its row (its state slot) back at once, and the request that takes that slot starts
    from zero state: its tokens are transformers'."""
    encoded = [hf_encode(checkpoint, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(artifact, device="cpu", max_num_seqs=2, num_kv_blocks=64) as llm:
        two = llm.generate([{"prompt_token_ids": encoded[0]}], SamplingParams(temperature=1.0, top_k=1, n=2,
                                                                               max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in two.outputs] == [_hf_tokens(checkpoint, encoded[0], 12)] * 2
    engine = Engine(artifact, device="cpu", max_num_seqs=2, num_kv_blocks=64, disable_log_stats=True)
    try:
        engine.add_request(None, params, prompt_token_ids=encoded[0], request_id="aborted")
        engine.add_request(None, params, prompt_token_ids=encoded[1], request_id="kept")
        results, delivered = {}, 0
        while delivered < 3:
            for output in engine.step():
                results[output.request_id] = output
            delivered = len(results["aborted"].outputs[0].token_ids) if "aborted" in results else 0
        row = engine.groups["aborted"].sequences[0].request.batch_row
        engine.abort_request("aborted")
        assert row in engine._free_rows
        engine.add_request(None, params, prompt_token_ids=encoded[2], request_id="next")
        while engine.has_unfinished_requests():
            for output in engine.step():
                results[output.request_id] = output
        assert engine.sequences == {} and sorted(engine._free_rows) == [0, 1]
        assert engine.scheduler.block_pool.num_free_blocks == 64
    finally:
        engine.close()
    assert results["kept"].outputs[0].token_ids == _hf_tokens(checkpoint, encoded[1], 12)
    assert results["next"].outputs[0].token_ids == _hf_tokens(checkpoint, encoded[2], 12)


@torch.inference_mode()
def test_runner_pooling_embeds_as_transformers(checkpoint, artifact, hf_encode):
    """runner pooling (convert embed: the last token's final hidden state, normalized) over two prompts prefilled in
    chunks of 8 on 2 seats (pool_hidden passes the state slots too): transformers' model's, normalized (1e-5)."""
    from tests.conftest import hf_model

    encoded = [hf_encode(checkpoint, p) for p in PROMPTS[:2]]
    with LLM(artifact, device="cpu", runner="pooling", max_num_seqs=2, max_num_batched_tokens=8,
             num_kv_blocks=64) as llm:
        outputs = llm.embed([{"prompt_token_ids": ids} for ids in encoded])
    for output, ids in zip(outputs, encoded, strict=True):
        last = hf_model(checkpoint).model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                   torch.nn.functional.normalize(last, dim=-1), atol=1e-5, rtol=1e-5)


def _hf_tokens(checkpoint, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens after `prompt` (no eos stop: ignore_eos's)."""
    from tests.conftest import hf_model

    ids = torch.tensor([prompt])
    out = hf_model(checkpoint).generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                        min_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("chunk_size", [64, 5])
def test_the_delta_rule_is_transformers(chunk_size):
    """chunked_delta_rule (chunks of 64 and 5 over 23 tokens) and recurrent_delta_rule (two sequences at once) from a
    random state: transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule's outputs and final
    states (q and k L2-normed there: use_qk_l2norm_in_kernel), 2 key heads grouped over 4 value heads."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    gen = torch.Generator().manual_seed(0)
    n, t, hk, hv, dk, dv = 2, 23, 2, 4, 8, 6
    q, k = torch.randn(n, t, hk, dk, generator=gen), torch.randn(n, t, hk, dk, generator=gen)
    v = torch.randn(n, t, hv, dv, generator=gen)
    g = -torch.rand(n, t, hv, generator=gen) * 2
    beta = torch.rand(n, t, hv, generator=gen)
    state = torch.randn(n, hv, dk, dv, generator=gen)
    want_chunk, want_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_steps, want_step_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = (l2_normalize(x).repeat_interleave(hv // hk, dim=2) for x in (q, k))
    qn = qn * dk ** -0.5
    for i in range(n):
        out, final = chunked_delta_rule(qn[i], kn[i], v[i], g[i], beta[i], state[i], chunk_size)
        torch.testing.assert_close(out, want_chunk[i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, want_state[i], atol=1e-4, rtol=1e-4)
    out, final = recurrent_delta_rule(qn, kn, v, g, beta, state)
    torch.testing.assert_close(out, want_steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_step_state, atol=1e-5, rtol=1e-5)


def test_the_default_config_reads_as_transformers():
    """Qwen3_5TextConfig's defaults (transformers' "Qwen3.5-9B style"; layer_types from full_attention_interval 4,
    partial_rotary_factor 0.25 filled in) read as transformers reads them: every fourth layer full attention, 64 of
    256 dims rotated, and transformers' parameter count."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import spec_for_architecture

    hf_config = Qwen3_5TextConfig(num_hidden_layers=8)
    config = {**hf_config.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    config.pop("layer_types")
    model = model_config_from_hf(config, spec_for_architecture("Qwen3_5ForCausalLM"), "bfloat16")
    assert (model.linear_attention_layers, model.kv_layers, model.rotary_dim, model.linear_num_value_heads) == (
        [0, 1, 2, 4, 5, 6], [3, 7], 64, 32)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def hf_state(artifact) -> dict[str, torch.Tensor]:
    """A Qwen3.5 artifact's weights as transformers' state dict: each linear dequantized by the formats' oracle
    (quant/reference.py) and split into its HF members, the (1 + w) norms unfolded, the full layer's q rows (not its
    gate rows), k rows and q/k norms permuted back (hf_checkpoint.rotary_fold). Qwen3.5-MoE's sparse MLPs: the
    experts stacked as transformers holds them (gate_up_proj [E, 2 * width, hidden], down_proj [E, hidden, width]),
    the router, the shared expert and its gate."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model, modules = manifest["model"], manifest["quant"]["modules"]
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    head_dim = model["head_dim"]
    inverse = torch.argsort(partial_rotary_permutation(head_dim, model["rotary_dim"]))

    def weight(name: str, expert: int | None = None) -> torch.Tensor:
        params = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
        if expert is not None:
            params = {k: v[expert] for k, v in params.items()}
        return dequantize(make_format(modules[name], torch.float32), params).float()

    def unpermute(rows: torch.Tensor, gated: bool = False) -> torch.Tensor:
        if gated:
            heads = rows.unflatten(0, (-1, 2, head_dim))
            return torch.stack((heads[:, 0, inverse], heads[:, 1]), dim=1).flatten(0, 2)
        return rows.unflatten(0, (-1, head_dim))[:, inverse].flatten(0, 1)

    state = {"model.embed_tokens.weight": tensors["embed.weight"], "model.norm.weight": tensors["norm.weight"] - 1,
             "lm_head.weight": weight("lm_head")}
    q, kv = 2 * model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim
    key = model["linear_num_key_heads"] * model["linear_key_head_dim"]
    value = model["linear_num_value_heads"] * model["linear_value_head_dim"]
    for i in range(model["num_layers"]):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        state |= {hf + "input_layernorm.weight": tensors[ours + "input_norm.weight"] - 1,
                  hf + "post_attention_layernorm.weight": tensors[ours + "post_attn_norm.weight"] - 1}
        if i in model.get("moe_layers", []):
            experts = range(model["num_experts"])
            shared = hf + "mlp.shared_expert."
            state |= {hf + "mlp.experts.gate_up_proj": torch.stack([weight(ours + "moe.experts.gate_up", e)
                                                                    for e in experts]),
                      hf + "mlp.experts.down_proj": torch.stack([weight(ours + "moe.experts.down", e)
                                                                 for e in experts]),
                      hf + "mlp.gate.weight": tensors[ours + "moe.gate.weight"],
                      hf + "mlp.shared_expert_gate.weight": tensors[ours + "moe.shared_gate.weight"],
                      shared + "down_proj.weight": weight(ours + "moe.shared.down")}
            state[shared + "gate_proj.weight"], state[shared + "up_proj.weight"] = weight(
                ours + "moe.shared.gate_up").chunk(2)
        else:
            state[hf + "mlp.down_proj.weight"] = weight(ours + "mlp.down")
            state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"] = weight(ours + "mlp.gate_up").chunk(2)
        if i in model["linear_attention_layers"]:
            la = hf + "linear_attn."
            qkv, z = weight(ours + "attn.in_qkvz").split([2 * key + value, value])
            b, a = tensors[ours + "attn.in_ba.weight"].chunk(2)
            state |= {la + "in_proj_qkv.weight": qkv, la + "in_proj_z.weight": z, la + "in_proj_b.weight": b,
                      la + "in_proj_a.weight": a, la + "out_proj.weight": weight(ours + "attn.out"),
                      la + "conv1d.weight": tensors[ours + "attn.conv.weight"][:, None],
                      la + "A_log": tensors[ours + "attn.A_log.weight"],
                      la + "dt_bias": tensors[ours + "attn.dt_bias.weight"],
                      la + "norm.weight": tensors[ours + "attn.norm.weight"]}
            continue
        wq, wk, wv = weight(ours + "attn.qkv").split([q, kv, kv])
        state |= {hf + "self_attn.q_proj.weight": unpermute(wq, gated=True),
                  hf + "self_attn.k_proj.weight": unpermute(wk),
                  hf + "self_attn.v_proj.weight": wv, hf + "self_attn.o_proj.weight": weight(ours + "attn.o"),
                  hf + "self_attn.q_norm.weight": unpermute(tensors[ours + "attn.q_norm.weight"] - 1),
                  hf + "self_attn.k_norm.weight": unpermute(tensors[ours + "attn.k_norm.weight"] - 1)}
    return state


@torch.inference_mode()
def test_float32_weights_read_back_as_transformers(checkpoint, artifact):
    """hf_state of the float32 build is the checkpoint's own state dict (what the quantized test's oracle rests on)."""
    assert_reads_back(hf_state(artifact), checkpoint)


def assert_reads_back(got: dict[str, torch.Tensor], checkpoint) -> None:
    """`got` (a float32 artifact's weights as transformers' state dict) is transformers' own state dict of
    `checkpoint`: the same names, every tensor to 1e-6."""
    from tests.conftest import hf_model

    want = hf_model(checkpoint).state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name].float(), tensor.float(), atol=1e-6, rtol=1e-6, msg=name)


# transformers' linears of a Qwen3.5 (-MoE) decoder layer → the artifact's linear holding their rows
HF_LINEARS = {"linear_attn.in_proj_qkv": "attn.in_qkvz", "linear_attn.in_proj_z": "attn.in_qkvz",
              "linear_attn.out_proj": "attn.out", "self_attn.q_proj": "attn.qkv", "self_attn.k_proj": "attn.qkv",
              "self_attn.v_proj": "attn.qkv", "self_attn.o_proj": "attn.o", "mlp.gate_proj": "mlp.gate_up",
              "mlp.up_proj": "mlp.gate_up", "mlp.down_proj": "mlp.down", "mlp.shared_expert.gate_proj":
              "moe.shared.gate_up", "mlp.shared_expert.up_proj": "moe.shared.gate_up",
              "mlp.shared_expert.down_proj": "moe.shared.down"}


def hf_linears(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{transformers' module: the artifact's linear} of the decoder linears in hf_state's `state`."""
    linears = {}
    for key in state:
        prefix, _, rest = key.partition(".layers.")
        index, _, module = rest.removesuffix(".weight").partition(".")
        if module in HF_LINEARS:
            linears[f"{prefix}.layers.{index}.{module}"] = f"layers.{index}.{HF_LINEARS[module]}"
    return linears


FP8_CASES = [{"method": "fp8"}, {"method": "fp8", "weights": "block"},
             {"method": "fp8", "weights": "per_tensor", "activations": "static"}]


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32}, {"method": "gptq", "bits": 4, "group_size": 32}, FP8_CASES[0],
    pytest.param(FP8_CASES[1], marks=pytest.mark.slow), FP8_CASES[2]],
    ids=["rtn-w4", "gptq-w4", "fp8", "fp8-block", "fp8-static"])
def test_quantized_builds_run_transformers_on_their_weights(quantization, checkpoint, tmp_path, hf_encode, data_dir):
    """RTN and GPTQ (calibrated through the DeltaNet layers: test_the_calibration_runs_a_deltanet_layer_...) W4 and FP8
    W8A8 (per channel and per token, in 128-blocks, per tensor with calibrated static input scales) of every linear
    (the full layer's qkv and o, the DeltaNets' in_qkvz and out, the MLPs, lm_head under W4; in_ba, the conv,
    A_log, dt_bias dense) against transformers' model holding its dequantized weights, each FP8 linear's input
    rounded to E4M3 as the scheme rounds it (hf_oracle.hf_model_on_weights_of): logits over 34 positions (1e-4; FP8:
    hf_oracle.FP8_CHECK) and 12 greedy tokens."""
    from tests.runtime.hf_oracle import FP8_CHECK, check_against_oracle, hf_model_on_weights_of, oracle_method

    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    want = {"rtn": "w4a16", "gptq": "w4a16", "fp8": "w8a8-fp8-block" if quantization.get("weights") == "block"
            else "w8a8-fp8"}[quantization["method"]]
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(0, "attn.in_qkvz"), (0, "attn.out"), (2, "attn.qkv"), (2, "attn.o"), (3, "mlp.gate_up")]} == {want}
    state = hf_state(out)
    oracle = hf_model_on_weights_of(checkpoint, out, oracle_method(quantization), state, hf_linears(state))
    with LLM(out, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        check_against_oracle(llm, oracle, checkpoint, hf_encode, PROMPTS, max_tokens=12,
                             **(FP8_CHECK if quantization["method"] == "fp8" else {}))


@torch.inference_mode()
@pytest.mark.parametrize("layout, form", [("fp8", "text"), ("compressed-tensors", "text"),
                                          ("fp8", "conditional generation")])
def test_an_fp8_checkpoint_imports(layout, form, checkpoint, tmp_path, hf_encode):
    """A block-FP8 checkpoint (every decoder linear: the DeltaNets' in_proj_qkv, in_proj_z and out_proj, the full
    layer's q/k/v/o, the MLPs; in transformers' `quant_method: fp8` layout or compressed-tensors' FP8_BLOCK, written
    here by the published definition: tests/quant/test_fp8_block_import.py; as the text model, or as
    Qwen3_5ForConditionalGeneration, the form Qwen3.5's dense releases take, its vision tower dense) imports with
    `quantization.method: import`: every linear's weights are the checkpoint's dequantized blocks exactly (the full
    layer's q rows moved with their scales), and the artifact is transformers on those weights with each linear's
    input rounded per token and 128 inputs (hf_oracle.FP8_CHECK)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.runtime.hf_oracle import check_fp8_import

    source = checkpoint if form == "text" else write_conditional_generation(
        checkpoint, tmp_path / "cg", Qwen3_5ForConditionalGeneration, Qwen3_5Config)
    quantized = check_fp8_import(source, checkpoint, tmp_path, hf_encode, PROMPTS,
                                 ("in_proj_qkv", "in_proj_z", "out_proj"), layout,
                                 lambda out: ((state := hf_state(out)), hf_linears(state)),
                                 lambda name: name.replace(".language_model.", "."))
    assert {name for name in quantized if "linear_attn" in name} == {
        f"model.layers.{i}.linear_attn.{n}" for i in (0, 1, 3) for n in ("in_proj_qkv", "in_proj_z", "out_proj")}


@torch.inference_mode()
def test_static_fp8_input_scales_are_the_calibration_inputs_absmax(checkpoint, tmp_path, data_dir):
    """FP8 with static activations: the first DeltaNet layer's in_qkvz and out input scales are the largest magnitude
    of what transformers' float model feeds in_proj_qkv and out_proj over the calibration windows, over 448 (E4M3's
    largest)."""
    from transformers import AutoTokenizer

    from llmc.compiler.calibration import calibration_windows
    from tests.conftest import hf_model

    out = build_quantized(checkpoint, tmp_path, data_dir, FP8_CASES[2])
    tensors = load_file(out / "rank-00" / "weights.safetensors")
    windows, _ = calibration_windows(AutoTokenizer.from_pretrained(str(checkpoint)), data_dir / "calibration.txt",
                                     num_samples=4, seq_len=32, seed=None)
    model, absmax = hf_model(checkpoint), {}
    for name in ("in_proj_qkv", "out_proj"):
        getattr(model.model.layers[0].linear_attn, name).register_forward_pre_hook(
            lambda _, args, name=name: absmax.__setitem__(name, max(absmax.get(name, 0.0), args[0].abs().max().item())))
    for window in windows:  # (each window from zero state, as calibration runs them)
        model(window[None])
    for name, linear in (("in_proj_qkv", "attn.in_qkvz"), ("out_proj", "attn.out")):
        torch.testing.assert_close(tensors[f"layers.0.{linear}.input_scale"].item(), absmax[name] / 448.0,
                                   rtol=1e-5, atol=0)


@torch.inference_mode()
def test_the_calibration_runs_a_deltanet_layer_as_transformers(checkpoint):
    """What GPTQ calibrates on: LayerRunner's forward of a Gated DeltaNet layer (every window from zero state, no
    slots) is transformers' decoder layer on the same hidden states (2 windows of 32 tokens)."""
    from llmc.compiler.calibration import LayerRunner
    from llmc.compiler.convert import read_layer
    from llmc.compiler.hf_checkpoint import TensorReader, model_config_from_hf, norm_fold, read_hf_config
    from llmc.runtime.models import spec_for_architecture
    from tests.conftest import hf_model

    spec = spec_for_architecture("Qwen3_5ForCausalLM")
    config = model_config_from_hf(read_hf_config(checkpoint), spec, "float32")
    runner = LayerRunner(config, 32, torch.device("cpu"))
    with TensorReader(checkpoint, merge=norm_fold(spec, config)) as reader:
        module = runner.build_layer(read_layer(reader, spec, config, 1))
    hidden = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(3))
    want = hf_model(checkpoint).model.layers[1](hidden, position_embeddings=None)
    torch.testing.assert_close(runner.forward(module, hidden), want, atol=1e-4, rtol=1e-4)


def write_conditional_generation(checkpoint, dest, model_class, config_class):
    """The checkpoint's text model saved in `dest` as `model_class` (Qwen3.5's or Qwen3.5-MoE's ConditionalGeneration:
    its config's text_config, its weights under model.language_model.*, a one-layer vision tower beside them)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from tests.conftest import TOKENIZER_FILES

    text = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14, "num_position_embeddings": 16}
    model = model_class(config_class(text_config=text.config.to_dict(), vision_config=vision))
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        shutil.copyfile(checkpoint / name, dest / name)
    return dest


def check_conditional_generation(checkpoint, tmp_path, hf_logits, hf_encode, model_class, config_class, tolerance):
    """The checkpoint's text model saved as `model_class` (Qwen3.5's or Qwen3.5-MoE's ConditionalGeneration: its
    config's text_config, its weights under model.language_model.*, a one-layer vision tower beside them) builds an
    artifact scored as transformers' `model_class` loaded from it scores text ids (to `tolerance`; that model equal to
    the text model's, 1e-5), and an image is refused by name. Returns the artifact's model config."""
    from PIL import Image

    from tests.runtime.hf_oracle import build_float32

    source = write_conditional_generation(checkpoint, tmp_path / "cg", model_class, config_class)
    built = build_float32(source, tmp_path / "a")
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    reference = model_class.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager").eval()
    want = reference(input_ids=torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(want, hf_logits(checkpoint, token_ids), atol=1e-5, rtol=1e-5)
    with LLM(built, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), want, atol=tolerance, rtol=tolerance)
        with pytest.raises(RequestError, match="vision tower is not built"):
            image = Image.new("RGB", (28, 28))
            llm.generate([{"prompt": "Describe <|image_pad|>", "multi_modal_data": {"image": image}}],
                         SamplingParams(max_tokens=2))
    return read_manifest(built).model


@torch.inference_mode()
def test_conditional_generation_serves_its_language_model(checkpoint, tmp_path, hf_logits, hf_encode):
    """Qwen3_5ForConditionalGeneration's config form (text_config) and weights (model.language_model.*, a one-layer
    vision tower beside them): its artifact is the text model's, scored as transformers'
    Qwen3_5ForConditionalGeneration loaded from it scores text ids (1e-4); an image is refused by name."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    m = check_conditional_generation(checkpoint, tmp_path, hf_logits, hf_encode, Qwen3_5ForConditionalGeneration,
                                     Qwen3_5Config, 1e-4)
    assert (m.architecture, m.family, m.linear_attention_layers, m.vocab_size) == (
        "Qwen3_5ForConditionalGeneration", "qwen3_5", [0, 1, 3], 4096)


def _rounding_state_to(dtype: torch.dtype, delta_rule):
    """transformers' delta rule (one call per forward of a layer: a prompt, or a decode step) leaving its state rounded
    to `dtype`, as the engine stores it after each step."""
    def rule(*args, **kwargs):
        out, state = delta_rule(*args, **kwargs)
        return out, None if state is None else state.to(dtype).to(state.dtype)
    return rule


@torch.inference_mode()
def test_a_bfloat16_recurrent_state_is_transformers_state_rounded_each_step(checkpoint, artifact, hf_model, hf_encode,
                                                                            monkeypatch):
    """mamba_ssm_cache_dtype bfloat16 (vLLM's knob): the recurrent states are stored in bfloat16, the conv states stay
    in the compute dtype (half the recurrent bytes); greedy tokens and logprobs of prompts prefilled in one step each,
    then decoded, are transformers' generate whose delta rule rounds the state it leaves to bfloat16 after each forward
    (the engine's rounding points) to 2e-4, where the float32 states' logprobs are further from them. mamba_cache_dtype
    float16 stores both states in float16."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf

    encoded = [hf_encode(checkpoint, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    got = {}
    for state_dtype in ("bfloat16", "auto"):
        with LLM(artifact, device="cpu", max_num_seqs=3, num_kv_blocks=64, mamba_ssm_cache_dtype=state_dtype) as llm:
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded], params)
            layer = llm.engine.runner.model.layers["0"].attn
            assert (layer.conv_state.dtype, layer.recurrent_state.dtype) == (
                torch.float32, torch.bfloat16 if state_dtype == "bfloat16" else torch.float32)
            slot_bytes = layer.conv_dim * 3 * 4 + 4 * 16 * 16 * layer.recurrent_state.itemsize  # (3 such layers)
            assert llm.engine.runner.state_bytes == 4 * 3 * slot_bytes  # max_num_seqs + 1 slots
            # what the build's memory plan counts for them (memory.estimate)
            assert memory.linear_state_bytes_per_slot(read_manifest(artifact).model, *art.state_dtypes(
                llm.engine.options, "float32")) == 3 * slot_bytes
        got[state_dtype] = [(o.outputs[0].token_ids, [step[t] for step, t in zip(o.outputs[0].logprobs,
                                                                                   o.outputs[0].token_ids)])
                            for o in outputs]
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(hf, name, _rounding_state_to(torch.bfloat16, getattr(hf, name)))
    for ids, (tokens, logprobs), (_, float32_logprobs) in zip(encoded, got["bfloat16"], got["auto"], strict=True):
        generated = hf_model(checkpoint).generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=12,
            do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert generated.sequences[0, len(ids):].tolist() == tokens
        want = torch.stack([step[0].log_softmax(-1)[t] for step, t in zip(generated.logits, tokens, strict=True)])
        torch.testing.assert_close(torch.tensor([float(p) for p in logprobs]), want, atol=2e-4, rtol=0)
        assert (torch.tensor([float(p) for p in float32_logprobs]) - want).abs().max() > 2e-4
    with LLM(artifact, device="cpu", max_num_seqs=3, num_kv_blocks=64, mamba_cache_dtype="float16") as llm:
        layer = llm.engine.runner.model.layers["0"].attn
        assert layer.conv_state.dtype == layer.recurrent_state.dtype == torch.float16


def test_the_memory_plan_counts_the_states_at_their_dtypes(checkpoint, artifact):
    """The build's estimate holds the states of max_num_seqs + 1 slots apart from the CUDA context (hybrid states), at
    their dtypes: bf16 recurrent states take their share's half and leave the KV cache that much more; `llmc inspect`
    and the build summary say them."""
    import dataclasses

    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.cli_report import _state_rows

    manifest = read_manifest(artifact)
    m, runtime = manifest.model, manifest.runtime
    conv = (2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim) * (
        m.linear_conv_kernel_dim - 1)
    recurrent = m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim
    slots = runtime.max_num_seqs + 1
    assert manifest.plan.memory["state_bytes"] == slots * 3 * (conv + recurrent) * 4  # (a float32 build: 3 DeltaNets)
    assert manifest.plan.memory["other_bytes"] == memory.CUDA_CONTEXT_BYTES

    def plan(**options):
        return memory.least_room(memory.estimate_per_rank(m, manifest.parallel, manifest.plan.weight_bytes_per_rank,
                                                          manifest.kv.dtype, dataclasses.replace(runtime, **options),
                                                          80 * memory.GIB))
    full, half = plan(), plan(mamba_ssm_cache_dtype="bfloat16")
    assert full.state_bytes - half.state_bytes == slots * 3 * recurrent * 2
    assert half.num_kv_tokens >= full.num_kv_tokens + (full.state_bytes - half.state_bytes) // full.kv_bytes_per_token - 16
    shown = CliRunner().invoke(cli, ["inspect", str(artifact)])
    assert shown.exit_code == 0 and "hybrid states " in shown.output
    assert _state_rows(manifest)[0][1].startswith(f"{(3 * (conv + recurrent) * 4) / 1024:.1f} KiB per request (conv "
                                                  f"float32, recurrent float32), ")


def test_what_a_hybrid_model_refuses(checkpoint, artifact, tmp_path, caplog):
    """Refused by name: prefix caching asked for (off by default), speculative decoding, LoRA,
    multi-step scheduling, beam search; at build an ONNX target, tensor / pipeline parallel, int8 (AWQ alike), an
    import of an integer checkpoint, attention_bias, an unknown layer type; `llmc export`."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "Qwen3_5ForCausalLM")
    with caplog.at_level("INFO", logger="llmc"), LLM(artifact, device="cpu", num_kv_blocks=64) as llm:
        with pytest.raises(RequestError, match="use_beam_search: not supported for Qwen3_5ForCausalLM"):
            llm.engine.add_request(None, SamplingParams(use_beam_search=True, n=2, max_tokens=4),
                                   prompt_token_ids=[5, 6, 7])
    assert "Gated DeltaNet states (conv float32, recurrent float32): " in caplog.text
    assert read_manifest(artifact).runtime.enable_prefix_caching is False  # (the build's default for it, logged)
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    refused(CheckpointError, "import is not supported for Qwen3_5ForCausalLM .* from awq .*; quantize the float",
            recipe={"quantization": {"method": "import"}}, quantization_config=awq)
    refused(CheckpointError, "attention_bias: true is not supported", attention_bias=True)
    refused(CheckpointError, "layer_types .*: one of linear_attention or full_attention",
            layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"])
    with pytest.raises(ArtifactError, match="cannot export architecture Qwen3_5ForCausalLM: a hybrid model"):
        export_artifact(artifact, tmp_path / "export")


def check_hybrid_refusals(checkpoint, artifact, tmp_path, architecture: str):
    """What every hybrid model refuses by name (Qwen3.5's, Granite 4.0's): at start prefix caching asked for,
    speculative decoding, LoRA, multi-step scheduling; at build an ONNX target, tensor parallel, int8. Returns
    `refused(error, match, recipe=None, **config_changes)`, a build of the checkpoint (its config changed) refused."""
    def refused_at_start(match, **options):
        with pytest.raises(ConfigError, match=match):
            LLM(artifact, device="cpu", num_kv_blocks=64, **options)

    refused_at_start(f"enable_prefix_caching: {architecture} .* has no prefix caching", enable_prefix_caching=True)
    refused_at_start(f"speculative_config: not supported for {architecture}",
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    refused_at_start("enable_lora: not supported", enable_lora=True)
    refused_at_start("num_scheduler_steps: not supported", num_scheduler_steps=4)

    def refused(error, match, recipe=None, **changes):
        source = write_config(checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoint
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(RecipeError, "target.device onnx-cpu: .* is not exported to ONNX",
            recipe={"target": {"device": "onnx-cpu"}})
    refused(RecipeError, "parallel: .* runs on one rank", recipe={"parallel": {"tensor": 2}})
    refused(RecipeError, "quantization.method int8: .* builds with none, rtn, gptq, fp8",
            recipe={"quantization": {"method": "int8"}})
    return refused


@torch.inference_mode()
def check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits, every_layer_attends: bool = False):
    """The GPU's memory profile (memory_profile.profile_activation_bytes) run on the CPU, its CUDA counters stubbed:
    it binds a KV cache to the attention layers alone (a hybrid's state layers hold none; every_layer_attends:
    Falcon-H1's, each its Mamba-2 mixer beside the attention), its two fresh prompts of zeros (16 and 8 tokens) give
    transformers' probabilities at the logits rows (the second prompt's last 4), and it leaves every layer unbound."""
    from llmc.runtime import memory_profile
    from llmc.runtime.loader import build_model

    manifest = read_manifest(artifact)
    model = build_model(artifact, manifest, torch.device("cpu"), max_positions=16)
    probs = []
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    options = art.RuntimeDefaults(max_num_batched_tokens=24, max_num_seqs=4, max_model_len=16, block_size=16)
    memory_profile.profile_activation_bytes(model, options, torch.device("cpu"),
                                            lambda ids, batch: probs.append(memory_profile.run_profile_step(
                                                model, ids, batch)))
    want = torch.softmax(hf_logits(checkpoint, [0] * 8)[4:], dim=-1)
    torch.testing.assert_close(probs[0], want, atol=2e-5, rtol=0)
    assert all(attn.kv_cache is None for attn in model.kv_attentions())
    assert len(model.kv_attentions()) == len(manifest.model.kv_layers)
    assert (len(model.kv_attentions()) == len(model.layers)) == every_layer_attends


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifact on CUDA (Triton attention in the full layer, the conv and delta rule on their Triton
    kernels; decode steps replay CUDA graphs that read the state slots, prefill and mixed steps eager): transformers'
    logits (2e-3), greedy tokens and logprobs, also with the first request finishing first; the same with
    enforce_eager."""
    encoded = [hf_encode(checkpoint, p) for p in PROMPTS]
    lengths = [3, 12, 8]
    for eager in (False, True):
        with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16,
                 enforce_eager=eager) as llm:
            runner = llm.engine.runner
            assert runner.pieces is None and (runner.graphs is None) == eager
            _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, tolerance=2e-3)
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded],
                                   [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
            assert eager or runner.graphs.num_replays > 0
        assert [o.outputs[0].token_ids for o in outputs] == [
            _hf_tokens(checkpoint, ids, n) for ids, n in zip(encoded, lengths, strict=True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("quantization", FP8_CASES[:2], ids=["fp8", "fp8-block"])
def test_an_fp8_build_on_the_gpu(quantization, checkpoint, tmp_path, hf_encode, hf_logits, data_dir, free_gpu):
    """An FP8 build (per channel, and in 128-blocks; dynamic activations) on CUDA: its linears on the FP8 GEMMs, the
    DeltaNets on their Triton kernels, decode steps from CUDA graphs. On this tiny random model FP8 on CUDA does not
    reproduce the CPU's FP8 reference path position by position (session 42 measured the same for every family, RESULTS
    "Session 42" §2; session 54: 1.2-4.7 of logits up to 38 here, 0.5-1.6 of 18 for a tiny Llama), so it is held to
    the CPU's quality instead: its logits' mean distance from transformers' float32 model at most 1.5 times the CPU
    build's, and the graphs replayed."""
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    want = hf_logits(checkpoint, token_ids)
    distance = {}
    for device in ("cpu", "cuda"):
        with LLM(out, device=device, gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16) as llm:
            distance[device] = float((llm.engine.score(token_ids).cpu().float() - want).abs().mean())
            if device == "cuda":
                llm.generate([{"prompt_token_ids": token_ids[:5]}], SamplingParams(temperature=0, max_tokens=4))
                assert llm.engine.runner.graphs.num_replays > 0
    print(f"FP8 logits' mean distance from the float32 model: {distance}")
    assert distance["cuda"] <= 1.5 * distance["cpu"], distance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_long_prompts_prefill_on_the_chunked_kernels_on_the_gpu(checkpoint, artifact, hf_model, monkeypatch, free_gpu):
    """Prompts of 150 and 200 tokens (3-4 chunks of 64) prefilled in one step each on CUDA, so the delta rule runs on
    the chunked kernels (tf32 products: kernels/recurrent_triton.DOT_PRECISION), beside a 1-token prompt on the token
    loop: transformers' greedy tokens and their logprobs (float32 artifact, transformers on the CPU) to 5e-3, where the
    float32 path holds 2e-3 (test_on_the_gpu): tf32 keeps 10 of float32's 23 mantissa bits (call 3 of session 53:
    2.8e-3 off on the fifth token)."""
    import llmc.kernels.recurrent_triton as recurrent_triton

    calls = []
    chunked = recurrent_triton.delta_rule_chunked
    monkeypatch.setattr(recurrent_triton, "delta_rule_chunked", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (150, 1, 200)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=512,
             max_model_len=256, enforce_eager=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    assert calls
    for ids, output in zip(prompts, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        generated = hf_model(checkpoint).generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=6,
            do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert generated.sequences[0, len(ids):].tolist() == tokens
        want = torch.stack([step[0].log_softmax(-1)[t] for step, t in zip(generated.logits, tokens, strict=True)])
        got = torch.tensor([float(step[t]) for step, t in zip(output.outputs[0].logprobs, tokens, strict=True)])
        torch.testing.assert_close(got, want.float(), atol=5e-3, rtol=0)


def test_a_checkpoints_mtp_layer_is_left_out_and_said(checkpoint, tmp_path, caplog):
    """A checkpoint holding Qwen3.5's multi-token prediction tensors (mtp.*, as the published ones do; transformers
    skips them) builds the same weights as without them, and the build says the layer is not built."""
    import logging
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.runtime.hf_oracle import build_float32

    source = tmp_path / "with-mtp"
    shutil.copytree(checkpoint, source)
    tensors = load_file(source / "model.safetensors")
    tensors |= {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.ones(64)}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="llmc"):
        built = build_float32(source, tmp_path / "a")
    assert "multi-token prediction layer (2 mtp.* tensors) is not built" in caplog.text
    plain = build_float32(checkpoint, tmp_path / "b")
    assert load_file(built / "rank-00" / "weights.safetensors").keys() == \
        load_file(plain / "rank-00" / "weights.safetensors").keys()


def check_16_bit_states_on_the_gpu(checkpoint, artifact, hf_encode, **state_dtypes):
    """The state kernels on CUDA with 16-bit states (decode graphs, eager prefill): the CPU engine's greedy tokens and
    logprobs with the same state dtypes (the CPU path is checked against transformers above) to 2e-3."""
    encoded = [hf_encode(checkpoint, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    got = []
    for device in ("cpu", "cuda"):
        with LLM(artifact, device=device, max_num_seqs=3, num_kv_blocks=64, **state_dtypes) as llm:
            got.append([o.outputs[0] for o in llm.generate([{"prompt_token_ids": ids} for ids in encoded], params)])
            states = llm.engine.runner.model.state_layers()[0].states()
            assert states[-1].dtype == getattr(torch, state_dtypes.get("mamba_ssm_cache_dtype", "float16"))
            assert device == "cpu" or llm.engine.runner.graphs.num_replays > 0
    for cpu, cuda in zip(*got, strict=True):
        assert cuda.token_ids == cpu.token_ids
        logprob = lambda out: torch.tensor([float(s[t]) for s, t in zip(out.logprobs, out.token_ids)])  # noqa: E731
        torch.testing.assert_close(logprob(cuda), logprob(cpu), atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_a_bfloat16_recurrent_state_on_the_gpu(checkpoint, artifact, hf_encode, free_gpu):
    check_16_bit_states_on_the_gpu(checkpoint, artifact, hf_encode, mamba_ssm_cache_dtype="bfloat16")
