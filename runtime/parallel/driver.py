"""Rank 0 of a parallel engine: the driver. The Engine's scheduler and sampler run here, once; this
runner implements the engine's `Runner` contract (runtime/runner.py) and spreads each forward pass.

Per step the driver builds the batch exactly as a single rank does (on the CPU), broadcasts it as a
StepMessage, runs its own shard (tensor rank 0 of stage 0), and receives the last stage's
vocab-parallel logits, which it concatenates into the full logits the sampler reads.

`make_model_runner` picks: a one-rank artifact gets the plain ModelRunner (no process, no group);
a larger one starts its workers on this host (spawn), or joins a torchrun / env:// launch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from llmc.errors import ConfigError, WorkerError
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.model_runner import ModelRunner, check_num_kv_blocks, score_in_chunks
from llmc.runtime.onnx_model import is_onnx
from llmc.runtime.parallel.groups import ParallelGroups, Rendezvous, apply_parallel_env, rendezvous_from_env
from llmc.runtime.parallel.launcher import FAILURE_GRACE_S, LaunchConfig, WorkerPool, wait_for_ranks
from llmc.runtime.parallel.layout import rank_layout
from llmc.runtime.parallel.messages import StepMessage, send_step
from llmc.runtime.parallel.shard_runner import ShardRunner
from llmc.runtime.runner import Runner, StepLogits
from llmc.runtime.scheduler import ScheduledBatch
from llmc.runtime.step_inputs import PendingTokens, StepBuffers
from llmc.runtime.parallel.worker import STORE_TIMEOUT, WorkerArgs, rank_device, serve_rank

logger = logging.getLogger("llmc")


def make_model_runner(artifact_dir: Path, manifest: art.Manifest, options: art.RuntimeDefaults,
                      device: torch.device, launch: LaunchConfig | None = None,
                      reserve: tuple[int, int] = (0, 0),
                      keep_hidden: tuple[tuple[int, ...], bool] | None = None) -> Runner:
    """The runner for this artifact and launch. Under torchrun, ranks other than 0 serve their shard
    here until the driver shuts down, then leave the process (SystemExit(0)). `reserve`: what a
    single-rank GPU runner's memory plan leaves for a draft model, `keep_hidden`: the hidden states its model keeps
    for an EAGLE head (ModelRunner; the engine refuses both on more ranks)."""
    if is_onnx(manifest):  # one graph on onnxruntime's CPU EP (target onnx-cpu): never split
        from llmc.runtime.onnx_runner import OnnxRunner

        return OnnxRunner(artifact_dir, manifest, options, device)
    world_size = manifest.parallel.world_size
    from_env = rendezvous_from_env() if launch is None else None
    if from_env is not None:
        rendezvous, rank = from_env
        if rendezvous.world_size != world_size:
            raise ConfigError(
                f"the artifact is split into {_shape(manifest)} = {world_size} rank(s), but this launch has "
                f"WORLD_SIZE {rendezvous.world_size}; launch {world_size} rank(s) or rebuild with another parallel plan"
            )
        if world_size == 1:
            return ModelRunner(artifact_dir, manifest, options, device, reserve, keep_hidden)
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if rank != 0:
            serve_rank(rank, WorkerArgs(str(artifact_dir), options, device.type, rendezvous, ranks_per_node))
            raise SystemExit(0)
        return ParallelModelRunner(artifact_dir, manifest, options, device, rendezvous, [], ranks_per_node)
    launch = launch or LaunchConfig()
    ranks_per_node = launch.ranks_per_node(world_size)
    if world_size == 1:
        return ModelRunner(artifact_dir, manifest, options, device, reserve, keep_hidden)
    if launch.node_rank != 0:
        raise ConfigError("a node other than 0 runs worker ranks only: use `llmc run ... --node-rank N`")
    rendezvous = Rendezvous(launch.master_addr, launch.master_port, world_size)
    return ParallelModelRunner(artifact_dir, manifest, options, device, rendezvous,
                               list(launch.local_ranks(world_size))[1:], ranks_per_node)


def run_node(artifact_dir: Path, options: art.RuntimeDefaults, device: torch.device, launch: LaunchConfig) -> None:
    """Serve this node's worker ranks (node_rank > 0 of a multi-host launch) until the driver shuts
    down; WorkerError if one of them fails."""
    manifest = art.read_manifest(artifact_dir)
    world_size = manifest.parallel.world_size
    rendezvous = Rendezvous(launch.master_addr, launch.master_port, world_size)
    args = WorkerArgs(str(artifact_dir), options, device.type, rendezvous, launch.ranks_per_node(world_size))
    pool = WorkerPool(list(launch.local_ranks(world_size)), args, manifest.parallel.tensor)
    try:
        pool.wait()
    finally:
        pool.stop()


def _shape(manifest: art.Manifest) -> str:
    return f"tensor {manifest.parallel.tensor} × pipeline {manifest.parallel.pipeline}"


class _Resources:
    """What a parallel runner must release exactly once (by close() or, failing that, by its finalizer)."""

    def __init__(self):
        self.store = None
        self.pool: WorkerPool | None = None
        self.groups: ParallelGroups | None = None
        self.is_healthy = True

    def release(self) -> None:
        groups, pool, self.groups, self.pool = self.groups, self.pool, None, None
        if groups is not None and self.is_healthy:
            try:
                send_step(groups, StepMessage.shutdown())
            except RuntimeError:  # a worker is already gone: stop() below ends the others
                pass
        if pool is not None:
            pool.stop(is_graceful=self.is_healthy)
        if groups is not None:
            groups.shutdown()
        self.store = None


class ParallelModelRunner:
    """The `Runner` (runtime/runner.py) of T × P ranks; this process is rank 0. Its steps only
    enqueue work on the GPUs (NCCL collectives included) and send the next message to the ranks,
    so the engine overlaps them as on one GPU: step N+1 goes out while the ranks run step N, its
    not-yet-known tokens as placeholders the first stage fills in on its devices (messages.py)."""

    can_overlap = True

    def __init__(self, artifact_dir: Path, manifest: art.Manifest, options: art.RuntimeDefaults, device: torch.device,
                 rendezvous: Rendezvous, local_worker_ranks: list[int], ranks_per_node: int):
        apply_parallel_env()
        parallel = manifest.parallel
        self.first_gpu = device.index or 0  # rank r on this host uses GPU first_gpu + local rank
        self.device = rank_device(device.type, self.first_gpu)
        # the step message is built on the CPU, then broadcast
        self.buffers = StepBuffers(options.max_num_seqs, options.max_num_batched_tokens,
                                   -(-options.max_model_len // options.block_size), options.block_size,
                                   torch.device("cpu"), defer_pending=True)
        self.block_size = options.block_size
        self.vocab_size = manifest.model.vocab_size
        self.tensor = parallel.tensor
        self.last_stage = [rank_layout(manifest.model, parallel, rank)
                           for rank in range(parallel.world_size - parallel.tensor, parallel.world_size)]
        self._failure: str | None = None
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.release)
        try:
            self._start(artifact_dir, manifest, options, rendezvous, local_worker_ranks, ranks_per_node)
        except BaseException:
            self.close()
            raise

    def _start(self, artifact_dir: Path, manifest: art.Manifest, options: art.RuntimeDefaults, rendezvous: Rendezvous,
               local_worker_ranks: list[int], ranks_per_node: int) -> None:
        resources, world_size = self._resources, manifest.parallel.world_size
        resources.store = rendezvous.connect(0, STORE_TIMEOUT)
        rendezvous = dataclasses.replace(rendezvous, port=resources.store.port)  # the free port it picked
        if local_worker_ranks:
            args = WorkerArgs(str(artifact_dir), options, self.device.type, rendezvous, ranks_per_node, self.first_gpu)
            resources.pool = WorkerPool(local_worker_ranks, args, self.tensor, on_failure=self._abort_groups)
        wait_for_ranks(resources.store, list(range(1, world_size)), resources.pool, STORE_TIMEOUT.total_seconds())
        with self._failures():
            resources.groups = ParallelGroups(resources.store, 0, world_size, self.tensor, self.device)
            layout = rank_layout(manifest.model, manifest.parallel, 0)
            self.shard = ShardRunner(artifact_dir, manifest, options, self.device, layout, resources.groups)
        self.graphs = self.shard.graphs  # this rank's; every rank captured the same sizes
        self.memory_plan = self.shard.memory_plan  # this rank's
        self.rank_memory = self.shard.rank_memory  # what each rank reported; the engine takes the smallest
        for report in self.rank_memory:
            logger.info("rank %d: room for %d KV blocks%s", report.rank, report.num_kv_blocks,
                        f" (measured: weights {report.weight_bytes / memory.GIB:.2f} GiB, activation peak "
                        f"{report.activation_bytes / memory.GIB:.2f} GiB)" if report.measured else "")
        self.num_blocks = check_num_kv_blocks(self.shard.num_blocks, options, self.device)

    @property
    def failure(self) -> str | None:
        """Why the parallel engine is down (a rank died or a collective failed), also while it is idle:
        the pool's watchdog records a dead worker at once (the server's health check reads this)."""
        pool = self._resources.pool
        return self._failure or (pool.failure if pool is not None else None)

    @property
    def worker_pids(self) -> dict[int, int]:
        """{rank: process id} of the workers this process started."""
        return self._resources.pool.pids if self._resources.pool is not None else {}

    def close(self) -> None:
        """Send SHUTDOWN, wait for the workers to leave (terminating stragglers), destroy the groups."""
        self._finalizer()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, pending: PendingTokens | None = None) -> StepLogits:
        """Send the step to every rank, run this rank's part and gather the logits, all without
        waiting for a device. `pending`: step N-1's sampled tokens (on this GPU) for placeholders."""
        inputs = self.buffers.build(batch, pending)
        num_pending = pending.token_ids.shape[0] if pending is not None else 0
        message = StepMessage.forward(inputs.input_ids, inputs.forward_batch,
                                      (inputs.pending_dst, inputs.pending_src), num_pending)
        logits = self._run(message, pending.token_ids if pending is not None else None)
        sample_rows = inputs.sample_rows
        if self.device.type == "cuda":
            sample_rows = sample_rows.pin_memory().to(self.device, non_blocking=True)
        return StepLogits.split(logits, dataclasses.replace(inputs, sample_rows=sample_rows))

    def score(self, token_ids: list[int], block_ids: list[int], chunk_size: int) -> Tensor:
        return score_in_chunks(self.forward_logits, token_ids, block_ids, chunk_size, self.block_size,
                               torch.device("cpu"))

    def forward_logits(self, input_ids: Tensor, forward_batch: ForwardBatch) -> Tensor:
        """Logits [num_logits, vocab_size] float32 of a batch with no placeholders."""
        return self._run(StepMessage.forward(input_ids, forward_batch))

    def _run(self, message: StepMessage, pending: Tensor | None = None) -> Tensor:
        with self._failures():
            send_step(self._resources.groups, message)
            own = self.shard.run(message, pending)
            return self._gather_logits(own, message.num_logits)

    def _gather_logits(self, own: Tensor | None, num_logits: int) -> Tensor:
        """[num_logits, vocab_size] float32: the last stage's shards side by side, padding cut off."""
        if num_logits == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        shards = []
        for layout in self.last_stage:
            if layout.rank == 0:
                shards.append(own)
                continue
            shard = torch.empty(num_logits, layout.vocab_size, dtype=torch.float32, device=self.device)
            shards.append(self._resources.groups.recv(shard, layout.rank))
        logits = torch.cat(shards, dim=1) if len(shards) > 1 else shards[0]
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size].contiguous()

    @contextmanager
    def _failures(self):
        """Turn a failed collective into a WorkerError naming the rank that died (and why); the engine
        is unusable after one (the ranks are no longer in step), so everything is torn down."""
        if self._failure is not None:
            raise WorkerError(f"the parallel engine is down: {self._failure}")
        try:
            yield
        except RuntimeError as e:
            pool = self._resources.pool
            cause = pool.wait_for_failure(FAILURE_GRACE_S) if pool is not None else None
            self._failure = cause or f"a collective with the other ranks failed: {str(e).splitlines()[0]}"
            self._resources.is_healthy = False
            self.close()
            raise WorkerError(f"the parallel engine is down: {self._failure}") from None

    def _abort_groups(self) -> None:
        """The watchdog's reaction to a dead worker: NCCL collectives would wait for it until their
        timeout, so abort them; gloo already fails them when the dead rank's sockets close."""
        groups = self._resources.groups
        if groups is not None and self.device.type == "cuda":
            groups.abort()
