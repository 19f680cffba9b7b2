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
from tests.runtime.hf_oracle import build_float32, make_peft_adapter

peft = pytest.importorskip("peft")

PROMPTS = ["ROMEO: what light through yonder window", "First Citizen:\nBefore we proceed any further",
           "the king my lord"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("lora-runtime")
    artifact = build_float32(tiny_llama, root / "base")
    adapters = {
        "attn": make_peft_adapter(tiny_llama, root / "attn", 1, r=4, lora_alpha=8,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": make_peft_adapter(tiny_llama, root / "mlp", 2, r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                        layers_to_transform=[1], rank_pattern={"down_proj": 2}),
        "all": make_peft_adapter(tiny_llama, root / "all", 3, r=2, lora_alpha=6, target_modules="all-linear", use_rslora=True),
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


@pytest.mark.parametrize("max_loras,device", [(1, "cpu"), (3, "cpu"), pytest.param(2, "cuda", marks=pytest.mark.gpu)])
def test_each_request_runs_its_own_adapter_as_peft_does(setup, max_loras, device):
    """Requests of three adapters and of the base model in one generate call: each one's prompt logprobs and
    greedy tokens are PEFT's for its adapter (max_loras 1: the adapters take turns in the one slot). On a GPU
    the decode steps replay CUDA graphs and the prefill steps piecewise ones, the adapters' sums inside."""
    checkpoint, artifact, adapters = setup
    loras = _requests(adapters)
    order = [None, "attn", "mlp", "all", "attn", None, "all"]
    with LLM(artifact, device=device, enable_lora=True, max_loras=max_loras, max_lora_rank=8,
             disable_log_stats=True) as llm:
        if device == "cuda":
            assert llm.engine.runner.graphs is not None and llm.engine.runner.pieces is not None
        tokenizer = llm.get_tokenizer()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(order))]
        params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
        outputs = llm.generate(prompts, params, lora_request=[None if n is None else loras[n] for n in order])
        # the base model alone: its decode steps replay the graphs captured without the LoRA sums
        # (compilation_config.cudagraph_specialize_lora) on a GPU, and skip them eagerly on a CPU
        order, prompts = order + [None, None], prompts + PROMPTS[:2]
        outputs += llm.generate(prompts[-2:], params)
        assert not llm.engine.runner.lora.slots.active
        if device == "cuda":
            assert {key[1] for key in llm.engine.runner.graphs.graphs} == {True, False}
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
        tuned_output = llm.generate(prompt, params, lora_request=loras["all"])[0].outputs[0]
        assert llm.stats()["prefix_cache_hits"] > hits  # the adapter's own blocks are reused
        streamed = "".join(llm.stream(prompt, params, lora_request=loras["all"]))  # LLM.stream takes the adapter too
    assert tuned != base
    assert again == base and tuned_output.token_ids == tuned
    assert streamed == tuned_output.text


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
    for field, value, what in [("method", "awq", "an AWQ build"), ("settings", {"smoothquant": 0.5}, "a SmoothQuant build")]:
        with pytest.raises(ConfigError, match=f"run-time LoRA does not run on {what} .*; merge the adapter at build time"):
            LLM(_with_quant(artifact, tmp_path / field, field, value), device="cpu", enable_lora=True)
    with pytest.raises(ConfigError, match="fully_sharded_loras: shards adapters over tensor ranks"):
        LLM(artifact, device="cpu", enable_lora=True, fully_sharded_loras=True)


def _prompt_logprobs(llm, prompt, lora_request=None) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    entries = llm.generate(prompt, params, lora_request=lora_request)[0].prompt_logprobs[1:]
    return torch.tensor([next(iter(e.values())).logprob for e in entries], dtype=torch.float64)


@pytest.mark.parametrize("quantization", [{"method": "fp8"}, {"method": "rtn", "bits": 8, "group_size": 32}],
                         ids=["w8a8-fp8", "w8a16"])
def test_an_adapter_on_a_quantized_build_is_peft_within_the_quantization_error(setup, tmp_path, quantization):
    """On FP8 W8A8 (whose norms quantize the linears' inputs, except under LoRA) and on 8-bit weights: the
    adapter's prompt logprobs are PEFT's (float model + adapter) about as closely as the build's own are the
    float model's (mean absolute difference), while the adapter moves them several times more than that."""
    checkpoint, _, adapters = setup
    artifact = tmp_path / "q"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(artifact), "quantization": quantization}),
          show_progress=False)
    lora = _requests(adapters)["all"]
    with LLM(artifact, device="cpu", enable_lora=True, max_lora_rank=8, disable_log_stats=True) as llm:
        token_ids = llm.get_tokenizer().encode(PROMPTS[0])
        base, tuned = _prompt_logprobs(llm, PROMPTS[0]), _prompt_logprobs(llm, PROMPTS[0], lora)
    float_base, float_tuned = (
        torch.tensor([float(lp[i, token_ids[i + 1]]) for i in range(len(token_ids) - 1)], dtype=torch.float64)
        for lp, _ in (_peft_reference(checkpoint, a, token_ids, 0) for a in (None, adapters["all"])))
    quantization_error = (base - float_base).abs().mean()
    adapter_effect = (float_tuned - float_base).abs().mean()
    # (FP8 activations on this random tiny model: a mean error of ~0.5 nats against an adapter effect of ~3.3)
    assert adapter_effect > 4 * quantization_error
    assert (tuned - float_tuned).abs().mean() < 2 * quantization_error + 1e-3


def test_the_slot_sum_is_each_tokens_adapter_in_float64():
    """LinearLora.add_to over random slots, ranks, members and token → slot maps (-1: none) against
    x @ Aᵀ @ Bᵀ · scale of each token's own adapter in float64."""
    from types import SimpleNamespace

    from llmc.runtime.lora import LinearLora, LoraSlots

    gen = torch.Generator().manual_seed(0)
    slots = SimpleNamespace(max_loras=3, max_rank=4, dtype=torch.float64, device=torch.device("cpu"))
    LoraSlots._init_mapping(slots, 16)
    member_rows, in_features = [6, 2, 2], 5
    perm = torch.randperm(in_features, generator=gen)
    lora = LinearLora(slots, member_rows, in_features, perm)
    factors = {}
    for slot, rank in enumerate([4, 1, 3]):
        members = [None if (slot, j) == (1, 2) else (torch.randn(rank, in_features, generator=gen),
                   torch.randn(rows, rank, generator=gen)) for j, rows in enumerate(member_rows)]
        lora.load(slot, members)
        factors[slot] = members
    token_slots = [0, 2, -1, 1, 1, 0, -1, 2, 2]
    LoraSlots.set_mapping(slots, token_slots)
    x = torch.randn(len(token_slots), in_features, generator=gen, dtype=torch.float64)
    base = torch.randn(len(token_slots), sum(member_rows), generator=gen, dtype=torch.float64)
    got = lora.add_to(base.clone(), x) - base
    original = torch.empty_like(x)
    original[:, perm] = x  # x arrives permuted by the norm (act order): x = original[:, perm]
    for t, slot in enumerate(token_slots):
        want = torch.zeros(sum(member_rows), dtype=torch.float64)
        if slot >= 0:
            parts = [torch.zeros(rows, dtype=torch.float64) if f is None else f[1].double() @ (f[0].double() @ original[t])
                     for f, rows in zip(factors[slot], member_rows)]
            want = torch.cat(parts)
        torch.testing.assert_close(got[t], want, rtol=1e-12, atol=1e-11)


def _with_quant(artifact, out, field, value):
    """A copy of the artifact's manifest alone (the checks run before any weight loads) with quant.<field> changed,
    its digest recomputed as format 1.2 defines it (sha256 of the sorted compact JSON without the key)."""
    import hashlib
    import json

    out.mkdir()
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["quant"][field] = value
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    manifest["manifest_sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out
@pytest.mark.slow  # 7 s on 2 cores
def test_adapters_dropped_from_host_memory_while_their_requests_wait_are_read_again(setup):
    """max_cpu_loras 1: queuing a second adapter's request drops the first adapter's factors while its request
    still waits for a slot; the step that runs it reads it again (it failed with a KeyError), and an id once
    used stays that adapter's (another path under it would share its prefix-cache blocks)."""
    _, artifact, adapters = setup
    loras = _requests(adapters)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    order = ["attn", "mlp", "all", "attn"]
    with LLM(artifact, device="cpu", enable_lora=True, max_lora_rank=8, disable_log_stats=True) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1] * 4, params, lora_request=[loras[n] for n in order])]
    with LLM(artifact, device="cpu", enable_lora=True, max_lora_rank=8, max_cpu_loras=1, disable_log_stats=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1] * 4, params, lora_request=[loras[n] for n in order])]
        assert len(llm.engine.runner.lora.adapters) == 1
        with pytest.raises(RequestError, match="lora_int_id 1 is 'attn'"):  # 1 is no longer read, still 'attn'
            llm.generate("x", lora_request=LoRARequest("other", 1, str(adapters["mlp"])))
    assert got == want and len(set(map(tuple, want))) == 3


@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_an_act_order_gptq_import_takes_attention_adapters_and_refuses_mlp_ones(setup, tmp_path, target):
    """A desc_act GPTQ import: the norms gather qkv's and gate_up's inputs (the gpu layout), so the adapters'
    lora_A columns follow that order, and PEFT's result on the dequantized weights comes out. The build put
    down's groups in order by permuting gate_up's rows and down's input columns alike
    (compiler/shard.order_down_groups) and keeps no record of the order: an adapter on gate/up/down would
    add its deltas to the wrong intermediate channels (it did, silently), so it is refused by name."""
    from tests.compiler.test_quantized_build import write_act_order_gptq

    checkpoint, _, adapters = setup
    source = tmp_path / "ckpt"
    dequantized = write_act_order_gptq(checkpoint, source)
    artifact = tmp_path / "a"
    build(recipe_from_dict({"model": str(source), "output": str(artifact), "dtype": "float32",
                            "quantization": {"method": "import"}, "target": {"device": target}}), show_progress=False)
    loras = _requests(adapters)
    with LLM(artifact, device="cpu", enable_lora=True, max_lora_rank=8, disable_log_stats=True) as llm:
        if target == "cuda":
            assert llm.engine.runner.model.layers["0"].input_norm.out_perm is not None
        token_ids = llm.get_tokenizer().encode(PROMPTS[0])
        got = _prompt_logprobs(llm, PROMPTS[0], loras["attn"])
        for name in ("mlp", "all"):
            with pytest.raises(RequestError, match="act-order .* gate/up/down"):
                llm.generate("x", lora_request=loras[name])
        assert not llm.engine.has_unfinished_requests()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        for name, weight in dequantized.items():
            model.get_parameter(name).copy_(weight)
        model = peft.PeftModel.from_pretrained(model, str(adapters["attn"])).eval()
        logprobs = torch.log_softmax(model(torch.tensor([token_ids])).logits[0].double(), dim=-1)
    want = torch.tensor([float(logprobs[i, token_ids[i + 1]]) for i in range(len(token_ids) - 1)], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
