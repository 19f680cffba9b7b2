"""Starting the ranks of a parallel engine, and noticing when one dies.

NOTE (failure handling): a worker that raises reports one line (its error) through a pipe and exits
with code 1. The driver's watchdog thread waits on every local worker's process sentinel: when one
ends while the engine is not shutting down, it records which rank and why (the reported line, the
exit code, or the signal that killed it) and runs `on_failure` (on GPUs: abort the NCCL groups, so
a collective blocked on the dead rank returns instead of hanging). The driver turns the failed
collective into a WorkerError naming the rank. Workers watch the driver too: a worker whose parent
is gone exits, and gloo ends a wait on a peer whose sockets closed. Ranks on other hosts are not
watched by process: their death closes their sockets, which fails the next collective with them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from llmc.errors import ConfigError, WorkerError
from llmc.runtime.parallel.groups import apply_parallel_env
from llmc.runtime.parallel.worker import WorkerArgs, joined_key, spawned_worker_main

FAILURE_GRACE_S = 5.0  # after a failed collective, how long the watchdog may take to name the dead rank
STOP_TIMEOUT_S = 10.0  # how long workers get to leave after SHUTDOWN before they are terminated


@dataclass(frozen=True)
class LaunchConfig:
    """Where the ranks of one engine run. The defaults start every rank on this host.

    With nnodes > 1, run the same `llmc run` on every host with its node_rank; node 0 holds the
    driver (rank 0) and hosts the rendezvous at master_addr:master_port.
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port (one host only)

    def ranks_per_node(self, world_size: int) -> int:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank {self.node_rank} is not in [0, nnodes={self.nnodes})")
        if world_size % self.nnodes:
            raise ConfigError(f"the artifact needs {world_size} ranks, which {self.nnodes} nodes cannot share "
                              "evenly; use a number of nodes that divides it")
        if self.nnodes > 1 and not self.master_port:
            raise ConfigError("--master-port is needed with several nodes (the same on every node)")
        return world_size // self.nnodes

    def local_ranks(self, world_size: int) -> range:
        per_node = self.ranks_per_node(world_size)
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


def describe_rank(rank: int, tensor: int) -> str:
    return f"rank {rank} (pipeline stage {rank // tensor}, tensor rank {rank % tensor})"


class WorkerPool:
    """The worker processes one host starts for an engine, and the watchdog over them."""

    def __init__(self, ranks: list[int], args: WorkerArgs, tensor: int, on_failure: Callable[[], None] | None = None):
        apply_parallel_env()  # inherited by the spawned processes
        context = multiprocessing.get_context("spawn")
        self.tensor = tensor
        self.on_failure = on_failure
        self.processes: dict[int, multiprocessing.Process] = {}
        self.error_conns: dict[int, multiprocessing.connection.Connection] = {}
        for rank in ranks:
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=spawned_worker_main, args=(rank, args, sender, os.getpid()),
                                      name=f"llmc-rank-{rank}", daemon=True)
            process.start()
            sender.close()
            self.processes[rank], self.error_conns[rank] = process, receiver
        self.failure: str | None = None
        self._failed = threading.Event()
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="llmc-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> dict[int, int]:
        return {rank: process.pid for rank, process in self.processes.items()}

    def wait_for_failure(self, timeout: float) -> str | None:
        """The recorded failure, waiting up to `timeout` seconds for one."""
        self._failed.wait(timeout)
        return self.failure

    def wait(self) -> None:
        """Block until every worker has exited (a node supervisor's main loop); WorkerError if one failed."""
        for process in self.processes.values():
            process.join()
        self._stopping.set()
        if self.wait_for_failure(0.5):
            raise WorkerError(self.failure)

    def stop(self, is_graceful: bool = True) -> None:
        """Wait for the workers to leave (they were sent SHUTDOWN), then terminate any that did not;
        not graceful (after a failure: nobody told them to leave): terminate them at once."""
        self._stopping.set()
        deadline = time.monotonic() + (STOP_TIMEOUT_S if is_graceful else 0.0)
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.error_conns.values():
            conn.close()

    def _watch(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in self.processes.items()}
        while sentinels and not self._stopping.is_set():
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
                rank = sentinels.pop(sentinel)
                if self._stopping.is_set():
                    return
                cause = self._cause(rank)
                if cause is None:  # exited cleanly: only after a SHUTDOWN, which sets _stopping first
                    continue
                self.failure = cause
                self._failed.set()
                if self.on_failure is not None:
                    self.on_failure()
                return

    def _cause(self, rank: int) -> str | None:
        process = self.processes[rank]
        process.join(1.0)
        conn = self.error_conns[rank]
        try:
            reported = conn.recv() if conn.poll() else None
        except EOFError:  # closed without a word: the exit code or signal says what happened
            reported = None
        who = describe_rank(rank, self.tensor)
        if reported:
            return f"{who} failed: {reported}"
        code = process.exitcode
        deadline = time.monotonic() + 2.0
        while code is None and time.monotonic() < deadline:
            # Another thread (wait/stop) may be reaping the same process: its exit code shows up shortly.
            time.sleep(0.05)
            code = process.exitcode
        if code is not None and code < 0:
            return f"{who} was killed by signal {signal.Signals(-code).name}"
        return None if code == 0 else f"{who} exited with code {code}"


_loading = threading.local()  # .cancel: the event that stops this thread's wait for ranks (cancellable_loading)


@contextmanager
def cancellable_loading(cancel: threading.Event):
    """An engine loaded in this thread (a server's engine thread) stops waiting for its ranks once `cancel`
    is set (the server is shutting down), instead of waiting out the store's timeout."""
    _loading.cancel = cancel
    try:
        yield
    finally:
        _loading.cancel = None


def wait_for_ranks(store, ranks: list[int], pool: WorkerPool | None, timeout_s: float) -> None:
    """Wait until every rank in `ranks` has joined the store, failing fast if a local worker dies first
    or the loading is cancelled."""
    keys = [joined_key(rank) for rank in ranks]
    deadline = time.monotonic() + timeout_s
    cancel = getattr(_loading, "cancel", None)
    while not store.check(keys):
        if pool is not None and pool.failure is not None:
            raise WorkerError(f"a rank could not start: {pool.failure}")
        if cancel is not None and cancel.is_set():
            raise WorkerError("loading was cancelled (the server is shutting down) while waiting for ranks "
                              f"{[rank for rank, key in zip(ranks, keys) if not store.check([key])]} to join")
        if time.monotonic() > deadline:
            missing = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
            raise WorkerError(f"ranks {missing} did not join within {timeout_s:.0f} s; start them (on every node: "
                              "`llmc run ... --nnodes N --node-rank I --master-addr HOST --master-port PORT`)")
        time.sleep(0.05)
