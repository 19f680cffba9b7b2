"""Int weights (w3a16, w4a16, w8a16) and FP8 ones (w8a8-fp8, w8a8-fp8-block) on a CPU are dequantized once at
load (Linear.dequantize_once), not in every forward: the same tokens and logprobs as the per-call path, bit for
bit, in either layout, with zero points, act-order-free groups and per-channel scales, static and dynamic FP8
activations, FP8 blocks, and for MoE experts."""

import logging

import pytest

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.layers.linear import Linear
from llmc.runtime.llm import LLM
from llmc.runtime.models.moe import ExpertLinears
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT

DATA = REPO_ROOT / "data"

CASES = {
    # name: (checkpoint fixture, target device, quantization)
    "w4-g32-gpu-layout": ("tiny_llama", "cuda", {"method": "rtn", "bits": 4, "group_size": 32}),
    "w4-asym-channel": ("tiny_llama", "cpu", {"method": "rtn", "bits": 4, "group_size": -1, "symmetric": False}),
    "w8-g32": ("tiny_llama", "cpu", {"method": "rtn", "bits": 8, "group_size": 32}),
    "w3-g32-asym": ("tiny_llama", "cpu", {"method": "rtn", "bits": 3, "group_size": 32, "symmetric": False}),
    "w4-moe-experts": ("tiny_qwen3_moe", "cuda", {"method": "rtn", "bits": 4, "group_size": 32}),
    "fp8-channel": ("tiny_llama", "cpu", {"method": "fp8"}),
    "fp8-tensor-static": ("tiny_llama", "cpu", {"method": "fp8", "weights": "per_tensor", "activations": "static"}),
    "fp8-block": ("tiny_llama", "cpu", {"method": "fp8", "weights": "block"}),
    "fp8-block-moe-experts": ("tiny_qwen3_moe", "cpu", {"method": "fp8", "weights": "block"}),
}


SLOW_CASES = ("w8-g32", "w3-g32-asym", "fp8-tensor-static", "w4-asym-channel", "fp8-channel")  # 3.5 s each; the
# gpu-layout w4, block FP8 and the MoE experts cover their paths


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_int_weights_dequantized_once_give_the_per_call_results(case, request, tmp_path, caplog):
    family, device, quantization = CASES[case]
    out = tmp_path / "a"
    calibration = {"calibration": {"data": str(DATA / "calibration.txt"), "num_samples": 4, "seq_len": 32}}
    build(recipe_from_dict({"model": str(request.getfixturevalue(family)), "output": str(out), "dtype": "bfloat16",
                            "quantization": {**quantization, "report": False,
                                             **(calibration if quantization.get("activations") == "static" else {})},
                            "target": {"device": device}, "runtime": {"max_model_len": 128}}), show_progress=False)
    prompts = [{"prompt_token_ids": [5 + 7 * i + j for j in range(9 + 4 * i)]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    with caplog.at_level(logging.INFO, logger="llmc"), LLM(out, device="cpu") as llm:
        model = llm.engine.runner.model
        int_modules = [m for m in model.modules() if isinstance(m, (Linear, ExpertLinears)) and m.dense is not None]
        assert any(isinstance(m, ExpertLinears) for m in int_modules) == (family == "tiny_qwen3_moe")
        assert len(int_modules) >= 4 * model.config.num_layers - 1  # qkv, o, gate_up, down (a MoE layer: experts)
        assert "int and FP8 weights dequantized once for the CPU" in caplog.text
        once = [o.outputs[0] for o in llm.generate(prompts, params)]
        prompt_once = [o.prompt_logprobs for o in llm.generate(prompts, params)]
        for module in int_modules:
            module.dense = None  # the format's apply dequantizes in every forward again
        per_call = [o.outputs[0] for o in llm.generate(prompts, params)]
        prompt_per_call = [o.prompt_logprobs for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in once] == [o.token_ids for o in per_call]
    assert [o.logprobs for o in once] == [o.logprobs for o in per_call]  # bit for bit: the same dequantized values
    assert prompt_once == prompt_per_call


@pytest.mark.slow  # 6 s on 2 cores
def test_without_the_memory_for_a_copy_int_weights_stay_packed(tiny_llama, tmp_path, caplog, monkeypatch):
    """Where the float copy would take more than half the available memory, each forward dequantizes
    (as before), with a line that says so; the outputs are the same."""
    from llmc.runtime.models import decoder

    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out), "dtype": "bfloat16", "target": {"device": "cpu"},
                            "quantization": {"method": "rtn", "bits": 4, "group_size": 32},
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": list(range(5, 25))}
    with LLM(out, device="cpu") as llm:
        expected = llm.generate([prompt], params)[0].outputs[0]
    monkeypatch.setattr(decoder, "available_memory_bytes", lambda: 1000)
    with caplog.at_level(logging.INFO, logger="llmc"), LLM(out, device="cpu") as llm:
        modules = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.dense_bytes()]
        assert modules and all(m.dense is None for m in modules)
        output = llm.generate([prompt], params)[0].outputs[0]
    assert "int and FP8 weights stay packed on the CPU" in caplog.text
    assert output.token_ids == expected.token_ids and output.logprobs == expected.logprobs
