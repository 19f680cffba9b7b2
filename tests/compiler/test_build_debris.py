"""Builds leave no debris (issue 20): killed builds' temporary directories are removed by the next build
at that output, the name holds a whole artifact at every instant of the swap, every recipe value is
checked before work starts, and artifacts get the usual permissions."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys

import pytest
import yaml

from llmc.compiler import emit
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RecipeError
from llmc.runtime.artifact import read_manifest, verify_files


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _host() -> str:
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())


def _leftover(parent, name, kind, pid, host=None, with_manifest=False):
    path = parent / f".{name}.{kind}-{host or _host()}.{pid}-0badc0de"
    (path / "rank-00").mkdir(parents=True)
    (path / "rank-00" / "weights.safetensors").write_bytes(b"x" * 1000)
    if with_manifest:
        (path / "manifest.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("debris") / "tiny"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out)}), show_progress=False)
    return out


def test_stale_building_directories_are_removed_live_and_foreign_ones_kept(tmp_path, tiny_llama):
    out = tmp_path / "out"
    dead = [_leftover(tmp_path, "out", "building", _dead_pid()) for _ in range(2)]
    live_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _leftover(tmp_path, "out", "building", live_process.pid)
        foreign = _leftover(tmp_path, "out", "building", _dead_pid(), host="some-other-host")
        other_output = _leftover(tmp_path, "other", "building", _dead_pid())
        build(recipe_from_dict({"model": str(tiny_llama), "output": str(out)}), show_progress=False)
    finally:
        live_process.kill()
        live_process.wait()
    assert not any(p.exists() for p in dead)
    assert live.exists() and foreign.exists() and other_output.exists()
    assert verify_files(out, read_manifest(out)) == []


def test_an_old_artifact_left_aside_by_a_killed_swap_is_put_back(built, tmp_path):
    # The state a kill between the two renames of the non-atomic swap leaves: no `out`, the old
    # artifact renamed aside, the new one complete in its temporary directory.
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{_host()}.{_dead_pid()}-12345678"
    shutil.copytree(built, old)
    new = _leftover(tmp_path, "out", "building", _dead_pid(), with_manifest=True)
    old_inode = old.stat().st_ino
    assert set(emit.recover_output(out)) == {new}
    assert out.stat().st_ino == old_inode and verify_files(out, read_manifest(out)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


_KILL_AFTER_EXCHANGE = """
import os, signal
from llmc.compiler import build as build_module, emit
from llmc.compiler.recipe import recipe_from_dict
real = emit._exchange
def exchange_then_die(a, b):
    assert real(a, b)
    os.kill(os.getpid(), signal.SIGKILL)  # the old artifact now sits in the temporary directory
emit._exchange = exchange_then_die
build_module.build(recipe_from_dict({"model": %r, "output": %r}), show_progress=False)
"""


def test_kill_during_the_swap_leaves_a_whole_artifact_and_the_next_build_cleans(built, tmp_path, tiny_llama):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    if not emit._exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this filesystem")
    (tmp_path / "a").rmdir()
    (tmp_path / "b").rmdir()
    out = tmp_path / "out"
    shutil.copytree(built, out)
    (out / "marker").write_text("old")  # tells the old artifact from the new one
    script = _KILL_AFTER_EXCHANGE % (str(tiny_llama), str(out))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr
    assert not (out / "marker").exists() and verify_files(out, read_manifest(out)) == []  # the new one, whole
    leftovers = [p for p in tmp_path.iterdir() if p.name != "out"]
    assert len(leftovers) == 1 and (leftovers[0] / "marker").read_text() == "old"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out)}), show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_artifact_directories_follow_the_umask(tmp_path, tiny_llama):
    previous = os.umask(0o022)
    try:
        out = tmp_path / "out"
        build(recipe_from_dict({"model": str(tiny_llama), "output": str(out)}), show_progress=False)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "rank-00").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "manifest.json").stat().st_mode) == 0o644


def test_output_that_is_a_file_is_refused_before_any_work(tmp_path, tiny_llama, llmc_cli):
    target = tmp_path / "taken"
    target.write_text("keep me")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_llama), "output": str(target)}))
    code, err = llmc_cli("build", recipe, "-q")
    _assert_one_line(code, err, "exists and is not a directory")
    assert target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "taken"]


def _assert_one_line(code, err, expected):
    assert code not in (0, None) and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("llmc: error:")]
    assert len(lines) == 1 and err.rstrip().splitlines()[-1] == lines[0] and expected in lines[0], err


def _calibration(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return {"quantization": {"method": "gptq", "group_size": 32,
                             "calibration": {"data": str(path), "num_samples": 2, "seq_len": 16}}}


# (id, recipe fields (or a function of tmp_path giving them), what the error names)
BAD_RECIPES = [
    ("nan-utilization", "runtime:\n  gpu_memory_utilization: .nan\n", "runtime.gpu_memory_utilization: expected a finite number"),
    ("inf-cpu-kv", "runtime:\n  cpu_kv_cache_gib: .inf\n", "runtime.cpu_kv_cache_gib: expected a finite number"),
    ("huge-cpu-kv", "runtime:\n  cpu_kv_cache_gib: 1.0e+300\n", "runtime.cpu_kv_cache_gib: 1e+300 is too large"),
    ("nan-gpu-gib", "target:\n  gpu_memory_gib: .nan\n", "target.gpu_memory_gib: expected a finite number"),
    ("seed-too-big", "runtime:\n  seed: 100000000000000000000000\n", "runtime.seed: 100000000000000000000000 is too large"),
    # planned 6.25M CUDA-graph sizes (a 99 MB manifest) before the limit
    ("huge-max-num-seqs", "runtime:\n  max_num_seqs: 100000000\n", "runtime.max_num_seqs: 100000000 is too large"),
    ("bad-regex-override", "quantization:\n  method: rtn\n  overrides:\n  - match: 're:layers.(['\n    bits: 8\n",
     "quantization.overrides[0].match: 're:layers.([' is not a valid regular expression"),
    ("bad-regex-ignore", "quantization:\n  method: rtn\n  ignore: ['re:*lm_head']\n",
     "quantization.ignore[0]: 're:*lm_head' is not a valid regular expression"),
    ("malformed-jsonl", lambda t: _calibration(t, "c.jsonl", b'{"text": "a"}\n{"text": \n'), "c.jsonl line 2 is not JSON"),
    ("jsonl-not-objects", lambda t: _calibration(t, "c.jsonl", b'{"text": "a"}\n[1, 2]\n'),
     'c.jsonl line 2 must be an object with a "text" string'),
    ("binary-calibration", lambda t: _calibration(t, "c.txt", bytes(range(256)) * 64), "c.txt is not UTF-8 text"),
    ("calibration-is-a-directory", lambda t: {"quantization": {"method": "gptq", "calibration": {"data": str(t)}}},
     "is not a regular file"),
    ("binary-recipe", None, "not a YAML text file"),
]


@pytest.mark.parametrize("name, fields, expected", BAD_RECIPES, ids=[r[0] for r in BAD_RECIPES])
def test_bad_recipe_values_are_one_line_errors_and_leave_nothing(tmp_path, tiny_llama, llmc_cli, name, fields, expected):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    recipe = work / "r.yaml"
    if fields is None:
        recipe.write_bytes(b"\xff\xfe" + bytes(range(256)))
    elif isinstance(fields, str):
        recipe.write_text(f"model: {json.dumps(str(tiny_llama))}\noutput: {json.dumps(str(out))}\n" + fields)
    else:
        recipe.write_text(yaml.safe_dump({"model": str(tiny_llama), "output": str(out), **fields(tmp_path)}))
    code, err = llmc_cli("build", recipe, "-q")
    _assert_one_line(code, err, expected)
    assert sorted(p.name for p in work.iterdir()) == ["r.yaml"]


def test_a_valid_regex_still_builds(tmp_path, tiny_llama):
    recipe = recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "o"), "quantization": {
        "method": "rtn", "group_size": 32, "overrides": [{"match": r"re:layers\.1\..*", "bits": 8}]}})
    modules = build(recipe, show_progress=False).manifest.quant.modules
    assert modules["layers.1.mlp.down"]["format"] == "w8a16" and modules["layers.0.mlp.down"]["format"] == "w4a16"


def test_recipe_errors_come_before_the_build(tmp_path, tiny_llama):
    with pytest.raises(RecipeError, match="not a valid regular expression"):
        recipe_from_dict({"model": str(tiny_llama), "quantization": {"ignore": ["re:("]}})


def test_rebuild_without_rename_exchange_swaps_through_a_renamed_old(built, tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setattr(emit, "_exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    out = tmp_path / "out"
    shutil.copytree(built, out)
    (out / "marker").write_text("old")
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out)}), show_progress=False)
    assert not (out / "marker").exists() and verify_files(out, read_manifest(out)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A read-only folder fails before any work; a disk that fills up while the artifact is written is one
    line naming the output, and the temporary directory goes (no traceback, no partial artifact)."""
    final = tmp_path / "out" / "art"

    def read_only(final_path, kind):
        raise OSError(30, "Read-only file system", str(final_path.parent / ".x"))

    with monkeypatch.context() as patch:
        patch.setattr(emit, "_make_temp_dir", read_only)
        with pytest.raises(RecipeError, match=r"output: cannot write in .* \(Read-only file system\)"):
            with emit.atomic_directory(final):
                raise AssertionError("no work may start")
    with pytest.raises(emit.ArtifactError, match=r"output: writing the artifact in .* failed \(No space left on device\)"):
        with emit.atomic_directory(final) as tmp:
            (tmp / "weights.safetensors").write_bytes(b"x")
            raise OSError(28, "No space left on device")
    assert sorted(p.name for p in final.parent.iterdir()) == []
    with pytest.raises(FileNotFoundError):  # a file outside the artifact (the checkpoint): its own error
        with emit.atomic_directory(final):
            open(tmp_path / "no-checkpoint" / "config.json")


def test_weights_that_do_not_fit_the_dtype_are_refused_by_name(tmp_path, hf_checkpoint_factory):
    """dtype float16 on a checkpoint holding a weight beyond float16's range: the cast gives inf, which
    the build refuses, naming the tensor, instead of an artifact whose every logit is NaN."""
    from safetensors.torch import load_file, save_file

    from llmc.errors import CheckpointError

    checkpoint = hf_checkpoint_factory(tmp_path / "ck", "llama")
    (weights,) = checkpoint.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(tensors, weights, metadata={"format": "pt"})
    recipe = {"model": str(checkpoint), "output": str(tmp_path / "a"), "runtime": {"max_model_len": 64}}
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.down.weight: inf or NaN in the torch.float16 tensor "
                                              r"\(torch.float16 holds at most 65504\).*bfloat16 or float32"):
        build(recipe_from_dict({**recipe, "dtype": "float16"}), show_progress=False)
    assert not (tmp_path / "a").exists()
    build(recipe_from_dict({**recipe, "dtype": "bfloat16"}), show_progress=False)  # fits bfloat16


def test_qwen3_attention_bias_is_refused(tmp_path, hf_checkpoint_factory):
    """Qwen3 with attention_bias has an o_proj bias, which llmc's attention does not apply: refused, as
    Llama's biases are, rather than built with it dropped."""
    from llmc.errors import CheckpointError

    checkpoint = hf_checkpoint_factory(tmp_path / "ck", "qwen3", attention_bias=True)
    with pytest.raises(CheckpointError, match="qwen3 checkpoints with attention_bias .*are not supported"):
        build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "a")}), show_progress=False)


@pytest.mark.parametrize(("quantization", "error"), [
    ({"ignore": ["lm_haed"]}, r"quantization.ignore\[0\]: 'lm_haed' matches no linear of this model"),
    ({"overrides": [{"match": "*dwn_proj", "bits": 8}]}, r"quantization.overrides\[0\].match: '\*dwn_proj' matches no"),
    ({"overrides": [{"match": "*q_proj", "bits": 8}]},
     r"quantization.overrides\[0\].match matches \['model.layers.0.self_attn.q_proj'\] but they are fused into "
     r"layers.0.attn.qkv; change all of them or none"),
    # lm_head is in the default ignore list: an override of it alone changed nothing
    ({"overrides": [{"match": "lm_head", "bits": 8}]},
     r"quantization.overrides\[0\].match: 'lm_head' names only linears that quantization.ignore keeps unquantized"),
    ({"ignore": ["lm_head", "*down_proj"], "overrides": [{"match": "*down_proj", "bits": 8}]},
     r"names only linears that quantization.ignore keeps unquantized \(layers.0.mlp.down, layers.1.mlp.down"),
])
def test_recipe_patterns_that_name_no_linear_or_part_of_a_fused_one_are_refused(tmp_path, tiny_llama, quantization,
                                                                                error):
    """A typo in an ignore or override pattern quantized what it meant to keep (or changed nothing), and
    an override of q_proj alone made all of qkv 8-bit: each is refused by name before anything is built."""
    recipe = {"model": str(tiny_llama), "output": str(tmp_path / "a"), "runtime": {"max_model_len": 64},
              "quantization": {"method": "rtn", "bits": 4, "group_size": 32, **quantization}}
    with pytest.raises(RecipeError, match=error):
        build(recipe_from_dict(recipe), show_progress=False)
    assert not (tmp_path / "a").exists()


def test_an_override_of_lm_head_applies_once_ignore_lets_it(tmp_path, tiny_llama):
    recipe = {"model": str(tiny_llama), "output": str(tmp_path / "a"), "runtime": {"max_model_len": 64},
              "quantization": {"method": "rtn", "bits": 4, "group_size": 32, "ignore": [],
                               "overrides": [{"match": "lm_head", "bits": 8}]}}
    build(recipe_from_dict(recipe), show_progress=False)
    modules = read_manifest(tmp_path / "a").quant.modules
    assert modules["lm_head"]["bits"] == 8 and modules["layers.0.attn.qkv"]["bits"] == 4


def test_a_tied_lm_head_says_it_stays_unquantized(tmp_path, hf_checkpoint_factory, caplog):
    import logging

    checkpoint = hf_checkpoint_factory(tmp_path / "ck", "llama", tie_word_embeddings=True)
    recipe = {"model": str(checkpoint), "output": str(tmp_path / "a"), "runtime": {"max_model_len": 64},
              "quantization": {"method": "rtn", "bits": 4, "group_size": 32, "ignore": []}}
    with caplog.at_level(logging.INFO, logger="llmc"):
        build(recipe_from_dict(recipe), show_progress=False)
    assert "lm_head is tied to the embedding (tie_word_embeddings) and stays" in caplog.text
    assert "lm_head" not in read_manifest(tmp_path / "a").quant.modules


def test_a_max_model_len_beyond_the_model_fails_before_the_quantization(tmp_path, tiny_llama, data_dir, monkeypatch):
    """runtime.max_model_len above max_position_embeddings (no rope scaling) is refused right after the
    checkpoint is read: a GPTQ build no longer runs to the manifest before saying so."""
    from llmc.compiler import build as build_module

    monkeypatch.setattr(build_module, "_plan_formats", lambda ctx: pytest.fail("planned before the check"))
    recipe = {"model": str(tiny_llama), "output": str(tmp_path / "a"), "runtime": {"max_model_len": 100000},
              "quantization": {"method": "gptq", "bits": 4, "group_size": 32,
                               "calibration": {"data": str(data_dir / "calibration.txt"), "num_samples": 2}}}
    with pytest.raises(RecipeError, match="runtime.max_model_len: 100000 exceeds the model.s context of 256 \\(max_position_embeddings 256\\)"):
        build(recipe_from_dict(recipe), show_progress=False)


def test_calibration_windows_longer_than_the_model_context_are_refused(tmp_path, tiny_llama, data_dir, monkeypatch):
    """seq_len 300 on a model of 256 positions calibrated GPTQ on positions the model never saw, silently."""
    from llmc.compiler import build as build_module

    monkeypatch.setattr(build_module, "_plan_formats", lambda ctx: pytest.fail("planned before the check"))
    recipe = {"model": str(tiny_llama), "output": str(tmp_path / "a"), "runtime": {"max_model_len": 128},
              "quantization": {"method": "gptq", "group_size": 32,
                               "calibration": {"data": str(data_dir / "calibration.txt"), "num_samples": 2,
                                               "seq_len": 300}}}
    with pytest.raises(RecipeError, match="quantization.calibration.seq_len: 300 exceeds the model.s context of 256 "
                                          "\\(max_position_embeddings 256\\)"):
        build(recipe_from_dict(recipe), show_progress=False)
    recipe["quantization"]["calibration"]["seq_len"] = 256  # the whole context is allowed
    monkeypatch.undo()
    build(recipe_from_dict(recipe), show_progress=False)


@pytest.mark.parametrize(("quantization", "named"), [
    ({"method": "fp8", "bits": 4, "group_size": 32}, "quantization.bits, quantization.group_size: method fp8"),
    ({"method": "rtn", "act_order": True}, "quantization.act_order: method rtn does not use it"),
    ({"method": "rtn", "min_expert_tokens": 8}, "quantization.min_expert_tokens: method rtn does not use it"),
    ({"method": "none", "bits": 3}, "quantization.bits: method none"),
    ({"method": "fp8", "overrides": [{"match": "*down_proj", "bits": 4}]}, "quantization.overrides[0].bits: method fp8"),
    ({"method": "rtn", "calibration": {"seed": 3}}, "quantization.calibration.seed: the windows are drawn by seed only "
                                                    "with quantization.calibration.shuffle: true"),
])
def test_quantization_keys_the_method_does_not_read_are_named(tmp_path, tiny_llama, caplog, quantization, named):
    import logging

    with caplog.at_level(logging.WARNING, logger="llmc"):
        recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "a"), "quantization": quantization})
    assert named in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmc"):
        recipe_from_dict({"model": str(tiny_llama), "quantization": {"method": "gptq", "act_order": True,
                                                                      "calibration": {"data": __file__, "shuffle": True,
                                                                                      "seed": 3}}})
    assert "does not use" not in caplog.text and "seed" not in caplog.text


def test_the_build_closes_the_checkpoint_shards_after_each_layer(tmp_path, tiny_llama, monkeypatch):
    """An open shard stays mapped, and its pages already read count in the build's resident memory (a 705 MiB
    checkpoint's build peaked 645 MiB higher than a 60 MiB one's): the reader lets go of them after each unit."""
    from llmc.compiler import hf_checkpoint

    mapped_at_release = []
    release = hf_checkpoint.TensorReader.release

    def counting_release(self):
        mapped_at_release.append(len(self._handles))
        release(self)
        assert self._handles == {}

    monkeypatch.setattr(hf_checkpoint.TensorReader, "release", counting_release)
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "a"), "runtime": {"max_model_len": 64},
                            "quantization": {"method": "rtn", "bits": 4, "group_size": 32}}), show_progress=False)
    layers = read_manifest(tmp_path / "a").model.num_layers
    assert len(mapped_at_release) >= layers + 1 and max(mapped_at_release) >= 1
