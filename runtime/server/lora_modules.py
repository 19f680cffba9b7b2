"""The server's LoRA adapters (vLLM's `--enable-lora --lora-modules NAME=PATH ...`): a request whose `model` is
an adapter's name runs with that adapter (runtime/lora.py), the base model's served names without one.

Each module gets its own lora_int_id, 1, 2, ... in the order given (adapters loaded later through
/v1/load_lora_adapter take the next ones; an id is never reused, so the prefix cache, keyed by id, never gives
one adapter's KV to another). GET /v1/models lists them as vLLM does: `root` the adapter's path, `parent` its
base model's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from llmc.errors import ConfigError
from llmc.runtime.lora import LoRARequest


@dataclass(frozen=True)
class LoraModule:
    """vLLM's LoRAModulePath: an adapter's served name, its PEFT folder and the model it adapts (None: the
    server's first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoraModule:
    """One --lora-modules value: NAME=PATH, or vLLM's JSON {"name": ..., "path": ..., "base_model_name": ...};
    ValueError saying what is wrong."""
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r}: not valid JSON ({e.msg}); give NAME=PATH or "
                             '\'{"name": NAME, "path": PATH}\'') from None
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {value!r}: unknown key {unknown[0]!r}; the keys are name, path "
                             "and base_model_name")
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ValueError(f"--lora-modules {value!r}: the JSON form needs \"name\" and \"path\" (non-empty strings)")
        if base is not None and not (isinstance(base, str) and base):
            raise ValueError(f"--lora-modules {value!r}: \"base_model_name\" must be a non-empty string")
        return LoraModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH (or JSON with name and path)")
    return LoraModule(name, path)


def parse_lora_modules(values) -> list[LoraModule]:
    """Every --lora-modules value; ValueError for a malformed one or a name given twice."""
    modules = [parse_lora_module(v) for v in values]
    seen = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice; give each adapter its own name")
        seen.add(module.name)
    return modules


class ServedAdapters:
    """The adapters a server serves by name: name → LoRARequest, and each one's parent (base model name)."""

    def __init__(self, modules: list[LoraModule] = (), default_base: str = ""):
        self.default_base = default_base
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self._last_id = 0
        for module in modules:
            self.add(module.name, module.path, module.base_model_name)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __contains__(self, name: object) -> bool:
        return name in self.requests

    def get(self, name: str | None) -> LoRARequest | None:
        return self.requests.get(name) if name else None

    def next_request(self, name: str, path: str) -> LoRARequest:
        """The LoRARequest a new adapter would get (the next id), not added yet."""
        return LoRARequest(name, self._last_id + 1, path)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        request = self.next_request(name, path)
        self._last_id = request.lora_int_id
        self.requests[name] = request
        self.parents[name] = base_model_name or self.default_base
        return request

    def remove(self, name: str) -> LoRARequest:
        self.parents.pop(name)
        return self.requests.pop(name)


def with_adapters(engine_factory: Callable[[], object], adapters: ServedAdapters) -> Callable[[], object]:
    """The factory, its engine then reading every served adapter (each data-parallel replica the same ones,
    with the same ids); a bad adapter, or an engine without enable_lora, fails its start."""
    requests = list(adapters.requests.values())

    def make_engine():
        engine = engine_factory()
        try:
            lora = getattr(getattr(engine, "runner", None), "lora", None)
            if lora is None:
                raise ConfigError("--lora-modules serves LoRA adapters: give --enable-lora too (vLLM requires "
                                  "enable_lora for them)")
            for request in requests:
                lora.read(request)
        except BaseException:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
            raise
        return engine

    return make_engine
