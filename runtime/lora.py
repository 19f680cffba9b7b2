"""Run-time LoRA (vLLM's `enable_lora`): PEFT adapters chosen per request, added to the decoder's linears.

NOTE (layout): every decoder linear an adapter may change (qkv, o, gate_up, down) gets a `LinearLora` with
A [S·m·R, in] and B [S·m·R, out]: S = max_loras slots, m members (q, k, v of qkv; gate, up of gate_up; one
elsewhere), R = max_lora_rank. Slot s, member j owns rows (s·m + j)·R ..+R: the adapter's lora_A [r, in]
zero-padded to R rows, and its lora_B [out_j, r] transposed, times PEFT's scale, in the columns of member
j's rows of the fused output. Every token of a step names a slot (or none: -1), written as int32 into one
buffer the model's linears share (`LoraSlots.token_slot`); a linear adds, in place into its output,
    (x @ A[the token's slot's rows]ᵀ) @ B[the same rows]
for each token. On CUDA that is two Triton kernels (kernels/lora_triton.py, punica's shrink and expand):
each token multiplies by its own slot's factors only. Elsewhere (the reference) it is dense over the
slots: ((x @ Aᵀ) [T, S·m·R] ⊙ the token's slot's blocks) @ B, the blocks a 0/1 mask made once per step
from token_slot (`block_masks`); rows without an adapter add exactly 0. Both keep fixed shapes, no
per-adapter loop and no host value, so the CUDA graphs capture them. PEFT computes scale · B(A x) per
module; this is the same sum up to float rounding.

What the scheduler guarantees (runtime/scheduler.py): the running requests use at most max_loras adapters,
so every step's adapters have slots. `LoraManager` keeps adapters read from disk (by lora_int_id) and
which slot each occupies; a slot is reused, least recently used first, only by a step none of whose
requests uses it (device copies are queued on the stream after the steps that read the slot).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from llmc.errors import ConfigError, RecipeError, RequestError
from llmc.kernels import is_triton_installed
from llmc.runtime import artifact as art
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.models.spec import hf_member_rows
from llmc.runtime.onnx_model import is_onnx
from llmc.runtime.peft import _load_adapter, _mergeable_linears

logger = logging.getLogger("llmc")

LORA_LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, a positive integer id (one id, one adapter) and its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise RequestError(f"lora_request.lora_name {self.lora_name!r}: expected a non-empty string",
                               param="lora_request")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise RequestError(f"lora_request.lora_int_id {self.lora_int_id!r}: expected an integer >= 1 (vLLM's rule)",
                               param="lora_request")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise RequestError("lora_request.lora_path: give the PEFT adapter's folder", param="lora_request")


def check_lora_artifact(manifest: art.Manifest) -> None:
    """A ConfigError naming what stops run-time LoRA on this artifact: the adapters' deltas are computed on the
    linears' inputs as the checkpoint had them, so builds that changed those inputs (AWQ's and SmoothQuant's
    folded scales) or the outputs (Granite's folded multipliers, GLM-4's and Cohere's permuted q/k rows) cannot take
    them; nor can mixture-of-experts layers, split or ONNX artifacts (not built yet). W8A8 linears can: with LoRA on
    they quantize their input themselves (LoraSlots), so the adapters read it unquantized."""
    model, quant = manifest.model, manifest.quant
    problem = None
    if is_onnx(manifest):
        problem = "an onnx-cpu artifact"
    elif manifest.parallel.world_size != 1:
        problem = f"an artifact split into {manifest.parallel.world_size} ranks"
    elif model.num_experts:
        problem = "a mixture-of-experts model"
    elif model.kv_lora_rank:
        problem = "DeepSeek's latent attention (its q / kv_a / kv_b linears have no run-time LoRA)"
    elif model.family in ("granite", "granitemoehybrid"):
        problem = "Granite (its residual_multiplier is folded into o_proj and down_proj at build time)"
    elif not model.gated_mlp:
        problem = (f"{model.architecture} (its MLP without gate, hidden_act {model.hidden_act}: mlp.up in place of "
                   "the mlp.gate_up the adapters' deltas are added to)")
    elif model.rotary_rows_permuted:
        problem = (f"{model.architecture} (its q_proj and k_proj rows are permuted into the runtime's rotary layout "
                   "at build time)")
    elif quant.method == "awq":
        problem = "an AWQ build (its scales are folded into the norms: the linears see scaled inputs)"
    elif quant.settings.get("smoothquant"):
        problem = "a SmoothQuant build (its scales are folded into the norms: the linears see scaled inputs)"
    elif spec_for_architecture(model.architecture) is None:
        problem = f"architecture {model.architecture}"
    if problem is not None:
        raise ConfigError(f"enable_lora: run-time LoRA does not run on {problem}; merge the adapter at build time "
                          "(recipe `adapter`), or serve a build that folds no scales into the norms (method none, rtn, gptq, "
                          "fp8, or int8 without smoothquant)")


@dataclass
class LoadedAdapter:
    """One adapter's factors per runtime linear ("layers.3.attn.qkv"): per member, (A [r, in], scale · B [out_j, r])
    float32, or None where the adapter leaves that member alone."""

    request: LoRARequest
    factors: dict[str, list[tuple[Tensor, Tensor] | None]]
    rank: int


class _ModuleShapes:
    """The checkpoint's module names and weight shapes, as the artifact's config gives them (what
    peft._load_adapter asks of a checkpoint reader)."""

    def __init__(self, modules: dict[str, tuple[int, int]], others: set[str]):
        self.modules, self.others = modules, others

    def has(self, name: str) -> bool:
        return name.removesuffix(".weight") in self.modules or name in self.others

    def names(self) -> list[str]:
        return [m + ".weight" for m in self.modules] + sorted(self.others)


def read_adapter(request: LoRARequest, manifest: art.Manifest, max_rank: int) -> LoadedAdapter:
    """Read and check a PEFT adapter against the artifact's model; a RequestError (400) says what is wrong."""
    model = manifest.model
    spec = spec_for_architecture(model.architecture)
    modules, where = {}, {}  # HF module → (out, in); HF module → (runtime linear, member index)
    for index in range(model.num_layers):
        for linear in spec.layer_linears:
            if linear.name not in LORA_LINEARS:
                continue
            in_features = {"attn.o": model.num_heads * model.head_dim, "mlp.down": model.intermediate_size}.get(
                linear.name, model.hidden_size)
            for member, (hf_name, rows) in enumerate(zip(linear.hf_members, hf_member_rows(linear, model))):
                hf_module = f"{spec.hf_layer_prefix}{index}.{hf_name}"
                modules[hf_module] = (rows, in_features)
                where[hf_module] = (f"layers.{index}.{linear.name}", member)
    others = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    shapes = _ModuleShapes(modules, others)
    if not Path(request.lora_path).is_dir():
        raise RequestError(f"lora_request {request.lora_name!r}: {request.lora_path} is not a folder; give a PEFT "
                           "adapter's folder (adapter_config.json + adapter_model.safetensors)", param="lora_request")
    try:
        adapter = _load_adapter(request.lora_path, f"lora_request {request.lora_name!r}", modules,
                                _mergeable_linears(spec, model), shapes)
    except RecipeError as e:
        raise RequestError(str(e), param="lora_request") from None
    factors: dict[str, list[tuple[Tensor, Tensor] | None]] = {}
    rank = 0
    for hf_module, f in adapter.modules.items():
        linear, member = where[hf_module]
        rank = max(rank, f.a.shape[0])
        members = factors.setdefault(linear, [None] * len(_members(spec, linear)))
        members[member] = (f.a, f.b * f.scale)
    if rank > max_rank:
        raise RequestError(f"lora_request {request.lora_name!r}: rank {rank} is above max_lora_rank {max_rank}; start "
                           f"the engine with max_lora_rank {rank} or more (--max-lora-rank)", param="lora_request")
    return LoadedAdapter(request, factors, rank)


def _down_groups_reordered(down) -> bool:
    """Whether an act-order down projection's groups were put in order at build time, its input columns and
    gate_up's rows permuted alike (compiler/shard.order_down_groups): its g_idx (plain layout) or perm (gpu
    layout, dropped as the identity: Linear.drop_identity_perm) is then in order."""
    fmt = down.fmt
    if not getattr(fmt, "has_g_idx", False):
        return False
    if getattr(fmt, "layout", "plain") == "gpu":
        return "perm" not in down.param_names
    g_idx = down.g_idx.cpu().to(torch.int64)
    return torch.equal(g_idx, torch.arange(g_idx.numel()) // fmt.group_size)


def _members(spec, linear_name: str) -> tuple[str, ...]:
    return spec.layer_linear(linear_name.split(".", 2)[2]).hf_members


class LinearLora:
    """One linear's adapter slots (see NOTE): A [S·m·R, in] and B [S·m·R, out], the model's dtype."""

    def __init__(self, slots: LoraSlots, member_rows: list[int], in_features: int, input_perm: Tensor | None):
        self.slots = slots
        self.member_rows = member_rows
        self.member_starts = [sum(member_rows[:j]) for j in range(len(member_rows))]
        # the linear's input arrives in this column order (an act-order gather done by the norm before it)
        self.input_perm = input_perm
        block = len(member_rows) * slots.max_rank
        self.a = torch.zeros(slots.max_loras * block, in_features, dtype=slots.dtype, device=slots.device)
        self.b = torch.zeros(slots.max_loras * block, sum(member_rows), dtype=slots.dtype, device=slots.device)

    def add_to(self, out: Tensor, x: Tensor) -> Tensor:
        """out [T, out] += each token's own slot's x [T, in] @ Aᵀ @ B, in place: on CUDA two Triton kernels
        (kernels/lora_triton.py); elsewhere three torch ops dense over the slots: x @ Aᵀ [T, S·m·R], the
        token's slot kept (its R-blocks' 0/1 mask, made once per step for all linears), @ B added in place."""
        if not self.slots.active:  # no token of the step has an adapter (outside a graph holding the sums)
            return out
        if self.slots.kernels:
            from llmc.kernels import lora_triton  # triton loads on the first CUDA call only

            return lora_triton.lora_add(out, x, self.a, self.b, self.slots.token_slot, self.slots.max_loras)
        xa = x @ self.a.T  # [T, S·m·R]
        xa.mul_(self.slots.block_masks[len(self.member_rows)][: x.shape[0]])
        return out.addmm_(xa, self.b)

    def load(self, slot: int, members: list[tuple[Tensor, Tensor] | None] | None) -> None:
        """Slot `slot` holds these factors (None: zeros)."""
        rank, m = self.slots.max_rank, len(self.member_rows)
        rows = slice(slot * m * rank, (slot + 1) * m * rank)
        a = torch.zeros(m * rank, self.a.shape[1], dtype=torch.float32)
        b = torch.zeros(m * rank, self.b.shape[1], dtype=torch.float32)
        for j, factors in enumerate(members or []):
            if factors is None:
                continue
            lora_a, scaled_b = factors
            r = lora_a.shape[0]
            a[j * rank : j * rank + r] = lora_a if self.input_perm is None else lora_a[:, self.input_perm.cpu()]
            start = self.member_starts[j]
            b[j * rank : j * rank + r, start : start + self.member_rows[j]] = scaled_b.T
        self.a[rows].copy_(a.to(self.slots.dtype), non_blocking=True)
        self.b[rows].copy_(b.to(self.slots.dtype), non_blocking=True)


class LoraSlots:
    """The model's adapter slots: a LinearLora on each qkv / o / gate_up / down, and the step's token → slot
    map they share (token_slot [max_tokens] int32, -1: no adapter)."""

    def __init__(self, model, max_loras: int, max_rank: int, max_tokens: int, device: torch.device):
        self.max_loras, self.max_rank, self.device = max_loras, max_rank, device
        self.dtype = getattr(torch, model.config.dtype)
        self._init_mapping(max_tokens)
        spec = spec_for_architecture(model.config.architecture)
        self.linears: dict[str, LinearLora] = {}
        for layer in model.layers.values():  # W8A8: the adapters need x unquantized; the linear quantizes it itself
            for norm in (getattr(layer, "input_norm", None), getattr(layer, "post_attn_norm", None)):
                if norm is not None:
                    norm.fp8_output = False
            layer.mlp.fp8_down_input = False
        for index, layer in model.layers.items():
            norms = {"attn.qkv": getattr(layer, "input_norm", None), "mlp.gate_up": getattr(layer, "post_attn_norm", None)}
            for name in LORA_LINEARS:
                module = layer.get_submodule(name)  # "attn.qkv" → layer.attn.qkv
                norm = norms.get(name)
                perm = None if norm is None else norm.out_perm
                lora = LinearLora(self, hf_member_rows(spec.layer_linear(name), model.config), module.in_features, perm)
                module.lora = lora
                self.linears[f"layers.{index}.{name}"] = lora
        # layers whose intermediate channels the build permuted (act order: compiler/shard.order_down_groups)
        self.reordered_mlps = {index for index, layer in model.layers.items() if _down_groups_reordered(layer.mlp.down)}

    def check(self, adapter: LoadedAdapter) -> None:
        """A RequestError for an adapter on gate/up/down of a layer whose intermediate channels the build
        permuted without keeping the order (an act-order down projection's groups put in order): its deltas
        would land on the wrong channels."""
        layers = sorted({int(name.split(".")[1]) for name in adapter.factors if name.split(".", 2)[2] in ("mlp.gate_up", "mlp.down")
                         and name.split(".")[1] in self.reordered_mlps})
        if layers:
            raise RequestError(f"lora_request {adapter.request.lora_name!r}: this act-order build permuted the MLP's "
                               f"intermediate channels (layers {layers}: down's groups put in order) and keeps no "
                               "record of the order, so an adapter on gate/up/down cannot run on it; target the "
                               "attention projections only, merge the adapter at build time (recipe `adapter`), or "
                               "serve a build without act order", param="lora_request")

    def load(self, slot: int, adapter: LoadedAdapter) -> None:
        for name, lora in self.linears.items():
            lora.load(slot, adapter.factors.get(name))

    def _init_mapping(self, max_tokens: int, kernels: bool | None = None) -> None:
        """The step's token → slot buffers, for up to max_tokens tokens (all -1 at first). kernels: whether
        add_to runs the Triton kernels (default: on CUDA, with triton installed)."""
        self.max_tokens = max_tokens
        # whether a token of the step has an adapter: the LoRA sums are skipped when not, eagerly and in the
        # decode graphs captured without them (compilation_config.cudagraph_specialize_lora)
        self.active = True
        # CUDA: the two kernels read token_slot; elsewhere the torch sum reads the block masks made from it
        self.kernels = self.device.type == "cuda" and is_triton_installed() if kernels is None else kernels
        self.token_slot = torch.full((max_tokens,), -1, dtype=torch.int32, device=self.device)
        # two host buffers, alternating: a step's copy may still be queued when the next step fills its own (the
        # engine resolves step N before it builds step N + 2, as runtime/step_inputs.py's staging buffers rely on)
        self._hosts = [torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
                       for _ in range(2)]
        self._num_steps = 0
        # torch path: each column's slot of x @ Aᵀ [T, S·m·R], and the step's 0/1 mask of the token's slot's
        # columns, for m = 1, 2, 3 members (o/down, gate_up, qkv)
        self._column_slots = {} if self.kernels else {
            m: torch.arange(self.max_loras * m * self.max_rank, device=self.device) // (m * self.max_rank)
            for m in (1, 2, 3)}
        self.block_masks = {m: torch.zeros(max_tokens, columns.numel(), dtype=self.dtype, device=self.device)
                            for m, columns in self._column_slots.items()}

    def set_mapping(self, token_slots: list[int]) -> None:
        """Each token's slot (-1: no adapter) for the next forward, into token_slot (one host-to-device copy),
        and on the torch path into the block masks."""
        num_tokens = len(token_slots)
        self.active = any(slot >= 0 for slot in token_slots)
        host = self._hosts[self._num_steps % 2][:num_tokens]
        self._num_steps += 1
        host.copy_(torch.tensor(token_slots, dtype=torch.int32))
        token_slot = self.token_slot[:num_tokens]
        token_slot.copy_(host, non_blocking=True)
        for m, mask in self.block_masks.items():
            mask[:num_tokens] = token_slot[:, None] == self._column_slots[m]


class LoraManager:
    """Adapters read from disk (by lora_int_id) and the slot each holds; a step asks `slots_for` its requests'."""

    def __init__(self, manifest: art.Manifest, slots: LoraSlots, max_cpu_loras: int | None = None):
        self.manifest, self.slots = manifest, slots
        self.adapters: OrderedDict[int, LoadedAdapter] = OrderedDict()
        # every id's request, kept after its factors are dropped from host memory (max_cpu_loras): a request
        # queued with an adapter evicted since is read again when a step needs its slot
        self.requests: dict[int, LoRARequest] = {}
        self.max_cpu_loras = max_cpu_loras or max(slots.max_loras, 8)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id → slot, least recently used first

    def read(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter for `request` (read once per lora_int_id; an id given with another path is refused)."""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is not None:
            if (adapter.request.lora_path, adapter.request.lora_name) != (request.lora_path, request.lora_name):
                raise RequestError(f"lora_request: lora_int_id {request.lora_int_id} is {adapter.request.lora_name!r} "
                                   f"at {adapter.request.lora_path}; give each adapter its own id", param="lora_request")
            self.adapters.move_to_end(request.lora_int_id)
            return adapter
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise RequestError(f"lora_request: lora_int_id {request.lora_int_id} is {known.lora_name!r} at "
                               f"{known.lora_path}; give each adapter its own id", param="lora_request")
        adapter = read_adapter(request, self.manifest, self.slots.max_rank)
        self.slots.check(adapter)
        self.requests[request.lora_int_id] = request
        self.adapters[request.lora_int_id] = adapter
        while len(self.adapters) > self.max_cpu_loras:  # the least recently used one no slot holds
            victim = next((i for i in self.adapters if i not in self.slot_of and i != request.lora_int_id), None)
            if victim is None:
                break
            del self.adapters[victim]
        logger.info("LoRA adapter %r (id %d, rank %d) read from %s", request.lora_name, request.lora_int_id,
                    adapter.rank, request.lora_path)
        return adapter

    def slots_for(self, lora_ids: set[int]) -> dict[int, int]:
        """A slot for each adapter id of a step (at most max_loras of them: the scheduler's guarantee)."""
        if len(lora_ids) > self.slots.max_loras:
            raise ValueError(f"a step with {len(lora_ids)} adapters, above max_loras {self.slots.max_loras}")
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.slots.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used adapter this step does not use
                victim = next(i for i in self.slot_of if i not in lora_ids)
                slot = self.slot_of.pop(victim)
            adapter = self.adapters.get(lora_id)
            if adapter is None:  # dropped from host memory while its request waited: read it again
                adapter = self.read(self.requests[lora_id])
            self.slots.load(slot, adapter)
            self.slot_of[lora_id] = slot
        return {lora_id: self.slot_of[lora_id] for lora_id in lora_ids}
