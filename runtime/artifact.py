"""The artifact format: the one boundary between compiler and runtime (DESIGN §2).

```
artifact/
  manifest.json                 Manifest below, as JSON
  tokenizer/                    HF tokenizer files, copied (chat template included)
  rank-00/weights.safetensors   this rank's tensors, already sharded and packed
```
The compiler writes a `Manifest`; the runtime reads it. JSON and safetensors only, no pickles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import ArtifactError
from llmc.runtime.spec_decode import SpeculativeConfig
from llmc.schema import opt, parse

FORMAT_VERSION = "1.2"  # 1.1: plan.w4a16_kernels; 1.2: target (ONNX models); older manifests load without them
MANIFEST_NAME = "manifest.json"
TOKENIZER_DIR = "tokenizer"


def rank_weights_path(rank: int) -> str:
    return f"rank-{rank:02d}/weights.safetensors"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, normalised from the HF config (one schema for every family)."""

    family: str  # "llama" (Llama 1/2/3, Mistral) | "qwen2" | "qwen3"
    architecture: str  # the HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v carry biases (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (qwen3)
    bos_token_id: int | None
    eos_token_ids: list[int]
    dtype: str  # the weights' dtype in the artifact: "float32" | "bfloat16" | "float16"
    sliding_window: int | None = None  # Mistral-style local attention window, None = full attention

    @property
    def num_parameters(self) -> int:
        """Logical parameter count (as the HF model counts it), whatever the storage format."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + q * self.hidden_size + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_layers * (attn + mlp + norms) + self.hidden_size + lm_head


@dataclass(frozen=True)
class QuantInfo:
    """What quantization did: the method, and the format spec of every linear module."""

    method: str  # "none" | "rtn" | "gptq" | "awq" | "fp8" | "import"
    modules: dict[str, dict]  # runtime module name ("layers.0.attn.qkv") → format spec ({"format": "dense"})
    settings: dict = field(default_factory=dict)  # the recipe's quantization section, for the record
    report: dict = field(default_factory=dict)  # quality numbers measured at build time (perplexity, ...)


@dataclass(frozen=True)
class ParallelPlan:
    """How the model is split: tensor parallel size, pipeline parallel size, layers per stage.

    Rank r = pipeline_rank * tensor + tensor_rank holds `rank-{r:02d}/weights.safetensors`: the
    layers of its stage, and of each of them its tensor rank's share (runtime/parallel/layout.py).
    The per-rank sizes are recorded for `llmc inspect`; the runtime derives them from the model
    and (tensor, stage_layers) with the same function the compiler used. None: an artifact
    built before parallel builds existed (tensor 1).
    """

    tensor: int = 1
    pipeline: int = 1
    stage_layers: list[list[int]] = field(default_factory=list)  # stage → decoder layer indices
    num_heads_per_rank: int | None = None  # query heads per tensor rank
    num_kv_heads_per_rank: int | None = None  # KV heads per tensor rank (replicated when tensor > num_kv_heads)
    intermediate_size_per_rank: int | None = None  # MLP columns per tensor rank
    vocab_size_per_rank: int | None = None  # embedding / lm_head rows per tensor rank (vocab padded to a multiple of tensor)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline


@dataclass(frozen=True)
class KVSpec:
    """Shape of one rank's KV cache: per layer, a [num_blocks, block_size, num_kv_heads, head_dim] K and V."""

    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_num_bytes(self.dtype)


@dataclass(frozen=True)
class RuntimeDefaults:
    """Engine options: the recipe's `runtime` section, baked into the artifact at build time;
    `llmc run` flags and `LLM(**kwargs)` override them by the same names."""

    max_model_len: int | None = opt(None, min=1, help="longest prompt + output, in tokens (default: the model's)")
    max_num_seqs: int = opt(64, min=1, help="most sequences running at once")
    max_num_batched_tokens: int = opt(2048, min=1, help="token budget of one engine step")
    block_size: int = opt(16, choices=[8, 16, 32, 64, 128], help="tokens per KV-cache block")
    gpu_memory_utilization: float = opt(0.9, min_exclusive=0.0, max=1.0, help="fraction of GPU memory to use")
    num_kv_blocks: int | None = opt(None, min=1, help="exact KV block count; overrides the memory fraction")
    cpu_kv_cache_gib: float = opt(1.0, min_exclusive=0.0, help="KV-cache size on CPU, in GiB")
    enable_prefix_caching: bool = opt(True, help="reuse the KV of shared prompt prefixes")
    enforce_eager: bool = opt(False, help="never capture CUDA graphs")
    seed: int = opt(0, min=0, help="seed of the random sampler")
    scheduling_policy: str = opt("fcfs", choices=["fcfs", "priority"], help="fcfs, or priority (lower value first)")
    speculative: SpeculativeConfig | None = opt(None, help="n-gram speculative decoding, e.g. {method: ngram, num_speculative_tokens: 3}")
    disable_log_stats: bool = opt(False, help="no periodic engine statistics line")
    log_stats_interval: float = opt(10.0, min_exclusive=0.0, help="seconds between engine statistics lines")


@dataclass(frozen=True)
class Plan:
    """Decisions made ahead of time for the runtime: graph buckets, the memory estimate, and which
    W4A16 kernel runs each GEMM shape.

    w4a16_kernels: one record per (K, N) per rank of the artifact's w4a16 linears in the gpu layout,
      "KxN" → {"source": "measured" | "heuristic",
               "gpu": the torch.cuda.get_device_name() it was measured on, or None,
               "entries": [[max_m, W4A16Config as a dict, time in µs or None], ...]}
      (the first entry whose max_m >= M applies, the last one beyond). Empty: no such linear, or an
      artifact built before the field existed (the runtime then uses the kernels' default table).
    """

    cuda_graph_batch_sizes: list[int]
    max_num_batched_tokens: int
    weight_bytes_per_rank: list[int]
    memory: dict = field(default_factory=dict)  # estimate for the target: total, weights, activations, kv
    w4a16_kernels: dict = field(default_factory=dict)


def kernel_source_label(record: dict) -> str:
    """Where one plan.w4a16_kernels record came from: "measured on NVIDIA H200", "heuristic"."""
    return f"measured on {record['gpu']}" if record.get("gpu") else str(record.get("source"))


@dataclass(frozen=True)
class Manifest:
    """The whole of manifest.json. `files` maps every other file's relative path to {sha256, size}."""

    format_version: str
    llmc_version: str
    source: dict  # {"path", "revision", "sha256": {file: digest}}
    model: ModelConfig
    quant: QuantInfo
    parallel: ParallelPlan
    kv: KVSpec
    plan: Plan
    runtime: RuntimeDefaults
    files: dict[str, dict] = field(default_factory=dict)
    # what the model file is and where it runs; empty: the torch runtime's safetensors (rank-*/).
    # ONNX: {"device": "onnx-cpu", "model_format": "onnx", "onnx": {"model", "opset", "max_positions",
    #        "op_counts", "linears"}} (runtime/onnx_model.py)
    target: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        nested = {
            "model": ModelConfig,
            "quant": QuantInfo,
            "parallel": ParallelPlan,
            "kv": KVSpec,
            "plan": Plan,
            "runtime": RuntimeDefaults,
        }
        kwargs = dict(data)
        for key, klass in nested.items():
            kwargs[key] = _build(klass, data[key], key)
        kwargs["runtime"] = parse(RuntimeDefaults, data["runtime"], "manifest.json: runtime", ArtifactError)
        return _build(cls, kwargs, "manifest")


def _build(klass, data: dict, where: str):
    names = {f.name for f in dataclasses.fields(klass)}
    missing = [f.name for f in dataclasses.fields(klass) if f.name not in data and _is_required(f)]
    if missing:
        raise ArtifactError(f"manifest.json: section {where!r} lacks {missing}; rebuild the artifact")
    return klass(**{k: v for k, v in data.items() if k in names})


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def dtype_num_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype]


def read_manifest(artifact_dir: str | Path) -> Manifest:
    """Read and check manifest.json; an unknown major format_version is refused."""
    path = Path(artifact_dir)
    if not path.is_dir():
        raise ArtifactError(f"no artifact at {path}: build one with `llmc build RECIPE`")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ArtifactError(f"{path} is not an llmc artifact (no {MANIFEST_NAME}); build one with `llmc build`")
    try:
        data = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{manifest_path} is not valid JSON ({e}); rebuild the artifact") from e
    version = str(data.get("format_version", ""))
    if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise ArtifactError(
            f"{path}: artifact format_version {version!r} is not supported by this llmc "
            f"(reads {FORMAT_VERSION.split('.')[0]}.x); rebuild it with this version of llmc"
        )
    return Manifest.from_dict(data)


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(root: Path) -> dict[str, dict]:
    """{relative path: {sha256, size}} for every file under root except the manifest."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST_NAME:
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return files


def verify_files(artifact_dir: str | Path, manifest: Manifest) -> list[str]:
    """Re-hash every file; return one problem line per missing, resized or corrupted file."""
    root = Path(artifact_dir)
    problems = []
    for rel, entry in manifest.files.items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{rel}: size {path.stat().st_size} bytes, expected {entry['size']} (truncated?)")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{rel}: sha256 mismatch (corrupted)")
    return problems


def check_sizes(artifact_dir: str | Path, manifest: Manifest, rel_paths: list[str]) -> None:
    """Fast load-time check (sizes, not hashes): refuse a truncated or missing weights file."""
    root = Path(artifact_dir)
    for rel in rel_paths:
        entry = manifest.files.get(rel)
        path = root / rel
        if entry is None or not path.is_file():
            raise ArtifactError(f"{root}: {rel} is missing; rebuild the artifact")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ArtifactError(
                f"{root}: {rel} is {size} bytes but the manifest says {entry['size']} "
                "(truncated or replaced); rebuild the artifact or run `llmc inspect --verify`"
            )


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """{tensor name: {dtype, shape, data_offsets}} from a safetensors file's header, without loading data."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header


def write_manifest(root: Path, manifest: Manifest) -> None:
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, root / MANIFEST_NAME)
