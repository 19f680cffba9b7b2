"""MTP speculative decoding (speculative method mtp): GLM-4.5's multi-token-prediction layer, kept by the build
(compiler/mtp.py), run as a draft head by the EAGLE machinery (runtime/mtp_head.py, runtime/spec_eagle.py).

The tiny random Glm4MoeForCausalLM of tests/conftest.py (3 layers: 1 dense, 2 MoE; q/k/v biases, q/k norms, rotary on
half of each head) with an MTP layer as GLM-4.5 publishes it, model.layers.3.*: transformers' save_pretrained drops it
(its model has no MTP layer), so the test writes its tensors under the published names (a decoder layer with the MoE,
enorm, hnorm, eh_proj, shared_head.norm, and shared_head.head / embed_tokens where a case has them).

References: (a) the drafts the engine proposes (first and chained) equal a float64 reference of the published MTP
definition (the DeepSeek-V3 paper's module: eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i))) → the decoder layer →
shared_head.norm → the head) computed over transformers' float64 hidden states, its decoder layer transformers' own
Glm4MoeDecoderLayer (loaded as layer 3 of a 4-layer copy of the checkpoint), with vLLM's zeroed embedding at position 0;
(b) greedy tokens identical to decoding without speculation under chunked prefill and preemption, n=2 and seeded samples
identical, every KV block freed; (c) the engine's accepted drafts, counted, equal what the float64 reference's
predictions would have accepted along the greedy continuation (k = 1), and far more than a random layer's. Also: the
Triton kernels (interpreted) in the head, `llmc inspect` / `llmc run`, the refusals; -m gpu: CUDA."""

import json
import os
import shutil

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime.artifact import MTP_WEIGHTS, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.spec_decode import SpeculativeConfig
from tests.conftest import make_hf_checkpoint
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)

PROMPTS = [f"the king {'and then ' * (2 * i)}my lord" for i in range(6)]  # 5 to 25 tokens
MAX_TOKENS = 16
HIDDEN, VOCAB, N = 64, 4096, 3  # the tiny model's hidden size, vocabulary and layers (the MTP layer is layer 3)


def _add_mtp_layer(checkpoint, seed: int, head: bool, embed: bool, scale: float = 1.0) -> None:
    """model.layers.3.* as GLM-4.5 publishes its MTP layer: a decoder layer (layer 2's tensors plus noise: the MoE with
    its router bias, q/k/v biases, q/k norms), enorm, hnorm, eh_proj, shared_head.norm, and shared_head.head /
    embed_tokens where asked."""
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:  # (transformers writes zeros)
        tensors[name] = 0.3 * rand(*tensors[name].shape)
    for name in [n for n in tensors if ".layers.2." in n]:
        t = tensors[name]
        tensors[name.replace(".layers.2.", ".layers.3.")] = t + scale * 0.1 * rand(*t.shape) * t.std().clamp(min=0.1)
    tensors |= {"model.layers.3.eh_proj.weight": scale * 0.15 * rand(HIDDEN, 2 * HIDDEN),
                **{f"model.layers.3.{norm}.weight": 1 + 0.1 * rand(HIDDEN) for norm in ("enorm", "hnorm",
                                                                                       "shared_head.norm")}}
    if head:
        tensors["model.layers.3.shared_head.head.weight"] = 0.2 * rand(VOCAB, HIDDEN)
    if embed:
        tensors["model.layers.3.embed_tokens.weight"] = 0.2 * rand(VOCAB, HIDDEN)
    save_file(tensors, path, metadata={"format": "pt"})


def _make_it_a_bigram_predictor(checkpoint) -> None:
    """Rewrites the MTP layer of `checkpoint` (its own head and embedding) so that it predicts t_{i+2} from t_{i+1}
    alone as the model's greedy continuations of PROMPTS do (the follower seen most often after each token there):
    eh_proj reads the normed embedding only, the decoder layer's outputs (o_proj, the experts' and shared expert's
    down) are scaled to a tenth (it still runs), and shared_head.head row u is the sum of the normed embeddings of the
    tokens followed by u. Its drafts are then the greedy tokens often, which random layers' never are."""
    from tests.conftest import hf_encode, hf_greedy

    followers: dict[int, dict[int, int]] = {}
    for prompt, tokens in zip(PROMPTS, hf_greedy(checkpoint, PROMPTS, MAX_TOKENS)):
        sequence = hf_encode(checkpoint, prompt)[-1:] + tokens
        for a, b in zip(sequence, sequence[1:]):
            followers.setdefault(a, {}).setdefault(b, 0)
            followers[a][b] += 1
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    p = f"model.layers.{N}."
    embed = tensors[p + "embed_tokens.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-5)
    head = torch.zeros(VOCAB, HIDDEN)
    for a, counts in followers.items():
        head[max(counts, key=counts.get)] += 4 * normed[a]
    tensors[p + "shared_head.head.weight"] = head
    tensors[p + "eh_proj.weight"] = torch.cat((torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)), dim=1)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{p}{norm}.weight"] = torch.ones(HIDDEN)
    for name in [n for n in tensors if n.startswith(p) and ("o_proj" in n or "down_proj" in n)]:
        tensors[name] = tensors[name] * 0.1
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """"shared": no shared_head.head nor embed_tokens (the model's lm_head and embedding, as in GLM-4.5-Air's index);
    "own": both its own; "bigram": "own" made a bigram predictor (_make_it_a_bigram_predictor)."""
    return make_mtp_checkpoints(tmp_path_factory.mktemp("mtp"), "glm4_moe", {"shared": 2, "own": 1, "bigram": 1})


def make_mtp_checkpoints(root, family: str, seeds: dict[str, int]) -> dict:
    """Tiny `family` checkpoints with an MTP layer each, by kind: "shared" without its own head and embedding, the
    others with them (seeded as `seeds` says); "bigram" made a bigram predictor."""
    made = {}
    for kind, seed in seeds.items():
        own = kind != "shared"
        made[kind] = make_hf_checkpoint(root / kind, family)
        _add_mtp_layer(made[kind], seed=seed, head=own, embed=own)
    _make_it_a_bigram_predictor(made["bigram"])
    return made


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return build_mtp_artifacts(checkpoints, tmp_path_factory.mktemp("mtp_artifacts"))


def build_mtp_artifacts(checkpoints: dict, root) -> dict:
    """Each checkpoint's float32 build (max_model_len 64), by kind."""
    for kind, checkpoint in checkpoints.items():
        build(recipe_from_dict({"model": str(checkpoint), "output": str(root / kind), "dtype": "float32",
                                "runtime": {"max_model_len": 64}}), show_progress=False)
    return {kind: root / kind for kind in checkpoints}


def _spec(k: int = 2) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def _generate(artifact, prompts, params=None, **options):
    """Outputs' token ids and the engine's stats; every block freed, every verify step given the head's drafts."""
    llm = LLM(artifact, device="cpu", max_num_seqs=8, disable_log_stats=True, **options)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    llm.engine.scheduler.check_invariants()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    proposer = llm.engine.proposer
    if proposer is not None and hasattr(proposer, "num_unprepared"):
        assert proposer.num_unprepared == 0, "a request was verified without the head's drafts"
    return [[o.token_ids for o in out.outputs] for out in outputs], stats


def _record_drafts(llm) -> dict:
    """{a verified request's tokens: the drafts the head filled in for it}, recorded as llm's steps run."""
    proposer, seen = llm.engine.proposer, {}
    fill = proposer.fill

    def recording_fill(batch):
        fill(batch)
        for scheduled in batch.requests:
            if scheduled.draft_token_ids:
                seen[tuple(scheduled.request.all_token_ids)] = list(scheduled.draft_token_ids)

    proposer.fill = recording_fill
    return seen


class Reference:
    """The published MTP definition in float64 over transformers' float64 model: h = the model's last_hidden_state
    (after its final norm); the decoder layer is transformers' Glm4MoeDecoderLayer, read as layer 3 of a 4-layer copy
    of the checkpoint (so transformers itself loads its experts and permutes nothing)."""

    def __init__(self, checkpoint, tmp_path):
        from transformers import AutoModelForCausalLM

        eager = {"dtype": torch.float64, "experts_implementation": "eager"}  # (grouped_mm takes no float64)
        self.model = AutoModelForCausalLM.from_pretrained(str(checkpoint), **eager).eval()
        four = tmp_path / "four-layers"
        shutil.copytree(checkpoint, four)
        config = json.loads((four / "config.json").read_text())
        grown = {**config, "num_hidden_layers": N + 1, "num_nextn_predict_layers": 0}
        if config.get("mlp_layer_types"):  # (GLM-4.7-Flash's: layer N sparse, as its MTP layer is)
            grown["mlp_layer_types"] = [*config["mlp_layer_types"], "sparse"]
        (four / "config.json").write_text(json.dumps(grown))
        self.grown = AutoModelForCausalLM.from_pretrained(str(four), **eager).eval()
        self.grown.config._attn_implementation = "eager"
        tensors = {k: v.double() for k, v in load_file(checkpoint / "model.safetensors").items()}
        prefix = f"model.layers.{N}."
        self.w = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        self.embed = self.w.get("embed_tokens.weight", tensors["model.embed_tokens.weight"])
        self.head = self.w.get("shared_head.head.weight", tensors["lm_head.weight"])
        self.eps = config["rms_norm_eps"]

    def norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name + ".weight"]

    def layer(self, hidden, tokens, positions):
        """The MTP module at rows (hidden [L, H], the next tokens [L], positions [L]), causal over the rows →
        its outputs [L, H] (before shared_head.norm)."""
        e = self.embed[tokens].masked_fill((positions == 0).unsqueeze(-1), 0)  # vLLM's: position 0's embedding zeroed
        x = torch.cat((self.norm(e, "enorm"), self.norm(hidden, "hnorm")), -1) @ self.w["eh_proj.weight"].T
        n = len(tokens)
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        cos_sin = self.grown.model.rotary_emb(x[None], positions[None])
        return self.grown.model.layers[N](x[None], attention_mask=mask, position_ids=positions[None],
                                          position_embeddings=cos_sin)[0]

    def logits(self, out):
        return self.norm(out, "shared_head.norm") @ self.head.T

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k drafts proposed after `tokens` (n of them): row n - 2 reads (h_{n-2}, t_{n-1}) and gives d1; draft j
        + 1 is the row at n - 2 + j reading (the previous row's output, d_j)."""
        ids = torch.tensor([tokens])
        h = self.model.model(ids).last_hidden_state[0]
        n = len(tokens)
        hidden, nxt, positions = h[: n - 1], ids[0, 1:], torch.arange(n - 1)
        out = self.layer(hidden, nxt, positions)
        drafts = [int(self.logits(out[-1]).argmax())]
        for j in range(1, k):
            hidden = torch.cat((hidden, out[-1:]))
            nxt = torch.cat((nxt, torch.tensor([drafts[-1]])))
            positions = torch.arange(n - 1 + j)
            out = self.layer(hidden, nxt, positions)
            drafts.append(int(self.logits(out[-1]).argmax()))
        return drafts


@pytest.mark.parametrize("kind", ["shared", "own"])
def test_the_build_keeps_the_mtp_layer(checkpoints, artifacts, kind, tmp_path, caplog):
    """mtp/weights.safetensors holds the decoder layer in the runtime's names (q/k rows permuted as the main
    layers': layer 3's q/k are layer 2's plus noise, so not compared here; the drafts test checks them), the MTP
    tensors as the checkpoint has them, and the manifest says which."""
    manifest = read_manifest(artifacts[kind])
    assert manifest.format_version == "1.47" and manifest.model.num_layers == N
    assert (manifest.mtp.layer_index, manifest.mtp.is_moe, manifest.mtp.has_head, manifest.mtp.has_embed) == (
        N, True, kind == "own", kind == "own")
    assert MTP_WEIGHTS in manifest.files
    weights = load_file(artifacts[kind] / MTP_WEIGHTS)
    source = load_file(checkpoints[kind] / "model.safetensors")
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
        assert torch.equal(weights[f"{name}.weight"], source[f"model.layers.3.{name}.weight"])
    assert ("shared_head.head.weight" in weights) == ("embed.weight" in weights) == (kind == "own")
    assert weights["layers.3.moe.experts.gate_up.weight"].shape == (8, 64, HIDDEN)
    assert torch.equal(weights["layers.3.moe.gate_bias.weight"], source["model.layers.3.mlp.gate.e_score_correction_bias"])
    main = load_file(artifacts[kind] / "rank-00" / "weights.safetensors")
    assert not [name for name in main if name.startswith("layers.3.")]
    with caplog.at_level("INFO", logger="llmc"):
        build(recipe_from_dict({"model": str(checkpoints[kind]), "output": str(tmp_path / "again"),
                                "dtype": "float32"}), show_progress=False)
    assert "the multi-token prediction layer (layer 3) is built into mtp/weights.safetensors" in caplog.text


def test_inspect_reports_it_and_llmc_run_takes_method_mtp(artifacts):
    from click.testing import CliRunner

    from llmc.cli import cli

    result = CliRunner().invoke(cli, ["inspect", str(artifacts["own"]), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["mtp"]
    assert (report["layer_index"], report["has_head"]) == (N, True)
    assert report["bytes"] == (artifacts["own"] / MTP_WEIGHTS).stat().st_size
    result = CliRunner().invoke(cli, ["run", str(artifacts["own"]), "--device", "cpu", "--prompt", "the king",
                                      "--max-tokens", "4", "--speculative",
                                      '{"method": "mtp", "num_speculative_tokens": 2}'])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", ["shared", "own"])
def test_drafts_equal_the_float64_reference(checkpoints, artifacts, kind, tmp_path):
    """Every verify step's drafts (k = 2: the first from the model's hidden state, the second chained on the head's
    own output) equal the float64 reference's, under chunked prefill and preemption; holds only if the head's KV
    cache holds the right rows at every step."""
    llm = LLM(artifacts[kind], device="cpu", max_num_seqs=4, disable_log_stats=True, max_num_batched_tokens=24,
              num_kv_blocks=6, speculative=_spec(2))
    seen = _record_drafts(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert llm.stats()["num_preemptions"] > 0
    reference = Reference(checkpoints[kind], tmp_path)
    agree = sum(reference.drafts(list(tokens), len(drafts)) == drafts for tokens, drafts in seen.items())
    assert len(seen) > 30
    assert agree >= 0.95 * len(seen), (agree, len(seen))  # float32 against float64: a near-tie may flip


@pytest.mark.parametrize("kind", ["shared", "bigram"])
def test_greedy_n2_and_seeded_samples_equal_decoding_without_speculation(artifacts, kind):
    """Greedy, seeded and n=2 requests batched: the same tokens as without speculation, with k = 2 under chunked
    prefill and preemption and with k = 3; the bigram layer's drafts are accepted often, the random one's not."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 3
    params += [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=11, ignore_eos=True),
               SamplingParams(temperature=0.8, top_p=0.9, n=2, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True),
               SamplingParams(temperature=0.3, n=2, max_tokens=MAX_TOKENS, seed=9, ignore_eos=True)]
    plain, _ = _generate(artifacts[kind], PROMPTS, params)
    for k, options in ((2, {"max_num_batched_tokens": 24, "num_kv_blocks": 6}), (3, {})):
        got, stats = _generate(artifacts[kind], PROMPTS, params, speculative=_spec(k), **options)
        assert got == plain
        assert stats["num_spec_proposed"] > 0
        assert (stats["num_spec_accepted"] > 0.2 * stats["num_spec_proposed"]) == (kind == "bigram"), stats
        if k == 2:
            assert stats["num_preemptions"] > 0


def test_accepted_drafts_are_the_references(checkpoints, artifacts, tmp_path):
    """k = 1, greedy: a draft is accepted iff it is the greedy token, so along each request's greedy tokens the
    engine accepts exactly where the float64 reference's draft is the next token (the verify steps skip a token after
    each acceptance). The bigram MTP layer's drafts are accepted often; the random ones' never."""
    check_accepted_as_the_reference(artifacts["bigram"], Reference(checkpoints["bigram"], tmp_path), artifacts["own"])


def check_accepted_as_the_reference(artifact, reference, random_artifact) -> None:
    """At k = 1, greedy, `artifact`'s engine accepts a draft exactly where `reference` (the float64 MTP definition)
    drafts the next greedy token, at least 30% of the proposals; `random_artifact`'s layer hardly ever (<= 2)."""
    got, stats = _generate(artifact, PROMPTS, speculative=_spec(1))
    llm = LLM(artifact, device="cpu", disable_log_stats=True)
    prompt_ids = [llm.get_tokenizer()(p)["input_ids"] for p in PROMPTS]
    want = 0
    for ids, (tokens,) in zip(prompt_ids, got):
        sequence, n = ids + tokens, len(ids) + 1  # the prefill samples the first token
        while n < len(sequence) - 1:  # (no draft where one token is left to generate)
            hit = reference.drafts(sequence[:n], 1)[0] == sequence[n]
            want += hit
            n += 1 + hit
    assert stats["num_spec_accepted"] == want, (stats, want)
    assert want >= 0.3 * stats["num_spec_proposed"], stats
    assert _generate(random_artifact, PROMPTS, speculative=_spec(1))[1]["num_spec_accepted"] <= 2


def test_the_triton_path_gives_the_same_tokens(artifacts, triton_dispatch):  # noqa: F811
    """The kernels CUDA runs (rotary + KV write, paged attention, fused MoE: Triton's interpreter on CPU tensors) in
    the model and the MTP head alike: greedy tokens as without speculation, the bigram layer's drafts accepted."""
    check_the_head_runs_a_kernel(artifacts["bigram"], triton_dispatch, lambda layer: layer.moe, "forward", "fused_moe")


def check_the_head_runs_a_kernel(artifact, triton_dispatch, part, method: str, kernel: str) -> None:
    """With Triton's kernels dispatched (interpreted on CPU tensors): greedy tokens with MTP at k = 2 as without, drafts
    accepted, and every call of the head layer's `part(layer).method` ran `kernel` once."""
    prompts, params = PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain, _ = _generate(artifact, prompts, params)
    llm = LLM(artifact, device="cpu", disable_log_stats=True, speculative=_spec(2))
    module, in_head = part(llm.engine.proposer.head.layer), []
    run = getattr(module, method)

    def counted(*args, **kwargs):
        before = triton_dispatch[kernel]
        out = run(*args, **kwargs)
        in_head.append(triton_dispatch[kernel] - before)
        return out

    setattr(module, method, counted)
    got = [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, params)]
    assert got == plain and llm.stats()["num_spec_accepted"] > 0
    assert in_head and all(n == 1 for n in in_head)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu(artifacts, free_gpu):
    """On CUDA (the model's CUDA graphs, the head eager): greedy tokens as without speculation."""
    check_on_the_gpu(artifacts["bigram"])


def check_on_the_gpu(artifact) -> None:
    """On CUDA: greedy tokens with MTP at k = 3 as without speculation, drafts accepted."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    for speculative in (None, _spec(3)):
        with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=4, speculative=speculative) as llm:
            outputs[speculative is None] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            if speculative:
                assert llm.stats()["num_spec_accepted"] > 0
    assert outputs[True] == outputs[False]


def test_what_mtp_refuses(artifacts, tmp_path, hf_checkpoint_factory):
    with pytest.raises(ConfigError, match="method mtp runs the artifact's own multi-token-prediction layer; drop "
                                          "speculative.model"):
        SpeculativeConfig(method="mtp", model="x", num_speculative_tokens=1)
    with pytest.raises(ConfigError, match="prompt_lookup_max is an n-gram setting; method mtp does not read it"):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2})
    for old in ("deepseek_mtp", "glm4_moe_mtp"):  # vLLM's older names
        assert SpeculativeConfig.from_dict({"method": old, "num_speculative_tokens": 1}).method == "mtp"
    llama = hf_checkpoint_factory(tmp_path / "llama", "llama")
    build(recipe_from_dict({"model": str(llama), "output": str(tmp_path / "llama-art"), "dtype": "float32"}),
          show_progress=False)
    with pytest.raises(ConfigError, match=r"speculative method mtp: this artifact \(LlamaForCausalLM\) holds no "
                                          "multi-token-prediction layer"):
        LLM(tmp_path / "llama-art", device="cpu", speculative=_spec())
    with pytest.raises(ConfigError, match="speculative method mtp does not run with enable_prompt_embeds"):
        LLM(artifacts["shared"], device="cpu", speculative=_spec(), enable_prompt_embeds=True)
