"""Recipes are strict: each mistake is one line naming the key and what is allowed, exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmc.compiler.recipe import load_recipe, recipe_from_dict
from llmc.errors import RecipeError

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "checkpoints" / "ref-llama-12m")


def test_the_shipped_recipe_parses(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name paths relative to the current directory
    recipe = load_recipe(REPO / "recipes" / "ref-llama-12m.yaml")
    assert recipe.quantization.method == "none"
    assert recipe.runtime.block_size == 16


def test_defaults():
    recipe = recipe_from_dict({"model": MODEL})
    assert recipe.dtype == "auto"
    assert recipe.output_dir == Path("build/ref-llama-12m")
    assert recipe.runtime.max_num_seqs == 64 and recipe.runtime.enable_prefix_caching is True
    assert recipe.parallel.tensor == 1


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"model": MODEL, "dtpye": "float32"}, ["dtpye", "unknown key", "did you mean 'dtype'"]),
        ({"model": MODEL, "runtime": {"max_num_seqs": "many"}}, ["runtime.max_num_seqs", "expected an integer"]),
        ({"model": MODEL, "runtime": {"max_num_seqs": 0}}, ["runtime.max_num_seqs", "at least 1"]),
        ({"model": MODEL, "runtime": {"gpu_memory_utilization": 1.5}}, ["gpu_memory_utilization", "at most 1.0"]),
        ({"model": MODEL, "runtime": {"enforce_eager": "yes"}}, ["runtime.enforce_eager", "true or false"]),
        ({"model": MODEL, "dtype": "int8"}, ["dtype", "choose one of", "bfloat16"]),
        ({"model": MODEL, "quantization": {"method": "magic"}}, ["quantization.method", "gptq"]),
        ({"model": MODEL, "quantization": {"bits": 5}}, ["quantization.bits", "3, 4, 8"]),
        ({"model": MODEL, "parallel": {"tensor": 0}}, ["parallel.tensor", "at least 1"]),
        ({"model": "no/such/dir/here"}, ["model", "does not exist"]),
        ({"model": MODEL, "runtime": [1, 2]}, ["runtime", "mapping"]),
        ({"dtype": "float32"}, ["model", "required"]),
        ({"model": MODEL, "quantization": {"method": "gptq"}}, ["calibration.data", "gptq"]),
        # settings the artifact could never start with are refused at build time
        ({"model": MODEL, "runtime": {"num_scheduler_steps": 4}}, ["runtime.num_scheduler_steps 4", "onnx-cpu"]),
        ({"model": MODEL, "target": {"device": "onnx-cpu"}, "runtime": {"num_scheduler_steps": 4, "speculative": {
            "method": "ngram", "num_speculative_tokens": 3}}}, ["runtime.num_scheduler_steps 4", "speculative"]),
        # asked for explicitly, it was turned off without a word (the default is, for onnx-cpu)
        ({"model": MODEL, "target": {"device": "onnx-cpu"}, "runtime": {"enable_prefix_caching": True}},
         ["runtime.enable_prefix_caching", "onnx-cpu", "no paged KV blocks"]),
    ],
)
def test_each_mistake_is_one_line_naming_the_key(data, words):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_cli_exit_code_2_and_no_traceback(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({"model": MODEL, "runtime": {"block_size": 7}}))
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "build", str(recipe)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "runtime.block_size" in result.stderr and "16" in result.stderr


def test_invalid_yaml_is_one_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(recipe)


@pytest.mark.parametrize(("args", "words"), [
    (["run", "x", "--max-num-seqs", "abc"], ["'--max-num-seqs'", "'abc' is not a valid integer", "`llmc run --help`"]),
    (["run", "x", "--swap-space", "4"], ["No such option '--swap-space'"]),
    (["bild", "x"], ["No such command 'bild'", "build"]),
    (["build"], ["Missing argument 'RECIPE'"]),
])
def test_a_bad_flag_is_one_error_line_and_exit_2(args, words):
    """A flag or value click refuses reads as every other error a user can cause: `llmc: error: ...`."""
    result = subprocess.run([sys.executable, "-m", "llmc.cli", *args], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("llmc: error: ") and result.stderr.strip().count("\n") == 0, result.stderr
    assert all(word in result.stderr for word in words), result.stderr
