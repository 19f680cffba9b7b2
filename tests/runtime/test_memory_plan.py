"""The memory plan: the arithmetic the estimate and the runtime share, the profiling batch, the
refusal when max_model_len does not fit, and (on a GPU) the measured plan against `llmc inspect`."""

import dataclasses

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.memory_profile import profile_batch, run_profile_step
from llmc.runtime.model_runner import ModelRunner, check_num_kv_blocks
from llmc.runtime.options import resolve_options
from llmc.runtime.parallel.layout import all_rank_layouts

GIB = memory.GIB
MODEL = art.ModelConfig(
    family="llama", architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=None,
    max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
    bos_token_id=1, eos_token_ids=[2], dtype="bfloat16",
)


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "a"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 256}}), show_progress=False)
    return out


def test_kv_is_what_is_left_in_whole_blocks():
    kv_per_token = 2 * 32 * 8 * 128 * 2  # Llama-3-8B, bf16: 128 KiB
    plan = memory.plan_kv(total_bytes=80 * GIB, utilization=0.9, weight_bytes=15 * GIB, other_bytes=GIB // 2,
                          activation_bytes=GIB, graph_bytes=GIB // 4, kv_bytes_per_token=kv_per_token,
                          block_size=16, max_model_len=8192)
    left = int(80 * GIB * 0.9) - 15 * GIB - GIB // 2 - GIB - GIB // 4
    assert plan.num_kv_blocks == left // (16 * kv_per_token)
    assert plan.kv_bytes == plan.num_kv_tokens * kv_per_token <= left
    assert plan.max_concurrent_seqs == pytest.approx(plan.num_kv_tokens / 8192)
    assert plan.fits and "55.25 GiB" in plan.describe()
    starved = memory.plan_kv(80 * GIB, 0.1, 15 * GIB, 0, 0, 0, kv_per_token, 16, 8192)
    assert starved.num_kv_blocks == 0 and not starved.fits


def test_the_estimate_is_the_runtime_subtraction_with_assumed_terms():
    """`llmc inspect` and the runtime differ only in where the terms come from."""
    estimate = memory.estimate(MODEL, 16 * GIB, 131072, 16, 80 * GIB, 0.9, 2048, 64, 8192, use_graphs=True)
    activations = memory.activation_peak_bytes(MODEL, 2048, 64)
    graphs = memory.graph_allowance_bytes(MODEL, memory.cuda_graph_batch_sizes(64), 8192)
    assert estimate == memory.plan_kv(80 * GIB, 0.9, 16 * GIB, memory.CUDA_CONTEXT_BYTES, activations, graphs,
                                      131072, 16, 8192)
    assert estimate.graph_bytes == graphs > memory.GRAPH_BASE_BYTES
    eager = memory.estimate(MODEL, 16 * GIB, 131072, 16, 80 * GIB, 0.9, 2048, 64, 8192, use_graphs=False)
    assert eager.graph_bytes == 0 and eager.num_kv_blocks > estimate.num_kv_blocks
    assert memory.graph_allowance_bytes(MODEL, [], 8192) == 0


def test_graph_allowance_holds_the_decode_split_of_max_model_len():
    sizes = memory.cuda_graph_batch_sizes(64)
    short = memory.graph_allowance_bytes(MODEL, sizes, 64)  # one partition: no split buffers
    assert short == (memory.GRAPH_BASE_BYTES + len(sizes) * MODEL.num_layers * memory.GRAPH_BYTES_PER_GRAPH_LAYER
                     + memory.activation_peak_bytes(MODEL, 64, 0) + _block_table_bytes(64, 64, 16))
    tables = _block_table_bytes(64, 131072, 16) - _block_table_bytes(64, 64, 16)  # (test below)
    # 8 KV heads on 132 SMs: sizes up to 32 split (32 × 8 < 264), into 131072 / 512 = 256 partitions
    long = memory.graph_allowance_bytes(MODEL, sizes, 131072)
    assert long - short == 32 * 256 * 32 * (128 + 2) * 4 + tables
    # on 16 SMs only sizes 1 and 2 split (2 × 8 < 32)
    assert memory.graph_allowance_bytes(MODEL, sizes, 131072, num_sms=16) - short == 2 * 256 * 32 * 130 * 4 + tables
    # a rank of tensor parallel 8 splits its own 4 heads, 1 KV head: every size up to 64 (64 × 1 < 264), 256 partitions
    rank = all_rank_layouts(MODEL, art.ParallelPlan(tensor=8, stage_layers=[list(range(32))]))[0]
    assert (memory.graph_allowance_bytes(MODEL, sizes, 131072, layout=rank)
            - memory.graph_allowance_bytes(MODEL, sizes, 64, layout=rank)) == 64 * 256 * 4 * 130 * 4 + tables


def _block_table_bytes(max_batch_size: int, max_model_len: int, block_size: int) -> int:
    """The decode graphs' static block-table buffer, as runtime/cuda_graphs.py allocates it (on the CPU here)."""
    from llmc.runtime.cuda_graphs import StaticInputs

    inputs = StaticInputs(max_batch_size, -(-max_model_len // block_size), 0, block_size, torch.device("cpu"))
    return inputs.block_tables.nbytes


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_graph_allowance_holds_the_graphs_block_tables(block_size):
    """The static block tables grow with max_model_len / block_size (2.5 MiB at DeepSeek-V2's 163840 tokens and 64
    rows: what a capture on an H200 overran the allowance by before they were counted); with one SM nothing splits,
    so the allowance grows by the buffer alone."""
    sizes = memory.cuda_graph_batch_sizes(64)
    for max_model_len in (1000, 8192, 163840):
        growth = (memory.graph_allowance_bytes(MODEL, sizes, max_model_len, num_sms=1, block_size=block_size)
                  - memory.graph_allowance_bytes(MODEL, sizes, block_size, num_sms=1, block_size=block_size))
        assert growth == _block_table_bytes(64, max_model_len, block_size) - _block_table_bytes(64, block_size, block_size)


def test_parallel_ranks_are_planned_without_graphs():
    parallel = art.ParallelPlan(tensor=2, pipeline=1, stage_layers=[list(range(32))])
    runtime = art.RuntimeDefaults(max_model_len=8192)
    estimates = memory.estimate_per_rank(MODEL, parallel, [8 * GIB, 8 * GIB], "bfloat16", runtime, 80 * GIB)
    assert [e.graph_bytes for e in estimates] == [0, 0]
    single = memory.estimate_per_rank(MODEL, art.ParallelPlan(), [16 * GIB], "bfloat16", runtime, 80 * GIB)
    assert single[0].graph_bytes > 0


def test_a_fixed_num_kv_blocks_is_the_cache_the_plan_reports():
    """num_kv_blocks sizes the cache without a profile: the estimate (build summary, inspect) says that
    size, and keeps the room the memory has, so a cache larger than it can be named."""
    runtime = art.RuntimeDefaults(max_model_len=8192)
    room = memory.estimate_per_rank(MODEL, art.ParallelPlan(), [16 * GIB], "bfloat16", runtime, 80 * GIB)[0]
    assert room.room_kv_tokens is None and not room.over_room
    for blocks in (600, room.num_kv_blocks + 1):
        fixed = memory.estimate_per_rank(MODEL, art.ParallelPlan(), [16 * GIB], "bfloat16",
                                         dataclasses.replace(runtime, num_kv_blocks=blocks), 80 * GIB)[0]
        assert fixed.num_kv_tokens == 16 * blocks and fixed.kv_bytes == 16 * blocks * 131072
        assert fixed.max_concurrent_seqs == 16 * blocks / 8192 and fixed.room_kv_tokens == room.num_kv_tokens
        assert fixed.over_room == (blocks > room.num_kv_blocks)
    knobs = memory.knob_table(MODEL, art.ParallelPlan(), [16 * GIB], [[GIB // 2] * 32],
                              dataclasses.replace(runtime, num_kv_blocks=600), 80 * GIB, [0.0])
    assert knobs[0]["num_kv_tokens"] == room.num_kv_tokens  # the knobs show room, which they move


def test_the_plan_holds_the_pieces_allowance_where_they_are_captured():
    plan = lambda **runtime: memory.estimate_per_rank(  # noqa: E731
        MODEL, art.ParallelPlan(), [16 * memory.GIB], "bfloat16", art.RuntimeDefaults(max_model_len=8192, **runtime),
        80 * memory.GIB)[0].graph_bytes
    decode_only = plan(compilation_config=art.CompilationConfig("FULL_DECODE_ONLY"))
    pieces = memory.piecewise_allowance_bytes(MODEL, memory.piecewise_sizes(512, 2048))
    assert plan() == decode_only + pieces
    assert plan(compilation_config=art.CompilationConfig("PIECEWISE")) == pieces
    # whole graphs: the same bound, and their block-table buffer (8192 / 16 blocks for 65 sequences)
    assert plan(compilation_config=art.CompilationConfig("FULL")) == decode_only + pieces + 65 * 512 * 4
    assert plan(compilation_config=art.CompilationConfig("NONE")) == 0 == plan(enforce_eager=True)
    assert plan(cpu_offload_gb=1.0) == decode_only  # offloaded layers: no pieces
    # the 512-token step's intermediates (two pieces' worth) dominate: ~143 MB for an 8B (44-134 MiB measured)
    assert 0.1 * memory.GIB < pieces < 0.2 * memory.GIB


def test_profile_batch_prefills_fresh_sequences_of_at_most_max_model_len():
    input_ids, batch, num_blocks = profile_batch(100, 40, 8, 16, torch.device("cpu"))
    assert batch.query_lens == [40, 40, 20] and batch.context_lens.tolist() == [40, 40, 20]
    assert num_blocks == 3 + 3 + 2 and batch.max_context_len == 40
    slots = batch.slot_mapping.tolist()
    assert len(set(slots)) == 100 and max(slots) < num_blocks * 16
    # each token's slot is where its block table says
    for row, start in enumerate([0, 40, 80]):
        for p in range(batch.query_lens[row]):
            assert slots[start + p] == batch.block_tables[row, p // 16] * 16 + p % 16
    assert batch.logits_indices.tolist() == list(range(92, 100)) and input_ids.shape == (100,)


@torch.inference_mode()
def test_profile_step_reads_only_what_it_wrote(artifact):
    """The profiling forward on a cache full of NaN: every slot it reads, it wrote first."""
    manifest = art.read_manifest(artifact)
    runner = ModelRunner(artifact, manifest, resolve_options(manifest, {"num_kv_blocks": 16}), torch.device("cpu"))
    input_ids, batch, num_blocks = profile_batch(300, 256, 64, 16, torch.device("cpu"))
    shape = (num_blocks, 16, manifest.model.num_kv_heads, manifest.model.head_dim)
    nan_cache = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
    runner.model.bind_kv_caches([nan_cache] * manifest.model.num_layers)
    probs = run_profile_step(runner.model, input_ids, batch)
    assert probs.shape == (64, manifest.model.vocab_size) and torch.isfinite(probs).all()


def test_refusal_names_the_knobs_in_one_line():
    options = art.RuntimeDefaults(max_model_len=4096, block_size=16)
    plan = memory.plan_kv(80 * GIB, 0.05, 15 * GIB, GIB // 2, GIB, 0, 131072, 16, 4096)
    messages = []
    for device, opts, p in [("cuda", options, plan), ("cuda", options, None), ("cpu", options, None),
                            ("cpu", dataclasses.replace(options, num_kv_blocks=10), None)]:
        with pytest.raises(ConfigError) as error:
            check_num_kv_blocks(10, opts, torch.device(device), p)
        messages.append(str(error.value))
    for message in messages:
        assert "\n" not in message and "max_model_len 4096" in message and "needs 256 blocks" in message
    for knob in ("gpu_memory_utilization", "max_num_batched_tokens", "num_kv_blocks"):
        assert knob in messages[0] and knob in messages[1]
    assert "weights 15.00 GiB" in messages[0]
    assert "cpu_kv_cache_gib" in messages[2]
    assert "raise num_kv_blocks to 256" in messages[3]
    assert check_num_kv_blocks(256, options, torch.device("cpu")) == 256


def test_a_plan_that_does_not_fit_in_what_is_free_is_refused_naming_a_utilization_that_does(monkeypatch):
    """vLLM's start-up check. An 80 GiB GPU, gpu_memory_utilization 0.9: this engine's weights 2 GiB, 30 GiB held by
    another tensor of the process (an engine not closed: torch's, so not "other"), 1 GiB outside torch; profiled
    activations 1 GiB, graphs 0.5 GiB. The plan's KV (72 - 4.5 = 67.5 GiB) and graphs need 68 GiB, only 47 are free:
    refused, naming the largest utilization that fits, worked out by hand: 0.63 (usable 50.4, KV 45.9 + 0.5 <= 47);
    0.64 would need 47.2."""
    from llmc.runtime import memory_profile

    total, weights, held, non_torch = 80 * GIB, 2 * GIB, 30 * GIB, 1 * GIB
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - weights - held - non_torch, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: weights + held)
    per_token = 2 * 8 * 128 * 2 * 32  # bf16 K and V of 8 heads of 128 over 32 layers

    def plan(utilization):
        options = art.RuntimeDefaults(gpu_memory_utilization=utilization, max_model_len=4096, block_size=16)
        return memory_profile.gpu_kv_plan(options, torch.device("cuda"), weights, GIB, per_token, GIB // 2)

    for utilization in (0.9, 0.64):
        with pytest.raises(ConfigError) as error:
            plan(utilization)
        message = str(error.value)
        assert "\n" not in message and "only 47.0 GiB of this GPU's 80.0 GiB are free" in message
        assert "lower gpu_memory_utilization to 0.63 or less" in message
    fitting = plan(0.63)
    assert fitting.other_bytes == non_torch and fitting.kv_bytes + GIB // 2 <= 47 * GIB
    assert fitting.kv_bytes > 45 * GIB


# ---- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_another_tensor_of_the_process_holds_is_refused_up_front(artifact, free_gpu):
    """A third of the GPU held by a tensor of this process (as an engine not closed holds it): a 0.9 plan is refused
    in one line naming a utilization that fits, and an engine with that utilization loads and generates."""
    import re

    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    _, total = torch.cuda.mem_get_info()
    held = torch.empty(total // 3, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(ConfigError) as error:
            LLM(artifact, device="cuda", gpu_memory_utilization=0.9)
        message = str(error.value)
        assert "\n" not in message and "are free" in message
        utilization = float(re.search(r"lower gpu_memory_utilization to (0\.\d+) or less", message)[1])
        assert 0.3 < utilization < 0.67
        with LLM(artifact, device="cuda", gpu_memory_utilization=utilization) as llm:
            [output] = llm.generate("the king", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            assert len(output.outputs[0].token_ids) == 4
    finally:
        del held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profiling_refuses_when_max_model_len_does_not_fit(artifact, free_gpu):
    from llmc.runtime.llm import LLM

    with pytest.raises(ConfigError) as error:
        LLM(artifact, device="cuda", gpu_memory_utilization=0.001)
    message = str(error.value)
    assert "\n" not in message and "max_model_len 256" in message
    assert "gpu_memory_utilization" in message and "max_num_batched_tokens" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measured_plan_is_within_ten_percent_of_inspect(artifact, free_gpu):
    from llmc.cli_report import inspect_report
    from llmc.runtime.llm import LLM

    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.5)
    measured = llm.engine.runner.memory_plan
    graphs = llm.engine.runner.graphs
    assert measured is not None and graphs is not None and graphs.num_replays == 0
    manifest = art.read_manifest(artifact)
    manifest = dataclasses.replace(manifest, runtime=dataclasses.replace(manifest.runtime, gpu_memory_utilization=0.5))
    estimate = inspect_report(str(artifact), manifest, measured.total_bytes / GIB)["memory_estimate"]
    assert abs(estimate["kv_bytes"] - measured.kv_bytes) <= 0.1 * measured.kv_bytes, (estimate, measured)
    # the profile also holds cuBLAS's workspaces, which the formula leaves out
    assert 0 < measured.activation_bytes < estimate["activation_bytes"] + 256 * memory.MIB, (estimate, measured)
    assert graphs.graph_bytes <= measured.graph_bytes, (graphs.graph_bytes, measured)  # within its allowance
