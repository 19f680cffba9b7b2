"""Engine settings on all three surfaces (recipe, `llmc run` flags, LLM(...) keywords): vLLM's values and
types taken or refused in one line, never a traceback; a setting given by both its names refused everywhere."""

import pytest
import torch
from click.testing import CliRunner

from llmc.cli import cli
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, RecipeError
from llmc.runtime.llm import LLM


@pytest.fixture(scope="module")
def artifact(ref_artifact_128):
    return ref_artifact_128


def test_vllm_values_taken(artifact):
    # max_model_len None is vLLM's default (the model's length); a torch.dtype and any case of a dtype name too
    with LLM(artifact, device="cpu", max_model_len=None, dtype=torch.float32) as llm:
        assert llm.engine.options.max_model_len == llm.engine.manifest.model.max_position_embeddings
    with LLM(artifact, device="cpu", dtype="FLOAT32"):
        pass


@pytest.mark.parametrize("options,message", [
    ({"dtype": ["x"]}, "dtype: expected a string"),
    ({"dtype": "float8"}, "dtype 'float8' is not a dtype"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size: expected an integer >= 1, got True"),
    ({"tensor_parallel_size": "1"}, "tensor_parallel_size: expected an integer >= 1, got '1'"),
    ({"pipeline_parallel_size": 1.0}, "pipeline_parallel_size: expected an integer >= 1, got 1.0"),
    ({"trust_remote_code": "yes"}, "trust_remote_code: expected true or false"),
    ({"num_kv_blocks": 10**12}, "cannot be allocated on cpu (out of memory); lower num_kv_blocks"),
])
def test_bad_values_one_line(artifact, options, message):
    with pytest.raises(ConfigError) as info:
        LLM(artifact, device="cpu", **options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_run_flag_by_both_names_refused(artifact):
    args = ["run", str(artifact), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2"]
    both = CliRunner().invoke(cli, [*args, "--num-kv-blocks", "20", "--num-gpu-blocks-override", "30"])
    assert isinstance(both.exception, ConfigError) and "given twice" in str(both.exception)
    named = CliRunner().invoke(cli, [*args, "--num-gpu-blocks-override", "0"])  # the flag given, as LLM(...) names it
    assert str(named.exception).startswith("num_gpu_blocks_override: 0 is too small")
    spec = CliRunner().invoke(cli, [*args, "--speculative-config", '{"method": "ngram"}'])
    assert str(spec.exception).startswith("speculative_config.num_speculative_tokens: required key is missing")


def test_recipe_num_kv_blocks_below_one_sequence_refused(ref_model_dir, tmp_path):
    recipe = recipe_from_dict({"model": str(ref_model_dir), "output": str(tmp_path / "a"),
                               "runtime": {"max_model_len": 128, "num_kv_blocks": 2}})
    with pytest.raises(RecipeError, match="runtime.num_kv_blocks: 2 blocks of 16 tokens hold fewer than one sequence"):
        build(recipe, show_progress=False)


def test_settings_objects_are_taken_as_their_mappings(artifact):
    """vLLM's LLM(...) takes CompilationConfig(...) / SpeculativeConfig(...) objects as well as dicts."""
    from llmc.runtime.artifact import CompilationConfig, SpeculativeConfig

    with LLM(artifact, device="cpu", compilation_config=CompilationConfig(cudagraph_mode="NONE"),
             speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2)) as llm:
        options = llm.engine.options
        assert options.compilation_config.cudagraph_mode == "NONE"
        assert (options.speculative.method, options.speculative.num_speculative_tokens) == ("ngram", 2)


def test_state_dtypes_are_refused_for_a_model_without_state_layers(artifact, ref_model_dir, tmp_path):
    """mamba_cache_dtype / mamba_ssm_cache_dtype (a hybrid model's state dtypes) set for a Llama: refused by name at
    start, by the run flag, and at build (a recipe's runtime section); auto and a bad value as any setting's; vLLM's
    mamba_block_size / mamba_cache_mode (its hybrid prefix caching, which llmc has not) refused by name."""
    with pytest.raises(ConfigError, match="^mamba_ssm_cache_dtype bfloat16: LlamaForCausalLM has no Mamba, "
                                          "linear-attention or short-conv layers .*; drop it or set it auto$"):
        LLM(artifact, device="cpu", mamba_ssm_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match="^mamba_cache_dtype: .*'fp8'.*"):
        LLM(artifact, device="cpu", mamba_cache_dtype="fp8")
    with LLM(artifact, device="cpu", mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"):
        pass
    flag = CliRunner().invoke(cli, ["run", str(artifact), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
                                    "--mamba-cache-dtype", "float32"])
    assert str(flag.exception).startswith("mamba_cache_dtype float32: LlamaForCausalLM has no Mamba")
    for name, value in (("mamba_block_size", 16), ("mamba_cache_mode", "align")):  # vLLM's hybrid prefix caching
        with pytest.raises(ConfigError, match=f"^{name}: sets vLLM's prefix caching of a hybrid model's states"):
            LLM(artifact, device="cpu", **{name: value})
    recipe = recipe_from_dict({"model": str(ref_model_dir), "output": str(tmp_path / "a"),
                               "runtime": {"mamba_ssm_cache_dtype": "float16"}})
    with pytest.raises(RecipeError, match="^runtime.mamba_ssm_cache_dtype float16: LlamaForCausalLM has no Mamba"):
        build(recipe, show_progress=False)
