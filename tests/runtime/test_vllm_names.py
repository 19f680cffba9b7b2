"""vLLM's names for the engine settings whose llmc name differs (LLM(model=...), speculative_config,
num_gpu_blocks_override, --data-parallel-size), and vLLM's build-time or always-on settings
(tensor_parallel_size, pipeline_parallel_size, dtype, enable_chunked_prefill, trust_remote_code): accepted
by LLM(...), `llmc run` and the recipe where they say what the artifact does, refused by name otherwise."""

import pytest
from click.testing import CliRunner

from llmc.cli import cli
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime.beam_search import BeamSearchParams
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _build(ref_model_dir, out, runtime=None):
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 128, **(runtime or {})}}), show_progress=False)
    return out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, ref_model_dir):
    return _build(ref_model_dir, tmp_path_factory.mktemp("vllm_names") / "ref")


def test_llm_takes_vllm_names(artifact):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["ROMEO: ROMEO:", "the king the king the king the king"]
    with LLM(artifact, disable_log_stats=True) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        # vLLM's accessor: the tokenizer that encodes the prompt the engine saw
        assert llm.get_tokenizer()(prompts[0])["input_ids"] == llm.generate(prompts[0], greedy)[0].prompt_token_ids
        # arguments that do not fit the prompts: one line naming them, not an IndexError or AttributeError
        for bad, message in [({"sampling_params": {"max_tokens": 1}}, "sampling_params must be a SamplingParams"),
                             ({"sampling_params": [greedy, "x"]}, "a list holding str"),
                             ({"sampling_params": greedy, "priority": [1]}, "1 priorities for 2 prompts"),
                             ({"lora_request": object()}, "lora_request: expected a LoRARequest")]:
            with pytest.raises(RequestError, match=message):
                llm.generate(prompts, **bad)
        with pytest.raises(RequestError, match="lora_request: expected a LoRARequest"):
            llm.chat([{"role": "user", "content": "hi"}], greedy, lora_request=object())
        with pytest.raises(RequestError, match="lora_request: beam search does not run with a LoRA adapter"):
            llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())
    with LLM(model=artifact, speculative_config=NGRAM, num_gpu_blocks_override=40, tensor_parallel_size=1,
             pipeline_parallel_size=1, data_parallel_size=1, enable_chunked_prefill=True, dtype="float", trust_remote_code=True,
             quantization=None, enable_lora=False, disable_log_stats=True) as llm:
        options = llm.engine.options
        assert options.speculative == art.SpeculativeConfig(**NGRAM) and options.num_kv_blocks == 40
        assert llm.engine.stats()["num_total_blocks"] == 40
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
        assert llm.stats()["num_spec_proposed"] > 0


@pytest.mark.parametrize("options,message", [
    ({"speculative_config": NGRAM, "speculative": NGRAM}, "speculative: given twice, as 'speculative_config' and as 'speculative'"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size 2: this artifact is split 1 way(s) at build time"),
    ({"pipeline_parallel_size": 2}, "build it again with parallel.pipeline: 2"),
    ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override: 0 is too small"),  # the name given, not num_kv_blocks
    ({"speculative_config": {"method": "medusa"}}, "speculative_config.method: 'medusa' is not allowed"),
    ({"data_parallel_size": 2}, "data_parallel_size 2: one engine runs one replica of the model; serve N replicas"),
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill False: llmc always prefills a prompt in chunks"),
    ({"dtype": "half"}, "dtype 'half': this artifact holds float32 weights (the recipe's dtype); build it again with dtype: float16"),
    ({"quantization": "awq"}, "quantization 'awq': this artifact holds unquantized weights; drop the flag"),
    ({"quantization": "nf4"}, "quantization 'nf4' is not one of vLLM's quantization methods"),
    ({"model": "elsewhere"}, "give the artifact directory once"),
    # run-time LoRA takes enable_lora, max_loras, max_lora_rank, max_cpu_loras (runtime/lora.py); vLLM's others are refused
    ({"max_loras": 0}, "max_loras: 0 is too small"),
    ({"fully_sharded_loras": True}, "fully_sharded_loras: shards adapters over tensor ranks; llmc's run-time LoRA runs on one rank"),
    ({"lora_dtype": "float16"}, "lora_dtype: adapters run in the model's dtype here"),
    ({"lora_modules": [{"name": "sql", "path": "/adapters/sql"}]}, "lora_modules: names adapters for the server"),
    # allocations up to these (step buffers, sampler rows) were a numpy / torch MemoryError traceback
    ({"max_num_seqs": 10**12}, "max_num_seqs: 1000000000000 is too large; it must be at most 65536"),
    ({"max_num_batched_tokens": 10**12}, "max_num_batched_tokens: 1000000000000 is too large"),
])
def test_what_the_artifact_cannot_do_is_refused_by_name(artifact, options, message):
    with pytest.raises((ConfigError, RequestError)) as info:
        LLM(artifact, **options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_run_flags_and_recipe_keys_by_vllm_names(artifact, tmp_path, ref_model_dir):
    args = ["run", str(artifact), "--device", "cpu", "--prompt", "ROMEO: ROMEO:", "--max-tokens", "12", "--temperature", "0"]
    plain = CliRunner().invoke(cli, args)
    vllm = CliRunner().invoke(cli, [*args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                                    "--num-gpu-blocks-override", "40", "--tensor-parallel-size", "1",
                                    "--enable-chunked-prefill", "--dtype", "auto", "--trust-remote-code"])
    assert plain.exit_code == 0 and vllm.exit_code == 0, vllm.output
    assert vllm.stdout == plain.stdout
    refused = CliRunner().invoke(cli, [*args, "--tensor-parallel-size", "2"])
    assert isinstance(refused.exception, ConfigError) and "tensor_parallel_size 2" in str(refused.exception)
    lora = CliRunner().invoke(cli, [*args, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"])
    assert lora.exit_code == 0 and lora.stdout == plain.stdout, lora.output  # no request names an adapter
    built = _build(ref_model_dir, tmp_path / "aliases", {"speculative_config": NGRAM, "num_gpu_blocks_override": 30})
    runtime = art.read_manifest(built).runtime
    assert runtime.speculative == art.SpeculativeConfig(**NGRAM) and runtime.num_kv_blocks == 30


def test_chat_takes_vllm_template_options(artifact):
    """LLM.chat(..., chat_template=, chat_template_kwargs=, add_generation_prompt=, continue_final_message=):
    the prompt transformers renders from the same arguments."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
                "<|assistant|>{% if not enable_thinking %}<think></think>{% endif %}{% endif %}")
    messages = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am"}]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with LLM(artifact, disable_log_stats=True) as llm:
        tokenizer = llm.get_tokenizer()
        for options, kwargs in [({"chat_template": template}, {"enable_thinking": False}),
                                ({"add_generation_prompt": False, "continue_final_message": True}, {})]:
            got = llm.chat(messages, greedy, chat_template_kwargs=kwargs, **options)[0].prompt_token_ids
            text = tokenizer.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **options, **kwargs})
            assert got == tokenizer.encode(text, add_special_tokens=False)
        # OpenAI-style content parts are the texts joined with newlines (vLLM's LLM.chat parses messages as its
        # server does), not the list's Python repr
        parts = [{"role": "user", "content": [{"type": "text", "text": "Who are"}, {"type": "text", "text": "you?"}]}]
        got = llm.chat(parts, greedy)[0].prompt_token_ids
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Who are\nyou?"}], tokenize=False,
                                             add_generation_prompt=True)
        assert got == tokenizer.encode(text, add_special_tokens=False)
        with pytest.raises(RequestError, match=r"messages: this model \(LlamaForCausalLM\) takes no images"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)
        # as vLLM: a tool call's JSON arguments text reaches the template as an object (templates `tojson`
        # it: it was encoded twice), an assistant's reasoning under both names, None content as ""
        tools = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.reasoning_content %}<think>"
                 "{{ m.reasoning_content }}|{{ m.reasoning }}</think>{% endif %}{% for c in m.tool_calls or [] %}"
                 "<call>{{ c.function.arguments | tojson }}</call>{% endfor %}\n{% endfor %}")
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        sent = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "reasoning": "call f", "tool_calls": [call]},
                {"role": "tool", "content": "2", "tool_call_id": "c1"}]
        parsed = [sent[0], {**sent[1], "content": "", "reasoning_content": "call f",
                            "tool_calls": [{**call, "function": {"name": "f", "arguments": {"x": 1}}}]}, sent[2]]
        got = llm.chat(sent, greedy, chat_template=tools)[0].prompt_token_ids
        text = tokenizer.apply_chat_template(parsed, chat_template=tools, tokenize=False, add_generation_prompt=True)
        assert '<call>{"x": 1}</call>' in text and "<think>call f|call f</think>" in text
        assert got == tokenizer.encode(text, add_special_tokens=False)
        assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the caller's messages unchanged
        bad = [sent[0], {**sent[1], "tool_calls": [{**call, "function": {"name": "f", "arguments": "{x"}}]}]
        with pytest.raises(RequestError, match=r"messages\.1\.tool_calls\.0\.function\.arguments: not JSON"):
            llm.chat(bad, greedy, chat_template=tools)


def test_max_logprobs_bounds_what_a_request_asks(artifact):
    """vLLM's max_logprobs (default 20; -1: the whole vocabulary) for logprobs and prompt_logprobs alike."""
    with LLM(artifact, disable_log_stats=True) as llm:
        for field in ("logprobs", "prompt_logprobs"):
            with pytest.raises(RequestError, match=rf"SamplingParams\.{field} 21 is more than max_logprobs \(20\)"):
                llm.generate("ROMEO:", SamplingParams(max_tokens=1, **{field: 21}))
        assert len(llm.generate("ROMEO:", SamplingParams(max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0]) >= 20
        with pytest.raises(RequestError, match=r"logprobs -1 \(the whole vocabulary, 4096\) is more than max_logprobs"):
            llm.generate("ROMEO:", SamplingParams(max_tokens=1, logprobs=-1))
        # beam search ranks 2 x width logprobs a step (vLLM refuses width 11 at max_logprobs 20 too)
        with pytest.raises(RequestError, match=r"SamplingParams\.n 11: beam search ranks 2 x beam width logprobs"):
            llm.generate("ROMEO:", SamplingParams(n=11, use_beam_search=True, max_tokens=2))
        assert len(llm.generate("ROMEO:", SamplingParams(n=10, use_beam_search=True, max_tokens=2))[0].outputs) == 10
        assert not llm.engine.has_unfinished_requests()
    with LLM(artifact, disable_log_stats=True, max_logprobs=-1) as llm:
        vocab_size = llm.engine.manifest.model.vocab_size
        output = llm.generate("ROMEO:", SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1))[0]
        top = output.outputs[0].logprobs[0]
        assert len(top) == vocab_size and sorted(entry.rank for entry in top.values())[-1] == vocab_size
        assert all(len(entry) == vocab_size for entry in output.prompt_logprobs[1:])


def test_logprobs_are_vllm_logprob_objects(artifact):
    """Each logprob is vLLM's Logprob (.logprob, .rank, .decoded_token) and still the float it was: ranks
    against a float64 log-softmax of the engine's own logits for the same sequence, texts against the tokenizer."""
    import pickle

    import torch

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    with LLM(artifact, disable_log_stats=True) as llm:
        output = llm.generate("ROMEO: my lord", params)[0]
        completion = output.outputs[0]
        sequence = output.prompt_token_ids + completion.token_ids
        reference = torch.log_softmax(llm.engine.score(sequence).double(), dim=-1)  # [len, vocab]
        tokenizer = llm.get_tokenizer()
        prompt_len = len(output.prompt_token_ids)
        checked = 0
        for position, entries in [(prompt_len - 1 + i, d) for i, d in enumerate(completion.logprobs)] + \
                                 [(i - 1, d) for i, d in enumerate(output.prompt_logprobs) if d is not None]:
            row = reference[position]
            for token_id, value in entries.items():
                assert value.logprob == float(value) and value == pytest.approx(row[token_id].item(), abs=1e-4)
                assert value.rank == int((row > row[token_id] + 1e-6).sum()) + 1 or \
                    value.rank == int((row > row[token_id] - 1e-6).sum()) + 1  # a tie either way
                assert value.decoded_token == tokenizer.decode([token_id])
                checked += 1
        assert checked > 20 and any(v.rank > 1 for d in completion.logprobs for v in d.values())
        assert sum(d[t] for d, t in zip(completion.logprobs, completion.token_ids)) == pytest.approx(
            completion.cumulative_logprob)  # still floats
        again = pickle.loads(pickle.dumps(completion.logprobs[0]))
        assert {t: (v.logprob, v.rank, v.decoded_token) for t, v in again.items()} == \
            {t: (v.logprob, v.rank, v.decoded_token) for t, v in completion.logprobs[0].items()}
        quiet = llm.generate("ROMEO:", SamplingParams(max_tokens=2, logprobs=1, detokenize=False))[0]
        assert all(v.decoded_token is None and v.rank >= 1 for d in quiet.outputs[0].logprobs for v in d.values())


@pytest.mark.parametrize("method,accepted", [("int", ["awq", "gptq_marlin", "compressed-tensors", "rtn"]),
                                             ("fp8", ["fp8", "compressed-tensors"]),
                                             ("int8", ["compressed-tensors"])])
def test_quantization_names_the_artifact_s_kind_of_weights(method, accepted, tmp_path, ref_model_dir):
    """vLLM's --quantization / -q: accepted where it names the kind of weights the artifact holds (its kernels
    were chosen at build time), refused by name where it names another kind."""
    from llmc.runtime.options import resolve_options

    quant = {"int": {"method": "rtn", "bits": 4, "group_size": 128}, "fp8": {"method": "fp8"},
             "int8": {"method": "int8"}}[method]
    out = tmp_path / method
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "quantization": quant,
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    manifest = art.read_manifest(out)
    for name in accepted:
        resolve_options(manifest, {"quantization": name})
    other = "fp8" if method == "int" else "awq"
    holds = {"int": "w4a16", "fp8": "w8a8-fp8", "int8": "w8a8-int8"}[method]
    with pytest.raises(ConfigError, match=f"quantization '{other}': this artifact holds {holds} weights"):
        resolve_options(manifest, {"quantization": other})
    result = CliRunner().invoke(cli, ["run", str(out), "--device", "cpu", "-q", other, "--prompt", "x"])
    assert isinstance(result.exception, ConfigError) and f"quantization '{other}'" in str(result.exception)
