"""Multi-step decoding (num_scheduler_steps, onnx-cpu artifacts): K decode steps per engine step give
the outputs of K = 1 token for token — stop strings, stop tokens and max_tokens falling inside a
window, seeded sampling, penalties, logprobs, n = 2 — and the option is refused by name elsewhere."""

import pytest
from click.testing import CliRunner
from llmc.cli import cli
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = ["ROMEO:", "The king said", "In the beginning", "What light through yonder window", "A", "my lord, I"]


def _build(model, out, device):
    build(recipe_from_dict({"model": str(model), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 128}, "target": {"device": device}}), show_progress=False)
    return out


@pytest.fixture(scope="module")
def onnx_artifact(tmp_path_factory, ref_model_dir):
    return _build(ref_model_dir, tmp_path_factory.mktemp("multistep") / "onnx", "onnx-cpu")


def _outputs(artifact, k, params):
    llm = LLM(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True, num_scheduler_steps=k)
    assert llm.engine.options.num_scheduler_steps == k
    results = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.block_pool.num_free_blocks == llm.engine.scheduler.block_pool.num_blocks
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
             for c in r.outputs] for r in results]


def test_multi_step_gives_the_outputs_of_single_steps(onnx_artifact):
    greedy = _outputs(onnx_artifact, 1, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop_token = greedy[0][0][0][5]  # the 6th token of the first prompt: a stop token inside a window
    stop_text = greedy[2][0][1][len(greedy[2][0][1]) // 2:][:3]  # a stop string in the middle of the third
    assert stop_text.strip()
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=7),  # max_tokens not a multiple of K
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=18, repetition_penalty=1.3, n=2),
        SamplingParams(temperature=0, max_tokens=13, logprobs=2, min_tokens=3),
        SamplingParams(temperature=0.7, seed=3, max_tokens=21, presence_penalty=0.5, frequency_penalty=0.3),
    ]
    single = _outputs(onnx_artifact, 1, params)
    assert single[0][0][2:4] == ("stop", stop_token) and len(single[0][0][0]) <= 6
    assert single[2][0][2:4] == ("stop", stop_text)
    assert len(single[1][0][0]) == 7
    for k in (3, 4):
        assert _outputs(onnx_artifact, k, params) == single


def test_multi_step_is_refused_by_name_where_unsupported(onnx_artifact, tmp_path, ref_model_dir):
    torch_artifact = _build(ref_model_dir, tmp_path / "torch", "cpu")
    with pytest.raises(ConfigError, match="num_scheduler_steps 4: multi-step decoding runs on onnx-cpu"):
        LLM(torch_artifact, device="cpu", num_scheduler_steps=4)
    with pytest.raises(ConfigError, match="num_scheduler_steps 2 cannot be combined with speculative"):
        LLM(onnx_artifact, device="cpu", num_scheduler_steps=2,
            speculative={"method": "ngram", "num_speculative_tokens": 2})
    result = CliRunner().invoke(cli, ["run", str(torch_artifact), "--device", "cpu", "--num-scheduler-steps", "4",
                                      "--prompt", "ROMEO:"])
    assert result.exit_code != 0 and isinstance(result.exception, ConfigError)
    assert "num_scheduler_steps 4: multi-step decoding runs on onnx-cpu artifacts only" in str(result.exception)


def test_a_lone_greedy_request_runs_its_window_back_to_back_with_the_same_outputs(onnx_artifact, monkeypatch):
    """One plain-greedy request at a time (the edge case: batch-1 decoding) takes the runner's
    back-to-back greedy window; stop tokens, stop strings, max_tokens and max_model_len inside a
    window still give K = 1's outputs token for token, and every block comes back."""
    from llmc.runtime.onnx_runner import OnnxRunner

    greedy = _outputs(onnx_artifact, 1, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[greedy[0][0][0][5]]),
              SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=30, stop=[greedy[2][0][1][-6:-3]]),
              SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)]  # runs into max_model_len 128
    windows = []
    real = OnnxRunner.greedy_window
    monkeypatch.setattr(OnnxRunner, "greedy_window", lambda self, *a: windows.append(a[1]) or real(self, *a))

    def one_at_a_time(k):
        llm = LLM(onnx_artifact, device="cpu", max_num_seqs=4, disable_log_stats=True, num_scheduler_steps=k)
        outputs = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in llm.generate([prompt], p)[0].outputs]
                   for prompt, p in zip(PROMPTS, params)]
        assert llm.engine.scheduler.block_pool.num_free_blocks == llm.engine.scheduler.block_pool.num_blocks
        return outputs

    single = one_at_a_time(1)
    assert not windows
    assert single[0][0][2] == "stop" and single[2][0][2] == "stop" and len(single[1][0][0]) == 7
    assert single[3][0][2] == "length" and len(single[3][0][0]) < 200
    assert one_at_a_time(5) == single
    assert windows and max(windows) == 5
