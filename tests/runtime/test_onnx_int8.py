"""method int8 (w8a8-int8) on the onnx-cpu target: each linear is kernels/int8.int8_linear in standard ONNX ops
(per-token int8 activations, MatMulInteger's exact int32 product, the same float32 epilogue), against the torch
runtime on the same build: the linear bit for bit, the model's logits and greedy tokens."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file

from llmc.cli import cli
from llmc.compiler.onnx_export import MS_DOMAIN, OPSET, _Emitter
from llmc.compiler.onnx_linears import INT8_LINEAR
from llmc.errors import RecipeError
from llmc.kernels.int8 import int8_linear
from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_float32

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]


def _linear_session(weight, weight_scale, bias):
    """A graph of one w8a8-int8 linear as the onnx-cpu build emits it, x [batch, seq, K] → y."""
    emitter = _Emitter(None, {}, None, 1)
    y = emitter.int8_linear("x", "m", {"weight": weight, "weight_scale": weight_scale}, bias)
    emitter.g.nodes.append(helper.make_node("Identity", [y], ["y"]))
    graph = helper.make_graph(emitter.g.nodes, "int8", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", "seq", weight.shape[1]])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], emitter.g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("k", [64, 2048])
def test_the_linear_is_the_torch_kernel_bit_for_bit(k):
    """Ties of x / scale (half to even), an all-zero token, a token at amax = 127 (scale 1), sums past 2**24 (their
    float32 rounding), the extreme levels, bias: the graph's y equals kernels/int8.int8_linear's exactly."""
    gen = torch.Generator().manual_seed(k)
    n = 96
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    weight[0] = 127
    weight[1] = -128
    weight_scale = torch.rand(n, 1, generator=gen) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=gen)
    x = torch.randn(2, 5, k, generator=gen) * 4
    x[0, 0] = 0  # all-zero token: the MIN_SCALE floor
    x[0, 1] = torch.arange(k) % 255 - 127 + 0.5 * (torch.arange(k) % 2)  # amax 127: x / scale = x, ties at n + 0.5
    x[0, 1, 0] = 127.0
    x[1, 0] = 127.0  # every level 127: |sum| = 127 * 127 * K, past 2**24 for K 2048
    for b in (None, bias):
        session = _linear_session(weight, weight_scale, b)
        got = session.run(None, {"x": x.numpy()})[0]
        want = int8_linear(x, weight, weight_scale, b).numpy()
        np.testing.assert_array_equal(got, want)


def _build_pair(model, tmp_path, quantization):
    quantization = {"report": False, **quantization}
    return (build_float32(model, tmp_path / "torch", quantization=quantization, target={"device": "cpu"}),
            build_float32(model, tmp_path / "onnx", quantization=quantization, target={"device": "onnx-cpu"}))


def _greedy(llm, prompt_ids, num_tokens=24):
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                           SamplingParams(temperature=0, max_tokens=num_tokens))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("quantization", [
    {"method": "int8", "ignore": []},  # lm_head too
    {"method": "int8", "algorithm": "gptq", "smoothquant": 0.8},
], ids=["rtn-with-lm-head", "gptq-smoothquant"])
def test_int8_graph_matches_the_torch_runtime(quantization, tiny_llama, tmp_path, data_dir, hf_encode):
    """Every w8a8-int8 linear is a MatMulInteger on the artifact's own levels and scales (SmoothQuant's folded norms
    are plain norm weights). Bound: the linears are bit-exact (the test above); the rest of the graph (attention, norms,
    SiLU) agrees with the torch path to float32 rounding, as the float32 graph does with transformers (atol 1e-4 in
    test_onnx_target.py); measured max |diff| 5e-6 (rtn) and 1e-5 (gptq+smoothquant) on logits up to 19: no
    activation level flipped. Greedy tokens equal."""
    if quantization.get("algorithm") == "gptq":
        quantization["calibration"] = {"data": str(data_dir / "calibration.txt"), "num_samples": 4, "seq_len": 32}
    torch_artifact, onnx_artifact = _build_pair(tiny_llama, tmp_path, quantization)
    manifest = art.read_manifest(onnx_artifact)
    record = manifest.target["onnx"]
    int8_modules = {m for m, spec in manifest.quant.modules.items() if spec["format"] == "w8a8-int8"}
    assert ("lm_head" in int8_modules) == (quantization.get("ignore") == [])
    assert {m for m, kind in record["linears"].items() if kind == INT8_LINEAR} == int8_modules
    assert record["op_counts"]["MatMulInteger"] == len(int8_modules) and "MatMulNBits" not in record["op_counts"]
    assert record["float_fallbacks"] == {}
    # the graph holds the artifact's levels and scales, as they are
    weights = load_file(torch_artifact / "rank-00" / "weights.safetensors")
    model = onnx.load(str(onnx_artifact / "onnx" / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    for module in int8_modules:
        weight_t = numpy_helper.to_array(inits[f"{module}.weight_t"], base_dir=str(onnx_artifact / "onnx"))
        scale = numpy_helper.to_array(inits[f"{module}.weight_scale"], base_dir=str(onnx_artifact / "onnx"))
        assert weight_t.dtype == np.int8 and np.array_equal(weight_t.T, weights[f"{module}.weight"].numpy()), module
        assert np.array_equal(scale[0], weights[f"{module}.weight_scale"].numpy()[:, 0]), module
    norm = numpy_helper.to_array(inits["layers.0.input_norm.weight"], base_dir=str(onnx_artifact / "onnx"))
    assert np.array_equal(norm, weights["layers.0.input_norm.weight"].float().numpy())  # smoothed, when it is
    torch_llm = LLM(torch_artifact, device="cpu", max_num_batched_tokens=16)
    onnx_llm = LLM(onnx_artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=8)
    token_ids = hf_encode(tiny_llama, PROMPTS[1]) + list(range(100, 140))
    torch.testing.assert_close(onnx_llm.engine.score(token_ids), torch_llm.engine.score(token_ids), atol=1e-4, rtol=1e-4)
    prompts = [hf_encode(tiny_llama, p) for p in PROMPTS]
    assert _greedy(onnx_llm, prompts) == _greedy(torch_llm, prompts)
    # inspect names the int8 linears and the op mix
    report = json.loads(CliRunner().invoke(cli, ["inspect", str(onnx_artifact), "--json"]).output)
    assert report["onnx"]["linears"][INT8_LINEAR] == len(int8_modules)
    assert report["onnx"]["op_counts"]["MatMulInteger"] == len(int8_modules)
    text = CliRunner().invoke(cli, ["inspect", str(onnx_artifact)]).output
    assert f"{len(int8_modules)} × {INT8_LINEAR}" in text, text


def test_int8_moe_on_onnx_is_refused_by_name(tiny_mixtral, tmp_path):
    with pytest.raises(RecipeError, match="mixture-of-experts"):
        build_float32(tiny_mixtral, tmp_path / "o", quantization={"method": "int8", "report": False},
                      target={"device": "onnx-cpu"})
