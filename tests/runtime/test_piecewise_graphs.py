"""Piecewise CUDA graphs of prefill and mixed steps: the cut forward against the model's own forward
(on a CPU, the pieces run eagerly), the sizes, the option; on a GPU, replay against eager."""

import dataclasses
import gc

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, RecipeError
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.model_runner import ModelRunner, allocate_kv_caches
from llmc.runtime.options import resolve_options
from llmc.runtime.parallel.layout import whole_model_layout
from llmc.runtime.mixed_graphs import MixedGraphs
from llmc.runtime.piecewise_graphs import PiecewiseGraphs

BLOCK_SIZE = 16
NUM_BLOCKS = 12
MAX_MODEL_LEN = 128


def _artifact(checkpoint, out, dtype="float32", **quantization):
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": dtype,
                            "quantization": quantization or {"method": "none"},
                            "runtime": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8}}), show_progress=False)
    return out


def test_capture_sizes_stop_at_the_bound_and_the_token_budget():
    assert memory.piecewise_sizes(512, 2048) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert memory.piecewise_sizes(512, 100) == [8, 16, 24, 32, 48, 64, 96, 100]
    assert memory.piecewise_sizes(40, 2048) == [8, 16, 24, 32, 40]
    assert memory.piecewise_sizes(4, 2048) == [4]
    assert memory.piecewise_allowance_bytes(art.ModelConfig.__new__(art.ModelConfig), []) == 0


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory, hf_checkpoint_factory):
    """A sliding window of 8 (tiny_mistral has none), shorter than the step's contexts (20-27)."""
    return hf_checkpoint_factory(tmp_path_factory.mktemp("windowed_mistral"), "mistral", sliding_window=8)


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tmp_path_factory, hf_checkpoint_factory):
    """DeepSeek-V3's latent attention (runtime/models/mla.py: its own project / attend / output) and routing."""
    return hf_checkpoint_factory(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")


class MixedStep:
    """A CPU model (no graphs) with cached prefixes, every block no sequence owns filled with 7.0, and
    a mixed step of 27 tokens (a prompt chunk after a cached prefix, a fresh prompt, two decode rows)
    whose hidden states and KV cache the model's own forward gave, the cache then put back."""

    def __init__(self, family, request, tmp_path, forward_step):
        artifact = _artifact(request.getfixturevalue(family), tmp_path / "a")
        manifest = art.read_manifest(artifact)
        self.runner = ModelRunner(artifact, manifest, resolve_options(manifest, {"num_kv_blocks": NUM_BLOCKS}),
                                  torch.device("cpu"))
        assert self.runner.pieces is None and self.runner.graphs is None  # never on a CPU
        self.runner.kv_caches = allocate_kv_caches(manifest, whole_model_layout(manifest.model), NUM_BLOCKS + 1,
                                                   BLOCK_SIZE, torch.device("cpu"))
        self.runner.model.bind_kv_caches(self.runner.kv_caches)
        self.model = model = self.runner.model
        if family == "windowed_mistral":
            assert all(layer.attn.sliding_window == 8 for layer in model.layers.values())
        gen = torch.Generator().manual_seed(0)
        self.tokens = lambda n: torch.randint(5, 200, (n,), generator=gen).tolist()  # noqa: E731
        prefixes = [([0, 1], 0, self.tokens(20)), ([2], 0, self.tokens(3)), ([3], 0, self.tokens(9))]
        model(*forward_step(prefixes, "cpu"))
        for caches in self.runner.kv_caches:  # (K and V; DeepSeek's one latent cache)
            for cache in caches:
                cache[6:].fill_(7.0)
        self.input_ids, self.batch = forward_step([([0, 1], 20, self.tokens(7)), ([2], 3, [11]),
                                                   ([4, 5], 0, self.tokens(18)), ([3], 9, [12])], "cpu")
        self.before = self.caches()
        self.eager = model(self.input_ids, self.batch)
        self.eager_caches = self.caches()
        for caches, saved in zip(self.runner.kv_caches, self.before):
            for cache, old in zip(caches, saved):
                cache.copy_(old)

    def caches(self) -> list[torch.Tensor]:
        return [torch.stack(caches).clone() for caches in self.runner.kv_caches]

    def assert_matches_eager(self, hidden: torch.Tensor) -> None:
        """The eager hidden states and KV cache, and only the scratch block written besides."""
        torch.testing.assert_close(hidden, self.eager, atol=2e-5, rtol=2e-5)
        for cache, full, old in zip(self.caches(), self.eager_caches, self.before):
            torch.testing.assert_close(cache[:, :6], full[:, :6], atol=2e-5, rtol=2e-5)
            assert torch.equal(cache[:, 6:NUM_BLOCKS], old[:, 6:NUM_BLOCKS])  # nobody's blocks: untouched
            assert not torch.equal(cache[:, NUM_BLOCKS], old[:, NUM_BLOCKS])  # the padding rows wrote here


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "windowed_mistral", "tiny_qwen3_moe", "tiny_gemma3",
                                    "tiny_gemma2", "tiny_olmo2", "tiny_deepseek_v3"])
@torch.inference_mode()
def test_the_cut_forward_is_the_model_forward_and_padding_writes_only_the_scratch_block(family, request, tmp_path,
                                                                                       forward_step):
    """The pieces of a mixed step run in order with each layer's attention between them, padded to a
    larger size whose padding rows hold an earlier step's tokens: the hidden states and the KV cache
    of the model's forward, and only the scratch block written besides (qk_norm, a sliding window, MoE
    layers; Gemma 3's sandwich norms and second rotary table; Gemma 2's attention soft cap in `attend`; OLMo 2's
    residual stream read by qkv and gate_up, and its full-width q/k norms in `project`; DeepSeek's latent attention,
    whose `project` rotates its rope part and writes the latent cache, and whose `attend` writes v_head_dim dims)."""
    step = MixedStep(family, request, tmp_path, forward_step)
    n = step.batch.num_tokens  # 27: padded to 32
    pieces = PiecewiseGraphs(step.model, [8, 16, 32, 48], NUM_BLOCKS * BLOCK_SIZE, torch.device("cpu"))
    wide_ids, wide = forward_step([([0, 1], 0, step.tokens(16)), ([4, 5], 0, step.tokens(24))], "cpu")
    pieces.load(wide_ids, wide)  # an earlier step of 40 tokens leaves real slots in rows 27..39
    size = pieces.load(step.input_ids, step.batch)
    assert size == 32 and pieces.slot_mapping[n:size].eq(NUM_BLOCKS * BLOCK_SIZE).all()
    assert pieces.slot_mapping[size] != NUM_BLOCKS * BLOCK_SIZE  # beyond the size: not the step's
    residual = pieces.piece(0, size, None)
    for i, layer in enumerate(pieces.layers):
        layer.attn.attend(pieces.q[:n], step.batch, out=pieces.attn[:n])
        residual = pieces.piece(i + 1, size, residual)
    assert residual is None
    step.assert_matches_eager(pieces.hidden[:n])


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_granite"])
@torch.inference_mode()
def test_the_cut_forward_takes_rows_in_place_of_embeddings(family, request, tmp_path, forward_step):
    """Pieces made to take rows (PiecewiseGraphs NOTE (rows): a prompt given as embeddings, image tokens): a step whose
    tokens 2-5 and 11 take given rows gives the model's eager forward with those rows (Granite's rows times its
    embedding multiplier in both), and the next step without rows the plain forward again (the mask cleared)."""
    step = MixedStep(family, request, tmp_path, forward_step)
    n, hidden = step.batch.num_tokens, step.model.config.hidden_size
    indices = torch.tensor([2, 3, 4, 5, 11])
    rows = torch.randn(len(indices), hidden, generator=torch.Generator().manual_seed(3))
    with_rows = dataclasses.replace(step.batch, image_rows=(indices, rows))
    eager = step.model(step.input_ids, with_rows)
    assert not torch.allclose(eager, step.eager, atol=1e-3)  # the rows change the step
    for (k, v), saved in zip(step.runner.kv_caches, step.before):
        k.copy_(saved[0])
        v.copy_(saved[1])
    pieces = PiecewiseGraphs(step.model, [8, 16, 32, 48], NUM_BLOCKS * BLOCK_SIZE, torch.device("cpu"), takes_rows=True)
    for batch, want in ((with_rows, eager), (step.batch, step.eager)):
        size = pieces.load(step.input_ids, batch)
        residual = pieces.piece(0, size, None)
        for i, layer in enumerate(pieces.layers):
            layer.attn.attend(pieces.q[:n], batch, out=pieces.attn[:n])
            residual = pieces.piece(i + 1, size, residual)
        torch.testing.assert_close(pieces.hidden[:n], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", ["tiny_llama", "windowed_mistral", "tiny_qwen3_moe", "tiny_gemma2", "tiny_olmo2",
                                    "tiny_deepseek_v3"])
@torch.inference_mode()
def test_the_whole_graph_forward_reads_its_sequences_from_the_index(family, request, tmp_path, forward_step):
    """cudagraph_mode FULL's forward (runtime/mixed_graphs.py; on a CPU, the same forward eagerly):
    a mixed step loaded after a larger one (which left real slots, sequences and blocks in the
    buffers) gives the model's hidden states and KV cache, and writes only the scratch block besides."""
    step = MixedStep(family, request, tmp_path, forward_step)
    batch, tokens = step.batch, step.tokens
    graphs = MixedGraphs(step.model, [8, 16, 32, 48], 5, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    wide_ids, wide = forward_step([([0, 1], 0, tokens(16)), ([6], 0, tokens(9)), ([7], 0, tokens(2)), ([8], 0, tokens(5)),
                            ([9], 0, tokens(8))], "cpu")
    graphs.load(wide_ids, wide)  # an earlier step of 40 tokens in 5 sequences: real slots, blocks and lengths
    six = forward_step([([b], 0, tokens(2)) for b in range(6)], "cpu")[1]
    too_long = forward_step([([0, 1, 2, 4], 0, tokens(49))], "cpu")[1]
    assert graphs.can_run(batch) and graphs.can_run(wide)
    assert not graphs.can_run(six) and not graphs.can_run(too_long)  # 6 sequences of 5; 49 tokens of 48
    assert not graphs.can_run(dataclasses.replace(batch, max_context_len=MAX_MODEL_LEN + 1))
    hidden = graphs.run(step.input_ids, batch)
    assert graphs.slot_mapping[batch.num_tokens:32].eq(NUM_BLOCKS * BLOCK_SIZE).all()
    per_block = graphs.queries_per_block  # the step's blocks, then the padding sequence's (5)
    seqs = [seq for seq, n_new in enumerate(batch.query_lens) for _ in range(-(-n_new // per_block))]
    assert graphs.batch(32).prefill_index.block_seqs.tolist() == seqs + [5] * (graphs.num_blocks[32] - len(seqs))
    step.assert_matches_eager(hidden)


def test_cudagraph_mode_takes_vllms_names(tiny_llama, tmp_path):
    manifest = art.read_manifest(_artifact(tiny_llama, tmp_path / "a"))
    assert resolve_options(manifest, {}).compilation_config is None
    options = resolve_options(manifest, {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                                "max_cudagraph_capture_size": 64}})
    assert options.compilation_config == art.CompilationConfig("FULL_DECODE_ONLY", 64)
    assert not options.compilation_config.has_piecewise and options.compilation_config.has_full_decode
    full = resolve_options(manifest, {"compilation_config": {"cudagraph_mode": "full"}}).graph_modes
    assert full.has_full_decode and full.has_full_mixed and not full.has_piecewise
    assert memory.planned_piece_sizes(resolve_options(manifest, {"compilation_config": {"cudagraph_mode": "FULL"},
                                                                 "max_num_batched_tokens": 100})) == \
        [8, 16, 24, 32, 48, 64, 96, 100]
    piecewise = resolve_options(manifest, {"compilation_config": {"cudagraph_mode": "piecewise"}})  # vLLM upper-cases
    assert piecewise.compilation_config.cudagraph_mode == "PIECEWISE"
    with pytest.raises(ConfigError, match="compilation_config.cudagraph_mode"):
        resolve_options(manifest, {"compilation_config": {"cudagraph_mode": "piecewise_please"}})
    with pytest.raises(ConfigError, match="compilation_config.cudagraph_capture_sizes: unknown key"):
        resolve_options(manifest, {"compilation_config": {"cudagraph_capture_sizes": [1, 2]}})


def test_a_speculative_engine_plans_whole_forward_graphs_of_its_verify_steps(tiny_llama, tmp_path):
    """ModelRunner NOTE (verify graphs): under FULL_AND_PIECEWISE with a `speculative` config the runner captures
    whole-forward graphs of the piecewise sizes too (verify steps), and the memory plan holds them back; under the
    other modes, or without speculation, none."""
    manifest = art.read_manifest(_artifact(tiny_llama, tmp_path / "a"))
    config = manifest.model
    ngram = {"speculative": {"method": "ngram", "num_speculative_tokens": 3}, "max_num_batched_tokens": 100}
    sizes = [8, 16, 24, 32, 48, 64, 96, 100]
    plain = resolve_options(manifest, {"max_num_batched_tokens": 100})
    spec = resolve_options(manifest, ngram)
    assert memory.planned_piece_sizes(spec) == sizes
    assert memory.verify_graph_sizes(spec, sizes) == sizes and memory.verify_graph_sizes(plain, sizes) == []
    for mode in ("PIECEWISE", "FULL", "FULL_DECODE_ONLY"):
        other = resolve_options(manifest, {**ngram, "compilation_config": {"cudagraph_mode": mode}})
        assert memory.verify_graph_sizes(other, sizes) == []
    full = resolve_options(manifest, {**ngram, "compilation_config": {"cudagraph_mode": "FULL"}})
    both = memory.prefill_graph_allowance_bytes(config, spec, sizes)
    assert both == (memory.prefill_graph_allowance_bytes(config, plain, sizes)
                    + memory.prefill_graph_allowance_bytes(config, full, sizes))  # piecewise + whole


def test_a_recipe_takes_the_mode_in_any_case_and_inspect_json_shows_it(tiny_llama, tmp_path):
    """vLLM upper-cases cudagraph_mode: a recipe may say `full_decode_only`, as the flags may; and
    `llmc inspect --json` writes the runtime section's nested settings (it raised TypeError on them)."""
    import json

    from click.testing import CliRunner

    from llmc.cli import cli

    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": MAX_MODEL_LEN,
                                        "compilation_config": {"cudagraph_mode": "full_decode_only"},
                                        "speculative": {"method": "ngram", "num_speculative_tokens": 3}}}),
          show_progress=False)
    assert art.read_manifest(out).runtime.compilation_config.cudagraph_mode == "FULL_DECODE_ONLY"
    result = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    runtime = json.loads(result.output[result.output.index("{"):])["runtime"]
    assert runtime["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 512,
                                             "cudagraph_specialize_lora": True}
    assert runtime["speculative"]["num_speculative_tokens"] == 3


def test_parallel_artifacts_refuse_graphs_of_other_steps(tiny_llama, tmp_path):
    out = tmp_path / "tp"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out), "dtype": "float32",
                            "parallel": {"tensor": 2}, "runtime": {"max_model_len": MAX_MODEL_LEN}}), show_progress=False)
    manifest = art.read_manifest(out)
    for mode in ("PIECEWISE", "FULL"):
        with pytest.raises(ConfigError, match=f"{mode}: the ranks of a 2-way artifact capture decode graphs only"):
            resolve_options(manifest, {"compilation_config": {"cudagraph_mode": mode}})
        with pytest.raises(RecipeError, match=f"runtime.compilation_config.cudagraph_mode {mode}: the ranks of a "
                                              "2-way artifact"):  # refused at build time, not on every start
            recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "b"), "parallel": {"tensor": 2},
                              "runtime": {"compilation_config": {"cudagraph_mode": mode.lower()}}})
    assert resolve_options(manifest, {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}})


# ---- on a GPU ------------------------------------------------------------------------------------

PROMPTS = ["ROMEO:", "The quick brown fox jumps over the lazy dog, and then", "In the beginning", "A",
           "What light through yonder window breaks? It is the east", "To be, or not to be"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3_moe"])
def test_greedy_tokens_and_logprobs_are_the_same_in_every_graph_mode(family, request, tmp_path, free_gpu):
    """float32: prefill and mixed steps through the pieces give eager's tokens (a small token budget
    chunks the long prompts beside running decodes), in every mode; MoE layers (the fused kernel)
    inside the pieces too."""
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    artifact = _artifact(request.getfixturevalue(family), tmp_path / "a")
    params = [SamplingParams(temperature=0, max_tokens=8 * (i + 1), ignore_eos=True, logprobs=2, prompt_logprobs=1)
              for i in range(len(PROMPTS))]
    results = {}
    modes = ("NONE", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL") if family == "tiny_llama" else \
        ("NONE", "FULL_AND_PIECEWISE", "FULL")
    for mode in modes:
        llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=24,
                  compilation_config={"cudagraph_mode": mode})
        outputs = llm.generate(PROMPTS, params)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outputs]
        runner = llm.engine.runner
        assert (runner.pieces is not None) == (mode in ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL"))
        assert isinstance(runner.pieces, MixedGraphs) == (mode == "FULL")
        assert (runner.graphs is not None) == (mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL"))
        if runner.pieces is not None:
            assert runner.pieces.num_replays >= 2 and runner.pieces.sizes == [8, 16, 24]
        llm.close()
        del llm, runner
        gc.collect()
    eager = results.pop("NONE")
    for mode, result in results.items():
        assert [tokens for tokens, _ in result] == [tokens for tokens, _ in eager], mode
        assert [lp for _, lp in result] == pytest.approx([lp for _, lp in eager], abs=1e-3), mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_w4a16_prefill_through_the_pieces_matches_eager(ref_model_dir, tmp_path, free_gpu):
    """bf16 W4A16 (the Gluon/Triton GEMMs in the graphs at the padded token counts): the prompt's
    logprobs within bf16 rounding of eager's, and the first greedy tokens the same."""
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    artifact = _artifact(ref_model_dir, tmp_path / "w4", dtype="bfloat16", method="rtn", bits=4, group_size=128)
    prompt = {"prompt_token_ids": list(range(40, 140))}  # 100 tokens: the pieces of 128
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    runs = {}
    for mode in ("NONE", "FULL_AND_PIECEWISE", "FULL"):
        llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, compilation_config={"cudagraph_mode": mode})
        (output,) = llm.generate([prompt], params)
        runs[mode] = ([next(iter(p.values())).logprob for p in output.prompt_logprobs[1:]], output.outputs[0].token_ids)
        if mode != "NONE":
            assert llm.engine.runner.pieces.num_replays >= 1
        llm.close()
        del llm
        gc.collect()
    for mode in ("FULL_AND_PIECEWISE", "FULL"):
        assert runs[mode][0] == pytest.approx(runs["NONE"][0], abs=0.05), mode
        assert runs[mode][1][:2] == runs["NONE"][1][:2], mode


@pytest.mark.parametrize("final", [False, True], ids=["eagle3-layers", "eagle1-final"])
@torch.inference_mode()
def test_the_graphs_keep_an_eagle_heads_inputs_as_the_eager_forward_does(final, request, tmp_path, forward_step):
    """Under an EAGLE head the model keeps some layers' inputs (EAGLE-3) or its final hidden states (EAGLE-1) in
    aux_hidden (runtime/spec_eagle.py reads them after the step): the cut forward copies them to its static buffer
    piece by piece, the whole-graph forward after the forward; either leaves aux_hidden equal to the eager forward's."""
    step = MixedStep("tiny_llama", request, tmp_path, forward_step)
    model, n = step.model, step.batch.num_tokens
    model.keep_hidden(() if final else (0, len(model.layers) - 1), final)

    def restore():
        for caches, saved in zip(step.runner.kv_caches, step.before):
            for cache, old in zip(caches, saved):
                cache.copy_(old)

    model(step.input_ids, step.batch)
    want = model.aux_hidden.clone()
    assert want.shape == (n, model.config.hidden_size * (1 if final else 2))
    restore()
    pieces = PiecewiseGraphs(model, [8, 16, 32, 48], NUM_BLOCKS * BLOCK_SIZE, torch.device("cpu"))
    size = pieces.load(step.input_ids, step.batch)
    residual = pieces.piece(0, size, None)
    for i, layer in enumerate(pieces.layers):
        layer.attn.attend(pieces.q[:n], step.batch, out=pieces.attn[:n])
        residual = pieces.piece(i + 1, size, residual)
    torch.testing.assert_close(pieces.aux[:n], want, atol=2e-5, rtol=2e-5)
    restore()
    graphs = MixedGraphs(model, [8, 16, 32, 48], 5, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    model.aux_hidden = None
    graphs.run(step.input_ids, step.batch)
    assert model.aux_hidden.data_ptr() == graphs.aux.data_ptr()  # the static buffer's rows, as after a replay
    torch.testing.assert_close(model.aux_hidden, want, atol=2e-5, rtol=2e-5)
