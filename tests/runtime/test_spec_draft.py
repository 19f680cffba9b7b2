"""Draft-model speculative decoding (runtime/spec_draft.py): a second llmc artifact proposes the drafts.

The references are the engine without speculation (greedy tokens identical, seeded samples identical) and the
draft model itself: with the model as its own draft every draft must be accepted, which holds only if the
draft's KV cache holds exactly the request's tokens at every step (chunked prefill, preemption, prefix cache,
rejected drafts)."""

import random

import pytest

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.spec_decode import SpeculativeConfig

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory, ref_model_dir):
    out = tmp_path_factory.mktemp("spec-target") / "ref"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 256}}), show_progress=False)
    return out


@pytest.fixture(scope="module")
def draft(tmp_path_factory, ref_model_dir):
    """The same model, 4-bit RTN: a draft that agrees with the target most of the time, not always."""
    out = tmp_path_factory.mktemp("spec-draft") / "w4"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "quantization": {"method": "rtn", "bits": 4, "group_size": 32},
                            "runtime": {"max_model_len": 256}}), show_progress=False)
    return out


@pytest.fixture(scope="module")
def prompts():
    """24 prompts sharing a few multi-block prefixes (prefix-cache hits), of mixed lengths."""
    rng = random.Random(1)
    words = ("the king", "my lord", "ROMEO:", "sweet love", "of the night", "and then", "I pray you", "good sir")
    prefixes = ["First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n",
                "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"]
    return [rng.choice(prefixes) + " ".join(rng.choice(words) for _ in range(rng.randint(1, 16))) for _ in range(24)]


def _generate(artifact, prompts, params=None, **options):
    llm = LLM(artifact, device="cpu", max_num_seqs=8, disable_log_stats=True, **options)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    llm.engine.scheduler.check_invariants()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    proposer = llm.engine.proposer
    if proposer is not None and hasattr(proposer, "_sequences"):  # a draft model's
        assert not proposer._sequences or all(s.request.is_finished for s in proposer._sequences.values())
    if proposer is not None and hasattr(proposer, "num_unprepared"):  # an EAGLE head's (test_spec_eagle.py)
        assert proposer.num_unprepared == 0, "a request was verified without the head's drafts"
        assert all(s.request.is_finished for s in proposer._states.values())
    return [[c.token_ids for c in o.outputs] for o in outputs], stats


@pytest.fixture(scope="module")
def reference(target, prompts):
    return _generate(target, prompts)[0]


WORKLOADS = {
    "plain": {},
    "preemption": {"num_kv_blocks": 16},
    "chunked-prefill": {"max_num_batched_tokens": 24},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "all-at-once": {"num_kv_blocks": 16, "max_num_batched_tokens": 40},
}
# all-at-once covers preemption and chunked prefill together in the default run
SLOW_WORKLOADS = ("preemption", "chunked-prefill", "no-prefix-cache")


@pytest.mark.parametrize("workload", [pytest.param(w, marks=pytest.mark.slow) if w in SLOW_WORKLOADS else w
                                      for w in WORKLOADS], ids=list(WORKLOADS))
def test_greedy_tokens_equal_decoding_without_a_draft(target, draft, prompts, reference, workload):
    got, stats = _generate(target, prompts, speculative={"model": str(draft), "num_speculative_tokens": 3},
                           **WORKLOADS[workload])
    mismatches = [i for i, (a, b) in enumerate(zip(reference, got)) if a != b]
    assert not mismatches, f"{len(mismatches)} requests differ, first {mismatches[0]}"
    assert stats["num_spec_proposed"] > 0
    assert 0 < stats["num_spec_accepted"] < stats["num_spec_proposed"]  # a 4-bit draft: some rejected
    if workload in ("preemption", "all-at-once"):
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("workload", ["plain", "all-at-once"])
def test_the_model_as_its_own_draft_has_every_draft_accepted(target, prompts, reference, workload):
    """Only a draft cache that holds the request's exact tokens proposes the target's own argmax every time."""
    got, stats = _generate(target, prompts, speculative={"model": str(target), "num_speculative_tokens": 4},
                           **WORKLOADS[workload])
    assert got == reference
    assert stats["num_spec_proposed"] > 200
    # float32 on one CPU: a near-tie may flip between the draft's batch shapes and the target's
    assert stats["num_spec_accepted"] >= 0.98 * stats["num_spec_proposed"], stats


def test_seeded_samples_and_n_equal_decoding_without_a_draft(target, draft, prompts):
    """Drafts are point masses verified by the rejection rule, so a seeded request's tokens do not depend on
    them (spec_decode's NOTE); n=2 and stop strings go through the same verify path."""
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=11 + i, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, n=2, max_tokens=20, seed=5, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=40, stop=["king"], presence_penalty=0.5))
    chosen = prompts[:7]
    plain, _ = _generate(target, chosen, params)
    spec, stats = _generate(target, chosen, params, speculative={"model": str(draft), "num_speculative_tokens": 3})
    assert stats["num_spec_proposed"] > 0
    assert spec == plain


def test_aborted_requests_leave_no_blocks_and_no_draft_state(target, draft, prompts):
    llm = LLM(target, device="cpu", max_num_seqs=8, disable_log_stats=True,
              speculative={"model": str(draft), "num_speculative_tokens": 3})
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)) for p in prompts[:6]]
    for _ in range(4):
        engine.step()
    assert engine.proposer._sequences  # drafting for the running requests
    for request_id in ids[:3]:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # an idle step after the last finish
    llm.generate(prompts[6], SamplingParams(temperature=0, max_tokens=4))  # a step that forgets the finished
    assert all(s.request.is_finished for s in engine.proposer._sequences.values())
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_config_names_what_to_change(target, tmp_path):
    with pytest.raises(ConfigError, match="needs speculative.model"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="prompt_lookup_max is an n-gram setting"):
        SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    with pytest.raises(ConfigError, match="speculative.model is the draft model of method draft_model, not ngram"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="method"):
        SpeculativeConfig.from_dict({"method": "medusa", "model": "x", "num_speculative_tokens": 2})
    assert SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).prompt_lookup_max == 4
    with pytest.raises(ConfigError, match="speculative.model .*nothing.*: no artifact at .*build one with `llmc build RECIPE`"):
        LLM(target, device="cpu", speculative={"model": str(tmp_path / "nothing"), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="its vocabulary has 4097 tokens, the model's 4096; a draft model must share"):
        LLM(target, device="cpu", speculative={"model": str(_edited(tmp_path, target, vocab_size=4097)),
                                               "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="at most 128 positions, fewer than max_model_len 256; lower max_model_len"):
        LLM(target, device="cpu", max_model_len=256,
            speculative={"model": str(_edited(tmp_path, target, max_position_embeddings=128)), "num_speculative_tokens": 2})


def _edited(tmp_path, target, **model_fields):
    """The target's manifest alone (enough for the checks made before any weight loads), model fields changed
    and the manifest's digest recomputed (sha256 of its sorted compact JSON, as format 1.2 defines it)."""
    import hashlib
    import json

    out = tmp_path / "-".join(model_fields)
    out.mkdir()
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["model"].update(model_fields)
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    manifest["manifest_sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["self", "w4"])
def test_on_cuda_greedy_tokens_equal_and_the_plan_leaves_room(target, draft, prompts, which, free_gpu):
    """On a GPU: the target's measured memory plan leaves room for the draft (weights, graphs, its cache's
    share of each block), both runners replay CUDA graphs, and greedy tokens equal decoding without a draft."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    share = {"gpu_memory_utilization": 0.4}  # two engines in one process: a closed one's memory may stay cached
    with LLM(target, device="cuda", max_num_seqs=8, disable_log_stats=True, **share) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        plain_blocks = plain.engine.runner.num_blocks
    model = target if which == "self" else draft
    with LLM(target, device="cuda", max_num_seqs=8, disable_log_stats=True, **share,
             speculative={"model": str(model), "num_speculative_tokens": 3}) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
        assert llm.engine.runner.num_blocks < plain_blocks  # the draft's share of each block is set aside
        assert llm.engine.proposer.runner.graphs is not None
    assert got == expected
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if which == "self":
        assert stats["num_spec_accepted"] >= 0.98 * stats["num_spec_proposed"] > 0


def _kv_bytes(runner):
    return sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)


def test_on_a_cpu_the_draft_cache_is_inside_cpu_kv_cache_gib(target, draft):
    """cpu_kv_cache_gib is the KV cache's size on a CPU: the draft's cache (the model's block count, the
    draft's bytes per token) is part of it, as the measured GPU plan sets aside the draft's share of each block."""
    gib = 0.02
    llm = LLM(target, device="cpu", disable_log_stats=True, cpu_kv_cache_gib=gib,
              speculative={"model": str(draft), "num_speculative_tokens": 3})
    total = _kv_bytes(llm.engine.runner) + _kv_bytes(llm.engine.proposer.runner)
    assert total <= gib * 2**30, f"{total / 2**30:.4f} GiB of KV cache for cpu_kv_cache_gib {gib}"
    with LLM(target, device="cpu", disable_log_stats=True, cpu_kv_cache_gib=gib) as plain:  # no draft: all of it
        assert _kv_bytes(plain.engine.runner) > 0.9 * gib * 2**30


def test_the_gpu_plan_reserves_the_graphs_the_draft_runner_captures(draft, monkeypatch):
    """The draft runner captures its graphs with its own options (draft_options: weights on the device), so the
    target's plan must set aside their allowance, whatever the target offloads."""
    import dataclasses

    import torch

    from llmc.runtime import artifact as art
    from llmc.runtime import memory, model_runner, spec_draft

    monkeypatch.setattr(model_runner, "can_use_graphs", lambda device, enforce_eager: not enforce_eager)
    monkeypatch.setattr(model_runner, "_num_sms", lambda device: 132)
    manifest = art.read_manifest(draft)
    config = SpeculativeConfig.from_dict({"model": str(draft), "num_speculative_tokens": 3})
    base = art.RuntimeDefaults(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=256, speculative=config)
    device = torch.device("cuda")

    def graph_bytes(options):
        return spec_draft.draft_memory_reserve(draft, manifest, options, device)[0] - spec_draft.draft_memory_reserve(
            draft, manifest, dataclasses.replace(options, enforce_eager=True), device)[0]

    # the draft's weights stay on the device whatever the model offloads: it captures the same graphs
    assert graph_bytes(dataclasses.replace(base, cpu_offload_gb=1.0)) == graph_bytes(base)
    runner_options = spec_draft.draft_options(dataclasses.replace(base, cpu_offload_gb=1.0), 100)
    pieces = memory.prefill_graph_allowance_bytes(manifest.model, runner_options, memory.planned_piece_sizes(runner_options))
    assert pieces > 0
    assert graph_bytes(dataclasses.replace(base, cpu_offload_gb=1.0)) >= pieces


def test_draft_forwards_stay_within_max_num_batched_tokens(target, draft, prompts, reference):
    """DESIGN §5: the draft catches up in forwards of at most max_num_batched_tokens tokens, the size the model's
    memory plan profiles its activations at (and plans its prefill graphs for); a draft no larger than the model
    then fits the memory the plan left. A request's first drafts make the draft catch up on its whole prompt
    (prefix-cache hits included), more than a step's budget."""
    budget = 24
    llm = LLM(target, device="cpu", max_num_seqs=8, disable_log_stats=True, max_num_batched_tokens=budget,
              speculative={"model": str(draft), "num_speculative_tokens": 3})
    runner, sizes = llm.engine.proposer.runner, []
    execute = runner.execute

    def recording(batch, *args, **kwargs):
        sizes.append(batch.num_batched_tokens)
        return execute(batch, *args, **kwargs)

    runner.execute = recording
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [[c.token_ids for c in o.outputs] for o in outputs] == reference
    assert max(sizes) <= budget, f"draft forwards of up to {max(sizes)} tokens, max_num_batched_tokens {budget}"


def test_run_help_shows_the_draft_model_form():
    """`llmc run --help` is where the flag's forms are looked up: the draft model's, not only n-gram's."""
    from click.testing import CliRunner

    from llmc.cli import cli

    result = CliRunner().invoke(cli, ["run", "--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.strip().startswith("--speculative JSON"))
    assert "model" in line and "ngram" in line, line


def test_an_onnx_draft_is_told_to_rebuild_for_the_torch_runtime(target, ref_model_dir, tmp_path):
    """The refusal names what to change for that draft: its target device (an onnx-cpu build has no parallel ranks)."""
    onnx = tmp_path / "onnx"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(onnx), "dtype": "float32",
                            "target": {"device": "onnx-cpu"}, "runtime": {"max_model_len": 256}}), show_progress=False)
    with pytest.raises(ConfigError) as refused:
        LLM(target, device="cpu", speculative={"model": str(onnx), "num_speculative_tokens": 2})
    message = str(refused.value)
    assert "it is onnx-cpu" in message and "target.device cpu or cuda" in message and "parallel" not in message, message
