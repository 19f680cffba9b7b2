"""CUDA graphs of decode steps: batch sizes, padding, and (on a GPU) replay against eager."""

import gc

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime import artifact as art
from llmc.runtime.cuda_graphs import StaticInputs, can_use_graphs, graph_batch_sizes, padded_batch_size
from llmc.runtime.model_runner import ModelRunner, allocate_kv_caches
from llmc.runtime.options import resolve_options
from llmc.runtime.parallel.layout import whole_model_layout

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BLOCK_SIZE = 16
NUM_BLOCKS = 12
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("graphs") / "a"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8}}), show_progress=False)
    return out


def test_batch_sizes_follow_the_plan_up_to_max_num_seqs():
    planned = [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(planned, 32) == planned
    assert graph_batch_sizes(planned, 20) == [1, 2, 4, 8, 16, 20]
    # a run-time max_num_seqs above the build's: more sizes at the plan's spacing, not one jump to 64
    assert graph_batch_sizes(planned, 64) == planned + [40, 48, 56, 64]
    above = graph_batch_sizes([1, 2, 4, 8] + list(range(16, 257, 8)), 1000)
    assert above[-3:] == [976, 992, 1000] and all(b - a <= 16 for a, b in zip(above, above[1:]))
    assert graph_batch_sizes(planned, 1) == [1]


def test_a_batch_pads_to_the_next_size_and_none_fits_above_the_largest():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert padded_batch_size(sizes, 25) is None


def test_graphs_need_cuda_and_no_enforce_eager():
    assert not can_use_graphs(torch.device("cpu"), enforce_eager=False)
    assert not can_use_graphs(torch.device("cuda"), enforce_eager=True)
    assert can_use_graphs(torch.device("cuda"), enforce_eager=False)  # triton is installed here


# three sequences: (blocks, prompt length); blocks FIRST_FREE_BLOCK..NUM_BLOCKS-1 belong to nobody
SEQS = [([0], 5), ([1, 2], 20), ([3, 4, 5], 33)]
FIRST_FREE_BLOCK = 6


def _prefilled_runner(artifact, device, forward_step, **overrides):
    """A runner whose cache holds the three prompts and a scratch block (NUM_BLOCKS) as the graphs
    keep one, the other blocks filled with a sentinel; plus the decode step that follows."""
    manifest = art.read_manifest(artifact)
    options = resolve_options(manifest, {"num_kv_blocks": NUM_BLOCKS, **overrides})
    runner = ModelRunner(artifact, manifest, options, torch.device(device))
    if runner.graphs is None:  # the CPU: give it the scratch block a GPU runner has
        runner.kv_caches = allocate_kv_caches(manifest, whole_model_layout(manifest.model), NUM_BLOCKS + 1,
                                              BLOCK_SIZE, torch.device(device))
        runner.model.bind_kv_caches(runner.kv_caches)
    gen = torch.Generator().manual_seed(0)
    prompts = [(blocks, 0, torch.randint(5, 4000, (n,), generator=gen).tolist()) for blocks, n in SEQS]
    with torch.inference_mode():
        runner.model(*forward_step(prompts, device))
    for k, v in runner.kv_caches:  # nobody's blocks and the scratch block
        k[FIRST_FREE_BLOCK:].fill_(7.0)
        v[FIRST_FREE_BLOCK:].fill_(7.0)
    decode = forward_step([(blocks, n, [100 + i]) for i, (blocks, n) in enumerate(SEQS)], device)
    return runner, decode


def _snapshot(runner) -> list[torch.Tensor]:
    return [torch.stack([k, v]).clone() for k, v in runner.kv_caches]


def _restore(runner, snapshot) -> None:
    for (k, v), saved in zip(runner.kv_caches, snapshot):
        k.copy_(saved[0])
        v.copy_(saved[1])


def _check_padding_is_harmless(runner, eager_hidden, eager_caches, padded_hidden, before) -> None:
    assert torch.allclose(padded_hidden, eager_hidden, atol=1e-5, rtol=1e-5)
    for eager, padded, old in zip(eager_caches, _snapshot(runner), before):
        assert torch.allclose(padded[:, :NUM_BLOCKS], eager[:, :NUM_BLOCKS], atol=1e-5, rtol=1e-5)
        free = slice(FIRST_FREE_BLOCK, NUM_BLOCKS)
        assert torch.equal(padded[:, free], old[:, free])  # nobody's blocks: untouched
        assert not torch.equal(padded[:, NUM_BLOCKS], old[:, NUM_BLOCKS])  # the padding row wrote here


@torch.inference_mode()
def test_padding_rows_write_only_the_scratch_block_and_change_no_result(artifact, forward_step):
    """The graphs' padded step, run eagerly on the CPU: 3 sequences in a batch of 4."""
    runner, (input_ids, batch) = _prefilled_runner(artifact, "cpu", forward_step)
    before = _snapshot(runner)
    eager_hidden = runner.model(input_ids, batch)
    eager_caches = _snapshot(runner)
    _restore(runner, before)
    static = StaticInputs(8, MAX_MODEL_LEN // BLOCK_SIZE, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    wide_ids, wide = forward_step([(blocks, n, [7]) for blocks, n in SEQS + SEQS[:2]], "cpu")
    static.load(wide_ids, wide, 8)  # an earlier step of 5 leaves real sequences in rows 3 and 4
    static.load(input_ids, batch, 4)
    assert static.slot_mapping[3] == NUM_BLOCKS * BLOCK_SIZE and static.context_lens[3] == 1
    assert static.block_tables[3, 0] == NUM_BLOCKS
    padded_hidden = runner.model(static.input_ids[:4], static.batch(4, MAX_MODEL_LEN))[:3]
    _check_padding_is_harmless(runner, eager_hidden, eager_caches, padded_hidden, before)


# ---- on a GPU ------------------------------------------------------------------------------------



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_matches_eager_and_leaves_other_blocks_alone(artifact, free_gpu, forward_step):
    runner, (input_ids, batch) = _prefilled_runner(artifact, "cuda", forward_step)
    assert runner.graphs is not None and runner.graphs.batch_sizes == [1, 2, 4, 8]
    before = _snapshot(runner)
    with torch.inference_mode():
        eager_hidden = runner.model(input_ids, batch)
    eager_caches = _snapshot(runner)
    _restore(runner, before)
    with torch.inference_mode():
        graph_hidden = runner.graphs.run(input_ids, batch).clone()  # 3 sequences: the graph of 4
    assert runner.graphs.num_replays == 1
    _check_padding_is_harmless(runner, eager_hidden, eager_caches, graph_hidden, before)


PROMPTS = ["ROMEO:", "The quick brown fox jumps over the lazy dog, and then", "In the beginning", "A",
           "What light through yonder window breaks? It is the east", "To be, or not to be"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_tokens_are_the_same_with_and_without_graphs(artifact, free_gpu):
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    # different lengths: the running batch shrinks 6 → 1 through the graphs of 8, 4, 2 and 1; a small
    # token budget chunks the long prompts beside running decodes (those steps run eagerly)
    params = [SamplingParams(temperature=0, max_tokens=8 * (i + 1), ignore_eos=True) for i in range(len(PROMPTS))]
    tokens = {}
    for enforce_eager in (True, False):
        llm = LLM(artifact, device="cuda", enforce_eager=enforce_eager, gpu_memory_utilization=0.3,
                  max_num_batched_tokens=16)
        tokens[enforce_eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == enforce_eager
        if graphs is not None:
            assert graphs.num_replays > 20
        llm.close()
        del llm, graphs
        gc.collect()
    assert tokens[False] == tokens[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"])
def test_no_triton_kernel_compiles_while_serving(artifact, free_gpu, mode):
    """Start-up compiles what steps run (the graphs' decode steps, then one eager step per decode
    variant; without decode graphs, decode steps through the pieces too): mixed steps of new
    block-table widths, prefill chunks beside decodes, shrinking batches and decode rows split into
    fewer partitions than the graphs' (contexts up to 121 under a 256-key bound: 2 partitions of 64
    keys against 4) compile nothing."""
    from triton import knobs

    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=24, max_model_len=256,
              compilation_config={"cudagraph_mode": mode})
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda fn, **kwargs: compiled.append(fn.name)
    try:
        prompts = [[(7 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 17, 33, 50, 70, 90))]
        params = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        knobs.runtime.jit_post_compile_hook = None
        llm.close()
    assert all(len(o.outputs[0].token_ids) == 6 + 5 * i for i, o in enumerate(outputs))
    assert compiled == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_row_graphs_start_and_match_eager(artifact, free_gpu):
    """max_num_seqs 1: graphs of one row; the start-up mixed step (3 tokens) does not use their buffers."""
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for enforce_eager in (True, False):
        llm = LLM(artifact, device="cuda", enforce_eager=enforce_eager, max_num_seqs=1, gpu_memory_utilization=0.3)
        tokens[enforce_eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
        assert (llm.engine.runner.graphs is None) == enforce_eager
        llm.close()
    assert tokens[False] == tokens[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs Hopper or later")
def test_programmatic_dependent_launch_changes_no_result(ref_model_dir, tmp_path, monkeypatch, free_gpu):
    """Kernels launched with PDL (each may start while the one before it runs, and waits before it
    reads that one's results; the W4A16 GEMVs fetch weights meanwhile) give the bits that the same
    kernels launched one after the other give: W4A16 on the Gluon and Triton GEMVs, in CUDA graphs
    (decode) and eagerly (chunked prefill beside decodes)."""
    from llmc import kernels
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    out = tmp_path / "w4"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "bfloat16",
                            "quantization": {"method": "rtn", "bits": 4, "group_size": 128, "symmetric": True},
                            "runtime": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8}}), show_progress=False)
    params = [SamplingParams(temperature=0, max_tokens=8 * (i + 1), ignore_eos=True, logprobs=1)
              for i in range(len(PROMPTS))]
    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("LLMC_PDL", pdl)
        kernels._use_pdl_on.cache_clear()
        llm = LLM(out, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=16)
        assert kernels.use_pdl(torch.device("cuda")) == (pdl == "1")
        results[pdl] = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(PROMPTS, params)]
        assert llm.engine.runner.graphs.num_replays > 20
        llm.close()
        del llm
        gc.collect()
    kernels._use_pdl_on.cache_clear()
    assert results["1"] == results["0"]
