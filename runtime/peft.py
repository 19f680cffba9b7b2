"""PEFT LoRA adapters read and checked against a model: what the build merges into the weights (compiler/lora.py,
the recipe's `adapter`) and what the runtime adds per request (runtime/lora.py, vLLM's `enable_lora`).

An adapter is a PEFT directory: `adapter_config.json` and `adapter_model.safetensors`, whose tensors are
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. Module W's delta is
scale · B·A with scale = alpha / r (alpha / sqrt(r) with `use_rslora`), r and alpha per module from
`rank_pattern` / `alpha_pattern`, as PEFT computes it. Everything else PEFT can save (DoRA, biases,
modules_to_save, embedding LoRA, other PEFT types, ...) is refused by name. Errors are RecipeErrors (one line,
prefixed by `key`: which adapter); the runtime re-raises them as its own.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from torch import Tensor

from llmc.errors import RecipeError
from llmc.runtime.artifact import ModelConfig, sha256_file
from llmc.runtime.models.spec import ModelSpec, in_layer

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
_PREFIX = "base_model.model."
_FACTORS = ("lora_A.weight", "lora_B.weight")

# init_lora_weights values whose adapter is a plain delta on the unchanged base model (PiSSA, OLoRA, CorDA,
# LoftQ and LoRA-GA change the base weights when they initialise: their adapters need that changed base)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")

# adapter_config.json keys that ask for more than W + scale·B·A: refused when set, with what to change
_REFUSED_KEYS = {
    "use_dora": "DoRA (use_dora) is not merged; merge it with PEFT (merge_and_unload) and build the merged checkpoint",
    "lora_bias": "a LoRA bias (lora_bias) is not merged; train without it, or merge with PEFT and build the merged checkpoint",
    "modules_to_save": "modules_to_save holds whole trained modules, which are not merged; merge with PEFT "
                       "(merge_and_unload) and build the merged checkpoint",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices) are not merged; merge with PEFT "
                               "and build the merged checkpoint",
    "layer_replication": "layer_replication changes the model's layers; merge with PEFT and build the merged checkpoint",
    "target_parameters": "LoRA on parameters (target_parameters, MoE experts) is not merged; target linear modules",
    "alora_invocation_tokens": "an activated LoRA (alora_invocation_tokens) acts only after its invocation tokens "
                               "and cannot be merged into the weights",
    "use_qalora": "QA-LoRA (use_qalora) is not merged; merge it with PEFT and build the merged checkpoint",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not merged; merge it with PEFT and build the merged checkpoint",
    "arrow_config": "Arrow routing (arrow_config) picks adapters per token and cannot be merged",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not merged; merge it with PEFT and build the merged checkpoint",
    "kasa_config": "KaSA (kasa_config) is not merged; merge it with PEFT and build the merged checkpoint",
    "velora_config": "VeLoRA (velora_config) is not merged; merge it with PEFT and build the merged checkpoint",
}


def adapter_key(index: int, count: int) -> str:
    """The recipe key naming adapter `index` of `count`: "adapter", or "adapter[i]" for a list."""
    return "adapter" if count == 1 else f"adapter[{index}]"


def check_adapter_dir(key: str, path: str) -> None:
    """The files an adapter directory must hold, checked when the recipe is read (no tensor is opened)."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is a file; give the adapter's directory" if folder.exists() else "does not exist"
        raise RecipeError(f"{key}: {path!r} {what} (a PEFT LoRA directory: {CONFIG_NAME} + {WEIGHTS_NAME})")
    if not (folder / CONFIG_NAME).is_file():
        raise RecipeError(f"{key}: {path!r} has no {CONFIG_NAME}; give a PEFT adapter directory (save_pretrained's output)")
    if not (folder / WEIGHTS_NAME).is_file():
        hint = (f"{PICKLE_NAME} is a pickle, which llmc does not load: save the adapter with PEFT's "
                f"save_pretrained(..., safe_serialization=True)" if (folder / PICKLE_NAME).is_file()
                else "save the adapter with PEFT's save_pretrained")
        raise RecipeError(f"{key}: {path!r} has no {WEIGHTS_NAME}; {hint}")


@dataclass(frozen=True)
class LoraFactors:
    """One module's delta: scale · b @ a (float32)."""

    a: Tensor  # [r, in]
    b: Tensor  # [out, r]
    scale: float


@dataclass(frozen=True)
class Adapter:
    path: str  # as the recipe gives it
    modules: dict[str, LoraFactors]  # HF module name ("model.layers.0.self_attn.q_proj") → its factors

    def record(self) -> dict:
        """The manifest's entry (source.adapters): the path as given and the sha256 of its files."""
        folder = Path(self.path)
        return {"path": self.path, "sha256": {name: sha256_file(folder / name) for name in (CONFIG_NAME, WEIGHTS_NAME)},
                "modules": len(self.modules)}


def _mergeable_linears(spec: ModelSpec, model: ModelConfig) -> set[str]:
    """The decoder layers' linears (attention, and dense MLPs), by HF module name."""
    out = set()
    for index in range(model.num_layers):
        for linear in spec.layer_linears:
            if not in_layer(linear, model, index):
                continue
            out |= {f"{spec.hf_layer_prefix}{index}.{member}" for member in linear.hf_members}
    return out


def _load_adapter(path: str, key: str, modules: dict[str, tuple[int, ...]], linears: set[str], reader) -> Adapter:
    folder = Path(path)
    try:
        config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RecipeError(f"{key}: {folder / CONFIG_NAME} is not a readable JSON file ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise RecipeError(f"{key}: {folder / CONFIG_NAME} must hold a JSON object")
    _check_config(key, config)
    factors = _read_factors(key, folder / WEIGHTS_NAME)
    for module in sorted(factors):
        _check_module(key, module, linears, reader)
    targeted = {m for m in modules if _targets(config, m)}
    _check_target_entries(key, config, modules)
    for module in sorted(set(factors) - targeted):
        raise RecipeError(f"{key}: {WEIGHTS_NAME} holds LoRA weights for {module}, which {CONFIG_NAME}'s "
                          "target_modules / layers_to_transform do not select; the files do not belong together")
    for module in sorted(targeted - set(factors)):
        raise RecipeError(f"{key}: {CONFIG_NAME} targets {module}, and {WEIGHTS_NAME} has no lora_A/lora_B for it; "
                          "the files do not belong together")
    out = {}
    for module, (a, b) in sorted(factors.items()):
        rank, alpha = _pattern_value(config, "rank_pattern", "r", module), _pattern_value(config, "alpha_pattern", "lora_alpha", module)
        out_features, in_features = modules[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise RecipeError(f"{key}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not of rank {rank} "
                              f"(r / rank_pattern in {CONFIG_NAME}); the files do not belong together")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise RecipeError(f"{key}: {module}: the adapter's delta is [{b.shape[0]}, {a.shape[1]}] and the checkpoint's "
                              f"weight [{out_features}, {in_features}]; the adapter was trained on another base model")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        out[module] = LoraFactors(a.float(), b.float(), scale)
    return Adapter(path, out)


def _check_config(key: str, config: dict) -> None:
    where = f"{key}: {CONFIG_NAME}"
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise RecipeError(f"{where}: peft_type {peft_type!r} is not merged; llmc merges LoRA adapters (peft_type LORA) "
                          "only: merge other kinds with PEFT (merge_and_unload) and build the merged checkpoint")
    for name, message in _REFUSED_KEYS.items():
        if config.get(name):
            raise RecipeError(f"{where}: {name}: {message}")
    if config.get("bias", "none") != "none":
        raise RecipeError(f"{where}: bias {config['bias']!r}: trained biases are not merged; train with bias 'none', or "
                          "merge with PEFT and build the merged checkpoint")
    if config.get("fan_in_fan_out"):
        raise RecipeError(f"{where}: fan_in_fan_out true is for GPT-2-style Conv1D weights, and this model's linears "
                          "are nn.Linear (PEFT sets it back to false for them); set it to false")
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise RecipeError(f"{where}: init_lora_weights {init!r} changes the base weights when it initialises, and the "
                          "adapter needs that changed base; save it with PEFT's path_initial_model_for_weight_conversion "
                          "(a plain LoRA of the original model)")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets))):
        raise RecipeError(f"{where}: target_modules {targets!r}: expected a list of module names or a regex string")
    layers = config.get("layers_to_transform")
    if layers is not None and layers != [] and isinstance(targets, str):
        raise RecipeError(f"{where}: layers_to_transform applies to a list of target_modules, not a regex string "
                          "(PEFT refuses it too); put the layers in the regex")
    for name in ("r", "lora_alpha"):
        if not isinstance(config.get(name), (int, float)) or isinstance(config.get(name), bool) or config[name] <= 0:
            raise RecipeError(f"{where}: {name} {config.get(name)!r}: expected a positive number")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise RecipeError(f"{where}: {name} {config.get(name)!r}: expected a mapping of module patterns to numbers")


def _read_factors(key: str, path: Path) -> dict[str, tuple[Tensor, Tensor]]:
    """{module: (lora_A, lora_B)} from the weights file; any other tensor is refused by name."""
    parts: dict[str, dict[str, Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                module, factor = _split_key(key, name)
                parts.setdefault(module, {})[factor] = f.get_tensor(name)
    except (OSError, ValueError, RuntimeError) as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"{key}: {path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    for module, found in parts.items():
        missing = [factor for factor in _FACTORS if factor not in found]
        if missing:
            raise RecipeError(f"{key}: {WEIGHTS_NAME} has {module}'s {' and '.join(found)} without its {missing[0]}")
    if not parts:
        raise RecipeError(f"{key}: {WEIGHTS_NAME} holds no LoRA weights")
    return {module: (found["lora_A.weight"], found["lora_B.weight"]) for module, found in parts.items()}


def _split_key(key: str, name: str) -> tuple[str, str]:
    if "lora_embedding_A" in name or "lora_embedding_B" in name:
        raise RecipeError(f"{key}: {name}: LoRA on an embedding is not merged; train without the embedding in "
                          "target_modules, or merge with PEFT and build the merged checkpoint")
    if name.endswith(".lora_B.bias"):
        raise RecipeError(f"{key}: {name}: a LoRA bias (lora_bias) is not merged; train without it, or merge with PEFT "
                          "and build the merged checkpoint")
    if "lora_magnitude_vector" in name:
        raise RecipeError(f"{key}: {name}: a DoRA magnitude vector; DoRA is not merged (merge it with PEFT and build "
                          "the merged checkpoint)")
    if name.startswith(_PREFIX):
        for factor in _FACTORS:
            if name.endswith("." + factor):
                return name[len(_PREFIX):-len(factor) - 1], factor
    raise RecipeError(f"{key}: {WEIGHTS_NAME} holds {name!r}, which is not a PEFT LoRA factor "
                      f"({_PREFIX}<module>.lora_A.weight / .lora_B.weight); merge it with PEFT and build the merged checkpoint")


def _check_module(key: str, module: str, linears: set[str], reader) -> None:
    if module in linears:
        return
    if not reader.has(module + ".weight"):
        raise RecipeError(f"{key}: the adapter changes {module}, which this checkpoint does not have; it was trained on "
                          "another model")
    if ".experts." in module or module.endswith((".gate", ".router")):
        raise RecipeError(f"{key}: {module}: LoRA on mixture-of-experts experts and routers is not merged; target the "
                          "attention projections only, or merge with PEFT and build the merged checkpoint")
    raise RecipeError(f"{key}: {module}: LoRA is merged into the decoder layers' linears (q/k/v/o_proj, gate/up/down_proj) "
                      "only, not the embedding or lm_head; train without it, or merge with PEFT and build the merged checkpoint")


def _targets(config: dict, module: str) -> bool:
    """Whether PEFT puts a LoRA layer on `module` under this config (its target_modules, exclude_modules,
    layers_to_transform and layers_pattern rules)."""
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, module):
        return False
    if isinstance(exclude, list) and any(module == e or module.endswith("." + e) for e in exclude):
        return False
    targets = config["target_modules"]
    if targets == "all-linear":  # PEFT's shorthand: every linear but the output layer
        return module != "lm_head" and not module.endswith(("embed_tokens", "norm", "layernorm"))
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    if module in targets:
        return True
    if not any(module.endswith("." + t) for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern")
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)  # the first numbered segment: the layer index
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            if (match := re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)) is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _check_target_entries(key: str, config: dict, modules: dict) -> None:
    """Every module name target_modules lists (every regex) must name some module of this model."""
    targets = config["target_modules"]
    if targets == "all-linear":
        return
    if isinstance(targets, str):
        if not any(re.fullmatch(targets, m) for m in modules):
            raise RecipeError(f"{key}: {CONFIG_NAME}: target_modules {targets!r} matches no module of this model; it "
                              "was trained on another model")
        return
    for target in targets:
        if not any(m == target or m.endswith("." + target) for m in modules):
            raise RecipeError(f"{key}: {CONFIG_NAME}: target_modules names {target!r}, which this model does not have; "
                              "it was trained on another model (or drop the name)")


def _pattern_value(config: dict, pattern_key: str, default_key: str, module: str) -> float:
    """r or lora_alpha of `module`: the first rank_pattern / alpha_pattern key that matches the end of its name
    (a regex, on whole name segments), else the config's r / lora_alpha."""
    for pattern, value in (config.get(pattern_key) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return config[default_key]

