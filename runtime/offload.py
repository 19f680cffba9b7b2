"""cpu_offload_gb (vLLM's meaning): that many GiB of one GPU's weights live in pinned host memory and
are streamed to the GPU ahead of their layer.

NOTE: whole decoder layers, chosen by memory.plan_offload (evenly spread over the stack). Each
offloaded layer's tensors are packed into one flat pinned host buffer; its modules hold views into
one of NUM_STAGING_SLOTS device buffers (layer k of the offloaded ones uses slot k % slots), so the
model's code is unchanged and a CUDA graph sees fixed addresses. A forward pre-hook on the first
decoder layer starts the copy of offloaded layer 0; the pre-hook of offloaded layer k makes the
compute stream wait for its copy, then starts the copy of layer k + 1 into the other slot on a side
stream, once the compute stream has reached this point (so the slot's previous layer is done). The
copies run on the side stream while resident layers compute. Hooks run while a graph is captured, so
the copies and event waits are captured with the forward (fork/join of the side stream).
On a CPU the same code runs with plain copies (no streams): it exercises the packing, the slot
views and the order of the copies, not the stream synchronisation.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from llmc.runtime import memory

logger = logging.getLogger("llmc")
_ALIGN = 256  # bytes: every tensor view starts aligned for any dtype and vectorised loads


class WeightOffloader:
    def __init__(self, model: torch.nn.Module, cpu_offload_bytes: int, device: torch.device):
        names = list(model.layers.keys())
        tensors = [dict(model.layers[n].state_dict()) for n in names]
        layer_bytes = [sum(_aligned(t.numel() * t.element_size()) for t in ts.values()) for ts in tensors]
        self.plan = memory.plan_offload(layer_bytes, cpu_offload_bytes)
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.hosts: list[Tensor] = []
        chosen = [names[i] for i in self.plan.layers]
        num_slots = min(len(chosen), memory.NUM_STAGING_SLOTS)
        slot_bytes = max((layer_bytes[i] for i in self.plan.layers), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        for k, name in enumerate(chosen):
            self.hosts.append(self._offload(model.layers[name], tensors[names.index(name)], self.slots[k % num_slots]))
        self.side = torch.cuda.Stream(device) if self.is_cuda and chosen else None
        self.loaded = [torch.cuda.Event() for _ in chosen] if self.side is not None else []
        self.handles = []
        if chosen:
            self.handles.append(model.layers[names[0]].register_forward_pre_hook(lambda *_: self._prefetch(0)))
            for k, name in enumerate(chosen):
                self.handles.append(model.layers[name].register_forward_pre_hook(lambda *_, k=k: self._enter(k)))

    def describe(self) -> str:
        gib = lambda n: f"{n / memory.GIB:.2f} GiB"  # noqa: E731
        return (f"cpu_offload_gb: {len(self.plan.layers)} decoder layer(s) ({gib(self.plan.offloaded_bytes)}) in "
                f"{'pinned ' if self.is_cuda else ''}host memory, streamed through {len(self.slots)} staging "
                f"buffer(s) of {gib(self.plan.staging_bytes)}")

    def _offload(self, layer: torch.nn.Module, tensors: dict[str, Tensor], slot: Tensor) -> Tensor:
        """Pack the layer's tensors into a host buffer; point the layer at views of `slot`."""
        total = sum(_aligned(t.numel() * t.element_size()) for t in tensors.values())
        host = torch.empty(total, dtype=torch.uint8, pin_memory=self.is_cuda)
        offset = 0
        for name, tensor in tensors.items():
            num_bytes = tensor.numel() * tensor.element_size()
            host[offset : offset + num_bytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            view = slot[offset : offset + num_bytes].view(tensor.dtype).view(tensor.shape)
            owner, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(owner) if owner else layer, attr, view)
            offset += _aligned(num_bytes)
        return host

    def _prefetch(self, k: int) -> None:
        """Copy offloaded layer k into its slot (CUDA: on the side stream, after the compute stream's work so far)."""
        if k >= len(self.hosts):
            return
        host = self.hosts[k]
        slot = self.slots[k % len(self.slots)][: host.numel()]
        if self.side is None:
            slot.copy_(host)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            slot.copy_(host, non_blocking=True)
            self.loaded[k].record(self.side)

    def _enter(self, k: int) -> None:
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[k])
        if k + 1 < len(self.hosts):  # the next one's slot held layer k - 1, whose work is queued before this point
            self._prefetch(k + 1)


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN
