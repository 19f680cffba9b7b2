"""The memory plan holds what DeepSeek's latent MLA kernel allocates for its split (kernels/mla_attention_triton.py):
per (partition, row, head) a float32 partial of kv_lora_rank (512) values, not head_dim, and its merge by torch ops.
The kernel's allocation is measured, not restated: its Python wrapper runs on meta tensors with the Triton launch
stubbed out, the split it would choose on CUDA given, and every tensor the call allocates is tracked until freed (a
CUDA graph's pool keeps that peak). The shapes are DeepSeek-V2-Lite's and V3's, at the batch sizes and contexts the
graphs are captured for; and one decode step of the latent attention module, measured the same way, against the
activation and split shares of its graph's allowance."""

import functools
import os

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from llmc.quant.formats import DenseFormat
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.memory import GIB
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.parallel.layout import all_rank_layouts

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

V2_LITE = art.ModelConfig(
    family="deepseek_v2", architecture="DeepseekV2ForCausalLM", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192, rms_norm_eps=1e-6,
    rope_theta=1e4, rope_scaling=None, max_position_embeddings=163840, tie_word_embeddings=False,
    attention_bias=False, qk_norm=False, bos_token_id=100000, eos_token_ids=[100001], dtype="bfloat16",
    num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, moe_layers=list(range(1, 27)),
    shared_expert_intermediate_size=2816, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
V3 = art.ModelConfig(
    family="deepseek_v3", architecture="DeepseekV3ForCausalLM", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192, rms_norm_eps=1e-6,
    rope_theta=1e4, rope_scaling=None, max_position_embeddings=163840, tie_word_embeddings=False,
    attention_bias=False, qk_norm=False, bos_token_id=0, eos_token_ids=[1], dtype="bfloat16",
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, moe_layers=list(range(3, 61)),
    shared_expert_intermediate_size=2048, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128,
)
MODELS = {"v2-lite": V2_LITE, "v3": V3}


class _PeakBytes(TorchDispatchMode):
    """The most bytes of tensors allocated under it that are alive at once: every op's new (non-aliasing) outputs,
    each counted until its storage is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.live.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        self.peak = max(self.peak, sum(n for _, n in self.live))
        return out


class _NoLaunch:
    """The Triton kernel's launcher, launching nothing (only the wrapper's own allocations are measured)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@functools.cache
def kernel_split_bytes(num_rows: int, num_heads: int, max_context_len: int, num_sms: int) -> int:
    """The peak bytes mla_absorbed_attention allocates for num_rows rows of num_heads heads (bf16, kv_lora_rank 512,
    rope 64) where it splits max_context_len keys on num_sms SMs; 0 where it does not (its only tensor is then the
    output, the layer's activation)."""
    import llmc.kernels.mla_attention_triton as mt

    # the split the kernel chooses on CUDA (off CUDA it forces none): its own function over its (row, head block) grid
    partitions = mt.num_partitions(num_rows * -(-num_heads // mt.BLOCK_H), max_context_len, num_sms)
    if partitions == 1:
        return 0
    meta = dict(dtype=torch.bfloat16, device="meta")
    q_lat, q_pe = torch.empty(num_rows, num_heads, 512, **meta), torch.empty(num_rows, num_heads, 64, **meta)
    cache = torch.empty(4, 16, 576, **meta)
    tables = torch.zeros(num_rows, 1, dtype=torch.int32, device="meta")
    rows = torch.zeros(num_rows, dtype=torch.int32, device="meta")
    launcher, mt._mla_kernel = mt._mla_kernel, _NoLaunch()
    try:
        with _PeakBytes() as tracked:
            out = mt.mla_absorbed_attention(q_lat, q_pe, cache, tables, rows, rows, 0.1, 1.0, max_context_len,
                                            partitions=partitions)
    finally:
        mt._mla_kernel = launcher
    assert out.shape == (num_rows, num_heads, 512) and out.dtype == torch.bfloat16
    return tracked.peak


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_sms", [132, 78])
def test_the_decode_graphs_allowance_holds_the_mla_split(name, num_sms):
    """The decode graphs are captured at max_model_len, each size splitting as the kernel does for it; the allowance
    grows by the split's buffers (the allowance at a max_model_len of 64 keys, which nothing splits, taken away) at
    least as much as the largest split the kernel allocates at any planned size, and by little more. A
    tensor-parallel rank (parallel/shard_runner.py passes its layout) splits its own share of the heads: more rows
    split, of fewer heads each."""
    model = MODELS[name]
    for tp in (1, 2, 4, 8):
        layout = all_rank_layouts(model, art.ParallelPlan(tensor=tp, stage_layers=[list(range(model.num_layers))]))[0]
        assert layout.num_heads == model.num_heads // tp
        for max_num_seqs in (1, 8, 20, 32, 256, 512):
            sizes = memory.cuda_graph_batch_sizes(max_num_seqs)
            for max_model_len in (2048, 8192, 163840):
                # (blocks of max_model_len tokens: the graphs' block tables are the same one column in both)
                planned = (memory.graph_allowance_bytes(model, sizes, max_model_len, num_sms, layout, max_model_len)
                           - memory.graph_allowance_bytes(model, sizes, 64, num_sms, layout, max_model_len))
                kernel = max(kernel_split_bytes(size, layout.num_heads, max_model_len, num_sms) for size in sizes)
                assert kernel > 0  # every case splits at its smallest size
                assert kernel <= planned <= 1.01 * kernel, (tp, max_num_seqs, max_model_len)


def test_the_split_estimate_is_the_kernels_allocation_size_by_size():
    """decode_split_bytes, per number of rows: what the kernel allocates, to within 1% (0 where it does not split:
    V2-Lite's 16 heads are one program a row, V3's 128 eight, and 264 programs fill 132 SMs)."""
    for model in MODELS.values():
        for rows in (1, 2, 7, 16, 32, 33, 100, 263, 264):
            kernel = kernel_split_bytes(rows, model.num_heads, 32768, 132)
            planned = memory.decode_split_bytes(model, rows, 32768, 132)
            assert kernel <= planned <= 1.01 * kernel
            assert (kernel == 0) == (rows * model.num_heads // 16 >= 264)


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_the_whole_forward_graphs_allowance_holds_the_mla_split(mode):
    """A whole-forward graph (cudagraph_mode FULL, or speculative verify steps beside piecewise graphs) runs each of
    its token rows through the absorbed kernel at the graphs' context bound (mixed_graphs.MAX_CONTEXT): its
    allowance on 132 SMs less its allowance on one (where no captured size splits) holds the largest split."""
    from llmc.runtime.mixed_graphs import MAX_CONTEXT

    speculative = art.SpeculativeConfig(method="ngram", num_speculative_tokens=3) if mode != "FULL" else None
    for model in MODELS.values():
        for max_model_len in (1024, 32768):
            runtime = art.RuntimeDefaults(max_model_len=max_model_len, speculative=speculative,
                                          compilation_config=art.CompilationConfig(mode))
            sizes = memory.planned_piece_sizes(runtime)
            planned = (memory.prefill_graph_allowance_bytes(model, runtime, sizes, 132)
                       - memory.prefill_graph_allowance_bytes(model, runtime, sizes, 1))
            bound = min(max_model_len, MAX_CONTEXT)
            kernel = max(kernel_split_bytes(size, model.num_heads, bound, 132) for size in sizes)
            assert 0 < kernel <= planned <= 1.01 * kernel


def test_an_eager_split_fits_in_the_activation_allowance():
    """Eager steps (enforce_eager, the start-up forwards of eager_decode_cases, steps the graphs do not take) split as
    for their longest context, outside any graph: the activation term, one forward of max_num_batched_tokens,
    holds a step of fewer rows with its split (V2-Lite's and V3's shapes, 128K contexts, the budgets named)."""
    for model in MODELS.values():
        for max_num_batched_tokens in (256, 2048, 8192):
            for max_num_seqs in (1, 8, 64, 256):
                allowance = memory.activation_peak_bytes(model, max_num_batched_tokens,
                                                         min(max_num_seqs, max_num_batched_tokens))
                for rows in {1, 8, 33, 132, 263} & set(range(1, min(max_num_seqs, max_num_batched_tokens) + 1)):
                    step = memory.activation_peak_bytes(model, rows, rows) + kernel_split_bytes(
                        rows, model.num_heads, 131072, 132)
                    assert step <= allowance


def test_a_decode_graph_step_of_the_latent_attention_fits_its_allowance(monkeypatch):
    """One decode step of a layer's MLAttention as a CUDA graph captures it (runtime/models/mla.py on meta tensors:
    the absorbed kernel's wrapper with its launch stubbed, split as on 132 SMs at max_model_len 32768): what it
    allocates, with the residual and hidden states it reads, stays within the graph allowance of that one batch size
    less its fixed shares (what is left: the largest graph's activations and the split): q, its latent, the
    kernel's output latent and that times W_UV live at once (memory.mla_attention_per_token; V3's exceeded its MoE's
    per-token estimate, which bounded it before), besides the split's buffers."""
    import llmc.kernels.mla_attention as mla_attention
    import llmc.kernels.mla_attention_triton as mt
    from llmc.runtime.models.mla import MLAttention

    def split_as_on_cuda(q_lat, q_pe, cache, tables, row_seq, row_limit, scale, kv_scale, max_context_len):
        partitions = mt.num_partitions(q_lat.shape[0] * -(-q_lat.shape[1] // mt.BLOCK_H), max_context_len, 132)
        return absorbed(q_lat, q_pe, cache, tables, row_seq, row_limit, scale, kv_scale, max_context_len, partitions)

    absorbed = mt.mla_absorbed_attention
    monkeypatch.setattr(mla_attention, "can_use_triton", lambda *tensors: True)
    monkeypatch.setattr(mt, "_mla_kernel", _NoLaunch())
    monkeypatch.setattr(mt, "mla_absorbed_attention", split_as_on_cuda)
    meta = dict(dtype=torch.bfloat16, device="meta")
    max_model_len = 32768
    for model in MODELS.values():
        names = ("q", "q_a", "q_b", "kv_a", "kv_b", "o")
        formats = {f"layers.0.attn.{name}": DenseFormat(torch.bfloat16) for name in names}
        attn = MLAttention(model, formats, 0, torch.bfloat16).to("meta")
        heads = model.num_heads
        attn.w_uk = torch.empty(heads, model.qk_nope_head_dim, model.kv_lora_rank, **meta)
        attn.w_uv = torch.empty(heads, model.v_head_dim, model.kv_lora_rank, **meta)
        attn.kv_cache = (torch.empty(8, 16, model.kv_lora_rank + model.qk_rope_head_dim, **meta),)
        cos_sin = torch.empty(64, model.qk_rope_head_dim, dtype=torch.float32, device="meta")
        for rows in (1, 8, 32, 256):
            index = dict(dtype=torch.int32, device="meta")
            batch = ForwardBatch(
                positions=torch.zeros(rows, dtype=torch.long, device="meta"),
                slot_mapping=torch.zeros(rows, dtype=torch.long, device="meta"),
                block_tables=torch.zeros(rows, 1, **index), context_lens=torch.ones(rows, **index),
                query_lens=[1] * rows, max_context_len=max_model_len,
                logits_indices=torch.zeros(rows, dtype=torch.long, device="meta"))
            x = torch.empty(rows, model.hidden_size, **meta)
            with _PeakBytes() as tracked:
                out = attn(x, batch, cos_sin)
            assert out.shape == (rows, model.hidden_size)
            step = tracked.peak + 2 * x.nbytes  # and the residual and hidden states
            allowance = (memory.graph_allowance_bytes(model, [rows], max_model_len)
                         - memory.GRAPH_BASE_BYTES - model.num_layers * memory.GRAPH_BYTES_PER_GRAPH_LAYER)
            assert step <= allowance + 4 * rows, (model.family, rows)  # (the rows' int32 index: the base's share)


def expanded_peak_bytes(num_queries: int, context_len: int, num_heads: int, cache_dtype=torch.bfloat16) -> int:
    """The peak bytes mla_attention.expanded_attention allocates for one sequence of num_queries queries over
    context_len keys (bf16, DeepSeek's 128 + 64 q/k dims, 128 v, latent 512 + 64, blocks of 16; a dense kv_b), its
    CUDA route on meta tensors (torch's memory-efficient kernel's meta function: its output and padded log-sum-exp),
    the returned output included, q and the cache not."""
    import llmc.kernels.mla_attention as mla_attention

    meta = dict(dtype=torch.bfloat16, device="meta")
    blocks = -(-context_len // 16)
    cache = torch.empty(blocks, 16, 576, device="meta", dtype=cache_dtype)
    tables = torch.zeros(1, blocks, dtype=torch.int32, device="meta")
    q = torch.empty(num_queries, num_heads, 192, **meta)
    kv_b = torch.empty(num_heads * 256, 512, **meta)

    def expand(c_kv):
        return torch.nn.functional.linear(c_kv, kv_b).view(-1, num_heads, 256).split([128, 128], dim=-1)

    latents = mla_attention._latents_of(cache, tables, 0, 0.5, torch.bfloat16)
    with _PeakBytes() as tracked:
        out = mla_attention.expanded_attention(q, latents, context_len, 512, expand, 0.1, torch.bfloat16)
    assert out.shape == (num_queries, num_heads, 128) and out.dtype == torch.bfloat16
    return tracked.peak


@pytest.mark.parametrize("name", list(MODELS))
def test_the_expanded_workspace_is_what_the_expanded_form_allocates(name):
    """mla_attention.expanded_bytes (the plan's mla_expanded_bytes), per tensor-parallel rank's heads and number of
    queries: what the expanded form allocates for a sequence over a context of several chunks, to within 1% (V3's
    128 heads: chunks of 8192 keys; a rank of 8, 16 heads, and V2-Lite's 16: 65536; V2-Lite's rank of 8, 2 heads:
    65536 too, EXPAND_MAX_KEYS), with a bf16 and with an FP8 latent cache (its conversion is over before kv_b runs);
    a context of one full chunk and the queries' own keys, or within one chunk, allocates no more."""
    model = MODELS[name]
    for tp in (1, 8):
        heads = model.num_heads // tp
        chunk = min(2**20 // heads, 2**16)
        for queries in (128, 1000, 8192):
            planned = memory.mla_expanded_bytes(model, queries, 163840, heads)
            context = 2 * chunk + 3 * queries // 2  # (the second full chunk expands beside the queries' running output)
            fp8 = expanded_peak_bytes(queries, context, heads, torch.float8_e4m3fn)
            bf16 = expanded_peak_bytes(queries, context, heads)
            assert max(bf16, fp8) <= planned <= 1.01 * min(bf16, fp8), (tp, queries)
            for context in (chunk + queries, chunk // 2 + queries):
                assert expanded_peak_bytes(queries, context, heads, torch.float8_e4m3fn) <= planned, (tp, queries)
    assert memory.mla_expanded_bytes(MODELS["v3"], 8192, 163840) > 2**30  # V3: ~1.4 GiB at a budget of 8192 tokens


@pytest.mark.parametrize("name", list(MODELS))
def test_the_expanded_workspace_is_bounded_by_max_model_len(name):
    """A context of at most max_model_len keys expands chunks of at most that many: at max_model_len 4096 the plan
    holds what a whole context of 4096 allocates (2048 queries after 2048 cached, and a fresh prompt of 4096),
    less than at 163840 (V2-Lite: chunks of 65536 keys there); a budget below CUDA_EXPAND_MIN_QUERIES expands nothing on CUDA and holds nothing back."""
    model = MODELS[name]
    for queries in (2048, 4096):
        planned = memory.mla_expanded_bytes(model, queries, 4096)
        assert expanded_peak_bytes(queries, 4096, model.num_heads) <= planned, queries
        assert planned < memory.mla_expanded_bytes(model, queries, 163840)
    assert memory.mla_expanded_bytes(model, 127, 4096) == 0 < memory.mla_expanded_bytes(model, 128, 4096)


def test_a_long_context_prefill_of_the_latent_attention_fits_the_activation_term(monkeypatch):
    """One eager prefill step of a layer's MLAttention on CUDA's route (runtime/models/mla.py on meta tensors, every row
    expanded, the form forced: a chunk of the step's budget after a cached context of several expanded chunks, and a
    fresh prompt of the budget): what it allocates, with the residual and hidden states, stays within the estimate's
    activation term for that budget (activation_peak_bytes and mla_expanded_bytes, over the rank's heads), at V2-Lite's
    and V3's shapes, whole and as a rank of tensor parallel 8."""
    import llmc.kernels.mla_attention as mla_attention
    from llmc.runtime.models.mla import MLAttention

    monkeypatch.setattr(mla_attention, "can_use_triton", lambda *tensors: True)
    meta = dict(dtype=torch.bfloat16, device="meta")
    for model in MODELS.values():
        for tp in (1, 8):
            plan = art.ParallelPlan(tensor=tp, stage_layers=[list(range(model.num_layers))])
            layout = all_rank_layouts(model, plan)[0]
            names = ("q", "q_a", "q_b", "kv_a", "kv_b", "o")
            formats = {f"layers.0.attn.{name}": DenseFormat(torch.bfloat16) for name in names}
            attn = MLAttention(model, formats, 0, torch.bfloat16, layout).to("meta")
            attn.form = "expanded"  # (the shorter prompts of a rank of few heads are below CUDA_EXPAND_MIN_WORK)
            heads, chunk = layout.num_heads, mla_attention.expand_chunk_keys(layout.num_heads)
            attn.w_uk = torch.empty(heads, model.qk_nope_head_dim, model.kv_lora_rank, **meta)
            attn.w_uv = torch.empty(heads, model.v_head_dim, model.kv_lora_rank, **meta)
            for tokens in (2048, 8192):
                for context in (2 * chunk + tokens + 5, tokens):
                    blocks = -(-context // 16)
                    attn.kv_cache = (torch.empty(blocks, 16, model.kv_lora_rank + model.qk_rope_head_dim, **meta),)
                    cos_sin = torch.empty(context, model.qk_rope_head_dim, dtype=torch.float32, device="meta")
                    batch = ForwardBatch(
                        positions=torch.zeros(tokens, dtype=torch.long, device="meta"),
                        slot_mapping=torch.zeros(tokens, dtype=torch.long, device="meta"),
                        block_tables=torch.zeros(1, blocks, dtype=torch.int32, device="meta"),
                        context_lens=torch.tensor([context], dtype=torch.int32, device="meta"),
                        query_lens=[tokens], max_context_len=context,
                        logits_indices=torch.zeros(1, dtype=torch.long, device="meta"), host_context_lens=[context])
                    x = torch.empty(tokens, model.hidden_size, **meta)
                    with _PeakBytes() as tracked:
                        out = attn(x, batch, cos_sin)
                    route, absorbed = batch.kernel_cache[("mla_route", tokens)]
                    assert out.shape == (tokens, model.hidden_size) and route == [(0, 0, context)]
                    step = tracked.peak + 2 * x.nbytes  # and the residual and hidden states
                    allowance = (memory.activation_peak_bytes(model, tokens, 0)
                                 + memory.mla_expanded_bytes(model, tokens, 163840, heads))
                    assert step <= allowance, (model.family, tp, tokens, context)


def test_both_plans_hold_back_the_expanded_workspace(monkeypatch):
    """The estimate of every tensor-parallel rank (`llmc inspect`, the compiler) holds, beside one forward's
    activations, what the expanded form allocates over a long context at that rank's heads (measured on meta
    tensors); the runtime's measured plan adds the same workspace to its profiled peak (the profile's prompts are
    fresh: they expand no long context), over its layers' heads; a model without MLA adds nothing."""
    from dataclasses import replace
    from types import SimpleNamespace

    from llmc.kernels.mla_attention import expand_chunk_keys
    from llmc.runtime import memory_profile

    runtime = art.RuntimeDefaults(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=163840, enforce_eager=True)
    for model in MODELS.values():
        for tp in (1, 8):
            plan = art.ParallelPlan(tensor=tp, stage_layers=[list(range(model.num_layers))])
            estimates = memory.estimate_per_rank(model, plan, [GIB] * tp, "bfloat16", runtime, 141 * GIB)
            heads = model.num_heads // tp
            expanded = expanded_peak_bytes(2048, 2 * expand_chunk_keys(heads) + 3000, heads)
            for estimate in estimates:
                assert estimate.activation_bytes >= memory.activation_peak_bytes(model, 2048, 8) + expanded
    held = []
    monkeypatch.setattr(memory_profile, "profile_activation_bytes", lambda *args: 1000)
    monkeypatch.setattr(memory_profile, "gpu_kv_plan", lambda options, device, weights, activations, *rest:
                        held.append(activations))
    for config, heads in ((V3, 16), (replace(V3, kv_lora_rank=None), 16)):
        attn = SimpleNamespace(num_heads=heads)
        model = SimpleNamespace(config=config, kv_attentions=lambda attn=attn: [attn])
        memory_profile.measure_kv_plan(model, runtime, "cuda", 0, 1, 0)
    assert held == [1000 + memory.mla_expanded_bytes(V3, 2048, 163840, 16), 1000]
