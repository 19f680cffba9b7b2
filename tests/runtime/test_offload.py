"""cpu_offload_gb on the CPU: the offloaded layers run from their staging buffers and give the same
bits as the resident model. On a CPU the copies are plain and synchronous, so this checks the packing
into host buffers, the slot views (two layers sharing a slot) and the order of the copies; the CUDA
side stream and its events are exercised only by benchmarks/bench_kv_fp8.py on a GPU."""

import pytest
import torch

from llmc import LLM, SamplingParams
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime import memory


@pytest.fixture(scope="module")
def artifact(ref_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("offload") / "a"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "runtime": {"max_model_len": 256}}),
          show_progress=False)
    return out


def test_offloaded_layers_give_bit_identical_outputs(artifact) -> None:
    resident = LLM(str(artifact), device="cpu")
    ids = resident.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    expected = resident.engine.score(ids)
    # 4 of 6 layers (~6 MiB each as float32 on a CPU): slots 0 and 1 each serve two layers
    offloaded = LLM(str(artifact), device="cpu", cpu_offload_gb=0.025)
    offloader = offloaded.engine.runner.offloader
    assert len(offloader.plan.layers) >= 3 and len(offloader.slots) == 2
    assert torch.equal(offloaded.engine.score(ids), expected)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    assert ([o.outputs[0].token_ids for o in offloaded.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in resident.generate(prompts, params)])


def test_offload_plan_spreads_whole_layers() -> None:
    plan = memory.plan_offload([100] * 8, 450)
    assert plan.layers == [1, 3, 5, 7] and plan.offloaded_bytes == 400 and plan.staging_bytes == 200
    assert plan.gpu_bytes_saved == 200
    assert memory.plan_offload([100] * 8, 99).layers == []


def test_negative_offload_is_one_line(artifact) -> None:
    with pytest.raises(ConfigError, match="cpu_offload_gb"):
        LLM(str(artifact), device="cpu", cpu_offload_gb=-1)


def test_an_artifact_s_own_offload_is_in_its_memory_plan(ref_model_dir, tmp_path) -> None:
    """The build's plan and `llmc inspect`'s headline count only the weights left on the GPU when the recipe
    sets cpu_offload_gb (they counted all of them: 1,520 KV tokens, "does not fit", while inspect's own
    offload row said 5,632), and agree with that row."""
    from llmc.cli_report import inspect_report
    from llmc.runtime.artifact import read_manifest

    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "runtime": {"cpu_offload_gb": 0.02},
                            "target": {"device": "cuda", "gpu_memory_gib": 0.765}}), show_progress=False)
    manifest = read_manifest(out)
    report = inspect_report(str(out), manifest, None)
    row = next(r for r in report["memory_knobs"] if r["cpu_offload_gb"] == 0.02 and r["kv_cache_dtype"] == "auto")
    resident = next(r for r in report["memory_knobs"] if r["cpu_offload_gb"] == 0 and r["kv_cache_dtype"] == "auto")
    assert row["offloaded_layers"] > 0 and row["num_kv_tokens"] > resident["num_kv_tokens"]
    assert manifest.plan.memory["num_kv_tokens"] == report["memory_estimate"]["num_kv_tokens"] == row["num_kv_tokens"]
    assert manifest.plan.memory["weight_bytes"] == row["weight_bytes"] < sum(manifest.plan.weight_bytes_per_rank)
