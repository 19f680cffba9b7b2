"""EAGLE-3 speculative decoding (runtime/spec_eagle.py, runtime/eagle_head.py): a head in the published format
proposes the drafts from the model's hidden states.

References: the engine without speculation (greedy tokens identical, seeded samples identical), an independent
full-sequence implementation of the head (benchmarks/train_eagle.py's trainer, float64, over transformers' hidden
states: the engine's first drafts must be its argmax, which holds only if the head's KV cache and inputs are right
at every step), and acceptance: the head trained by benchmarks/train_eagle.py for ref-llama-12m
(checkpoints/eagle3-ref-llama-12m) against a random head of the same shapes on held-out text."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.spec_decode import SpeculativeConfig
from tests.runtime.test_spec_draft import (  # noqa: F401 (the draft model's workloads, generate-and-check, and
    SLOW_WORKLOADS, WORKLOADS, _generate, prompts, reference, target)  # its prompts, float32 target and reference)

REPO = Path(__file__).resolve().parents[2]
TRAINED_HEAD = REPO / "checkpoints" / "eagle3-ref-llama-12m"
MAX_TOKENS = 16


def _llama_layer(layer: str, rand, qkv_inputs: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int) -> dict:
    """A head's decoder layer under `layer`: q/k/v (reading qkv_inputs), o, the MLP and the post-attention norm."""
    return {layer + "self_attn.q_proj.weight": rand(heads * head_dim, qkv_inputs),
            layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, qkv_inputs),
            layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, qkv_inputs),
            layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            layer + "mlp.gate_proj.weight": rand(intermediate, hidden), layer + "mlp.up_proj.weight": rand(intermediate, hidden),
            layer + "mlp.down_proj.weight": rand(hidden, intermediate),
            layer + "post_attention_layernorm.weight": 1 + rand(hidden)}


def _save_head(path: Path, tensors: dict, architecture: str, hidden: int, vocab: int, heads: int, kv_heads: int,
               head_dim: int, intermediate: int, **config_fields) -> Path:
    """model.safetensors and a one-layer LlamaConfig's config.json (plus config_fields) in path."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    config = {"architectures": [architecture], "model_type": "llama", "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "intermediate_size": intermediate, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": vocab, **config_fields}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_head(path: Path, hidden: int, vocab: int, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               intermediate: int = 128, draft_vocab: int = 512, seed: int = 0, scale: float = 0.1,
               embed: bool = False, **config_fields) -> Path:
    """A random EAGLE-3 head in the published format: config.json (a LlamaConfig with draft_vocab_size) and
    model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d; embed_tokens only if `embed`)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * scale  # noqa: E731
    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": 1 + rand(hidden), "lm_head.weight": rand(draft_vocab, hidden),
               "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d,
               **_llama_layer("midlayer.", rand, 2 * hidden, hidden, heads, kv_heads, head_dim, intermediate),
               **{f"midlayer.{n}.weight": 1 + rand(hidden) for n in ("input_layernorm", "hidden_norm")}}
    if embed:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    return _save_head(path, tensors, "LlamaForCausalLMEagle3", hidden, vocab, heads, kv_heads, head_dim, intermediate,
                      draft_vocab_size=draft_vocab, **config_fields)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_checkpoint_factory):
    """A tiny random 8-layer Llama (the head reads layers 2, 4 and 5), built in float32."""
    root = tmp_path_factory.mktemp("eagle-tiny")
    checkpoint = hf_checkpoint_factory(root / "hf", "llama", num_hidden_layers=8)
    build(recipe_from_dict({"model": str(checkpoint), "output": str(root / "art"), "dtype": "float32",
                            "runtime": {"max_model_len": 256}}), show_progress=False)
    return root / "art"


@pytest.fixture(scope="module")
def trained_head():
    if not (TRAINED_HEAD / "model.safetensors").is_file():
        pytest.skip(f"{TRAINED_HEAD} is absent (benchmarks/train_eagle.py writes it)")
    return TRAINED_HEAD


def _record_first_drafts(llm) -> dict:
    """{a verified request's tokens: the first draft the head proposed after them}, filled as llm's steps run."""
    proposer, seen = llm.engine.proposer, {}
    fill = proposer.fill

    def recording_fill(batch):
        for scheduled in batch.requests:
            state = proposer._states.get(scheduled.request.request_id)
            if scheduled.draft_token_ids and state is not None:
                seen[tuple(scheduled.request.all_token_ids)] = state.draft
        fill(batch)

    proposer.fill = recording_fill
    return seen


def _spec(head, k=3):
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}




@pytest.mark.parametrize("workload", [pytest.param(w, marks=pytest.mark.slow) if w in SLOW_WORKLOADS else w
                                      for w in WORKLOADS], ids=list(WORKLOADS))
def test_greedy_tokens_equal_decoding_without_speculation(target, trained_head, prompts, reference, workload):
    got, stats = _generate(target, prompts, speculative=_spec(trained_head), **WORKLOADS[workload])
    mismatches = [i for i, (a, b) in enumerate(zip(reference, got)) if a != b]
    assert not mismatches, f"{len(mismatches)} requests differ, first {mismatches[0]}"
    assert 0 < stats["num_spec_accepted"] < stats["num_spec_proposed"]
    if workload in ("preemption", "all-at-once"):
        assert stats["num_preemptions"] > 0


def test_seeded_samples_n_stops_and_penalties_equal_decoding_without_speculation(target, trained_head, prompts):
    """Drafts are point masses verified by the rejection rule: a seeded request's tokens do not depend on them."""
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=11 + i, ignore_eos=True) for i in range(4)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, n=2, max_tokens=20, seed=5, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=40, stop=["king"], presence_penalty=0.5,
                                 repetition_penalty=1.2))
    params.append(SamplingParams(temperature=0.7, max_tokens=24, seed=3, frequency_penalty=0.4, stop=["\n\n"]))
    chosen = prompts[:7]
    plain, _ = _generate(target, chosen, params)
    spec, stats = _generate(target, chosen, params, speculative=_spec(trained_head), max_num_batched_tokens=32)
    assert stats["num_spec_accepted"] > 0
    assert spec == plain


def test_a_random_head_on_a_random_model_changes_no_token(tiny, tmp_path):
    """The tiny random model with a random head (its own embeddings, then the model's): greedy tokens as without."""
    prompts = [f"the king {'and then ' * i}my lord" for i in range(6)]
    reference, _ = _generate(tiny, prompts)
    for embed in (True, False):
        head = write_head(tmp_path / f"head-{embed}", 64, 4096, embed=embed)
        got, stats = _generate(tiny, prompts, speculative=_spec(head, 2), max_num_batched_tokens=32, num_kv_blocks=24)
        assert got == reference
        assert stats["num_spec_proposed"] > 0


def _heldout_prompts(n: int, words: int = 60) -> list[str]:
    text = (REPO / "data" / "heldout.txt").read_text().split()
    return [" ".join(text[i * 997 : i * 997 + words]) for i in range(n)]


def test_the_trained_head_is_accepted_far_more_often_than_a_random_one(target, trained_head, tmp_path):
    """On held-out text, greedy, k = 3: the trained head's drafts against a random head's of the same shapes."""
    config = json.loads((trained_head / "config.json").read_text())
    random_head = write_head(tmp_path / "random", config["hidden_size"], config["vocab_size"],
                             heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                             head_dim=config["head_dim"], intermediate=config["intermediate_size"],
                             draft_vocab=config["draft_vocab_size"], scale=0.05)
    prompts = _heldout_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    rates = {}
    for name, head in (("trained", trained_head), ("random", random_head)):
        _, stats = _generate(target, prompts, params, speculative=_spec(head))
        rates[name] = stats["spec_acceptance_rate"]
    # measured: trained 0.183 (1.53 tokens per verify step), random 0.0
    assert rates["trained"] >= 0.13 and rates["random"] <= 0.02, rates


def test_first_drafts_equal_a_full_sequence_head_over_transformers_hidden_states(target, trained_head, ref_model_dir,
                                                                                 load_benchmark):
    """The engine's d1 for a request of N tokens is the head's argmax at position N - 2 over the whole sequence, as
    benchmarks/train_eagle.py's trainer computes it in float64 from transformers' hidden states (no paged cache),
    under chunked prefill and prefix-cache hits (the prompts share a 3-block prefix; the scheduler recomputes a
    hit's last block for the head); holds only if the head's cache holds the right rows at every step."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    llm = LLM(target, device="cpu", max_num_seqs=2, disable_log_stats=True, max_num_batched_tokens=40,
              speculative=_spec(trained_head))
    seen = _record_first_drafts(llm)
    shared = _heldout_prompts(1, 40)[0]
    llm.generate([shared + " " + p for p in _heldout_prompts(4, 12)], SamplingParams(temperature=0, max_tokens=24,
                                                                                     ignore_eos=True))
    assert llm.stats()["prefix_cache_hits"] > 0
    head, draft_ids = _trainer_head(load_benchmark("train_eagle"), trained_head, load_file)
    model = AutoModelForCausalLM.from_pretrained(ref_model_dir, dtype=torch.float64).eval()
    n = model.config.num_hidden_layers
    embed = model.model.embed_tokens.weight.detach()
    agree = 0
    with torch.no_grad():
        for tokens, draft in seen.items():
            ids = torch.tensor([tokens])
            states = model(ids, output_hidden_states=True).hidden_states
            aux = torch.cat([states[i] for i in (2, n // 2, n - 3)], dim=-1)  # the residual stream entering them
            out, _ = head.two_steps(embed[ids[:, 1:]], head.fc(aux[:, :-1]), torch.arange(len(tokens) - 1))
            agree += int(draft_ids[head.logits(out[0, -1]).argmax()]) == draft
    assert len(seen) > 60
    assert agree >= 0.97 * len(seen), (agree, len(seen))  # float32 against float64: a near-tie may flip


def _trainer_head(trainer, path: Path, load_file):
    """benchmarks/train_eagle.py's Head in float64 with the head's weights, and its draft-to-model token map."""
    config = json.loads((path / "config.json").read_text())
    weights = {k: v.double() for k, v in load_file(path / "model.safetensors").items()}
    head = trainer.Head(config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                        config["head_dim"], config["intermediate_size"], config["draft_vocab_size"],
                        config["rms_norm_eps"], config["rope_theta"]).double()
    names = {"fc": "fc", "q": "midlayer.self_attn.q_proj", "k": "midlayer.self_attn.k_proj",
             "v": "midlayer.self_attn.v_proj", "o": "midlayer.self_attn.o_proj", "gate": "midlayer.mlp.gate_proj",
             "up": "midlayer.mlp.up_proj", "down": "midlayer.mlp.down_proj", "lm_head": "lm_head"}
    with torch.no_grad():
        for attr, key in names.items():
            getattr(head, attr).weight.copy_(weights[key + ".weight"])
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            head.norms[norm].copy_(weights[f"midlayer.{norm}.weight"])
        head.norms["norm"].copy_(weights["norm.weight"])
    return head, torch.arange(config["draft_vocab_size"]) + weights["d2t"].long()


def test_config_and_heads_that_do_not_fit_are_refused_by_name(tiny, tmp_path):
    with pytest.raises(ConfigError, match="speculative.method eagle3 needs speculative.model, the EAGLE-3 head's folder"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="prompt_lookup_min is an n-gram setting; method eagle3 does not read it"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    with pytest.raises(ConfigError, match="method"):
        SpeculativeConfig.from_dict({"method": "medusa", "model": "x", "num_speculative_tokens": 2})
    # vLLM's rule when no method is given: by the head's name
    assert SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 2}
                                       ).method == "eagle3"
    assert SpeculativeConfig.from_dict({"model": "heads/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 2}
                                       ).method == "eagle"
    assert SpeculativeConfig.from_dict({"model": "build/small", "num_speculative_tokens": 2}).method == "draft_model"

    def refused(head, match, **options):
        with pytest.raises(ConfigError, match=match):
            LLM(tiny, device="cpu", speculative=_spec(head), **options)

    refused(tmp_path / "nothing", "no folder there; give the EAGLE-3 head's Hugging Face folder")
    refused(write_head(tmp_path / "wide", 96, 4096), "hidden states of size 96 .* the model's are 64; use a head trained")
    refused(write_head(tmp_path / "vocab", 64, 5000), "vocabulary has 5000 tokens, the model's 4096")
    refused(write_head(tmp_path / "layers", 64, 4096, eagle_aux_hidden_state_layer_ids=[1, 4, 8]),
            r"eagle_aux_hidden_state_layer_ids \[1, 4, 8\] must be three layers of the model's 8")
    refused(write_head(tmp_path / "deep", 64, 4096, num_hidden_layers=2), "the head has 2 layers")
    no_size = write_head(tmp_path / "no-size", 64, 4096)
    (no_size / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    refused(no_size, "config.json has no hidden_size, num_attention_heads, intermediate_size; not a head's config")
    pickled = write_head(tmp_path / "pickled", 64, 4096)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    refused(pickled, r"no safetensors .*pytorch_model.bin.*convert the head to safetensors")
    broken = write_head(tmp_path / "broken", 64, 4096, intermediate_size=100)
    refused(broken, r"tensor midlayer.mlp.gate_proj.weight has shape \[128, 64\], its config.json says \[100, 64\]")
    head = write_head(tmp_path / "ok", 64, 4096)
    refused(head, "does not run with enable_lora", enable_lora=True)
    refused(head, "does not run with enable_prompt_embeds", enable_prompt_embeds=True)


def test_onnx_and_parallel_models_are_refused_by_name(tiny, tmp_path, monkeypatch):
    """Checked from the manifest before any runner starts (here the tiny model's, seen as onnx-cpu, then as split
    into two ranks)."""
    import llmc.runtime.engine as engine_module

    head = write_head(tmp_path / "ok", 64, 4096)
    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "is_onnx", lambda manifest: True)
        with pytest.raises(ConfigError, match="speculative method eagle3 does not run with an onnx-cpu artifact; use "
                                              "method ngram"):
            LLM(tiny, device="cpu", speculative=_spec(head))
    read_manifest = engine_module.art.read_manifest

    def split(path, *args, **kwargs):
        manifest = read_manifest(path, *args, **kwargs)
        return dataclasses.replace(manifest, parallel=dataclasses.replace(manifest.parallel, tensor=2))

    monkeypatch.setattr(engine_module.art, "read_manifest", split)
    with pytest.raises(ConfigError, match="speculative method eagle does not run with a tensor/pipeline-parallel artifact"):
        LLM(tiny, device="cpu", speculative=_eagle1(write_eagle1_head(tmp_path / "e1", 64, 4096)))


def test_the_head_config_names_other_layers(tiny, tmp_path):
    """eagle_aux_hidden_state_layer_ids replaces vLLM's default layers (2, n // 2, n - 3)."""
    head = write_head(tmp_path / "layers", 64, 4096, eagle_aux_hidden_state_layer_ids=[0, 3, 7])
    llm = LLM(tiny, device="cpu", disable_log_stats=True, speculative=_spec(head))
    assert llm.engine.runner.model.aux_layer_ids == (0, 3, 7)
    assert LLM(tiny, device="cpu", disable_log_stats=True, speculative=_spec(write_head(tmp_path / "d", 64, 4096))
               ).engine.runner.model.aux_layer_ids == (2, 4, 5)


def write_eagle1_head(path: Path, hidden: int, vocab: int, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                      intermediate: int = 128, seed: int = 0, scale: float = 0.1, bias: bool = True,
                      embed: bool = False, **config_fields) -> Path:
    """A random EAGLE-1 head in the published format: config.json (a LlamaConfig, `bias` for fc's) and
    model.safetensors (fc over [embedding, hidden], layers.0.* without an input norm; embed_tokens only if `embed`)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * scale  # noqa: E731
    tensors = {"fc.weight": rand(hidden, 2 * hidden),
               **_llama_layer("layers.0.", rand, hidden, hidden, heads, kv_heads, head_dim, intermediate)}
    if bias:
        tensors["fc.bias"] = rand(hidden)
    if embed:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    return _save_head(path, tensors, "LlamaForCausalLM", hidden, vocab, heads, kv_heads, head_dim, intermediate,
                      bias=bias, **config_fields)


def _eagle1(head, k=3):
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k}


def test_an_eagle1_head_changes_no_token_and_its_drafts_are_a_llama_layer_over_the_final_hidden_states(
        tiny, tmp_path):
    """EAGLE-1 (method eagle) on the tiny model: greedy tokens as without speculation, under chunked prefill and
    preemption; each first draft is transformers' LlamaDecoderLayer (its input norm the identity) over
    fc([embedding, final hidden state]) at every position, then the model's lm_head, in float64."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    prompts = [f"the king {'and then ' * i}my lord" for i in range(6)]
    reference, _ = _generate(tiny, prompts)
    head_dir = write_eagle1_head(tmp_path / "eagle1", 64, 4096, scale=0.3)
    llm = LLM(tiny, device="cpu", max_num_seqs=8, disable_log_stats=True, max_num_batched_tokens=32, num_kv_blocks=24,
              speculative=_eagle1(head_dir))
    seen = _record_first_drafts(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                                  ignore_eos=True))]
    assert got == [r[0] for r in reference]
    assert llm.stats()["num_spec_proposed"] > 0 and llm.engine.proposer.num_unprepared == 0

    model = AutoModelForCausalLM.from_pretrained(tiny.parent / "hf", dtype=torch.float64).eval()
    config = json.loads((head_dir / "config.json").read_text())
    head_config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "bias")})
    head_config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(head_config, 0).double()
    weights = {k: v.double() for k, v in load_file(head_dir / "model.safetensors").items()}
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    rotary = LlamaRotaryEmbedding(head_config)
    agree = 0
    with torch.no_grad():
        for tokens, draft in seen.items():
            ids = torch.tensor([tokens])
            final = model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
            x = torch.nn.functional.linear(torch.cat((model.model.embed_tokens.weight[ids[:, 1:]], final[:, :-1]), -1),
                                           weights["fc.weight"], weights["fc.bias"])
            positions = torch.arange(len(tokens) - 1)[None]
            mask = torch.full((len(tokens) - 1,) * 2, float("-inf")).triu(1)[None, None].double()
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
            out = out[0] if isinstance(out, tuple) else out
            agree += int(model.lm_head(out[0, -1]).argmax()) == draft
    assert len(seen) > 20 and agree >= 0.97 * len(seen), (agree, len(seen))


def test_eagle1_heads_that_do_not_fit_are_refused_by_name(tiny, tmp_path):
    def refused(head, match):
        with pytest.raises(ConfigError, match=match):
            LLM(tiny, device="cpu", speculative=_eagle1(head))

    refused(write_head(tmp_path / "eagle3", 64, 4096), "its config is an EAGLE-3 head's .*; use method eagle3")
    refused(write_eagle1_head(tmp_path / "wide", 96, 4096), "the model's are 64; use a head trained")
    with_norm = write_eagle1_head(tmp_path / "norm", 64, 4096)
    from safetensors.torch import load_file

    tensors = load_file(with_norm / "model.safetensors")
    tensors["layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, with_norm / "model.safetensors")
    refused(with_norm, "an EAGLE head's layer has no input norm")
    no_bias = write_eagle1_head(tmp_path / "nobias", 64, 4096, bias=False)
    (no_bias / "config.json").write_text((no_bias / "config.json").read_text().replace('"bias": false', '"bias": true'))
    refused(no_bias, "tensor fc.bias is missing")


def test_a_prefix_cache_hit_recomputes_its_last_block_for_the_head(tiny, tmp_path):
    """vLLM's rule under EAGLE: the head's row before the first computed token reads the next token, which the
    request that wrote the cached blocks may not share, so a hit gives one block fewer than without a head."""
    shared = "the king and then my lord " * 12  # several blocks of 16 tokens
    prompts = [shared + "ROMEO:", shared + "sweet love of the night"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    hits = {}
    for name, options in (("plain", {}), ("eagle", {"speculative": _spec(write_head(tmp_path / "h", 64, 4096))})):
        llm = LLM(tiny, device="cpu", max_num_seqs=1, disable_log_stats=True, **options)
        for prompt in prompts:  # one after the other: the second hits the first's blocks
            llm.generate(prompt, params)
        hits[name] = llm.engine.scheduler.prefix_cache_hits
    assert hits["plain"] >= 3 * 16 and hits["eagle"] == hits["plain"] - 16, hits


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_on_cuda_greedy_tokens_equal_decoding_without_speculation(target, trained_head, prompts, eager, free_gpu):
    """On a GPU, with CUDA graphs (the decode graphs, the piecewise graphs of prompts and the whole-forward graphs of
    the verify steps keep the head's inputs: DecoderModel.keep_hidden; the head's draft steps and its absorb of decode
    verify steps replay their own graphs, runtime/eagle_graphs.py, eagle_absorb_graphs.py) and without: greedy tokens
    as without speculation, drafts accepted, no block left in use."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    share = {"gpu_memory_utilization": 0.4}  # two engines in one process: a closed one's memory may stay cached
    with LLM(target, device="cuda", max_num_seqs=8, disable_log_stats=True, **share) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    with LLM(target, device="cuda", max_num_seqs=8, disable_log_stats=True, enforce_eager=eager, **share,
             speculative=_spec(trained_head)) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats, runner = llm.stats(), llm.engine.runner
        proposer = llm.engine.proposer
        assert (runner.pieces is None) == eager and (proposer.graphs is None) == (proposer.absorb_graphs is None) == eager
        if not eager:  # the prompts replayed the piecewise graphs, the verify steps the whole-forward ones, the
            # draft steps and the decode verify steps' absorb the head's
            assert runner.pieces.num_replays > 0 and runner.verify_graphs.num_replays > 0
            assert proposer.graphs.num_replays > 0 and proposer.absorb_graphs.num_replays > 0
    assert got == expected
    assert 0 < stats["num_spec_accepted"] < stats["num_spec_proposed"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
