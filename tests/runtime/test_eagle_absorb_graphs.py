"""EAGLE's absorb of decode verify steps over static buffers (runtime/eagle_absorb_graphs.py), CUDA graphs on a GPU.

References: the eager `EagleProposer.absorb` (the head's own forward over the step's rows: the first drafts and kept
hidden states it leaves, and the head cache), on the same step from the same cache and states; the engine without
speculation (greedy tokens); the buffers and the memory plan's allowance worked out by hand. On the CPU the graphs'
body runs eagerly over the graphs' buffers (dead rows, padding requests, the prefill index as captured), so what a
replay computes is checked here; the `gpu` test replays the captured graphs."""

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from llmc.runtime import artifact as art
from llmc.runtime import memory, model_runner, spec_eagle
from llmc.runtime.eagle_absorb_graphs import AbsorbInputs, EagleAbsorbGraphs
from llmc.runtime.eagle_head import read_head_config
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.spec_decode import SpeculativeConfig
from tests.runtime.test_eagle_graphs import _params, check_body_against_eager
from tests.runtime.test_spec_draft import _generate, prompts, target  # noqa: F401 (fixtures)
from tests.runtime.test_spec_eagle import (  # noqa: F401 (fixtures)
    REPO, _eagle1, _spec, tiny, trained_head, write_eagle1_head)

K = 3  # up to 4 rows a request: accepted counts 0 .. 3, and requests near their end with fewer drafts


def _absorb_graphs(llm, sizes: list[int]) -> EagleAbsorbGraphs:
    proposer, runner = llm.engine.proposer, llm.engine.runner
    model = runner.model
    return EagleAbsorbGraphs(proposer.head, sizes, K, model.aux_width(), model.embed.weight.dtype, 256,
                             runner.block_size, runner.num_blocks, torch.device("cpu"))


def _check_absorbs(llm, graphs: EagleAbsorbGraphs) -> dict:
    """Every absorb runs twice from the same head cache and states: eagerly (graphs off), then with `graphs`; the first
    drafts (exactly), the kept hidden states and the head cache's blocks (all but the scratch block) must agree.
    Returns what the graphs' steps held: padding requests, mixed accepted counts, rejected drafts, a request with fewer
    drafts than K, a live row starting a new block, and the number of runs."""
    proposer, runner = llm.engine.proposer, llm.engine.runner
    head, num_blocks, bs = proposer.head, runner.num_blocks, runner.block_size
    seen = {"padded": 0, "mixed": 0, "rejected": 0, "all_accepted": 0, "fewer_drafts": 0, "new_block": 0, "runs": 0}
    run, absorb = graphs.run, proposer.absorb

    def recording_run(aux, rows):
        seen["runs"] += 1
        seen["padded"] += len(rows) not in graphs.batch_sizes
        seen["mixed"] += len({len(after) for _, _, after, _ in rows}) > 1
        seen["new_block"] += any((start + j) % bs == 0 for _, start, after, _ in rows for j in range(1, len(after)))
        return run(aux, rows)

    def checking_absorb(batch, new_tokens):
        flags = {"fewer_drafts": 0, "rejected": 0, "all_accepted": 0}  # counted where the graphs' body ran
        for s in batch.requests:
            drafts, accepted = len(s.draft_token_ids), len(new_tokens.get(s.request.request_id, [])) - 1
            flags["fewer_drafts"] += 0 < drafts < graphs.k
            flags["rejected"] += accepted < drafts
            flags["all_accepted"] += 0 < drafts == accepted
        runs = seen["runs"]
        before_cache, before_states = [c.clone() for c in head.kv_cache], dict(proposer._states)
        proposer.absorb_graphs = None
        absorb(batch, new_tokens)
        eager_cache, eager_states = [c[:num_blocks].clone() for c in head.kv_cache], dict(proposer._states)
        for c, b in zip(head.kv_cache, before_cache):
            c.copy_(b)
        proposer._states = before_states
        proposer.absorb_graphs = graphs
        absorb(batch, new_tokens)
        if seen["runs"] > runs:
            for key, count in flags.items():
                seen[key] += count
        assert proposer._states.keys() == eager_states.keys()
        for rid, state in proposer._states.items():
            eager = eager_states[rid]
            assert (state.request, state.num_tokens, state.num_preemptions, state.draft) == (
                eager.request, eager.num_tokens, eager.num_preemptions, eager.draft)
            torch.testing.assert_close(state.hidden, eager.hidden, rtol=1e-4, atol=1e-5)
        for c, e in zip(head.kv_cache, eager_cache):  # a dead row wrote no request's slot
            # (rounding: the eager forward's matmuls have fewer rows; a wrong slot would differ by its whole value)
            torch.testing.assert_close(c[:num_blocks], e, rtol=1e-4, atol=1e-6 * max(1.0, e.abs().max().item()))

    graphs.run = recording_run
    proposer.absorb = checking_absorb
    return seen


def test_the_absorb_body_gives_the_eager_absorbs_drafts_states_and_head_cache(target, trained_head, prompts):
    """The body over padded buffers (batch sizes 1, 2, 4, 6 for up to 8 requests: 3 and 5 padded, 7 and 8 eager), on
    the shipped head: accepted counts 0 .. K, requests with fewer drafts than K (max_tokens runs out; a budget of 40
    tokens cuts drafts), live rows starting a new block: the eager absorb's first drafts, kept hidden states and head
    cache; greedy tokens as without speculation and the eager engine's acceptance."""
    def absorb_graphs(llm):
        assert llm.engine.proposer.absorb_graphs is None  # a CPU: no graphs unless given
        graphs = _absorb_graphs(llm, [1, 2, 4, 6])
        return graphs, _check_absorbs(llm, graphs)

    check_body_against_eager(target, trained_head, prompts, K, absorb_graphs)


def test_the_forced_path_keeps_greedy_outputs(target, trained_head, prompts):
    """The engine with the absorb graphs' body in place of every decode verify step's absorb (k = 1 and K, one size
    holding every batch): greedy tokens as without speculation, the same acceptance as the eager absorb's."""
    chosen = prompts[:8]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference, _ = _generate(target, chosen, params)
    for k in (1, K):
        _, eager_stats = _generate(target, chosen, params, speculative=_spec(trained_head, k))
        llm = LLM(target, device="cpu", max_num_seqs=8, disable_log_stats=True, speculative=_spec(trained_head, k))
        proposer, runner = llm.engine.proposer, llm.engine.runner
        proposer.absorb_graphs = EagleAbsorbGraphs(proposer.head, [8], k, runner.model.aux_width(),
                                                   runner.model.embed.weight.dtype, 256, runner.block_size,
                                                   runner.num_blocks, torch.device("cpu"))
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(chosen, params)]
        assert got == reference, k
        assert proposer.absorb_graphs.num_replays > 0 and proposer.num_unprepared == 0
        assert llm.stats()["num_spec_accepted"] == eager_stats["num_spec_accepted"] > 0


def test_an_eagle1_heads_absorb_body_gives_the_eager_absorbs_drafts(tiny, tmp_path):
    """EAGLE-1 (the model's final hidden states as the aux rows, drafts through the model's own head) on the tiny
    random model: the same checks (a random head's drafts are rejected: one live row a request)."""
    chosen = [f"the king {'and then ' * i}my lord" for i in range(6)]
    params, options = _params(6), {"max_num_batched_tokens": 32, "num_kv_blocks": 40}
    reference, _ = _generate(tiny, chosen, params, **options)
    head = write_eagle1_head(tmp_path / "eagle1", 64, 4096)
    llm = LLM(tiny, device="cpu", max_num_seqs=8, disable_log_stats=True, speculative=_eagle1(head, K), **options)
    seen = _check_absorbs(llm, _absorb_graphs(llm, [1, 2, 4, 8]))
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(chosen, params)] == reference
    assert seen["runs"] > 0 and seen["padded"] > 0 and seen["rejected"] > 0, seen


def test_loaded_rows_dead_rows_and_prefill_index_by_hand():
    """Blocks of 4 tokens, k = 2 (3 rows a request), scratch block 9, batch size 4, 4 query heads over 2 KV heads (32
    queries a prefill block), after a batch of 4 left its rows: a request with 7 computed tokens in blocks [5, 2, 6]
    and 3 live rows (positions 7, 8, 9; 8 starts block 6), its aux rows from 0; one with 4 in blocks [3, 1] and 1 live
    row (position 4), its aux row 3; rows 4 .. 11 dead."""
    config = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=16)
    head = SimpleNamespace(config=config, kv_cache=(torch.zeros(1),))
    inputs = AbsorbInputs(head, 4, 2, 48, torch.float32, 3, 9, 4, torch.device("cpu"))
    inputs.load([([1, 2, 7], 5, [1, 2, 3], 0)] * 4, 4)  # an earlier batch in every request's rows
    inputs.load([([5, 2, 6], 7, [31, 32, 33], 0), ([3, 1], 4, [41], 3)], 4)
    scratch = 9 * 4
    assert inputs.input_ids.tolist() == [31, 32, 33, 41] + [0] * 8
    assert inputs.positions.tolist() == [7, 8, 9, 4] + [0] * 8
    assert inputs.slot_mapping.tolist() == [2 * 4 + 3, 6 * 4, 6 * 4 + 1, 1 * 4] + [scratch] * 8
    assert inputs.aux_index.tolist() == [0, 1, 2, 3] + [0] * 8
    assert inputs.keep[:2].tolist() == [2, 3]
    assert inputs.context_lens.tolist() == [10, 5, 8, 8, 0]  # sequences 2, 3: no query; 4: the padding sequence
    assert inputs.block_tables[:2].tolist() == [[5, 2, 6], [3, 1, 0]]
    # query lens | first rows (5 sequences) | block sequences | block starts (12 // 32 + 4 = 4 blocks)
    assert inputs.index.tolist() == [3, 1, 0, 0, 0, 0, 3, 0, 0, 0, 0, 1, 4, 4, 0, 0, 0, 0]
    batch = inputs.batch(2)  # size 2: 6 rows, 6 // 32 + 2 = 2 blocks
    assert batch.prefill_index.block_seqs.tolist() == [0, 1] and batch.num_tokens == 6
    assert batch.prefill_index.pad_seq == 4


def test_batches_the_absorb_graphs_do_not_hold_run_eagerly(target, trained_head):
    """More requests than the largest size, more than k + 1 rows, a block table wider than max_model_len's, a context
    past MAX_CONTEXT (2048), or aux rows of another dtype: can_run says no."""
    llm = LLM(target, device="cpu", max_num_seqs=4, disable_log_stats=True, speculative=_spec(trained_head, K),
              num_kv_blocks=32)
    graphs = _absorb_graphs(llm, [1, 2])
    aux = torch.zeros(4, llm.engine.runner.model.aux_width())
    row = ([1] * 16, 3, [5] * (K + 1), 0)
    assert graphs.can_run(aux, [row, row]) and not graphs.can_run(aux, [row] * 3)
    assert not graphs.can_run(aux, [([1], 3, [5] * (K + 2), 0)]) and not graphs.can_run(aux, [([1] * 17, 3, [5], 0)])
    assert not graphs.can_run(aux.double(), [row])
    wide = EagleAbsorbGraphs(llm.engine.proposer.head, [1], K, aux.shape[1], aux.dtype, 4096, 16, 32,
                             torch.device("cpu"))
    assert wide.max_context_len == 2048
    assert wide.can_run(aux, [([1] * 128, 2044, [5] * 4, 0)]) and not wide.can_run(aux, [([1] * 128, 2045, [5] * 4, 0)])


def _head_8b() -> spec_eagle.EagleHeadConfig:
    return spec_eagle.EagleHeadConfig(
        hidden_size=4096, target_hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=None, vocab_size=128256, draft_vocab_size=32000,
        max_position_embeddings=8192, aux_layer_ids=None, norm_before_residual=False)


def test_the_absorb_graphs_allowance_by_hand():
    """An 8B-shaped EAGLE-3 head (hidden 4096, 32 heads of 128, 8 KV heads, MLP 14336, 32000 draft tokens) in bf16,
    k = 3, the decode graphs of max_num_seqs 8 (1, 2, 4, 8), max_model_len 4096, 16-token blocks."""
    head, sizes = _head_8b(), [1, 2, 4, 8]
    nodes = 4 * 768 * 1024  # 4 graphs of one layer
    rows = 8 * 4  # k + 1 rows for each of 8 requests
    # ids, positions, slots, aux index (int64); the aux rows (3 x 4096) and the attention output (32 x 128), bf16;
    # 9 block-table rows of 256 blocks and context lengths; the index: 2 x 9 + 2 x (32 // 16 + 8) int32; per request
    # its kept row, draft (int64) and hidden state
    static = rows * (4 * 8 + (12288 + 4096) * 2) + 9 * (256 * 4 + 4) + (18 + 20) * 4 + 8 * (8 + 8 + 4096 * 2)
    # fc's output, x, its norms and the concatenated input (5 x hidden) and the MLP's 3 x 14336 (wider than q/k/v +
    # output, 10240) over the rows; the kept rows and their float32 logits over the draft vocabulary
    intermediates = rows * (5 * 4096 + 3 * 14336) * 2 + 8 * (4096 * 2 + 32000 * 4)
    assert memory.absorb_graph_allowance_bytes(head, 2, sizes, 3, 4096, 16) == (
        nodes + static + intermediates) == 9_423_164
    # k = 1 (no draft graphs): 2 rows a request, 16 // 16 + 8 = 9 blocks, and the head cache's scratch block
    rows = 8 * 2
    static = rows * (4 * 8 + (12288 + 4096) * 2) + 9 * (256 * 4 + 4) + (18 + 18) * 4 + 8 * (8 + 8 + 4096 * 2)
    intermediates = rows * (5 * 4096 + 3 * 14336) * 2 + 8 * (4096 * 2 + 32000 * 4)
    scratch = 16 * 2 * 8 * 128 * 2
    assert memory.absorb_graph_allowance_bytes(head, 2, sizes, 1, 4096, 16) == nodes + static + intermediates + scratch
    assert memory.absorb_graph_allowance_bytes(head, 2, [], 3, 4096, 16) == 0


def test_the_memory_plan_holds_back_the_absorb_graphs(target, trained_head, monkeypatch):
    """eagle_memory_reserve on a GPU: the head's weights, the draft graphs' and the absorb graphs' allowances at the
    decode graphs' sizes where they are captured (k = 1 too: no draft graphs), not under enforce_eager."""
    monkeypatch.setattr(model_runner, "can_use_graphs", lambda device, enforce_eager: not enforce_eager)
    monkeypatch.setattr(spec_eagle, "device_num_sms", lambda device: 132)
    manifest, device = art.read_manifest(target), torch.device("cuda")
    head = read_head_config(trained_head, "head")
    weights = (trained_head / "model.safetensors").stat().st_size
    for k in (1, 3):
        config = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(trained_head),
                                              "num_speculative_tokens": k})
        base = art.RuntimeDefaults(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, speculative=config)
        sizes = model_runner.planned_graph_sizes(manifest, base, device)[0]
        reserve = spec_eagle.eagle_memory_reserve(trained_head, head, manifest, base, device)[0]
        assert reserve == (weights + memory.draft_graph_allowance_bytes(head, 4, sizes, k, 256, 16, 132)
                           + memory.absorb_graph_allowance_bytes(head, 4, sizes, k, 256, 16))
        assert memory.absorb_graph_allowance_bytes(head, 4, sizes, k, 256, 16) > 0
        eager = spec_eagle.eagle_memory_reserve(trained_head, head, manifest,
                                                dataclasses.replace(base, enforce_eager=True), device)[0]
        assert eager == weights


@pytest.mark.gpu
def test_on_cuda_the_graphed_absorb_gives_the_eager_absorbs_drafts(target, trained_head, prompts, free_gpu):
    """The captured graphs replayed (k = 1 and K): the eager absorb's first drafts, kept hidden states and head cache
    from the same state (float32), greedy tokens as without speculation."""
    chosen, params = prompts[:12], _params(12)
    options = {"max_num_seqs": 8, "disable_log_stats": True, "gpu_memory_utilization": 0.4,
               "max_num_batched_tokens": 40, "num_kv_blocks": 256}
    with LLM(target, device="cuda", **options) as plain:
        reference = [[c.token_ids for c in o.outputs] for o in plain.generate(chosen, params)]
    padded = 0
    for k in (1, K):
        with LLM(target, device="cuda", speculative=_spec(trained_head, k), **options) as llm:
            graphs = llm.engine.proposer.absorb_graphs
            assert graphs is not None and graphs.graphs  # captured
            assert graphs.batch_sizes == llm.engine.runner.graphs.batch_sizes
            seen = _check_absorbs(llm, graphs)
            got = [[c.token_ids for c in o.outputs] for o in llm.generate(chosen, params)]
            stats = llm.stats()
        assert got == reference, k
        assert seen["runs"] > 0 and seen["mixed"] > 0, seen
        assert 0 < stats["num_spec_accepted"] < stats["num_spec_proposed"]
        padded += seen["padded"]
    # (which batch sizes the decode verify steps hit is the workload's: at k = 1 an H200 run hit only 1, 2, 4, 8)
    assert padded > 0


TRITON_SCRIPT = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import llmc.kernels.attention as attention
attention.can_use_triton = lambda *tensors: True  # the rotary write and the indexed prefill kernel, interpreted
import torch
from llmc.kernels import attention_triton
from llmc.runtime.eagle_absorb_graphs import EagleAbsorbGraphs
from llmc.runtime.llm import LLM
from tests.runtime.test_eagle_absorb_graphs import K, _check_absorbs, _params
indexed = []
attend = attention_triton.paged_attention
def recording_attend(*args, **kwargs):
    indexed.append(kwargs.get("prefill_index") is not None)
    return attend(*args, **kwargs)
attention_triton.paged_attention = recording_attend
artifact, head = sys.argv[1], sys.argv[2]
llm = LLM(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True, num_kv_blocks=24, max_num_batched_tokens=32,
          speculative={"method": "eagle3", "model": head, "num_speculative_tokens": K})
proposer, runner = llm.engine.proposer, llm.engine.runner
graphs = EagleAbsorbGraphs(proposer.head, [1, 2, 4], K, runner.model.aux_width(), runner.model.embed.weight.dtype, 256,
                           runner.block_size, runner.num_blocks, torch.device("cpu"))
seen = _check_absorbs(llm, graphs)
prompts = [f"the king {'and then ' * i}my lord" for i in range(3)]
outputs = llm.generate(prompts, _params(3))
print(json.dumps([seen, any(indexed), [o.outputs[0].token_ids for o in outputs]]))
"""


def test_the_absorb_body_through_the_triton_kernels(target, trained_head):
    """The body as a GPU replays it, in Triton's interpreter on the CPU (the shipped head, whose drafts are accepted in
    part): the rotary K/V write (dead rows on the scratch slot), the prefill kernel reading its sequences from the
    PrefillIndex; each absorb's drafts, states and head cache are the eager absorb's, greedy tokens as without
    speculation."""
    reference, _ = _generate(target, [f"the king {'and then ' * i}my lord" for i in range(3)], _params(3),
                             num_kv_blocks=24, max_num_batched_tokens=32)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(target), str(trained_head)], env=env,
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    seen, indexed, got = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["runs"] > 0 and seen["padded"] > 0 and seen["mixed"] > 0 and indexed, seen
    assert [[t] for t in got] == reference
