"""DeepSeek's latent KV cache (runtime/models/mla.py, kernels/mla_attention.py) through the engine, against transformers'
float32 models (tiny random checkpoints): both attention forms, each forced for every step, give transformers' logits
over a chunked prefill and its greedy tokens in a batch; prefix-cache hits, preemption under a tiny cache and a draft
model's speculation keep them; the cache's bytes per token are (kv_lora_rank + qk_rope_head_dim) x layers x dtype
bytes, what the engine allocates, and a fixed budget holds that many more tokens than the expanded heads did; an FP8
latent cache stores one scale's E4M3 latents; `llmc inspect` states the cache."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import build_float32

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
ENGINE = {"device": "cpu", "max_num_seqs": 3, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("mla") / "deepseek_v3", "deepseek_v3")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("mla_artifact") / "art")


def _attention_modules(llm):
    return [layer.attn for layer in llm.engine.runner.model.layers.values()]


@torch.inference_mode()
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_each_form_gives_transformers_logits_and_greedy_tokens(form, checkpoint, artifact, hf_logits, hf_greedy,
                                                               hf_encode):
    """Every step in one form (absorbed: q_nope · W_UK against the cached latents; expanded: kv_b over them): the
    logits of 40 positions prefilled in chunks of 16 (1e-4) and three prompts' greedy tokens decoded together."""
    with LLM(artifact, **ENGINE) as llm:
        for attn in _attention_modules(llm):
            attn.form = form
        assert all(len(attn.kv_cache) == 1 for attn in _attention_modules(llm))  # one latent cache per layer
        token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
        torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids), atol=1e-4,
                                   rtol=1e-4)
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens)


@torch.inference_mode()
def test_prefix_hits_preemption_and_a_draft_model_keep_transformers_tokens(checkpoint, artifact, hf_greedy,
                                                                           hf_encode):
    """Prompts sharing a 40-token prefix in a cache of 10 blocks of 8 tokens: prefix-cache hits (the latents of the
    shared blocks reused), preemption and recomputation; then the model as its own draft (speculative decoding of 3
    tokens: every draft accepted only where the draft's latent cache holds the request's tokens): transformers'
    greedy tokens each time."""
    prefix = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 130))
    prompts = [prefix + [200 + i] for i in range(3)]
    want = [hf_greedy_ids(checkpoint, ids, GREEDY.max_tokens) for ids in prompts]
    with LLM(artifact, device="cpu", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=10, block_size=8,
             max_model_len=64) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
        got = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY)
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in got] == want
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0
    with LLM(artifact, **ENGINE, speculative={"model": str(artifact), "num_speculative_tokens": 3}) as llm:
        got = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY)
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in got] == want
    assert stats["num_spec_accepted"] == stats["num_spec_proposed"] > 0


def hf_greedy_ids(checkpoint, token_ids, max_new_tokens):
    """transformers' float32 greedy continuation of token ids (eager attention, its own cache)."""
    ids = torch.tensor([token_ids])
    out = _hf_model(checkpoint).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                         do_sample=False)
    return out[0, len(token_ids):].tolist()


_MODELS = {}


def _hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    if checkpoint not in _MODELS:
        _MODELS[checkpoint] = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    return _MODELS[checkpoint]


def test_the_cache_is_the_latent_and_a_budget_holds_that_many_more_tokens(artifact):
    """Per token and layer kv_lora_rank + qk_rope_head_dim values (32 + 4 here; 576 for V2 / V3): the manifest, the
    memory plan and the engine's tensors agree with (kv_lora_rank + qk_rope_head_dim) x layers x 4 bytes (float32;
    on each of two tensor ranks too: the latent is every head's), and a cpu_kv_cache_gib budget holds 2 x heads x (qk_nope + qk_rope) / (kv_lora_rank + qk_rope) = 3.6x the tokens
    the expanded heads held."""
    from llmc.runtime.artifact import ParallelPlan
    from llmc.runtime.parallel.layout import all_rank_layouts, kv_bytes_per_token, whole_model_layout

    manifest = read_manifest(artifact)
    model, kv = manifest.model, manifest.kv
    latent = model.kv_lora_rank + model.qk_rope_head_dim
    assert latent == 36 and kv.latent and (kv.num_kv_heads, kv.head_dim) == (1, latent)
    per_token = latent * model.num_layers * 4
    assert kv.bytes_per_token == kv_bytes_per_token(model, whole_model_layout(model), 4) == per_token
    # tensor parallel 2: each rank its 2 heads' W_UK / W_UV, and the whole latent of every token
    assert [kv_bytes_per_token(model, r, 4) for r in all_rank_layouts(model, ParallelPlan(2))] == [per_token] * 2
    expanded = 2 * model.num_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim) * model.num_layers * 4
    budget_gib = 1 / 1024  # 1 MiB
    with LLM(artifact, device="cpu", cpu_kv_cache_gib=budget_gib, max_model_len=64) as llm:
        caches = llm.engine.runner.kv_caches
        block_size = caches[0][0].shape[1]
        assert all(len(c) == 1 and c[0].shape[1:] == (block_size, latent) for c in caches)
        num_blocks = llm.engine.runner.num_blocks
        assert sum(c[0].numel() * c[0].element_size() for c in caches) == per_token * num_blocks * block_size
    assert num_blocks == 2**20 // (per_token * block_size)
    assert num_blocks * block_size >= 3.5 * (2**20 // (expanded * block_size)) * block_size


@torch.inference_mode()
@pytest.mark.parametrize("calibrated", [False, True])
def test_an_fp8_latent_cache(calibrated, checkpoint, artifact, tmp_path, data_dir, hf_logits, hf_encode,
                             monkeypatch):
    """kv_cache_dtype fp8: the latent cache is E4M3 with one scale per layer (1.0 without calibrated ones; a build's
    calibration records the amax of the latents it wrote / 448 as both k_scale and v_scale): transformers' logits
    (1e-4) where its own latent cache's two parts, the normed c_kv and the rotated k_pe, are stored as
    E4M3(x / scale) * scale, and not the float cache's."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    if calibrated:
        artifact = build_float32(checkpoint, tmp_path / "fp8", runtime={"kv_cache_dtype": "fp8", "max_model_len": 256},
                                 quantization={"calibration": {"data": str(data_dir / "calibration.txt"),
                                                               "num_samples": 4, "seq_len": 32}})
        kv = read_manifest(artifact).kv
        assert kv.scales_source == "calibration" and kv.k_scales == kv.v_scales and min(kv.k_scales) > 0
        scales = kv.k_scales
    else:
        scales = [1.0] * 3
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 116))
    with LLM(artifact, kv_cache_dtype="fp8", **ENGINE) as llm:
        assert all(attn.kv_cache[0].dtype == torch.float8_e4m3fn for attn in _attention_modules(llm))
        assert [attn.k_scale for attn in _attention_modules(llm)] == pytest.approx(scales)
        got = llm.engine.score(token_ids)
    assert (got - hf_logits(checkpoint, token_ids)).abs().max() > 1e-2  # (transformers' float cache: before the patch)
    layer_of_call = iter(range(3))  # (one forward rotates layer 0, 1, 2 in turn)

    def e4m3(x, layer):
        return ((x / scales[layer]).to(torch.float8_e4m3fn).to(x.dtype) * scales[layer])

    rotate = hf.apply_rotary_pos_emb_interleave

    def rotate_and_round(q, k, *args, **kwargs):
        q_rot, k_rot = rotate(q, k, *args, **kwargs)
        return q_rot, e4m3(k_rot, next(layer_of_call))

    monkeypatch.setattr(hf, "apply_rotary_pos_emb_interleave", rotate_and_round)
    model = _hf_model(checkpoint)
    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(lambda _, args, out, i=i: e4m3(out, i))
             for i, layer in enumerate(model.model.layers)]
    try:
        want = model(torch.tensor([token_ids])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_inspect_states_the_latent_cache(artifact):
    from click.testing import CliRunner

    from llmc.cli import cli

    result = CliRunner().invoke(cli, ["inspect", str(artifact)])
    assert result.exit_code == 0, result.output
    assert "latent KV cache of 32 + 4 values per token and layer, kv_b absorbed" in result.output
    assert ("KV cache                          432 bytes/token (float32; MLA's latent, 36 values per token and layer)"
            in result.output)  # 36 x 3 layers x 4 bytes


def test_an_older_manifest_records_the_expanded_cache_and_still_loads(artifact):
    """A 1.20 / 1.21 DeepSeek manifest's kv section is the expanded cache it ran with (num_heads K and V heads of
    qk_nope + qk_rope dims): accepted (the runtime allocates the latent cache from the model's fields); a 1.22 one
    must say latent."""
    import dataclasses

    from llmc.errors import ArtifactError
    from llmc.runtime import artifact as art

    manifest = read_manifest(artifact)
    expanded = dataclasses.replace(manifest.kv, latent=False, num_kv_heads=4, head_dim=16)
    art._check_consistency(dataclasses.replace(manifest, format_version="1.21", kv=expanded))
    for kv in (expanded, dataclasses.replace(manifest.kv, latent=False)):
        with pytest.raises(ArtifactError, match="kv does not match .* \\(MLA: its latent cache\\)"):
            art._check_consistency(dataclasses.replace(manifest, kv=kv))
