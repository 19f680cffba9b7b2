"""The W4A16 kernel table: recorded by the compiler in the plan for exactly the artifact's GEMM shapes,
handed by the runtime's loader to every w4a16 gpu-layout linear, shown by `llmc inspect`."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from llmc.cli import cli
from llmc.compiler import kernel_plan
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, RecipeError
from llmc.kernels.w4a16_gemm import (DEFAULT_W4A16_TABLE, DEFAULT_W4A16_TABLE_GPU, W4A16Config, heuristic_w4a16_config,
                                     select_w4a16_config)
from llmc.quant import formats as formats_module
from llmc.runtime.artifact import read_manifest
from llmc.runtime.loader import build_model, log_kernel_table, make_formats

# tiny_llama: hidden 64, 4 heads (2 KV) of 16, MLP 128. K×N per rank of qkv, o, gate_up, down:
SHAPES = {
    1: {"64x128", "64x64", "64x256", "128x64"},
    2: {"64x64", "32x64", "64x128"},  # qkv 64 → 32 + 2·16, o 32 → 64, gate_up 64 → 2·64, down 64 → 64
}
DISTINCT = W4A16Config("fused", 16, 32, 2, 8, 2, False)  # no heuristic or recorded table picks this


def _build(checkpoint, out, device="cuda", tensor=1, **target):
    recipe = {"model": str(checkpoint), "output": str(out), "dtype": "float32",
              "quantization": {"method": "rtn", "group_size": 32},
              "parallel": {"tensor": tensor}, "target": {"device": device, **target}}
    build(recipe_from_dict(recipe), show_progress=False)
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def w4_artifact(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("w4") / "artifact"
    _build(tiny_llama, out)
    return out


@pytest.mark.parametrize("tensor", [1, 2])
def test_cuda_build_records_the_table_for_exactly_its_shapes(tensor, w4_artifact, tiny_llama, tmp_path):
    manifest = (json.loads((w4_artifact / "manifest.json").read_text()) if tensor == 1
                else _build(tiny_llama, tmp_path / "t2", tensor=2))
    records = manifest["plan"]["w4a16_kernels"]
    assert set(records) == SHAPES[tensor]
    for shape, record in records.items():
        k, n = map(int, shape.split("x"))
        assert (record["source"], record["gpu"]) == ("heuristic", None)
        table = {shape: record["entries"]}
        for m in (1, 2, 16, 17, 64, 65, 128, 5000):
            assert select_w4a16_config(m, k, n, table, 0) == heuristic_w4a16_config(m, k, n, kernel_plan.PLAN_NUM_SMS)


def test_cpu_build_records_no_table(tiny_llama, tmp_path):
    manifest = _build(tiny_llama, tmp_path / "cpu", device="cpu")
    assert manifest["plan"]["w4a16_kernels"] == {}


def test_shapes_of_the_recorded_table_are_measured_ones(monkeypatch):
    monkeypatch.setattr(kernel_plan, "DEFAULT_W4A16_TABLE", {"64x128": DEFAULT_W4A16_TABLE["4096x6144"]})
    tuned = {"64x64": {"source": "measured", "gpu": "Some GPU", "entries": [[1, DISTINCT.to_dict(), 3.5]]}}
    records = kernel_plan.plan_w4a16_kernels({(64, 128): 32, (128, 64): 32, (64, 64): 32}, tuned)
    assert list(records) == ["64x64", "64x128", "128x64"]
    assert records["64x64"] == tuned["64x64"]
    assert (records["64x128"]["source"], records["64x128"]["gpu"]) == ("measured", DEFAULT_W4A16_TABLE_GPU)
    max_m, config, us = DEFAULT_W4A16_TABLE["4096x6144"][0]
    assert records["64x128"]["entries"][0] == [max_m, config.to_dict(), us] and us is not None
    assert records["128x64"]["source"] == "heuristic"


def test_tuning_measures_each_group_size_with_this_gpu_name(monkeypatch):
    calls = []

    def fake_tune(shapes, dtype, group_size):
        calls.append((sorted(shapes), dtype, group_size))
        return {f"{k}x{n}": [(1, DISTINCT.to_dict(), 2.0)] for k, n in shapes}

    monkeypatch.setattr("llmc.kernels.w4a16_tune.tune_w4a16", fake_tune)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Fake GPU")
    measured = kernel_plan.tune_w4a16_shapes({(64, 128): 32, (128, 64): 128, (64, 64): 32}, torch.float32)
    assert calls == [([(64, 64), (64, 128)], torch.bfloat16, 32), ([(128, 64)], torch.bfloat16, 128)]
    assert measured["128x64"] == {"source": "measured", "gpu": "Fake GPU", "entries": [[1, DISTINCT.to_dict(), 2.0]]}


def _rewrite_manifest(artifact, edit):
    """Edit manifest.json and seal it again (its manifest_sha256 covers every other key)."""
    from llmc.runtime.integrity import DIGEST_KEY, manifest_digest

    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    data[DIGEST_KEY] = manifest_digest(data)
    path.write_text(json.dumps(data))


def test_the_runtime_runs_the_manifests_table(w4_artifact, tmp_path, monkeypatch):
    artifact = tmp_path / "artifact"
    shutil.copytree(w4_artifact, artifact)
    _rewrite_manifest(artifact, lambda d: d["plan"]["w4a16_kernels"]["64x128"].update(
        entries=[[1, DISTINCT.to_dict(), None], [64, {"kind": "dequant"}, None]]))
    model = build_model(artifact, read_manifest(artifact), torch.device("cpu"), max_positions=16)
    qkv = model.layers["0"].attn.qkv
    seen = {}

    def spy(x, qweight, scales, qzeros, bias, group_size, table):
        seen["config"] = select_w4a16_config(x.shape[0], x.shape[-1], qweight.shape[1], table, 132)
        return x.new_zeros(x.shape[0], qweight.shape[1])

    monkeypatch.setattr(formats_module, "can_use_triton", lambda x: True)  # take the GPU dispatch on the CPU
    monkeypatch.setattr(formats_module, "w4a16_linear", spy)
    qkv(torch.randn(1, 64))
    assert seen["config"] == DISTINCT
    qkv(torch.randn(3, 64))
    assert seen["config"].kind == "dequant"


def test_an_old_manifest_without_the_table_loads(w4_artifact, tmp_path):
    artifact = tmp_path / "artifact"
    shutil.copytree(w4_artifact, artifact)

    def make_old(data):
        data["format_version"] = "1.0"
        del data["plan"]["w4a16_kernels"]

    _rewrite_manifest(artifact, make_old)
    manifest = read_manifest(artifact)
    assert manifest.plan.w4a16_kernels == {}
    formats = make_formats(manifest, torch.float32)
    assert formats["layers.0.attn.qkv"].is_gpu_layout and formats["layers.0.attn.qkv"].kernel_table is None
    build_model(artifact, manifest, torch.device("cpu"), max_positions=16)


def test_a_malformed_table_is_an_artifact_error(w4_artifact, tmp_path):
    artifact = tmp_path / "artifact"
    shutil.copytree(w4_artifact, artifact)
    _rewrite_manifest(artifact, lambda d: d["plan"]["w4a16_kernels"]["64x128"].update(entries=[[1, {"kind": "magic"}, None]]))
    with pytest.raises(ArtifactError, match="plan.w4a16_kernels"):
        make_formats(read_manifest(artifact), torch.float32)


def test_inspect_shows_the_kernel_per_shape(w4_artifact):
    text = CliRunner().invoke(cli, ["inspect", str(w4_artifact)])
    assert text.exit_code == 0, text.output
    assert "w4a16 kernels" in text.output
    assert "128x64" in text.output and "M=1 rows, M=16 wgmma, M=256 wgmma_ws (heuristic)" in text.output
    report = json.loads(CliRunner().invoke(cli, ["inspect", str(w4_artifact), "--json"]).output)
    assert set(report["w4a16_kernels"]) == SHAPES[1]
    assert report["w4a16_kernel_summary"]["64x128"]["kind_at_m"] == {"1": "rows", "16": "wgmma", "256": "wgmma_ws"}


def test_tune_kernels_without_a_gpu_is_one_line(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = {"model": str(tiny_llama), "output": str(tmp_path / "o"), "quantization": {"method": "rtn", "group_size": 32},
              "target": {"tune_kernels": True}}
    with pytest.raises(RecipeError, match="tune_kernels: true needs a CUDA GPU") as err:
        build(recipe_from_dict(recipe), show_progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()
    with pytest.raises(RecipeError, match="only a cuda target"):
        build(recipe_from_dict({**recipe, "target": {"device": "cpu", "tune_kernels": True}}), show_progress=False)


def test_tune_kernels_without_a_gpu_is_one_line_from_the_cli(tiny_llama, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"model": str(tiny_llama), "output": str(tmp_path / "o"),
                                  "quantization": {"method": "rtn", "group_size": 32}, "target": {"tune_kernels": True}}))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "build", str(recipe)], capture_output=True, text=True, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "tune_kernels: true needs a CUDA GPU" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tune_kernels_measures_on_this_gpu(tiny_llama, tmp_path):
    manifest = _build(tiny_llama, tmp_path / "tuned", tune_kernels=True)
    records = manifest["plan"]["w4a16_kernels"]
    assert set(records) == SHAPES[1]
    for record in records.values():
        assert (record["source"], record["gpu"]) == ("measured", torch.cuda.get_device_name())
        assert all(us is not None and us > 0 for _, _, us in record["entries"])


def test_a_table_measured_on_another_gpu_is_used_and_logged(w4_artifact, tmp_path, monkeypatch, caplog):
    artifact = tmp_path / "artifact"
    shutil.copytree(w4_artifact, artifact)
    _rewrite_manifest(artifact, lambda d: d["plan"]["w4a16_kernels"]["64x128"].update(source="measured", gpu="NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Other GPU")
    with caplog.at_level("INFO", logger="llmc"):
        log_kernel_table(read_manifest(artifact), torch.device("cuda"))
    assert "the artifact's table for 4 shape(s) (heuristic, measured on NVIDIA H200)" in caplog.text
    assert "entries measured on NVIDIA H200, this GPU is Other GPU; using them as planned" in caplog.text
