"""The single-token gather of StepBuffers (decode steps) builds exactly the inputs the general
numpy gather builds, placeholders of the overlapped engine included, over a real engine run."""

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, ref_model_dir):
    out = tmp_path_factory.mktemp("step_inputs") / "ref"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    return out


def _fields(inputs) -> dict:
    batch = inputs.forward_batch
    return {"input_ids": inputs.input_ids.tolist(), "positions": batch.positions.tolist(),
            "slots": batch.slot_mapping.tolist(), "tables": batch.block_tables.tolist(),
            "context_lens": batch.context_lens.tolist(), "query_lens": list(batch.query_lens),
            "host_context_lens": [int(n) for n in batch.host_context_lens],
            "max_context_len": batch.max_context_len, "logits_indices": batch.logits_indices.tolist(),
            "sample_rows": inputs.sample_rows.tolist(), "prompt_spans": inputs.prompt_spans,
            "num_sampling_rows": inputs.num_sampling_rows}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_single_token_steps_build_what_the_general_gather_builds(artifact, async_scheduling):
    engine = Engine(artifact, device="cpu", max_num_seqs=8, num_kv_blocks=24, block_size=16,
                    async_scheduling=async_scheduling, disable_log_stats=True)
    buffers = engine.runner.buffers
    build_fast = buffers.build
    compared = {"steps": 0, "placeholders": 0, "general": 0}

    def checked_build(batch, pending=None):
        if not all(s.num_new_tokens == 1 and not s.draft_token_ids and not s.request.skip_prefix_cache
                   for s in batch.requests):
            inputs = build_fast(batch, pending)
            fields = _fields(inputs)  # (the host copy of the context lengths: DeepSeek's expanded attention's)
            assert fields["host_context_lens"] == fields["context_lens"]
            compared["general"] += 1
            return inputs
        expected = _fields(buffers._build_chunks(batch, pending))  # the general numpy gather
        inputs = build_fast(batch, pending)
        assert _fields(inputs) == expected and expected["host_context_lens"] == expected["context_lens"]
        compared["steps"] += 1
        compared["placeholders"] += sum(1 for s in batch.requests if s.request.num_pending_tokens)
        return inputs

    buffers.build = checked_build
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, repetition_penalty=1.2)]
    for i in range(6):  # 6 sequences of up to ~50 tokens in 24 blocks of 16: preemption as well
        engine.add_request(None, params[i % 3], prompt_token_ids=[(7 * i + j) % 4000 + 10 for j in range(5 + 3 * i)])
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            engine.step()
    assert compared["steps"] > 20 and compared["general"] > 0
    assert (compared["placeholders"] > 0) == async_scheduling
