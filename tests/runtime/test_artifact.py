"""The artifact boundary: integrity checks, strict loading, version refusal, atomic builds."""

import json
import shutil
import subprocess
import sys

import pytest

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import read_manifest, verify_files
from llmc.runtime.llm import LLM

WEIGHTS = "rank-00/weights.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory, ref_model_dir):
    out = tmp_path_factory.mktemp("built") / "ref"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out)}), show_progress=False)
    return out


@pytest.fixture
def artifact(built, tmp_path):
    copy = tmp_path / "artifact"
    shutil.copytree(built, copy)
    return copy


def _llmc(*args):
    return subprocess.run([sys.executable, "-m", "llmc.cli", *map(str, args)], capture_output=True, text=True)


def test_manifest_records_every_file_and_the_source(built):
    manifest = read_manifest(built)
    files = set(manifest.files)
    assert WEIGHTS in files and "tokenizer/tokenizer.json" in files and "tokenizer/tokenizer_config.json" in files
    assert all(len(entry["sha256"]) == 64 for entry in manifest.files.values())
    assert set(manifest.source["sha256"]) >= {"config.json", "model-00001-of-00003.safetensors"}
    assert manifest.quant.modules["layers.0.attn.qkv"] == {"format": "dense"}
    assert verify_files(built, manifest) == []


def test_fused_tensor_names_and_shapes(built):
    from llmc.runtime.artifact import read_safetensors_header

    header = read_safetensors_header(built / WEIGHTS)
    assert header["layers.0.attn.qkv.weight"]["shape"] == [(6 + 2 * 2) * 64, 384]
    assert header["layers.5.mlp.gate_up.weight"]["shape"] == [2 * 1024, 384]
    assert "layers.0.self_attn.q_proj.weight" not in header


def test_corrupted_byte_is_caught_by_verify(artifact):
    path = artifact / WEIGHTS
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    result = _llmc("inspect", artifact, "--verify")
    assert result.returncode != 0
    assert "rank-00/weights.safetensors: sha256 mismatch" in result.stderr
    assert "Traceback" not in result.stderr


def test_truncated_weights_are_refused_at_load(artifact):
    path = artifact / WEIGHTS
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="truncated"):
        LLM(artifact, device="cpu")
    result = _llmc("run", artifact, "--prompt", "hi", "--device", "cpu")
    assert result.returncode == 1 and "truncated" in result.stderr and "Traceback" not in result.stderr


def test_missing_file_is_named_by_verify(artifact):
    (artifact / "tokenizer" / "tokenizer.json").unlink()
    problems = verify_files(artifact, read_manifest(artifact))
    assert problems == ["tokenizer/tokenizer.json: missing"]


def test_unknown_major_format_version_is_refused(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["format_version"] = "2.0"
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format_version '2.0' is not supported"):
        read_manifest(artifact)


def test_extra_or_missing_tensor_is_named(artifact):
    from safetensors.torch import load_file, save_file

    from llmc.runtime.artifact import hash_files, write_manifest

    path = artifact / WEIGHTS
    tensors = load_file(path)
    del tensors["layers.2.mlp.down.weight"]
    save_file(tensors, path)
    manifest = read_manifest(artifact)
    write_manifest(artifact, type(manifest)(**{**manifest.__dict__, "files": hash_files(artifact)}))
    with pytest.raises(ArtifactError, match="missing tensor layers.2.mlp.down.weight"):
        LLM(artifact, device="cpu")


def test_a_failed_build_leaves_nothing_behind(tmp_path, hf_checkpoint_factory):
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", "llama")
    broken = checkpoint / "model.safetensors"
    broken.write_bytes(broken.read_bytes()[:1000])  # a truncated shard fails mid-build
    out = tmp_path / "out"
    with pytest.raises(Exception):
        build(recipe_from_dict({"model": str(checkpoint), "output": str(out)}), show_progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_rebuild_replaces_an_artifact_atomically(built, tmp_path, ref_model_dir):
    out = tmp_path / "again"
    recipe = recipe_from_dict({"model": str(ref_model_dir), "output": str(out)})
    build(recipe, show_progress=False)
    first = read_manifest(out).files[WEIGHTS]["sha256"]
    build(recipe, show_progress=False)
    assert read_manifest(out).files[WEIGHTS]["sha256"] == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_pickle_only_checkpoint_is_a_clear_error(tmp_path, ref_model_dir):
    ckpt = tmp_path / "pickled"
    ckpt.mkdir()
    shutil.copy(ref_model_dir / "config.json", ckpt)
    (ckpt / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(CheckpointError, match="convert them to safetensors"):
        build(recipe_from_dict({"model": str(ckpt), "output": str(tmp_path / "o")}), show_progress=False)


def test_unsupported_architecture_is_a_clear_error(tmp_path, ref_model_dir):
    ckpt = tmp_path / "gpt2"
    shutil.copytree(ref_model_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not supported; supported: LlamaForCausalLM"):
        build(recipe_from_dict({"model": str(ckpt), "output": str(tmp_path / "o")}), show_progress=False)


def test_missing_tensor_in_checkpoint_is_named(tmp_path, ref_model_dir):
    ckpt = tmp_path / "holey"
    shutil.copytree(ref_model_dir, ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.3.mlp.up_proj.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.layers.3.mlp.up_proj.weight"):
        build(recipe_from_dict({"model": str(ckpt), "output": str(tmp_path / "o")}), show_progress=False)


def test_hub_id_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    from llmc.errors import RecipeError

    with pytest.raises(RecipeError, match="could not be fetched from the Hugging Face Hub"):
        build(recipe_from_dict({"model": "meta-llama/Llama-3.1-8B"}), show_progress=False)


def test_a_hugging_face_checkpoint_given_to_run_says_how_to_build_it(ref_model_dir, tmp_path):
    """vLLM serves a checkpoint directory directly; llmc runs artifacts, and says how to make one from it."""
    result = _llmc("run", ref_model_dir, "--prompt", "hi", "--device", "cpu")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{ref_model_dir} is a Hugging Face checkpoint, not an llmc artifact" in result.stderr
    assert f"`model: {ref_model_dir}`" in result.stderr
    (tmp_path / "empty").mkdir()
    assert "is not an llmc artifact (no manifest.json); build one" in _llmc("inspect", tmp_path / "empty").stderr
