"""The process groups of one parallel engine, built on torch.distributed's backends directly.

NOTE: each engine creates and owns its groups from a TCPStore; torch.distributed's default group
is never initialised or touched. So several engines (data-parallel replicas) can live in one
process, and user code keeps torch.distributed to itself. Three groups per rank:

  control  gloo over every rank, on the CPU: the driver's step messages, start-up agreement.
           Its timeout is long: a worker legitimately waits for the next step as long as the
           server is idle (a driver that dies closes its sockets, which ends the wait at once).
  device   every rank on the compute device (NCCL on GPUs; the control group itself on CPUs):
           hidden states from stage to stage, logits to the driver.
  tp       the tensor ranks of this rank's pipeline stage, on the compute device: all-reduces of
           row-parallel outputs and of the vocab-parallel embedding. None without tensor parallelism.

The rendezvous reads the same variables as torch.distributed's env:// (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), and under torchrun uses its agent's store, so a torchrun launch works as is.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# Set in every process the runtime starts (and inherited by what they start): NVLink SHARP
# multicast (NVLS) and multicast symmetric memory are off; they fail on some hosts.
PARALLEL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
STORE_PREFIX = "llmc/"
CONTROL_TIMEOUT = datetime.timedelta(days=7)


def apply_parallel_env() -> None:
    os.environ.update(PARALLEL_ENV)


def step_timeout() -> datetime.timedelta:
    """How long one collective inside a step may take before it is an error (LLMC_DIST_TIMEOUT_S)."""
    return datetime.timedelta(seconds=float(os.environ.get("LLMC_DIST_TIMEOUT_S", "300")))


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one engine meet: the TCPStore at host:port, hosted by the driver (rank 0)
    unless torchrun's agent already hosts one there."""

    host: str
    port: int
    world_size: int
    is_agent_store: bool = False  # torchrun's elastic agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)

    def connect(self, rank: int, timeout: datetime.timedelta) -> dist.TCPStore:
        """The store (its server, on rank 0; port 0 picks a free port: read it from `.port`)."""
        is_server = rank == 0 and not self.is_agent_store
        return dist.TCPStore(self.host, self.port, self.world_size, is_server, timeout=timeout, wait_for_workers=False)


def rendezvous_from_env() -> tuple[Rendezvous, int] | None:
    """(rendezvous, rank) of a torchrun / env:// launch, or None when this process was not launched so."""
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    if not all(name in os.environ for name in names):
        return None
    rendezvous = Rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    return rendezvous, int(os.environ["RANK"])


class TensorParallelGroup:
    """The all-reduce the model's row-parallel layers call (the only collective inside the model)."""

    def __init__(self, backend, size: int):
        self.backend = backend
        self.size = size

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum `tensor` over the stage's tensor ranks, in place; returns it."""
        self.backend.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: Tensor) -> Tensor:
        """Tensor rank 0's `tensor` into every tensor rank's, in place (on the device: no host waits)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.backend.broadcast([tensor], options).wait()
        return tensor


class ParallelGroups:
    """This rank's control, device and tensor-parallel groups (see the module note)."""

    def __init__(self, tcp_store: dist.TCPStore, rank: int, world_size: int, tensor: int, device: torch.device):
        self.rank = rank
        self.world_size = world_size
        self.tcp_store = tcp_store  # kept alive with the groups: on the driver it is the server
        store = dist.PrefixStore(STORE_PREFIX, tcp_store)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world_size, CONTROL_TIMEOUT)
        is_cuda = device.type == "cuda"
        self.device = _nccl(store, "device/", rank, world_size) if is_cuda else self.control
        stage, tp_rank = divmod(rank, tensor)
        self.tp: TensorParallelGroup | None = None
        if tensor > 1:
            prefix = f"tp{stage}/"
            backend = (_nccl(store, prefix, tp_rank, tensor) if is_cuda
                       else dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), tp_rank, tensor, step_timeout()))
            self.tp = TensorParallelGroup(backend, tensor)
        self._backends = [b for b in (self.control, self.device, self.tp and self.tp.backend) if b is not None]

    # ---- control (CPU) ------------------------------------------------------------------------

    def broadcast(self, tensor: Tensor) -> Tensor:
        """Rank 0's CPU tensor into every rank's `tensor` (same shape and dtype everywhere)."""
        self.control.broadcast(tensor, 0).wait()
        return tensor

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([tensor], options).wait()
        return int(tensor.item())

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (the same length everywhere), in rank order, on every rank."""
        mine = torch.tensor(values, dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self.control.allgather([gathered], [mine]).wait()
        return [t.tolist() for t in gathered]

    # ---- device (point to point) --------------------------------------------------------------

    def send(self, tensor: Tensor, dst: int) -> None:
        self.device.send([tensor.contiguous()], dst, 0).wait()

    def recv(self, tensor: Tensor, src: int) -> Tensor:
        self.device.recv([tensor], src, 0).wait()
        return tensor

    # ---- teardown -----------------------------------------------------------------------------

    def abort(self) -> None:
        """Make pending and future operations fail at once (a watchdog's way to end a hang)."""
        for backend in self._backends:
            try:
                backend.abort()
            except RuntimeError:  # already broken: nothing left to end
                pass

    def shutdown(self) -> None:
        """Destroy every group of this rank (idempotent). The backends' last references go here, so
        their destructors run now (without the GIL) and join their worker threads. Left to the
        interpreter's exit, a gloo worker thread still releasing the last step's tensors needs the
        GIL of a finishing interpreter, and the process aborts ("terminate called without an active
        exception": shutdown() alone stops no thread)."""
        backends = list(dict.fromkeys(self._backends))
        self._backends, self.control, self.device = [], None, None
        if self.tp is not None:
            self.tp.backend = None  # the model's layers keep the TensorParallelGroup itself
        self.tp = None
        while backends:
            _destroy(backends.pop())


def _destroy(backend) -> None:
    """Shut `backend` down; the caller's reference was the last, so it is destroyed on return."""
    try:
        backend.shutdown()
    except RuntimeError:  # a peer is already gone: the group is as destroyed as it gets
        pass


def _nccl(store: dist.Store, prefix: str, rank: int, size: int):
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = step_timeout()
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, options)
