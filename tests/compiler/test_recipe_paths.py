"""Recipe paths and YAML edge cases: duplicate keys, `~`, outputs that overlap the checkpoint."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmc.compiler.recipe import load_recipe, recipe_from_dict
from llmc.errors import RecipeError

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "checkpoints" / "ref-llama-12m"


@pytest.mark.parametrize("text, words", [
    (f"model: {MODEL}\nquantization: {{method: rtn}}\nquantization: {{method: none}}\n",
     ["line 3", "'quantization'", "given twice", "line 2"]),
    (f"model: {MODEL}\nruntime:\n  max_model_len: 256\n  max_model_len: 128\n", ["line 4", "'max_model_len'", "twice"]),
])
def test_a_key_given_twice_is_refused(tmp_path, text, words):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(path) in str(err.value) and all(w in str(err.value) for w in words), err.value


def test_merge_keys_still_work(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(f"model: {MODEL}\nruntime:\n  <<: {{max_num_seqs: 8}}\n  max_model_len: 256\n")
    assert load_recipe(path).runtime.max_num_seqs == 8


@pytest.mark.parametrize("data, key", [
    ({"model": "~/ckpt"}, "model"),
    ({"model": str(MODEL), "output": "~/out"}, "output"),
    ({"model": str(MODEL), "output": "$HOME/out"}, "output"),
    ({"model": str(MODEL), "output": ""}, "output"),
    ({"model": ""}, "model"),
    ({"model": str(MODEL), "quantization": {"calibration": {"data": "~/c.txt"}}}, "quantization.calibration.data"),
])
def test_unexpanded_or_empty_paths_are_refused(data, key):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data)
    assert str(err.value).startswith(f"recipe: {key}:"), err.value


@pytest.mark.parametrize("output", ["ck", "ck/out", "."])
def test_output_overlapping_the_checkpoint_is_refused(tmp_path, monkeypatch, output):
    shutil.copytree(MODEL, tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").write_text("{}")  # another tool's file must not make it look like an artifact
    monkeypatch.chdir(tmp_path / "ck" if output == "." else tmp_path)
    model = "." if output == "." else "ck"
    with pytest.raises(RecipeError, match="checkpoint"):
        recipe_from_dict({"model": model, "output": output})


@pytest.mark.parametrize("model", [".", ".."])
def test_default_output_of_dot_and_dotdot(tmp_path, monkeypatch, model):
    """It was `build` (inside the checkpoint) and `build/..`, the current directory itself, replaced whole."""
    shutil.copytree(MODEL, tmp_path / "ck")
    (tmp_path / "ck" / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "ck" / ("sub" if model == ".." else ""))
    with pytest.raises(RecipeError, match="inside the checkpoint"):
        recipe_from_dict({"model": model})
    assert recipe_from_dict({"model": model, "output": str(tmp_path / "art")}).output_dir == tmp_path / "art"
    from llmc.compiler.recipe import Recipe
    assert Recipe(model=model).output_dir == Path("build/ck")


def test_cli_output_flag_into_the_checkpoint_is_refused_and_checkpoint_intact(tmp_path):
    shutil.copytree(MODEL, tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").write_text("{}")
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tmp_path / 'ck'}\ntarget: {{device: cpu}}\n")
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "build", "-q", "-o", str(tmp_path / "ck"), str(recipe)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "checkpoint" in result.stderr, result.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before


def test_a_failed_build_leaves_no_empty_output_parents(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {MODEL}\noutput: {tmp_path / 'new' / 'a' / 'b'}\ntarget: {{device: cpu}}\n"
                      "runtime: {max_model_len: 1000000}\n")
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "build", "-q", str(recipe)], capture_output=True, text=True)
    assert result.returncode == 2 and "runtime.max_model_len" in result.stderr, result.stderr
    assert not (tmp_path / "new").exists()


def test_a_missing_relative_model_says_where_it_looked(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: checkpoints/ref-llama-12m\n")
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "build", "-q", str(recipe)], capture_output=True,
                            text=True, cwd=tmp_path, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "current directory" in result.stderr, result.stderr
    assert str(tmp_path / "checkpoints" / "ref-llama-12m") in result.stderr
    assert not (tmp_path / "build").exists()


def test_a_relative_generation_config_folder_is_recorded_absolute(tmp_path):
    import json
    shutil.copytree(MODEL, tmp_path / "ck")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: ck\noutput: art\ntarget: {device: cpu}\n"
                      "runtime: {max_model_len: 256, generation_config: ck}\n")
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "build", "-q", str(recipe)], capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["runtime"]["generation_config"] == str(tmp_path / "ck")


@pytest.mark.parametrize("text, key", [("quantization: {damp_percent: 1e-2}", "quantization.damp_percent"),
                                       ("runtime: {max_num_seqs: 1e3}", "runtime.max_num_seqs")])
def test_yaml11_exponent_without_a_dot_gets_a_hint(tmp_path, text, key):
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {MODEL}\n{text}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert key in str(err.value) and "YAML reads" in str(err.value), err.value


def test_build_time_recipe_errors_name_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {MODEL}\noutput: {tmp_path}\n")
    (tmp_path / "other.txt").write_text("x")
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "build", "-q", str(recipe)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith(f"llmc: error: {recipe}: output:"), result.stderr


def test_a_revision_with_a_local_model_is_refused():
    """It was recorded in the manifest as if the build had used it, and ignored."""
    with pytest.raises(RecipeError, match="revision: 'v2' applies to a hub id"):
        recipe_from_dict({"model": str(MODEL), "revision": "v2"})


def test_a_recipe_through_a_pipe_and_a_directory(tmp_path):
    read, write = __import__("os").pipe()
    with open(write, "w") as f:
        f.write(f"model: {MODEL}\n")
    assert load_recipe(f"/dev/fd/{read}").model == str(MODEL)  # `llmc build <(...)`
    __import__("os").close(read)
    with pytest.raises(RecipeError, match="is a directory, not a recipe file"):
        load_recipe(tmp_path)
