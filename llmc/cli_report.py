"""What `llmc build` and `llmc inspect` print: a readable summary, and the same numbers as a dict."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import click

from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.onnx_model import is_onnx
from llmc.runtime.parallel.layout import all_rank_layouts
from llmc.runtime.spec_decode import default_method

COMPONENTS = (("embed.", "embedding"), ("lm_head.", "lm_head"), (".attn.", "attention"), (".mlp.", "mlp"),
              (".moe.", "moe"))  # moe: the experts and the router
KERNEL_MS = (1, 16, 256)  # the M (tokens in a step) at which inspect shows the planned W4A16 kernel


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def bytes_by_component(artifact_dir: str | Path, manifest: art.Manifest) -> dict[str, int]:
    sizes: dict[str, int] = defaultdict(int)
    for name, num_bytes in _tensor_bytes(Path(artifact_dir), manifest):
        component = next((label for key, label in COMPONENTS if key in name or name.startswith(key)), "norms")
        sizes[component] += num_bytes
    return dict(sizes)


def _tensor_bytes(root: Path, manifest: art.Manifest):
    """(tensor name, bytes) of every stored weight: the ranks' safetensors, or the ONNX initializers."""
    if is_onnx(manifest):
        import onnx

        model = onnx.load(str(root / manifest.target["onnx"]["model"]), load_external_data=False)
        for tensor in model.graph.initializer:
            external = {entry.key: entry.value for entry in tensor.external_data}
            yield tensor.name, int(external["length"]) if "length" in external else len(tensor.raw_data)
        return
    for rank in range(manifest.parallel.tensor * manifest.parallel.pipeline):
        for name, entry in art.read_safetensors_header(root / art.rank_weights_path(rank)).items():
            start, end = entry["data_offsets"]
            yield name, end - start


def _onnx_summary(manifest: art.Manifest) -> dict | None:
    """The ONNX model's op mix and how its linears run (None for a torch artifact)."""
    if not is_onnx(manifest):
        return None
    record = manifest.target["onnx"]
    kinds = defaultdict(int)
    for kind in record.get("linears", {}).values():
        kinds[kind] += 1
    return {"device": manifest.target.get("device"), "model": record["model"], "opset": record.get("opset"),
            "op_counts": record.get("op_counts", {}), "linears": dict(kinds),
            "float_fallbacks": record.get("float_fallbacks", {})}


def _runtime_features(rt: dict) -> str:
    """What the recipe's runtime section turns on beyond the sizes: speculation (its draft), run-time LoRA, pooling."""
    parts = []
    spec = rt.get("speculative")
    if spec:
        method = spec.get("method") or default_method(spec.get("model"))
        draft = f" {spec['model']}" if spec.get("model") else ""
        parts.append(f"speculative {method}{draft}, k {spec['num_speculative_tokens']}")
    if rt.get("enable_lora"):
        parts.append(f"run-time LoRA (max_loras {rt['max_loras']}, max_lora_rank {rt['max_lora_rank']})")
    if rt.get("runner") == "pooling" or rt.get("convert") == "embed":
        pooler = rt.get("pooler_config") or {}
        how = ", ".join(f"{k} {v}" for k, v in pooler.items() if v is not None) or "the checkpoint's pooling"
        parts.append(f"runner pooling (embeddings; {how})")
    return "".join(f"; {p}" for p in parts)


def inspect_report(artifact_dir: str, manifest: art.Manifest, gpu_memory_gib: float | None) -> dict:
    model, runtime = manifest.model, manifest.runtime
    weight_bytes = sum(manifest.plan.weight_bytes_per_rank)
    gib = gpu_memory_gib or manifest.plan.memory.get("target_gpu_memory_gib", 80.0)
    # the decoder layers' bytes per rank (offload plans; none for an ONNX model)
    layer_bytes = None if is_onnx(manifest) else memory.layer_bytes_per_rank(Path(artifact_dir), model, manifest.parallel)
    on_gpu = manifest.plan.weight_bytes_per_rank
    if layer_bytes is not None:  # the artifact's own offload, as its knob row shows
        on_gpu = memory.gpu_weight_bytes(on_gpu, layer_bytes, runtime.cpu_offload_gb)
    estimates = memory.estimate_per_rank(model, manifest.parallel, on_gpu, manifest.kv.dtype, runtime,
                                         int(gib * memory.GIB))
    estimate = memory.least_room(estimates)
    formats = defaultdict(int)
    for spec in manifest.quant.modules.values():
        formats[_format_label(spec)] += 1
    return {
        "artifact": str(artifact_dir),
        "format_version": manifest.format_version,
        "llmc_version": manifest.llmc_version,
        "model": {**manifest.model.__dict__, "num_parameters": model.num_parameters},
        "source": {"path": manifest.source.get("path"), "revision": manifest.source.get("revision"),
                   "adapters": manifest.source.get("adapters", [])},
        "quantization": {"method": manifest.quant.method, "formats": dict(formats), "modules": manifest.quant.modules,
                         "report": manifest.quant.report},
        "parallel": manifest.parallel.__dict__,
        "ranks": _rank_rows(manifest, estimates),
        "weight_bytes": weight_bytes,
        "dense_bf16_bytes": 2 * model.num_parameters,
        "bytes_by_component": bytes_by_component(artifact_dir, manifest),
        "kv": {**manifest.kv.__dict__, "bytes_per_token": manifest.kv.bytes_per_token},
        "runtime": dataclasses.asdict(runtime),  # nested: compilation_config, speculative
        "cuda_graph_batch_sizes": manifest.plan.cuda_graph_batch_sizes,
        "w4a16_kernels": manifest.plan.w4a16_kernels,
        "w4a16_kernel_summary": _kernel_summary(manifest),
        "memory_estimate": {"gpu_memory_gib": gib, **estimate.to_dict()},
        "memory_knobs": _memory_knobs(manifest, layer_bytes, int(gib * memory.GIB)),
        "num_files": len(manifest.files),
        "onnx": _onnx_summary(manifest),
        "vision": dataclasses.asdict(manifest.vision) if manifest.vision is not None else None,
        # GLM-4.5's / DeepSeek-V3's MTP layer (speculative method mtp) and its file's bytes; None: none
        "mtp": ({**dataclasses.asdict(manifest.mtp), "bytes": manifest.files[art.MTP_WEIGHTS]["size"]}
                if manifest.mtp is not None else None),
    }


def _memory_knobs(manifest: art.Manifest, layer_bytes: list[list[int]] | None, total_bytes: int) -> list[dict]:
    """What kv_cache_dtype and cpu_offload_gb buy on this GPU (none for an ONNX model: no `layer_bytes`)."""
    if layer_bytes is None:
        return []
    offloads = sorted({0.0, 4.0, 8.0, manifest.runtime.cpu_offload_gb})
    return memory.knob_table(manifest.model, manifest.parallel, manifest.plan.weight_bytes_per_rank, layer_bytes,
                             manifest.runtime, total_bytes, offloads)


def _knob_rows(report: dict) -> list[tuple[str, str]]:
    rows = report.get("memory_knobs") or []
    if not rows:
        return []
    out = [("memory knobs", f"on {report['memory_estimate']['gpu_memory_gib']:g} GiB: KV tokens (sequences of "
                            f"max_model_len {report['runtime']['max_model_len']})")]
    for r in rows:
        layers = f", {r['offloaded_layers']} layers in host memory" if r["cpu_offload_gb"] else ""
        out.append((f"  kv {r['kv_cache_dtype']}, offload {r['cpu_offload_gb']:g} GiB",
                    f"{r['num_kv_tokens']:,} tokens ({r['max_concurrent_seqs']:.1f} seqs), GPU weights "
                    f"{_fmt_bytes(r['weight_bytes'])}{layers}"))
    return out


def _rank_rows(manifest: art.Manifest, estimates: list[memory.MemoryEstimate]) -> list[dict]:
    """Per rank: what it holds, its weight bytes, its KV bytes per token and KV capacity on the GPU."""
    rows = []
    for layout, est in zip(all_rank_layouts(manifest.model, manifest.parallel), estimates, strict=True):
        rows.append({
            "rank": layout.rank, "pipeline_stage": layout.pp_rank, "tensor_rank": layout.tp_rank,
            "layers": list(layout.layers), "num_heads": layout.num_heads, "num_kv_heads": layout.num_kv_heads,
            "weight_bytes": est.weight_bytes, "kv_bytes_per_token": est.kv_bytes_per_token,
            "num_kv_tokens": est.num_kv_tokens,
            **({"experts": list(range(layout.expert_start, layout.expert_start + layout.num_local_experts)),
                "expert_width": layout.moe_intermediate_size} if manifest.model.moe_layers else {}),
        })
    return rows


def _kernel_summary(manifest: art.Manifest) -> dict[str, dict]:
    """Per "KxN" of the plan's W4A16 table: the kernel kind at each of KERNEL_MS, and the record's source."""
    from llmc.kernels.w4a16_gemm import select_w4a16_config
    from llmc.runtime.loader import kernel_table

    table = kernel_table(manifest) or {}
    summary = {}
    for shape, record in manifest.plan.w4a16_kernels.items():
        k, n = map(int, shape.split("x"))
        kinds = {m: select_w4a16_config(m, k, n, table, num_sms=1).kind for m in KERNEL_MS}
        summary[shape] = {"kind_at_m": kinds, "source": art.kernel_source_label(record)}
    return summary


def _kernel_rows(summary: dict[str, dict]) -> list[tuple[str, str]]:
    if not summary:
        return []
    rows = [("w4a16 kernels", "K×N per rank: kernel at M = " + " / ".join(map(str, KERNEL_MS)))]
    for shape, entry in summary.items():
        kinds = ", ".join(f"M={m} {kind}" for m, kind in entry["kind_at_m"].items())
        rows.append((f"  {shape}", f"{kinds} ({entry['source']})"))
    return rows


def _format_label(spec: dict) -> str:
    extras = [f"{k}={v}" for k, v in spec.items() if k != "format"]
    return spec["format"] + (f" ({', '.join(extras)})" if extras else "")


def _format_runs(modules: dict[str, dict]) -> list[tuple[str, dict]]:
    """Per-module formats, runs of layers with the same format folded: ("layers.0-5.attn.qkv", spec)."""
    by_name: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for name, spec in modules.items():
        parts = name.split(".")
        if parts[0] == "layers":
            by_name[".".join(parts[2:])].append((int(parts[1]), spec))
        else:
            by_name[name].append((-1, spec))
    runs = []
    for suffix, entries in by_name.items():
        start = 0
        for i in range(1, len(entries) + 1):
            if i == len(entries) or entries[i][1] != entries[start][1]:
                first, last = entries[start][0], entries[i - 1][0]
                label = suffix if first < 0 else f"layers.{first}{'-' + str(last) if last != first else ''}.{suffix}"
                runs.append((label, entries[start][1]))
                start = i
    return runs


def _experts_text(row: dict) -> str:
    """", experts 0-3 (width 96)": the experts a rank holds in its MoE layers."""
    if "experts" not in row:
        return ""
    experts = row["experts"]
    return f", experts {experts[0]}-{experts[-1]} of each MoE layer (width {row['expert_width']} each)"


def print_inspect(report: dict) -> None:
    m, kv, rt, est = report["model"], report["kv"], report["runtime"], report["memory_estimate"]
    rows = [
        ("artifact", f"{report['artifact']}  (format {report['format_version']}, llmc {report['llmc_version']})"),
        ("source", report["source"]["path"]),
        *[("adapter", f"{a['path']} (sha256 {a['sha256']['adapter_model.safetensors'][:16]}…, merged into "
                      f"{a['modules']} linears)") for a in report["source"].get("adapters", [])],
        ("model", f"{m['architecture']} ({m['family']}): {m['num_layers']} layers, hidden {m['hidden_size']}, "
                  f"heads {m['num_heads']} (kv {m['num_kv_heads']}), head_dim {m['head_dim']}, vocab {m['vocab_size']}"),
        *([("classifier", f"{m['num_labels']} labels ({', '.join(m['labels'][:4])}{', ...' if m['num_labels'] > 4 else ''}),"
                          f" {m['classifier_activation']}; runs as a pooling model (convert classify)")]
          if m.get("num_labels") else []),
        ("attention", _attention_text(m)),
        *([("layers", text)] if (text := _layer_text(m)) else []),
        ("parameters", f"{m['num_parameters'] / 1e6:.2f} M, " + (f"stored as {m['dtype']}" if report.get("onnx") is None
                       else "float tensors stored as float32 (the ONNX graph computes in float32)")),
        *([("experts", f"{m['num_experts']} per MoE layer, top-{m['num_experts_per_tok']}"
                       f"{' renormalised' if m['norm_topk_prob'] else ''}{_router_text(m)}, "
                       f"width {m['moe_intermediate_size']}, "
                       f"MoE layers {m['moe_layers']}"
                       + (f", a shared expert of width {m['shared_expert_intermediate_size']}"
                          f"{' (sigmoid-gated)' if m.get('shared_expert_gate') else ''}"
                          if m.get("shared_expert_intermediate_size") else "")
                       + (", biased router and experts" if m.get("moe_bias") else "")
                       + (f", clamped SwiGLU (limit {m['swiglu_limit']:g}, alpha {m['swiglu_alpha']:g})"
                          if m.get("swiglu_limit") else ""))] if m.get("moe_layers") else []),
        ("quantization", f"{report['quantization']['method']}: "
                         + ", ".join(f"{n} × {f}" for f, n in report["quantization"]["formats"].items())),
        _saved_row(report),
        ("weights", f"{_fmt_bytes(report['weight_bytes'])}: " + ", ".join(
            f"{k} {_fmt_bytes(v)}" for k, v in sorted(report["bytes_by_component"].items(), key=lambda kv_: -kv_[1]))),
        ("KV cache", f"{kv['bytes_per_token']} bytes/token ({kv['dtype']}{_kv_ranks_note(kv, report['ranks'])}"
                     + (f"; MLA's latent, {kv['head_dim']} values per token and layer" if kv.get("latent") else "")
                     + "), "
                     f"blocks of {kv['block_size']} tokens" + _kv_scales_note(kv)),
        ("runtime", f"max_model_len {rt['max_model_len']}, max_num_seqs {rt['max_num_seqs']}, "
                    f"max_num_batched_tokens {rt['max_num_batched_tokens']}, prefix caching "
                    f"{'on' if rt['enable_prefix_caching'] else 'off'}, enforce_eager {str(rt['enforce_eager']).lower()}"
                    + _runtime_features(rt)),
    ]
    if report.get("onnx") is None:  # an ONNX artifact runs on the CPU: its KV budget is cpu_kv_cache_gib
        rows.append((f"on {est['gpu_memory_gib']:g} GiB", _estimate_line(est, rt) + fit_hint(report)))
        rows += _knob_rows(report)
    for module, spec in _format_runs(report["quantization"]["modules"]):
        rows.append((f"  {module}", _format_label(spec)))
    rows += _kernel_rows(report["w4a16_kernel_summary"])
    rows += _onnx_rows(report.get("onnx"))
    par = report["parallel"]
    if par["tensor"] * par["pipeline"] > 1:
        rows.append(("parallel", f"tensor {par['tensor']} × pipeline {par['pipeline']}: "
                                 f"{par['tensor'] * par['pipeline']} ranks, rank = stage × {par['tensor']} + tensor rank"
                                 + (f"; experts spread over {par['expert']} ranks" if par.get("expert", 1) > 1 else "")))
        for r in report["ranks"]:
            layers = r["layers"]
            rows.append((f"  rank {r['rank']}", f"stage {r['pipeline_stage']}, tensor rank {r['tensor_rank']}: "
                         f"layers {layers[0]}-{layers[-1]}, heads {r['num_heads']} (kv {r['num_kv_heads']}), "
                         f"weights {_fmt_bytes(r['weight_bytes'])}, KV {r['kv_bytes_per_token']} bytes/token, "
                         f"{r['num_kv_tokens']:,} KV tokens on {est['gpu_memory_gib']:g} GiB" + _experts_text(r)))
    for key, value in report["quantization"].get("report", {}).items():
        rows.append((f"quality: {key}", str(value)))
    if "verify" in report:
        rows.append(("verify", "all files match their sha256" if report["verify"]["ok"]
                     else "; ".join(report["verify"]["problems"])))
    _print_rows(rows)


def _rope_text(theta: float, scaling: dict | None) -> str:
    if not scaling:
        return f"rope theta {theta:g}"
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = f" x{scaling['factor']:g}" if isinstance(scaling.get("factor"), (int, float)) else ""
    return f"rope theta {theta:g} ({kind}{factor})"


def _router_text(m: dict) -> str:
    """DeepSeek's routing, where the model has it: scoring, groups, scale (the softmax router says nothing); ERNIE 4.5
    MoE's softmax chosen with its score bias."""
    if m.get("family") == "ernie4_5_moe":
        return " (softmax chosen with its score bias)"
    if m.get("router_scoring", "softmax") == "softmax" and not m.get("router_groups") and \
            m.get("routed_scaling_factor", 1.0) == 1.0:
        return ""
    groups = f", best {m['router_topk_groups']} of {m['router_groups']} groups" if m.get("router_groups") else ""
    return f" ({m.get('router_scoring', 'softmax')}{groups}, x {m.get('routed_scaling_factor', 1.0):g})"


def _attention_text(m: dict) -> str:
    """The model's attention as the artifact runs it: rotary (and partial rotary), the scale, windows, caps."""
    parts = [_rope_text(m["rope_theta"], m.get("rope_scaling"))]
    if m.get("kv_lora_rank"):  # DeepSeek's MLA over its latent cache (runtime/models/mla.py)
        q = f"q rank {m['q_lora_rank']}" if m.get("q_lora_rank") else "q_proj"
        parts.append(f"latent attention (kv rank {m['kv_lora_rank']}, {q}; per head {m['qk_nope_head_dim']} + "
                     f"{m['qk_rope_head_dim']} rope q/k dims, {m['v_head_dim']} v dims; latent KV cache of "
                     f"{m['kv_lora_rank']} + {m['qk_rope_head_dim']} values per token and layer, kv_b absorbed)")
    if m.get("linear_attention_layers"):  # Qwen3.5, OLMo Hybrid (runtime/models/gated_deltanet.py)
        beta = ", beta up to 2" if m.get("linear_allow_neg_eigval") else ""
        gated = "gated attention" if m.get("attn_output_gate") else "attention"
        parts.append(f"Gated DeltaNet on {len(m['linear_attention_layers'])} of {m['num_layers']} layers (a state per "
                     f"request, no KV{beta}), {gated} on the others")
    if m.get("short_conv_layers"):  # LFM2 (runtime/models/short_conv.py)
        parts.append(f"gated short conv of {m['short_conv_kernel']} taps on {len(m['short_conv_layers'])} of "
                     f"{m['num_layers']} layers (a conv state per request, no KV)")
    if m.get("rotary_dim") and m["rotary_dim"] != m["head_dim"]:
        parts.append(f"rotary on {m['rotary_dim']} of {m['head_dim']} dims")
    if m.get("rotary_interleaved"):
        parts.append("interleaved rotary pairs (q/k rows permuted at build)")
    if m.get("rope_on_full_layers") is False:
        parts.append("no rotary on the full-attention layers")
    if m.get("nope_layers"):  # SmolLM3
        parts.append(f"no rotary on {len(m['nope_layers'])} of {m['num_layers']} layers (NoPE)")
    if m.get("query_temperature_beta") is not None:  # Ministral 3, Llama 4
        layers = m.get("query_temperature_layers")
        where = "every layer" if layers is None else f"{len(layers)} of {m['num_layers']} layers"
        offset = m.get("query_temperature_offset", 0.0)
        position = f"(position + {offset:g})" if offset else "position"
        parts.append(f"q x 1 + {m['query_temperature_beta']:g} log(1 + floor({position} / "
                     f"{m['query_temperature_floor']:g})) on {where}")
    if m.get("softmax_scale"):
        parts.append(f"scale {m['softmax_scale']:g}")
    elif m.get("query_pre_attn_scalar"):
        parts.append(f"scale {m['query_pre_attn_scalar']:g}^-0.5")
    if m.get("qk_norm"):
        parts.append("q/k RMSNorm over the whole projections" if m.get("qk_norm_full_width") else "q/k RMSNorm per head")
    if m.get("qk_l2_norm_layers"):  # Llama 4
        parts.append(f"q/k L2 norm per head (no weight) on {len(m['qk_l2_norm_layers'])} of {m['num_layers']} layers")
    if m.get("attention_chunk_size") and m.get("attention_chunk_layers") is None:  # format 1.32-1.33
        parts.append(f"chunked attention not run: context held to its chunk of {m['attention_chunk_size']}")
    elif m.get("attention_chunk_size"):
        parts.append(f"chunked attention in chunks of {m['attention_chunk_size']} on "
                     f"{len(m['attention_chunk_layers'])} of {m['num_layers']} layers")
    if m.get("attention_bias"):
        parts.append("q/k/v/o biases" if m.get("o_bias") else "q/k/v biases")
    if m.get("attention_sinks"):
        parts.append("attention sinks (a learned softmax column per head)")
    window = m.get("sliding_window")
    if window:
        layers = m.get("sliding_window_layers")
        where = "every layer" if layers is None else f"{len(layers)} of {m['num_layers']} layers"
        local = (f", their {_rope_text(m['rope_local_theta'], m.get('rope_local_scaling'))}"
                 if m.get("rope_local_theta") else "")
        parts.append(f"sliding window {window} on {where}{local}")
    if m.get("attn_logit_softcapping"):
        parts.append(f"scores soft-capped at {m['attn_logit_softcapping']:g}")
    return ", ".join(parts)


def _layer_text(m: dict) -> str:
    """What a layer does beyond a Llama layer's (empty for a Llama)."""
    parts = []
    if m.get("hidden_act", "silu") != "silu":
        parts.append(f"{m['hidden_act']} MLP")
    if m.get("sandwich_norms"):
        parts.append("norms after attention and MLP too (sandwich)" if m.get("pre_norms", True)
                     else "norms after attention and MLP only (no pre-norms)")
    if m.get("layer_norm"):
        parts.append("LayerNorm (no bias)")
    if m.get("parallel_block"):
        parts.append("attention and MLP in parallel on one norm")
    if m.get("embed_scale"):
        parts.append(f"embeddings x {m['embed_scale']:g}")
    if m.get("final_logit_softcapping"):
        parts.append(f"logits soft-capped at {m['final_logit_softcapping']:g}")
    return ", ".join(parts)


def _onnx_rows(onnx_summary: dict | None) -> list[tuple[str, str]]:
    if onnx_summary is None:
        return []
    ops = ", ".join(f"{op} {n}" for op, n in sorted(onnx_summary["op_counts"].items(), key=lambda kv_: -kv_[1]))
    rows = [("onnx", f"{onnx_summary['model']} for {onnx_summary['device']} (opset {onnx_summary['opset']} + "
                     "com.microsoft), runs on onnxruntime's CPU EP; KV in per-sequence slots"),
            ("  op mix", ops),
            ("  linears", ", ".join(f"{n} × {kind}" for kind, n in onnx_summary["linears"].items()))]
    for module, reason in onnx_summary["float_fallbacks"].items():
        rows.append((f"  {module}", reason))
    return rows


def _saved_row(report: dict) -> tuple[str, str]:
    """("saved", what the tensors save against 16-bit weights), or ("larger", by how much) for a float32 artifact."""
    tensor_bytes, dense = sum(report["bytes_by_component"].values()), report["dense_bf16_bytes"]
    share = f"(tensors are {tensor_bytes / dense:.0%} of {_fmt_bytes(dense)})"
    if tensor_bytes > dense:
        return "larger", f"{_fmt_bytes(tensor_bytes - dense)} than 16-bit weights {share}"
    return "saved", f"{_fmt_bytes(dense - tensor_bytes)} against 16-bit weights {share}"



def _estimate_line(est: dict, rt: dict) -> str:
    line = (f"at gpu_memory_utilization {rt['gpu_memory_utilization']}: weights {_fmt_bytes(est['weight_bytes'])}, "
            f"activations {_fmt_bytes(est['activation_bytes'])}, CUDA graphs {_fmt_bytes(est['graph_bytes'])}, "
            + (f"hybrid states {_fmt_bytes(est['state_bytes'])}, " if est.get("state_bytes") else "")
            + f"CUDA context {_fmt_bytes(est['other_bytes'])}, KV {_fmt_bytes(est['kv_bytes'])} = "
            f"{est['num_kv_tokens']:,} tokens ({int(est['max_concurrent_seqs'])} sequences of {rt['max_model_len']})")
    line += _fixed_kv_note(est)
    if est["max_concurrent_seqs"] < 1:
        line += " — DOES NOT FIT: lower max_model_len, raise gpu_memory_utilization, or quantize"
    return line


def _fixed_kv_note(est: dict) -> str:
    """For a cache fixed by num_kv_blocks: that it is, and whether the memory has room for it."""
    room = est.get("room_kv_tokens")
    if room is None:
        return ""
    note = f", fixed by num_kv_blocks {est['num_kv_blocks']}"
    return note + (f" — MORE THAN FITS: room for {room:,} tokens; lower num_kv_blocks" if est["num_kv_tokens"] > room
                   else f" (room for {room:,})")


def _kv_ranks_note(kv: dict, ranks: list[dict]) -> str:
    """The model's KV bytes per token are held once over the ranks, unless tensor ranks outnumber the KV heads
    (each head then on several ranks, as vLLM replicates them): then what the ranks hold together."""
    if len(ranks) == 1:
        return ""
    held = sum(r["kv_bytes_per_token"] for r in ranks)
    if held == kv["bytes_per_token"]:
        return ", all ranks"
    return f"; the ranks hold {held} together: " + ("each tensor rank the whole latent" if kv.get("latent")
                                                     else "KV heads replicated")


def _kv_scales_note(kv: dict) -> str:
    if not kv.get("k_scales"):
        return ", FP8 scales 1.0" if kv["dtype"].startswith("float8") else ""
    return (f", FP8 scales from the {kv['scales_source']} (K {min(kv['k_scales']):.3g}..{max(kv['k_scales']):.3g}, "
            f"V {min(kv['v_scales']):.3g}..{max(kv['v_scales']):.3g})")


def fit_hint(report: dict) -> str:
    """The knob suggestion for a plan that does not fit ('' when it fits)."""
    if report["memory_estimate"]["max_concurrent_seqs"] >= 1 or not report.get("memory_knobs"):
        return ""
    return "; " + memory.fit_suggestion(report["memory_knobs"])


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


def _state_rows(manifest: art.Manifest) -> list[tuple[str, str]]:
    """A hybrid model's per-request states: one slot's bytes at their dtypes, and the slots' in the memory plan."""
    if not manifest.model.is_hybrid:
        return []
    dtypes = art.state_dtypes(manifest.runtime, manifest.model.dtype)
    per_slot = memory.linear_state_bytes_per_slot(manifest.model, *dtypes)
    slots = manifest.runtime.max_num_seqs + 1
    return [("hybrid states", f"{_fmt_bytes(per_slot)} per request (conv {dtypes[0]}, recurrent {dtypes[1]}), "
                              f"{_fmt_bytes(per_slot * slots)} for max_num_seqs + 1 = {slots} slots")]


def print_build_summary(result) -> None:
    manifest = result.manifest
    weight_bytes = sum(manifest.plan.weight_bytes_per_rank)
    est = manifest.plan.memory
    rows = [
        ("built", str(result.output)),
        ("model", f"{manifest.model.architecture}, {manifest.model.num_parameters / 1e6:.2f} M parameters, "
                  + ("an ONNX graph computing in float32" if is_onnx(manifest) else manifest.model.dtype)),
        ("quantization", manifest.quant.method),
        ("weights", f"{_fmt_bytes(weight_bytes)} in {manifest.parallel.tensor * manifest.parallel.pipeline} rank file(s)"),
        ("KV per token", f"{manifest.kv.bytes_per_token} bytes"),
        *_state_rows(manifest),
        *([] if is_onnx(manifest) else [  # an ONNX artifact runs on the CPU: its KV budget is cpu_kv_cache_gib
            (f"on {est.get('target_gpu_memory_gib', 0):g} GiB", f"{est.get('num_kv_tokens', 0):,} KV tokens, "
                                                                f"{int(est.get('max_concurrent_seqs', 0))} sequences of "
                                                                f"{manifest.runtime.max_model_len}" + _fixed_kv_note(est))]),
        ("time", f"{result.seconds:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in result.stage_seconds.items()) + ")"),
    ]
    _print_rows(rows)
