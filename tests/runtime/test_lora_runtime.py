"""Run-time LoRA (runtime/lora.py): PEFT adapters chosen per request, against transformers + PEFT.

The oracle is PEFT's own forward of the adapter on the checkpoint (float32): every prompt token's logprob
(prompt_logprobs) and the greedy continuation, for requests with different adapters and none in one batch."""

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.lora import LoRARequest
from llmc.runtime.sampling_params import SamplingParams

peft = pytest.importorskip("peft")

PROMPTS = ["ROMEO: what light through yonder window", "First Citizen:\nBefore we proceed any further",
           "the king my lord"]


def _adapter(checkpoint, out, seed, **config):
    """A PEFT LoRA of the checkpoint, saved by PEFT, with random (non-zero) factors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("lora-runtime")
    artifact = root / "base"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(artifact), "runtime": {"max_model_len": 128}}),
          show_progress=False)
    adapters = {
        "attn": _adapter(tiny_llama, root / "attn", 1, r=4, lora_alpha=8,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": _adapter(tiny_llama, root / "mlp", 2, r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                        layers_to_transform=[1], rank_pattern={"down_proj": 2}),
        "all": _adapter(tiny_llama, root / "all", 3, r=2, lora_alpha=6, target_modules="all-linear", use_rslora=True),
    }
    return tiny_llama, artifact, adapters


def _peft_reference(checkpoint, adapter, token_ids: list[int], max_tokens: int):
    """(log_softmax rows [len, vocab] over the prompt, greedy continuation) from transformers + PEFT."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([token_ids])).logits[0].double(), dim=-1)
        tokens = list(token_ids)
        for _ in range(max_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return logprobs, tokens[len(token_ids):]


def _requests(adapters):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


@pytest.mark.parametrize("max_loras", [1, 3])
def test_each_request_runs_its_own_adapter_as_peft_does(setup, max_loras):
    """Requests of three adapters and of the base model in one generate call: each one's prompt logprobs and
    greedy tokens are PEFT's for its adapter (max_loras 1: the adapters take turns in the one slot)."""
    checkpoint, artifact, adapters = setup
    loras = _requests(adapters)
    order = [None, "attn", "mlp", "all", "attn", None, "all"]
    with LLM(artifact, device="cpu", enable_lora=True, max_loras=max_loras, max_lora_rank=8,
             disable_log_stats=True) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(order))]
        params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
        outputs = llm.generate(prompts, params, lora_request=[None if n is None else loras[n] for n in order])
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    for name, prompt, output in zip(order, prompts, outputs):
        token_ids = tokenizer.encode(prompt)
        want_logprobs, want_tokens = _peft_reference(checkpoint, None if name is None else adapters[name], token_ids, 6)
        assert output.outputs[0].token_ids == want_tokens, name
        got = [next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]]
        want = [float(want_logprobs[i, token_ids[i + 1]]) for i in range(len(token_ids) - 1)]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=2e-4, rtol=0)


def test_adapters_change_the_output_and_never_share_cached_blocks(setup):
    """The same prompt under an adapter and then the base model: the base model's tokens are its own (a prefix
    cache shared across adapters would give it the adapter's KV)."""
    _, artifact, adapters = setup
    loras = _requests(adapters)
    prompt = PROMPTS[1] * 3  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(artifact, device="cpu", disable_log_stats=True) as plain:
        base = plain.generate(prompt, params)[0].outputs[0].token_ids
    with LLM(artifact, device="cpu", enable_lora=True, max_lora_rank=8, disable_log_stats=True) as llm:
        tuned = llm.generate(prompt, params, lora_request=loras["all"])[0].outputs[0].token_ids
        again = llm.generate(prompt, params)[0].outputs[0].token_ids
        hits = llm.stats()["prefix_cache_hits"]
        tuned_again = llm.generate(prompt, params, lora_request=loras["all"])[0].outputs[0].token_ids
        assert llm.stats()["prefix_cache_hits"] > hits  # the adapter's own blocks are reused
    assert tuned != base
    assert again == base and tuned_again == tuned


def test_requests_and_engines_that_cannot_take_an_adapter_are_refused(setup, tmp_path):
    checkpoint, artifact, adapters = setup
    loras = _requests(adapters)
    with LLM(artifact, device="cpu", disable_log_stats=True) as plain:
        with pytest.raises(RequestError, match="run-time LoRA is off; start the engine with enable_lora"):
            plain.generate("x", lora_request=loras["attn"])
    with LLM(artifact, device="cpu", enable_lora=True, max_lora_rank=4, disable_log_stats=True) as llm:
        with pytest.raises(RequestError, match="rank 8 is above max_lora_rank 4"):
            llm.generate("x", lora_request=loras["mlp"])
        with pytest.raises(RequestError, match="is not a folder"):
            llm.generate("x", lora_request=LoRARequest("gone", 9, str(tmp_path / "gone")))
        llm.generate("x", SamplingParams(max_tokens=1), lora_request=loras["attn"])
        with pytest.raises(RequestError, match="lora_int_id 1 is 'attn'"):
            llm.generate("x", lora_request=LoRARequest("other", 1, str(adapters["mlp"])))
        with pytest.raises(RequestError, match="use_beam_search does not run with a LoRA adapter"):
            llm.generate("x", SamplingParams(n=2, use_beam_search=True), lora_request=loras["attn"])
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(RequestError, match="lora_int_id 0: expected an integer >= 1"):
        LoRARequest("a", 0, "p")
    fp8 = tmp_path / "fp8"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(fp8), "quantization": {"method": "fp8"}}),
          show_progress=False)
    with pytest.raises(ConfigError, match="run-time LoRA does not run on W8A8 linears"):
        LLM(fp8, device="cpu", enable_lora=True)
    with pytest.raises(ConfigError, match="fully_sharded_loras: shards adapters over tensor ranks"):
        LLM(artifact, device="cpu", enable_lora=True, fully_sharded_loras=True)
