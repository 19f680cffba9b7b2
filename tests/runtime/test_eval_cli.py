"""`llmc eval` and `llmc inspect` options, and a tokenizer that does not belong to its model: every user mistake
is one line and an exit code, before any model loads where it can be (no IndexError, no traceback)."""

import pytest
from click.testing import CliRunner

from llmc.cli import cli
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RequestError
from llmc.runtime.engine import Engine


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, ref_model_dir, hf_checkpoint_factory):
    """The reference model (vocabulary 4096) and a tiny llama of vocabulary 512 that carries the reference
    tokenizer, whose ids go up to 4095 (a tokenizer that does not belong to the model)."""
    root = tmp_path_factory.mktemp("eval_cli")
    small = hf_checkpoint_factory(root / "small-vocab", "llama", vocab_size=512)
    built = {}
    for name, model in (("ref", ref_model_dir), ("small", small)):
        built[name] = root / name
        build(recipe_from_dict({"model": str(model), "output": str(built[name]), "dtype": "float32",
                                "runtime": {"max_model_len": 128}}), show_progress=False)
    return built | {"small_checkpoint": small}


def _eval(*args):
    return CliRunner().invoke(cli, ["eval", *map(str, args), "--device", "cpu"])


def test_eval_options_out_of_range_are_usage_errors(artifacts, data_dir, tmp_path):
    heldout = data_dir / "heldout.txt"
    for option, value in (("--max-windows", 0), ("--max-windows", -3), ("--seq-len", 1)):
        result = _eval(artifacts["ref"], "--data", heldout, option, value)
        assert result.exit_code == 2 and option in result.output, result.output
    binary = tmp_path / "bin.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    result = _eval(artifacts["ref"], "--data", binary, "--seq-len", 16)
    assert isinstance(result.exception, RequestError) and "is not UTF-8 text" in str(result.exception)
    result = _eval(artifacts["ref"], "--data", tmp_path / "missing.txt")  # no model loads first
    assert isinstance(result.exception, RequestError) and "does not exist" in str(result.exception)
    (tmp_path / "empty.txt").write_text(" \n")
    for data, says in (("/dev/null", "is not a regular file"), (tmp_path / "empty.txt", "is empty")):
        result = _eval(artifacts["ref"], "--data", data)
        assert isinstance(result.exception, RequestError) and says in str(result.exception), result.output
    result = _eval(artifacts["ref"], "--data", heldout, "--seq-len", 4096)  # above the model's positions
    assert "--seq-len 4096" in str(result.exception), result.output


def test_a_tokenizer_that_does_not_belong_to_the_model_is_named(artifacts, data_dir, tmp_path):
    heldout = data_dir / "heldout.txt"
    result = _eval(artifacts["small"], "--data", heldout, "--seq-len", 64, "--max-windows", 1)
    assert isinstance(result.exception, RequestError) and "does not belong to this model" in str(result.exception)
    result = _eval(artifacts["ref"], "--data", heldout, "--seq-len", 64, "--compare", artifacts["small"])
    assert isinstance(result.exception, RequestError) and "vocabulary of 512 tokens" in str(result.exception)
    engine = Engine(artifacts["small"], device="cpu")
    try:
        with pytest.raises(RequestError, match="out of this model's vocabulary"):
            engine.score([1, 2, 600])
    finally:
        engine.close()
    with pytest.raises(CheckpointError, match="does not belong to this model"):  # calibration text through it
        build(recipe_from_dict({
            "model": str(artifacts["small_checkpoint"]), "output": str(tmp_path / "gptq"),
            "quantization": {"method": "gptq", "group_size": 32,
                             "calibration": {"data": str(heldout), "num_samples": 2, "seq_len": 32}}}),
              show_progress=False)
    assert not (tmp_path / "gptq").exists()


def test_inspect_gpu_memory_out_of_range_is_a_usage_error(artifacts):
    for value in ("0", "-5", "nan", "inf", "1e30"):
        result = CliRunner().invoke(cli, ["inspect", str(artifacts["ref"]), "--gpu-memory-gib", value])
        assert result.exit_code == 2 and "--gpu-memory-gib" in result.output, (value, result.output)
