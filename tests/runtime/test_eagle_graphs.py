"""EAGLE's draft steps over static buffers (runtime/eagle_graphs.py), captured as CUDA graphs on a GPU.

References: the eager `EagleProposer.fill` (the drafts the head's own step-by-step forward gives, and the head cache
it leaves), on the same batch from the same cache; the engine without speculation (greedy tokens); the memory
plan's allowance worked out by hand from its documented terms. On the CPU the graphs' body runs eagerly over the
graphs' buffers (padding rows, dead steps, the block tables as captured), so what a replay computes is checked here,
once through the Triton kernels a GPU runs (in Triton's interpreter); the `gpu` tests replay the captured graphs."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from llmc.runtime import artifact as art
from llmc.runtime import memory, model_runner, spec_eagle
from llmc.runtime.eagle_graphs import DraftInputs, EagleFillGraphs
from llmc.runtime.eagle_head import read_head_config
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.spec_decode import SpeculativeConfig
from tests.runtime.test_spec_draft import _generate, prompts, target  # noqa: F401 (fixtures)
from tests.runtime.test_spec_eagle import (  # noqa: F401 (fixtures)
    REPO, _eagle1, _spec, tiny, trained_head, write_eagle1_head, write_head)

K = 4  # three head steps a fill: dead steps where a request has 1 .. 3 drafts


def _params(n: int) -> list[SamplingParams]:
    """Greedy, max_tokens 3 .. 14: requests near their end have fewer than K drafts beside others with K."""
    return [SamplingParams(temperature=0, max_tokens=3 + (5 * i) % 12, ignore_eos=True) for i in range(n)]


def _check_fills(llm, graphs: EagleFillGraphs) -> dict:
    """Every fill with drafts runs twice from the same head cache: eagerly (graphs off), then through `graphs`; the
    drafts and the head cache's blocks (all but the scratch block) must agree. Returns what the graphs' batches held:
    padding rows, mixed num_drafts, a live draft position starting a new block, and the number of runs."""
    proposer, runner = llm.engine.proposer, llm.engine.runner
    head, num_blocks, bs = proposer.head, runner.num_blocks, runner.block_size
    seen = {"padded": 0, "mixed": 0, "new_block": 0, "runs": 0}
    run, fill = graphs.run, proposer.fill

    def recording_run(first_drafts, hidden, rows):
        seen["runs"] += 1
        seen["padded"] += len(rows) not in graphs.batch_sizes
        seen["mixed"] += len({n for _, _, n in rows}) > 1
        seen["new_block"] += any(s < n and (tokens - 2 + s) % bs == 0 for _, tokens, n in rows for s in range(1, K))
        return run(first_drafts, hidden, rows)

    def checking_fill(batch):
        placeholders = [list(s.draft_token_ids) for s in batch.requests]
        before = [c.clone() for c in head.kv_cache]
        proposer.graphs = None
        fill(batch)
        eager = [list(s.draft_token_ids) for s in batch.requests]
        eager_cache = [c[:num_blocks].clone() for c in head.kv_cache]
        for scheduled, ids in zip(batch.requests, placeholders):
            scheduled.draft_token_ids[:] = ids
        for c, b in zip(head.kv_cache, before):
            c.copy_(b)
        proposer.graphs = graphs
        fill(batch)
        assert [list(s.draft_token_ids) for s in batch.requests] == eager
        for c, e in zip(head.kv_cache, eager_cache):  # a dead step or padding row wrote no request's slot
            # (rounding: the eager steps' matmuls have fewer rows; a wrong slot would differ by its whole value)
            torch.testing.assert_close(c[:num_blocks], e, rtol=1e-4, atol=1e-6 * max(1.0, e.abs().max().item()))

    graphs.run = recording_run
    proposer.fill = checking_fill
    return seen


def test_the_graphs_body_gives_the_eager_fills_drafts_and_head_cache(target, trained_head, prompts):
    """The body over padded buffers (batch sizes 1, 2, 4, 6 for up to 8 requests: 3 and 5 padded, 7 and 8 eager),
    requests with mixed num_drafts (max_tokens runs out; a budget of 40 tokens cuts drafts), draft positions starting a
    new block: the eager fill's drafts, the same head cache outside the scratch block, greedy tokens as without
    speculation and the eager fill's acceptance."""
    def fill_graphs(llm):
        assert llm.engine.proposer.graphs is None  # a CPU: no graphs unless given
        runner = llm.engine.runner
        graphs = EagleFillGraphs(llm.engine.proposer.head, [1, 2, 4, 6], K, 256, runner.block_size, runner.num_blocks,
                                 torch.device("cpu"))
        return graphs, _check_fills(llm, graphs)

    check_body_against_eager(target, trained_head, prompts, K, fill_graphs)


def check_body_against_eager(target, trained_head, prompts, k: int, attach) -> None:
    """12 greedy requests of max_tokens 3 .. 14 (_params) under a 40-token budget, through an EAGLE engine of k
    drafts on the CPU whose graphs' body `attach(llm) -> (graphs, seen)` checks every run against the eager path (_check_fills,
    or the absorb's twin): greedy tokens as without speculation, every case `seen` counts met, one body run per
    check, the eager engine's acceptance, every block free after."""
    chosen, params = prompts[:12], _params(12)
    options = {"max_num_batched_tokens": 40, "num_kv_blocks": 64}
    reference, _ = _generate(target, chosen, params, **options)
    eager, eager_stats = _generate(target, chosen, params, speculative=_spec(trained_head, k), **options)
    assert eager == reference
    llm = LLM(target, device="cpu", max_num_seqs=8, disable_log_stats=True, speculative=_spec(trained_head, k),
              **options)
    graphs, seen = attach(llm)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(chosen, params)]
    stats = llm.stats()
    assert got == reference
    assert all(seen.values()), seen
    assert graphs.num_replays == seen["runs"]
    assert stats["num_spec_accepted"] == eager_stats["num_spec_accepted"] > 0
    assert stats["num_spec_proposed"] == eager_stats["num_spec_proposed"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_an_eagle1_heads_graph_body_gives_the_eager_fills_drafts(tiny, tmp_path):
    """EAGLE-1 (its drafts through the model's own head) on the tiny random model: the same checks."""
    chosen = [f"the king {'and then ' * i}my lord" for i in range(6)]
    params, options = _params(6), {"max_num_batched_tokens": 32, "num_kv_blocks": 40}
    reference, _ = _generate(tiny, chosen, params, **options)
    head = write_eagle1_head(tmp_path / "eagle1", 64, 4096)
    llm = LLM(tiny, device="cpu", max_num_seqs=8, disable_log_stats=True, speculative=_eagle1(head, K), **options)
    runner = llm.engine.runner
    graphs = EagleFillGraphs(llm.engine.proposer.head, [1, 2, 4, 8], K, 256, runner.block_size, runner.num_blocks,
                             torch.device("cpu"))
    seen = _check_fills(llm, graphs)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(chosen, params)] == reference
    assert seen["runs"] > 0 and seen["padded"] > 0 and seen["mixed"] > 0, seen


TRITON_SCRIPT = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import llmc.kernels.attention as attention
attention.can_use_triton = lambda *tensors: True  # the decode kernel with its fused rotary and KV write, interpreted
import torch
from llmc.kernels import attention_triton
from llmc.runtime.eagle_graphs import EagleFillGraphs
from llmc.runtime.llm import LLM
from tests.runtime.test_eagle_graphs import K, _check_fills, _params
bounds = set()
attend = attention_triton.paged_attention
def recording_attend(*args, **kwargs):
    bounds.add(args[8] if len(args) > 8 else kwargs.get("max_context_len"))
    return attend(*args, **kwargs)
attention_triton.paged_attention = recording_attend
artifact, head = sys.argv[1], sys.argv[2]
llm = LLM(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True, num_kv_blocks=24, max_num_batched_tokens=32,
          speculative={"method": "eagle3", "model": head, "num_speculative_tokens": K})
runner = llm.engine.runner
graphs = EagleFillGraphs(llm.engine.proposer.head, [1, 2, 4], K, 256, runner.block_size, runner.num_blocks,
                         torch.device("cpu"))
seen = _check_fills(llm, graphs)
prompts = [f"the king {'and then ' * i}my lord" for i in range(3)]
outputs = llm.generate(prompts, _params(3))
print(json.dumps([seen, 256 in bounds, [o.outputs[0].token_ids for o in outputs]]))
"""


def test_the_graphs_body_through_the_triton_kernels(tiny, tmp_path):
    """The body as a GPU replays it, in Triton's interpreter on the CPU: the decode kernel rotating and writing K/V,
    its split planned for the bound max_model_len (256), padding rows on the scratch slot; each fill's drafts and head
    cache are the eager fill's (whose kernels are bounded by the batch's longest context), greedy tokens as without
    speculation."""
    head = write_head(tmp_path / "head", 64, 4096)
    reference, _ = _generate(tiny, [f"the king {'and then ' * i}my lord" for i in range(3)], _params(3),
                             num_kv_blocks=24, max_num_batched_tokens=32)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(tiny), str(head)], env=env, capture_output=True,
                         text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    seen, bounded, got = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["runs"] > 0 and seen["padded"] > 0 and seen["mixed"] > 0 and bounded, seen
    assert [[t] for t in got] == reference


def test_loaded_rows_dead_steps_and_padding_rows_by_hand():
    """Blocks of 4 tokens, k = 4, scratch block 9, batch size 4, after a batch of 4 left its rows: a request of N = 8
    tokens with 3 drafts in blocks [5, 2, 6] (steps 1 and 2 at positions 7 and 8, the second starting block 6; step
    3 dead), one of N = 5 with 1 draft in blocks [3, 1] (every step dead); rows 2 and 3 padding."""
    inputs = DraftInputs(4, 4, 3, 9, 4, 8, torch.float32, torch.device("cpu"))
    hidden = [torch.full((8,), float(i)) for i in range(4)]
    inputs.load([11, 12, 13, 14], hidden, [([1, 2, 7], 5, 4)] * 4, 4)  # an earlier batch in every row
    inputs.load([21, 22], hidden[2:], [([5, 2, 6], 8, 3), ([3, 1], 5, 1)], 4)
    assert inputs.drafts[:2, 0].tolist() == [21, 22] and inputs.hidden[:2, 0].tolist() == [2.0, 3.0]
    scratch = 9 * 4
    assert inputs.positions[:, :2].tolist() == [[7, 0], [8, 0], [0, 0]]
    assert inputs.slot_mapping.tolist() == [[2 * 4 + 3] + [scratch] * 3, [6 * 4] + [scratch] * 3, [scratch] * 4]
    assert inputs.context_lens.tolist() == [[8, 1, 1, 1], [9, 1, 1, 1], [1, 1, 1, 1]]
    assert inputs.block_tables[:2].tolist() == [[5, 2, 6], [3, 1, 0]]  # padded with block 0, never read
    assert inputs.block_tables[2:, 0].tolist() == [9, 9]  # a padding row attends to the scratch slot it writes


def test_batches_the_graphs_do_not_hold_run_eagerly(target, trained_head):
    """More requests than the largest size, or a block table wider than max_model_len's: can_run says no."""
    llm = LLM(target, device="cpu", max_num_seqs=4, disable_log_stats=True, speculative=_spec(trained_head, K),
              num_kv_blocks=32)
    runner = llm.engine.runner
    graphs = EagleFillGraphs(llm.engine.proposer.head, [1, 2], K, 64, runner.block_size, runner.num_blocks,
                             torch.device("cpu"))
    assert graphs.can_run(2, 4) and not graphs.can_run(3, 4) and not graphs.can_run(1, 5)
    assert graphs.inputs.scratch_block == runner.num_blocks  # the head cache's extra block, no request's
    assert llm.engine.proposer.head.kv_cache[0].shape[0] == runner.num_blocks + 1


def test_the_draft_graphs_allowance_by_hand():
    """An 8B-shaped EAGLE-3 head (hidden 4096, 32 heads of 128, 8 KV heads, MLP 14336, 32000 draft tokens) in bf16,
    k = 3, the decode graphs of max_num_seqs 8 (1, 2, 4, 8), max_model_len 4096, 16-token blocks, 132 SMs."""
    head = spec_eagle.EagleHeadConfig(
        hidden_size=4096, target_hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=None, vocab_size=128256, draft_vocab_size=32000,
        max_position_embeddings=8192, aux_layer_ids=None, norm_before_residual=False)
    sizes = memory.cuda_graph_batch_sizes(8)
    assert sizes == [1, 2, 4, 8]
    nodes = 4 * 2 * 768 * 1024  # 4 graphs of 2 one-layer steps
    static = 8 * (8 * 3 + 2 * (8 + 8 + 4) + 4096 * 2 + 256 * 4)  # drafts, per-step inputs, hidden, block table row
    # x, its norms and the concatenated input (4 x hidden) and the widest of q/k/v + output (10240) or the MLP
    # (3 x 14336), bf16; float32 logits over the draft vocabulary
    intermediates = 8 * ((4 * 4096 + 3 * 14336) * 2 + 32000 * 4)
    # 8 rows x 8 KV heads = 64 programs: partitions halve 512 -> 64 keys (64 partitions of 4096 keys, the most),
    # float32 (acc, m, l) per head: 8 rows x 64 partitions x 32 heads x (128 + 2) x 4 bytes
    split = 8 * 64 * 32 * 130 * 4
    scratch = 16 * 2 * 8 * 128 * 2  # one block of K and V
    assert memory.draft_graph_allowance_bytes(head, 2, sizes, 3, 4096, 16, 132) == (
        nodes + static + intermediates + split + scratch) == 16_925_184
    assert memory.draft_graph_allowance_bytes(head, 2, sizes, 1, 4096, 16, 132) == 0  # k = 1: no head step
    assert memory.draft_graph_allowance_bytes(head, 2, [], 3, 4096, 16, 132) == 0


def test_the_memory_plan_holds_back_the_draft_graphs(target, trained_head, monkeypatch):
    """eagle_memory_reserve on a GPU: the head's weights, and the draft (and absorb) graphs' allowances at the decode
    graphs' sizes where they are captured (not under enforce_eager, cudagraph_mode NONE or PIECEWISE)."""
    monkeypatch.setattr(model_runner, "can_use_graphs", lambda device, enforce_eager: not enforce_eager)
    monkeypatch.setattr(spec_eagle, "device_num_sms", lambda device: 132)
    manifest, device = art.read_manifest(target), torch.device("cuda")
    head = read_head_config(trained_head, "head")
    config = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(trained_head), "num_speculative_tokens": 3})
    base = art.RuntimeDefaults(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, speculative=config)
    weights = (trained_head / "model.safetensors").stat().st_size

    def reserve(**changes):
        return spec_eagle.eagle_memory_reserve(trained_head, head, manifest, dataclasses.replace(base, **changes),
                                               device)[0]

    sizes = model_runner.planned_graph_sizes(manifest, base, device)[0]
    assert sizes[-1] == 8
    absorb = memory.absorb_graph_allowance_bytes(head, 4, sizes, 3, 256, 16)  # test_eagle_absorb_graphs.py
    assert reserve() == weights + memory.draft_graph_allowance_bytes(head, 4, sizes, 3, 256, 16, 132) + absorb > weights
    assert reserve(enforce_eager=True) == weights
    for mode in ("NONE", "PIECEWISE"):
        assert reserve(compilation_config=art.CompilationConfig(cudagraph_mode=mode)) == weights


@pytest.mark.gpu
def test_on_cuda_the_graphed_fill_gives_the_eager_fills_drafts(target, trained_head, prompts, free_gpu):
    """The captured graphs replayed: the eager fill's drafts from the same head cache (float32), greedy tokens as
    without speculation."""
    chosen, params = prompts[:12], _params(12)
    # a small cache: each fill clones the head's
    options = {"max_num_seqs": 8, "disable_log_stats": True, "gpu_memory_utilization": 0.4,
               "max_num_batched_tokens": 40, "num_kv_blocks": 256}
    with LLM(target, device="cuda", **options) as plain:
        reference = [[c.token_ids for c in o.outputs] for o in plain.generate(chosen, params)]
    with LLM(target, device="cuda", speculative=_spec(trained_head, K), **options) as llm:
        graphs = llm.engine.proposer.graphs
        assert graphs is not None and graphs.graphs  # captured
        assert graphs.batch_sizes == llm.engine.runner.graphs.batch_sizes
        seen = _check_fills(llm, graphs)
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(chosen, params)]
        stats = llm.stats()
    assert got == reference
    assert seen["runs"] > 0 and seen["padded"] > 0 and seen["mixed"] > 0, seen
    assert 0 < stats["num_spec_accepted"] < stats["num_spec_proposed"]
