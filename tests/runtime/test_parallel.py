"""Tensor and pipeline parallelism end to end on CPU (gloo): the ref-llama-12m artifact split over
ranks gives the 1-rank greedy output token for token, through `LLM` and through `llmc run --prompt`;
a rank that dies or cannot start ends the run with an error naming it; no process is left behind."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, WorkerError
from llmc.runtime.engine import Engine
from llmc.runtime.llm import LLM
from llmc.runtime.parallel import driver, messages
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me speak."]
NUM_TOKENS = 24
# Fewer seats than prompts and a small token budget: prefill chunks run beside decodes.
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
SPLITS = [(2, 1), (1, 2), (2, 2)]
# The whole-engine CLI and overlap comparisons below take 6-13 s per split on a 2-core CPU: tensor parallelism
# runs by default; pipeline and both together (each also compared by the greedy test, by default) with -m slow.
SPLITS_TENSOR_RUN = [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def artifacts(ref_model_dir, tmp_path_factory):
    """artifacts(tensor, pipeline, group_size=None) → a float32 build (rtn w4 with group_size), built once."""
    root = tmp_path_factory.mktemp("parallel")
    cache: dict[tuple, Path] = {}

    def get(tensor: int, pipeline: int, group_size: int | None = None) -> Path:
        key = (tensor, pipeline, group_size)
        if key not in cache:
            out = root / (f"t{tensor}p{pipeline}" + ("" if group_size is None else f"-w4g{group_size}"))
            quant = {} if group_size is None else {"quantization": {"method": "rtn", "bits": 4, "group_size": group_size}}
            build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                                    "parallel": {"tensor": tensor, "pipeline": pipeline},
                                    "runtime": {"max_model_len": 256}, **quant}), show_progress=False)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(artifacts):
    """The 1-rank run: (token ids per prompt, text of the first prompt at 16 tokens, logits of one sequence)."""
    with LLM(artifacts(1, 1), **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        short = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
        logits = llm.engine.score(list(range(5, 60)))
    return [o.outputs[0].token_ids for o in outputs], short, logits


def _are_gone(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


# both splits at once: 7 s on 2 cores, with -m slow (tensor and pipeline alone run by default)
@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_greedy_output_is_identical_to_one_rank(artifacts, reference, tensor, pipeline):
    token_ids, _, logits = reference
    with LLM(artifacts(tensor, pipeline), **ENGINE) as llm:
        pids = list(llm.engine.runner.worker_pids.values())
        assert len(pids) == tensor * pipeline - 1  # this process is rank 0
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == token_ids
        torch.testing.assert_close(llm.engine.score(list(range(5, 60))), logits, atol=1e-4, rtol=1e-4)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    assert _are_gone(pids)


@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="reads /proc/PID/environ")
def test_workers_start_with_nvlink_multicast_off(artifacts, monkeypatch):
    # NVLS and multicast symmetric memory fail on some hosts: every process the runtime starts must
    # have them off, whatever the parent's environment said.
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    with LLM(artifacts(2, 1), **ENGINE) as llm:
        for pid in llm.engine.runner.worker_pids.values():
            environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
            assert environ["NCCL_NVLS_ENABLE"] == "0" and environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def _gloo_threads() -> int:
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    return sum(name in ("pt_gloo_runloop", "gloo_tcp_loop") for name in names)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc/self/task")
def test_close_joins_the_process_groups_threads(artifacts):
    # Left running to the interpreter's exit, a gloo worker thread still releasing the last
    # message's tensors needs the GIL of a finishing interpreter: the process aborts ("terminate
    # called without an active exception"), once in a few hundred torchrun launches.
    before = _gloo_threads()
    with LLM(artifacts(2, 1), **ENGINE) as llm:
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))
        assert _gloo_threads() > before
    assert _gloo_threads() == before


@pytest.mark.slow  # for the default run's time (session 42)
@pytest.mark.parametrize(("tensor", "pipeline"), SPLITS_TENSOR_RUN)
def test_llmc_run_prompt_is_identical_to_one_rank(artifacts, reference, tensor, pipeline):
    command = [sys.executable, "-m", "llmc.cli", "run", str(artifacts(tensor, pipeline)), "--prompt", "ROMEO:",
               "--max-tokens", "16", "--temperature", "0", "--device", "cpu", "--num-kv-blocks", "64"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ROMEO:" + reference[1] + "\n"


def test_quantized_tensor_parallel_build_matches_its_one_rank_build(artifacts):
    with LLM(artifacts(1, 1, group_size=32), **ENGINE) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(artifacts(2, 1, group_size=32), **ENGINE) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_a_killed_worker_ends_the_run_naming_it(artifacts):
    llm = LLM(artifacts(1, 2), **ENGINE)
    pids = llm.engine.runner.worker_pids
    stream = llm.stream("ROMEO:", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)  # generating: now rank 1 (the second stage) dies
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        list(stream)
    assert time.monotonic() - start < 10
    assert "rank 1 (pipeline stage 1, tensor rank 0) was killed by signal SIGKILL" in str(err.value)
    with pytest.raises(WorkerError, match="rank 1"):  # and it stays down
        llm.generate(["ROMEO:"], GREEDY)
    llm.close()
    assert _are_gone(pids.values())


def test_a_rank_that_cannot_start_is_named(artifacts, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(artifacts(2, 1), broken)
    weights = broken / "rank-01" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"XXXXXXXX"  # same size (passes the size check), unreadable header
    weights.write_bytes(bytes(data))
    with pytest.raises(WorkerError) as err:
        LLM(broken, **ENGINE)
    assert "rank 1 (pipeline stage 0, tensor rank 1) failed: ArtifactError" in str(err.value)


def test_a_launch_of_the_wrong_world_size_is_refused_before_loading_weights(artifacts, monkeypatch):
    import llmc.runtime.loader as loader

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loader, "load_weights", no_loading)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"tensor 2 × pipeline 1 = 2 rank\(s\), but this launch has WORLD_SIZE 3"):
        LLM(artifacts(2, 1), **ENGINE)


# ---- overlapped scheduling with the parallel driver -----------------------------------------------

# A tiny cache (preemption by recompute), a small token budget (prefill chunks), seats for 4.
OVERLAP_ENGINE = {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 17,
                  "disable_log_stats": True}
OVERLAP_ABORTS = {"r5": 4}  # aborted mid-stream, once 4 tokens were delivered
GREEDY_IDS = ["r0", "r1", "r2", "r3", "r5", "r6"]


def _overlap_workload() -> list[tuple[str, SamplingParams]]:
    """Greedy (long prompts: chunked), a stop string, seeded samples with n=2, an abort."""
    long_prompt = "First Citizen:\nBefore we proceed any further, hear me speak. You are all resolved rather to die"
    return [
        ("ROMEO:", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)),
        (long_prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)),
        ("JULIET: O Romeo, Romeo, wherefore art thou", SamplingParams(temperature=0, max_tokens=62, ignore_eos=True)),
        ("The king", SamplingParams(temperature=0, max_tokens=30, stop=[" the", "\n"])),
        ("my lord", SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, n=2)),
        ("sweet love of the night", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)),
        (long_prompt[::-1], SamplingParams(temperature=0, max_tokens=56, ignore_eos=True)),
        ("I pray you", SamplingParams(temperature=0.8, seed=11, max_tokens=20)),
    ]


def _drive(artifact, **options) -> tuple[dict, dict, Engine]:
    """Run the workload through an Engine by hand (aborting as OVERLAP_ABORTS says): the last
    output of each request as (token ids, text, finish reason) per completion, and the stats."""
    engine = Engine(artifact, **{**OVERLAP_ENGINE, **options})
    try:
        for i, (prompt, params) in enumerate(_overlap_workload()):
            engine.add_request(prompt, params, request_id=f"r{i}")
        results = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                results[output.request_id] = [(c.token_ids, c.text, c.finish_reason) for c in output.outputs]
            for request_id, num_tokens in OVERLAP_ABORTS.items():
                if request_id in engine.groups and len(results.get(request_id, [([],)])[0][0]) >= num_tokens:
                    engine.abort_request(request_id)
        return results, engine.stats(), engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def overlap_reference(artifacts):
    """The 1-rank overlapped run of the workload."""
    results, stats, engine = _drive(artifacts(1, 1))
    assert engine._can_overlap and stats["num_preemptions"] > 0
    return results


@pytest.mark.slow  # for the default run's time (session 42)
@pytest.mark.parametrize(("tensor", "pipeline"), SPLITS_TENSOR_RUN)
def test_overlapped_parallel_engine_equals_synchronous_and_one_rank(artifacts, overlap_reference, monkeypatch,
                                                                    tensor, pipeline):
    fixups = []  # placeholders the driver sent its ranks (step N+1 left before step N's tokens were known)
    send = messages.send_step

    def counting_send(groups, message):
        fixups.append(message.num_fixups)
        send(groups, message)

    monkeypatch.setattr(driver, "send_step", counting_send)
    overlapped, stats, engine = _drive(artifacts(tensor, pipeline))
    assert engine._can_overlap and sum(fixups) > 0
    synchronous, sync_stats, sync_engine = _drive(artifacts(tensor, pipeline), async_scheduling=False)
    assert not sync_engine._can_overlap
    assert overlapped == synchronous  # greedy, stop strings, seeded samples (n=2), the abort
    assert {r: overlapped[r] for r in GREEDY_IDS} == {r: overlap_reference[r] for r in GREEDY_IDS}
    assert [len(c[0]) for c in overlapped["r4"]] == [24, 24] and overlapped["r4"][0] != overlapped["r4"][1]
    assert len(overlapped["r5"][0][0]) == OVERLAP_ABORTS["r5"]
    for s in (stats, sync_stats):
        assert s["num_preemptions"] > 0
        assert s["num_free_blocks"] == s["num_total_blocks"], "KV blocks leaked"


# ---- the memory plan on ranks ------------------------------------------------------------------------


@pytest.mark.slow  # 5 s on 2 cores
def test_every_rank_reports_its_kv_room_and_the_engine_takes_the_smallest(hf_checkpoint_factory, tmp_path):
    """3 layers over 2 stages: the stages hold different numbers of layers, so their KV bytes per
    token differ; each rank sizes its own cache, all reports reach the driver, the scheduler gets
    the smallest (computed here from the manifest's stage split)."""
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", "llama", num_hidden_layers=3)
    out = tmp_path / "t2p2"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "parallel": {"tensor": 2, "pipeline": 2}, "runtime": {"max_model_len": 64}}),
          show_progress=False)
    gib = 0.002
    with LLM(out, device="cpu", cpu_kv_cache_gib=gib, max_num_seqs=2) as llm:
        manifest, engine = llm.engine.manifest, llm.engine
        reports = engine.runner.rank_memory
        config, block_size = manifest.model, engine.options.block_size
        kv_heads = max(1, config.num_kv_heads // 2)
        expected = [int(gib * 2**30) // (2 * len(manifest.parallel.stage_layers[rank // 2]) * kv_heads
                                         * config.head_dim * 4 * block_size) for rank in range(4)]
        assert [r.rank for r in reports] == [0, 1, 2, 3]
        assert [r.num_kv_blocks for r in reports] == expected and len(set(expected)) == 2
        assert not any(r.measured for r in reports)  # a CPU: sized from cpu_kv_cache_gib, not profiled
        assert engine.scheduler.block_pool.num_blocks == min(expected) == engine.runner.num_blocks


def test_waiting_for_ranks_stops_when_the_server_shuts_down():
    """A server loading a parallel engine whose ranks never join (a node that is not started) waited out the
    store's timeout (300 s) after SIGTERM; its engine thread's wait now ends when the loading is cancelled."""
    import threading

    from llmc.runtime.parallel.launcher import cancellable_loading, wait_for_ranks

    class Store:  # rank 1 never joins
        def check(self, keys):
            return False

    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    start = time.monotonic()
    with cancellable_loading(cancel), pytest.raises(WorkerError, match=r"loading was cancelled .* ranks \[1\]"):
        wait_for_ranks(Store(), [1], None, timeout_s=300)
    assert time.monotonic() - start < 5
    with pytest.raises(WorkerError, match="did not join within 0 s"):  # outside a server: the timeout as before
        wait_for_ranks(Store(), [1], None, timeout_s=0.1)
