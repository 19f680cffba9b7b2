"""Expert parallelism on CPU (gloo ranks): experts spread over 2 ranks give the 1-rank greedy tokens,
each rank's file holds exactly its experts, and the manifest's plan says which; tensor parallelism
that splits every expert (parallel.expert 1) gives them too."""

import pytest
import torch
from safetensors.torch import load_file

from llmc.cli_report import inspect_report
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RecipeError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = ["ROMEO:", "In the beginning", "The quick brown fox jumps over the lazy dog, and then"]
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _build(checkpoint, out, **parallel):
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "parallel": parallel, "runtime": {"max_model_len": 128}}), show_progress=False)
    return out


def _greedy(artifact):
    with LLM(artifact, **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("parallel", [pytest.param({"tensor": 2, "expert": 2}, id="ep2", marks=pytest.mark.slow),
                                      pytest.param({"tensor": 2}, id="tp2")])  # ep2 with -m slow (session 42)
def test_parallel_moe_matches_one_rank(parallel, tiny_qwen3_moe, tmp_path):
    one = _build(tiny_qwen3_moe, tmp_path / "one")
    split = _build(tiny_qwen3_moe, tmp_path / "split", **parallel)
    assert _greedy(split) == _greedy(one)
    whole = load_file(one / "rank-00" / "weights.safetensors")
    plan = read_manifest(split).parallel
    if parallel.get("expert") != 2:
        return
    assert plan.expert == 2 and plan.rank_experts == [[0, 1], [2, 3]]
    for rank, experts in enumerate(plan.rank_experts):
        mine = load_file(split / f"rank-{rank:02d}" / "weights.safetensors")
        for layer in (0, 2):  # the sparse layers; 1 is dense
            for proj in ("gate_up", "down"):
                name = f"layers.{layer}.moe.experts.{proj}.weight"
                assert torch.equal(mine[name], whole[name][experts]), name  # exactly its experts, whole
            assert torch.equal(mine[f"layers.{layer}.moe.gate.weight"], whole[f"layers.{layer}.moe.gate.weight"])
    report = inspect_report(str(split), read_manifest(split), None)
    assert [r["experts"] for r in report["ranks"]] == [[0, 1], [2, 3]]  # what `llmc inspect` prints per rank
    # the experts and routers are counted as "moe", not as norms
    stored = {**whole}
    moe_bytes = sum(t.numel() * t.element_size() for n, t in stored.items() if ".moe." in n)
    norm_bytes = sum(t.numel() * t.element_size() for n, t in stored.items() if "norm" in n and ".attn." not in n)
    by_component = inspect_report(str(one), read_manifest(one), None)["bytes_by_component"]
    assert by_component["moe"] == moe_bytes and by_component["norms"] == norm_bytes


def test_expert_parallel_is_refused_where_it_cannot_apply(tiny_qwen3_moe, tiny_llama, tmp_path):
    with pytest.raises(RecipeError, match="must equal parallel.tensor"):
        _build(tiny_qwen3_moe, tmp_path / "a", expert=2)
    with pytest.raises(RecipeError, match="does not divide the model's 4 experts"):
        _build(tiny_qwen3_moe, tmp_path / "b", tensor=3, expert=3)
    with pytest.raises(RecipeError, match="needs a mixture-of-experts model"):
        _build(tiny_llama, tmp_path / "c", tensor=2, expert=2)
