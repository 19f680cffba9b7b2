"""vLLM's `generation_config` ("auto" by default): the sampling defaults of the model's generation_config.json
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) are what LLM.generate samples with
when given no SamplingParams, checked against transformers' generate, which reads the same file."""

import json
import shutil

import pytest
import torch
import transformers

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

# top_k 1 makes sampling the argmax (after the repetition penalty) in both libraries
GENERATION = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "top_k": 1, "repetition_penalty": 1.5,
              "max_new_tokens": 12}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, ref_model_dir):
    path = tmp_path_factory.mktemp("generation") / "ckpt"
    shutil.copytree(ref_model_dir, path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


@pytest.fixture(scope="module")
def artifact(checkpoint):
    out = checkpoint.parent / "artifact"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    return out


def test_generate_without_params_samples_as_transformers_generate_does(artifact, checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with LLM(artifact, device="cpu", disable_log_stats=True) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.repetition_penalty, defaults.max_tokens, defaults.temperature) == (1, 1.5, 12, 1.0)
        for prompt in ("ROMEO:", "The king said"):
            ids = llm.tokenizer.encode(prompt)
            expected = model.generate(torch.tensor([ids]))[0, len(ids):].tolist()  # its generation_config.json
            assert llm.generate(prompt)[0].outputs[0].token_ids == expected
            assert llm.chat([{"role": "user", "content": prompt}])[0].outputs[0].token_ids.__len__() <= 12
        free = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
        assert free != llm.generate("ROMEO:")[0].outputs[0].token_ids  # the penalty is the model's default
    with LLM(artifact, device="cpu", generation_config="vllm", disable_log_stats=True) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


@pytest.mark.slow  # for the default run's time (session 42)
def test_llmc_run_prompt_takes_the_model_s_defaults_for_flags_left_out(artifact):
    from click.testing import CliRunner

    from llmc.cli import cli

    with LLM(artifact, device="cpu", disable_log_stats=True) as llm:
        expected = llm.generate("ROMEO:")[0].outputs[0].text  # top_k 1, repetition penalty 1.5, 12 tokens
        flagged = llm.generate("ROMEO:", llm.get_default_sampling_params().replace(temperature=0, max_tokens=10))
        plain = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    assert flagged[0].outputs[0].text != plain  # the model's repetition penalty matters within 10 tokens
    run = ["run", str(artifact), "--device", "cpu", "--prompt", "ROMEO:"]
    assert CliRunner().invoke(cli, run).stdout == "ROMEO:" + expected + "\n"
    # given flags win; the model's repetition penalty still applies beside them
    output = CliRunner().invoke(cli, [*run, "--temperature", "0", "--max-tokens", "10"]).stdout
    assert output == "ROMEO:" + flagged[0].outputs[0].text + "\n"


def test_a_generation_config_folder_and_bad_ones(artifact, tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    with LLM(artifact, device="cpu", generation_config=str(folder), disable_log_stats=True) as llm:
        assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().max_tokens) == (0.0, 3)
        assert len(llm.generate("ROMEO:")[0].outputs[0].token_ids) <= 3
    with pytest.raises(ConfigError, match="no generation_config.json in that folder"):
        LLM(artifact, device="cpu", generation_config=str(tmp_path / "missing"))
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ConfigError, match=r"generation_config.json: SamplingParams\.top_p must be"):
        LLM(artifact, device="cpu", generation_config=str(folder))


def test_the_tokenizer_s_eos_ends_generation_and_other_end_tokens_report_themselves(tmp_path, ref_model_dir):
    """vLLM's eos is the tokenizer's (a ChatML fine-tune sets <|im_end|>-like tokens there while config.json
    keeps the base model's): it ends a sequence with stop_reason None; the generation config's other end
    tokens are stop token ids there, so a stop on one reports its id. The tokenizer's eos did not stop it."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(ref_model_dir, checkpoint)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        tokenizer_config = json.loads((checkpoint / name).read_text())
        (checkpoint / name).write_text(json.dumps({**tokenizer_config, "eos_token": "<|im_end|>"}))
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 64}}), show_progress=False)
    with LLM(out, device="cpu", disable_log_stats=True) as llm:
        tokenizer_eos = llm.tokenizer.eos_token_id
        assert tokenizer_eos == 3 and llm.engine.eos_token_ids == [3, 1, 7]  # the model's own eos first
        for forced, reason in [(3, None), (1, 1), (7, 7)]:
            completion = llm.generate("ROMEO:", SamplingParams(max_tokens=5, allowed_token_ids=[forced]))[0].outputs[0]
            assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == ([forced], "stop", reason)


def test_the_tokenizer_s_eos_comes_first_for_artifacts_built_before_it_was_recorded():
    """An artifact keeps config.json's order (Llama-3.1-Instruct: [128001, 128008, 128009]); the engine puts
    the tokenizer's eos (<|eot_id|>, 128009) first, so a stop on it has no stop_reason, as in vLLM."""
    from llmc.runtime.engine import model_eos_first

    assert model_eos_first([128001, 128008, 128009], 128009, 128256) == [128009, 128001, 128008]
    assert model_eos_first([1, 7], 3, 4096) == [3, 1, 7]
    assert model_eos_first([1], None, 4096) == [1] and model_eos_first([1], 5000, 4096) == [1]


def test_a_recipe_generation_config_folder_without_the_file_warns_at_build(checkpoint, tmp_path, caplog):
    import logging

    recipe = {"model": str(checkpoint), "output": str(tmp_path / "a"), "dtype": "float32",
              "runtime": {"max_model_len": 64, "generation_config": str(tmp_path / "missing")}}
    with caplog.at_level(logging.WARNING, logger="llmc"):
        build(recipe_from_dict(recipe), show_progress=False)
    assert f"runtime.generation_config '{tmp_path / 'missing'}': no generation_config.json there" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmc"):
        build(recipe_from_dict({**recipe, "output": str(tmp_path / "b"), "runtime": {"max_model_len": 64}}),
              show_progress=False)
    assert "generation_config" not in caplog.text
