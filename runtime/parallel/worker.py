"""A worker rank: join the groups, load the shard, then run each step the driver broadcasts until
it says SHUTDOWN. Started by the driver (spawn), by `llmc run --node-rank N` on another host, or
by torchrun (every rank but 0)."""

from __future__ import annotations

import datetime
import os
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.runtime import artifact as art
from llmc.runtime.parallel.groups import ParallelGroups, Rendezvous, apply_parallel_env
from llmc.runtime.parallel.layout import rank_layout
from llmc.runtime.parallel.messages import StepKind, receive_step
from llmc.runtime.parallel.shard_runner import ShardRunner

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # how long ranks wait for each other to show up


def joined_key(rank: int) -> str:
    """Store key a rank sets once it is about to build its groups (the driver waits for all of them)."""
    return f"llmc/joined/{rank}"


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process is started with (plain data: it crosses a spawn)."""

    artifact_dir: str
    options: art.RuntimeDefaults
    device_type: str  # "cpu" | "cuda"
    rendezvous: Rendezvous
    ranks_per_node: int  # local rank = rank % ranks_per_node picks the GPU: first_gpu + local rank
    first_gpu: int = 0  # > 0 for the second and later data-parallel replicas on one host


def rank_device(device_type: str, gpu_index: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(gpu_index)
        return torch.device("cuda", gpu_index)
    return torch.device("cpu")


def serve_rank(rank: int, args: WorkerArgs) -> None:
    """Run rank `rank` until the driver's SHUTDOWN; its groups are destroyed on the way out."""
    apply_parallel_env()
    artifact_dir = Path(args.artifact_dir)
    manifest = art.read_manifest(artifact_dir)
    device = rank_device(args.device_type, args.first_gpu + rank % args.ranks_per_node)
    store = args.rendezvous.connect(rank, STORE_TIMEOUT)
    store.set(joined_key(rank), "1")
    groups = ParallelGroups(store, rank, manifest.parallel.world_size, manifest.parallel.tensor, device)
    try:
        layout = rank_layout(manifest.model, manifest.parallel, rank)
        shard = ShardRunner(artifact_dir, manifest, args.options, device, layout, groups)
        while (message := receive_step(groups)).kind == StepKind.FORWARD:
            shard.run(message)
    finally:
        groups.shutdown()


def spawned_worker_main(rank: int, args: WorkerArgs, error_conn, parent_pid: int) -> None:
    """Entry point of a worker process the driver (or a node supervisor) spawned. Any failure is
    reported on `error_conn` (one line: its type and message) before the process exits with 1."""
    _exit_with_parent(parent_pid)
    try:
        serve_rank(rank, args)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the driver must learn it
        last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
        where = f" (at {Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        error_conn.send(f"{type(e).__name__}: {e}{where}".splitlines()[0])
        error_conn.close()
        os._exit(1)  # no interpreter teardown: nothing else is worth waiting for
    error_conn.close()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose driver is gone (killed, crashed) leaves at once instead of lingering."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="llmc-parent-watch", daemon=True).start()
