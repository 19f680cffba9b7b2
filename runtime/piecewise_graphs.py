"""CUDA graphs of prefill and mixed steps, cut at the attention (vLLM's piecewise graphs).

A step that is not a decode step (a prompt, or prompt chunks beside decodes) ran eagerly: a few
hundred Python launches, each costing the host 20-250 µs, against a few ms of GPU work for a short
prompt, so its time to first token was the host's. Everything of a layer but the attention is a
per-token function of its input that reads no host value of the step: the graphs here hold it, one
graph per stretch between two attentions, and only the attention (whose prefill kernel plans its
grid from the step's query lengths on the host) runs eagerly between the replays.

For a model of L layers, a step of n tokens replays the L + 1 graphs of the next captured size up
(size >= n):
  piece 0:  embed, layer 0's input norm, qkv, rotary embedding and KV write → q
  piece i:  layer i-1's o, post-attention norm and MLP (or MoE), layer i's input norm, qkv, rotary
            embedding and KV write → q                                                  (0 < i < L)
  piece L:  layer L-1's o, post-attention norm and MLP, the final norm → hidden
with layer i's attention, `Attention.attend`, launched eagerly after piece i on the first n rows.

NOTE (buffers): the graphs read and write fixed addresses. Static buffers hold what crosses a cut:
the token ids, positions and slots (rows n..size-1 are padding: their KV goes to the scratch block,
as in the decode graphs, and their outputs are dropped), q (each piece's rotary kernel writes it there) and the
attention's output (the eager kernel writes it there). The residual stream passes from piece i to
piece i + 1 in the graphs' memory pool: piece i's output is kept alive while piece i + 1 is
captured, then released, so the pool holds about two pieces' intermediates, whatever L.

NOTE (sharing): the graphs share one memory pool with the decode graphs (runtime/cuda_graphs.py),
captured after them, largest size first. Graphs of one pool never run at the same time (one
stream), and a graph's intermediates are dead once the next graph of the step starts.

NOTE (rows): a runner whose prefill steps may carry rows in place of token embeddings (a vision model's image
tokens, a prompt given as embeddings: ForwardBatch.image_rows) captures piece 0 with a `torch.where` over two more
static buffers, a row mask and the rows (written by `load`, all-false in a step without rows), so that such steps
replay the graphs too (they ran eagerly: a 16-token prompt given as embeddings took 3x the time to first token of
its token ids on an 8-layer model, session 42); the attention between the pieces takes the step's key limits (Gemma 3).

NOTE (aux): under an EAGLE head (runtime/spec_eagle.py) the model keeps the residual stream entering some layers
(EAGLE-3) or its final hidden states (EAGLE-1): piece i copies layer i's input (norm_in's residual: the sum the eager
forward keeps) into its columns of a static buffer, the last piece the hidden states, and a replay leaves the
model's aux_hidden pointing at the buffer's first n rows, as the eager forward leaves it.

Not used by tensor/pipeline-parallel ranks, nor with cpu_offload_gb (its copies hang on the layers'
forward hooks, which the pieces do not call), nor on a CPU.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from llmc.runtime import memory
from llmc.runtime.cuda_graphs import aux_buffer
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.models.decoder import DecoderModel

logger = logging.getLogger("llmc")


class PiecewiseGraphs:
    """The cut graphs of one single-rank model runner, and their replay."""

    def __init__(self, model: DecoderModel, sizes: list[int], scratch_slot: int, device: torch.device,
                 takes_rows: bool = False):
        """The static buffers; `capture` captures the graphs (on a CPU, `piece` runs eagerly: tests). `takes_rows`:
        steps may carry rows in place of embeddings (NOTE (rows))."""
        self.model = model
        self.takes_rows = takes_rows
        self.layers = list(model.layers.values())
        self.sizes = sorted(sizes)
        self.scratch_slot = scratch_slot
        self.device = device
        self.num_replays = 0  # steps run through the graphs
        self._free_before = 0  # free GPU memory before the buffers: what the graphs took is counted from it
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # what the allocator caches now is not the graphs' to count
            self._free_before = torch.cuda.mem_get_info(device)[0]
        top = self.sizes[-1]
        dtype = getattr(torch, model.config.dtype)
        heads = (self.layers[0].attn.num_heads, self.layers[0].attn.head_dim)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), scratch_slot, dtype=torch.long, device=device)
        self.q = torch.zeros(top, *heads, dtype=dtype, device=device)  # each layer's rotated q
        self.attn = torch.zeros(top, *heads, dtype=dtype, device=device)  # each layer's attention output
        self.hidden = torch.zeros(top, model.config.hidden_size, dtype=dtype, device=device)
        # an EAGLE head's inputs, when the model keeps them (NOTE (aux))
        self.aux = aux_buffer(model, top, device)
        self.aux_columns = {layer: slice(k * model.config.hidden_size, (k + 1) * model.config.hidden_size)
                            for k, layer in enumerate(model.aux_layer_ids)}
        if takes_rows:  # NOTE (rows)
            self.row_mask = torch.zeros(top, 1, dtype=torch.bool, device=device)
            self.rows = torch.zeros(top, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_seconds, self.graph_bytes = 0.0, 0

    def piece(self, i: int, size: int, residual: Tensor | None) -> Tensor | None:
        """Piece i of a step of `size` tokens (module docstring): reads the static buffers (and the
        residual piece i - 1 returned), writes q (or, the last, the hidden states) to them; returns
        the residual stream for piece i + 1 (None after the last)."""
        if i == 0:
            x = self.model.embed_tokens(self.input_ids[:size])
            if self.takes_rows:
                x = torch.where(self.row_mask[:size], self.rows[:size], x)
        else:
            previous = self.layers[i - 1]
            x, residual = previous.feed_forward(previous.attn.output(self.attn[:size]), residual)
        if i == len(self.layers):
            self.hidden[:size].copy_(self.model.final_norm(x, residual))
            if self.model.keeps_final_hidden:
                self.aux[:size].copy_(self.hidden[:size])
            return None
        layer = self.layers[i]
        x, residual = layer.norm_in(x, residual)
        if i in self.aux_columns:  # the residual stream entering layer i
            self.aux[:size, self.aux_columns[i]].copy_(residual)
        layer.attn.project(x, self.positions[:size], self.slot_mapping[:size], self.model.rope_of(layer),
                           q_out=self.q[:size])
        return residual

    @torch.inference_mode()
    def capture(self, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        """Every size's pieces, largest size first, into `pool` (the decode graphs', when there are
        some) on `stream` (theirs)."""
        start = time.perf_counter()
        num_pieces = len(self.layers) + 1
        with torch.cuda.device(self.device):
            stream = stream or torch.cuda.Stream(self.device)
            for size in reversed(self.sizes):
                residual = None
                for i in range(num_pieces):  # warm-up: compiles this size's kernels, sets up cuBLAS
                    residual = self.piece(i, size, residual)
                torch.cuda.synchronize(self.device)
                graphs = []
                for i in range(num_pieces):
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: another replica's engine thread may run its steps meanwhile
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        residual = self.piece(i, size, residual)  # piece i - 1's residual released here
                    pool = graph.pool() if pool is None else pool
                    graphs.append(graph)
                self.graphs[size] = graphs
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()  # the warm-up runs' intermediates are not graph memory
        self.graph_bytes = self._free_before - torch.cuda.mem_get_info(self.device)[0]  # buffers, pool, graphs

    def log_capture(self, allowance: int) -> None:
        logger.info("CUDA graphs of prefill and mixed steps: %d token counts (%s) x %d pieces in %.1f s, %.1f MiB "
                    "(allowance %.1f MiB)", len(self.sizes), ", ".join(map(str, self.sizes)), len(self.layers) + 1,
                    self.capture_seconds, self.graph_bytes / memory.MIB, allowance / memory.MIB)
        memory.warn_over_allowance("CUDA graphs of prefill and mixed steps", self.graph_bytes, allowance,
                                   "set compilation_config.max_cudagraph_capture_size lower")

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens <= self.sizes[-1]

    def load(self, input_ids: Tensor, batch: ForwardBatch) -> int:
        """Copy the step's n tokens into rows 0..n-1 and make rows n..size-1 padding rows (their KV
        to the scratch slot); returns size, the captured token count that holds n."""
        n = batch.num_tokens
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:size].fill_(self.scratch_slot)
        if self.takes_rows:
            self.row_mask[:size].fill_(False)
            if batch.image_rows is not None:
                indices, rows = batch.image_rows
                self.row_mask.index_fill_(0, indices, True)
                self.rows.index_copy_(0, indices, self.model.input_rows(rows, self.rows.dtype))
        return size

    def run(self, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
        """The final hidden states [num_tokens, hidden_size] of the step: the pieces of the next size
        up replayed, each layer's attention launched between them on the step's n tokens. A view of
        the static buffer: use it before the next step."""
        graphs = self.graphs[self.load(input_ids, batch)]
        n = batch.num_tokens
        with torch.cuda.device(self.device):
            graphs[0].replay()
            for layer, graph in zip(self.layers, graphs[1:]):
                layer.attn.attend(self.q[:n], batch, out=self.attn[:n])
                graph.replay()
        self.num_replays += 1
        if self.aux is not None:
            self.model.aux_hidden = self.aux[:n]
        return self.hidden[:n]
