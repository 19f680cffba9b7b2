"""Prompts given as embeddings (enable_prompt_embeds, runtime/prompt_embeds.py) against transformers' own model run on
`inputs_embeds` (float32): greedy tokens and their logprobs for Llama, Granite (whose forward multiplies given
embeddings) and Gemma 3 (whose embedding module scales, so given rows are final); chunked prefill and the prefix
cache; penalties that read no prompt ids; every refusal in one line."""

import pytest
import torch

from llmc.errors import ConfigError, RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.prompt_embeds import NOT_ENABLED, decode_prompt_embeds
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_float32

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def artifacts(tiny_llama, tiny_granite, tiny_gemma3, tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt_embeds")
    return {name: (checkpoint, build_float32(checkpoint, root / name))
            for name, checkpoint in (("llama", tiny_llama), ("granite", tiny_granite), ("gemma3", tiny_gemma3))}


def _embeds(hf, num_tokens: int, seed: int) -> torch.Tensor:
    """Rows not in the vocabulary: random, of the size of the embedding table's rows."""
    table = hf.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, table.shape[1], generator=generator) * table.float().std()


@torch.inference_mode()
def _hf_greedy(hf, embeds: torch.Tensor, max_tokens: int, repetition_penalty: float = 1.0):
    """transformers' greedy continuation of `inputs_embeds` (each step the whole sequence again, float32): the tokens
    and each one's logprob (the penalty applied to the logits as transformers' processor does, before the argmax)."""
    tokens, logprobs, rows = [], [], embeds[None]
    lookup = hf.get_input_embeddings()
    for _ in range(max_tokens):
        logits = hf(inputs_embeds=rows).logits[0, -1].double()
        if tokens and repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(tokens)))
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / repetition_penalty, picked * repetition_penalty)
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        rows = torch.cat([rows, lookup(torch.tensor([[token]]))], dim=1)
    return tokens, logprobs


@pytest.mark.parametrize("family", ["llama", "granite", "gemma3"])
def test_greedy_tokens_and_logprobs_match_transformers_inputs_embeds(artifacts, hf_model, family):
    checkpoint, artifact = artifacts[family]
    hf = hf_model(checkpoint)
    embeds = [_embeds(hf, 21, seed=1), _embeds(hf, 5, seed=2)]
    with LLM(artifact, device="cpu", enable_prompt_embeds=True, max_num_batched_tokens=16) as llm:
        outputs = llm.generate([{"prompt_embeds": e} for e in embeds],
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0))
    for e, output in zip(embeds, outputs, strict=True):
        tokens, logprobs = _hf_greedy(hf, e, MAX_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        got = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(logprobs, dtype=torch.float64), atol=2e-4,
                                   rtol=0)
        assert output.prompt_token_ids is None and output.num_prompt_tokens == len(e)
        assert torch.equal(output.prompt_embeds, e) and output.prompt is None


def test_rows_of_the_embedding_table_give_what_the_token_ids_give(artifacts, hf_model, hf_encode):
    """A prompt's own embedding rows in place of its ids: the same tokens and text (the detokenizer starts from no
    prompt context, which changes nothing here), logprobs equal to the ids' in float32."""
    checkpoint, artifact = artifacts["llama"]
    ids = hf_encode(checkpoint, "What light through yonder window breaks? It is the east")
    rows = hf_model(checkpoint).get_input_embeddings().weight[torch.tensor(ids)].detach()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    with LLM(artifact, device="cpu", enable_prompt_embeds=True) as llm:
        by_ids, by_rows = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": rows}], params)
    assert by_rows.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_rows.outputs[0].text.strip() == by_ids.outputs[0].text.strip()
    torch.testing.assert_close(torch.tensor([lp[t].logprob for lp, t in zip(by_rows.outputs[0].logprobs,
                                                                              by_rows.outputs[0].token_ids)]),
                               torch.tensor([lp[t].logprob for lp, t in zip(by_ids.outputs[0].logprobs,
                                                                              by_ids.outputs[0].token_ids)]),
                               atol=1e-5, rtol=0)


def test_prefix_cache_shares_only_identical_embeddings_and_a_penalty_reads_no_prompt_ids(artifacts, hf_model):
    checkpoint, artifact = artifacts["llama"]
    hf = hf_model(checkpoint)
    first, other = _embeds(hf, 40, seed=3), _embeds(hf, 40, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(artifact, device="cpu", enable_prompt_embeds=True, block_size=16) as llm:
        once = llm.generate([{"prompt_embeds": first}], greedy)[0]
        again, changed = llm.generate([{"prompt_embeds": first}, {"prompt_embeds": other}], greedy)
        # the same prompt computed again from 32 cached rows; another's rows share nothing
        assert (once.num_cached_tokens, again.num_cached_tokens, changed.num_cached_tokens) == (0, 32, 0)
        assert again.outputs[0].token_ids == once.outputs[0].token_ids
        assert changed.outputs[0].token_ids == _hf_greedy(hf, other, MAX_TOKENS)[0]
        # transformers' repetition penalty on inputs_embeds sees only the generated tokens: so does this one
        penalized = llm.generate([{"prompt_embeds": first}],
                                 SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.5))[0]
    assert penalized.outputs[0].token_ids == _hf_greedy(hf, first, MAX_TOKENS, repetition_penalty=1.5)[0]


def test_refusals_one_line(artifacts, ref_artifact_128):
    _, artifact = artifacts["llama"]
    rows = torch.zeros(4, 64)
    with LLM(artifact, device="cpu") as llm:
        with pytest.raises(RequestError) as info:
            llm.generate([{"prompt_embeds": rows}])
        assert str(info.value) == NOT_ENABLED
    with LLM(artifact, device="cpu", enable_prompt_embeds=True, max_model_len=64) as llm:
        hidden = llm.engine.manifest.model.hidden_size
        rows = torch.zeros(4, hidden)
        cases = [
            ({"prompt_embeds": torch.zeros(4, hidden + 1)}, None, f"but this model's hidden_size is {hidden}"),
            ({"prompt_embeds": torch.zeros(hidden)}, None, "expected a 2-D tensor"),
            ({"prompt_embeds": torch.zeros(4, hidden, dtype=torch.int64)}, None, "expected float32, bfloat16"),
            ({"prompt_embeds": torch.zeros(0, hidden)}, None, "the prompt is empty"),
            ({"prompt_embeds": torch.full((4, hidden), float("nan"))}, None, "inf or NaN"),
            ({"prompt_embeds": [[0.0] * hidden]}, None, "expected a torch.Tensor"),
            ({"prompt_embeds": rows, "prompt": "x"}, None, "give the prompt once"),
            ({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1), "prompt_logprobs: a prompt given as"),
            ({"prompt_embeds": rows}, SamplingParams(n=2, use_beam_search=True, temperature=0), "use_beam_search:"),
            ({"prompt_embeds": torch.zeros(64, hidden)}, None, "the prompt has 64 tokens but max_model_len is 64"),
        ]
        for prompt, params, message in cases:
            with pytest.raises(RequestError) as info:
                llm.generate([prompt], params)
            assert message in str(info.value) and "\n" not in str(info.value), (message, str(info.value))
        # a leading batch dimension of one is vLLM's too; truncate_prompt_tokens keeps the last rows
        kept = llm.generate([{"prompt_embeds": torch.randn(1, 10, hidden)}],
                            SamplingParams(max_tokens=1, truncate_prompt_tokens=3))[0]
        assert kept.num_prompt_tokens == 3
    with pytest.raises(ConfigError, match="enable_prompt_embeds does not run with speculative method draft_model"):
        LLM(artifact, device="cpu", enable_prompt_embeds=True,
            speculative_config={"model": str(artifact), "num_speculative_tokens": 2})


def test_the_servers_base64_form(tmp_path):
    import base64
    import io

    buffer = io.BytesIO()
    torch.save(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), buffer)
    decoded = decode_prompt_embeds(base64.b64encode(buffer.getvalue()).decode())
    assert decoded.dtype == torch.bfloat16 and decoded.tolist() == [[0, 1, 2], [3, 4, 5]]
    # a sparse tensor is made dense; its indices are checked first (an index out of range is refused)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 0]]), torch.tensor([1.0, 2.0]), (2, 3))
    buffer = io.BytesIO()
    torch.save(sparse, buffer)
    assert decode_prompt_embeds(base64.b64encode(buffer.getvalue()).decode()).tolist() == [[0, 0, 1], [2, 0, 0]]
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 5], [2, 0]]), torch.tensor([1.0, 2.0]), (2, 3),
                                  check_invariants=False)  # row 5 of 2
    buffer = io.BytesIO()
    torch.save(bad, buffer)
    out_of_range = base64.b64encode(buffer.getvalue()).decode()
    for data, message in [("not base64!", "not a base64 torch.save"), (base64.b64encode(b"junk").decode(),
                                                                         "not a base64 torch.save"),
                          (out_of_range, "not a base64 torch.save"), (3, "expected a base64 string")]:
        with pytest.raises(RequestError, match=message):
            decode_prompt_embeds(data)


@pytest.mark.gpu
def test_on_cuda_with_graphs(artifacts, hf_model):
    """On a GPU: the embeddings' prefill replays the piecewise graphs (their rows through the row buffers), the decode
    steps the decode graphs; the tokens are transformers' (float32 on the CPU)."""
    checkpoint, artifact = artifacts["llama"]
    hf = hf_model(checkpoint)
    embeds = [_embeds(hf, 37, seed=7), _embeds(hf, 3, seed=8)]
    with LLM(artifact, device="cuda", enable_prompt_embeds=True, gpu_memory_utilization=0.3) as llm:
        assert llm.engine.runner.graphs is not None
        outputs = llm.generate([{"prompt_embeds": e} for e in embeds],
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0))
        assert llm.engine.runner.pieces.takes_rows and llm.engine.runner.pieces.num_replays > 0  # the prefill's graphs
    for e, output in zip(embeds, outputs, strict=True):
        tokens, logprobs = _hf_greedy(hf, e, MAX_TOKENS)
        assert output.outputs[0].token_ids == tokens
        got = [entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(logprobs, dtype=torch.float64),
                                   atol=2e-3, rtol=0)
