"""The onnx-cpu target: the artifact's packed tensors → one ONNX graph that onnxruntime's CPU EP runs.

NOTE (algorithm): the build first writes the usual packed safetensors (the quantizers' levels, scales
and zeros, in the plain layout); this step reads them back one tensor at a time, emits the graph of
runtime/onnx_model.py's interface, and removes them. Per decoder layer:

  RMSNorm → qkv (MatMulNBits | MatMul) [+ bias] → Split → [q/k RMSNorm per head] →
  GroupQueryAttention (rotary from the model's cos/sin tables, causal, optional sliding window,
  past/present K/V in one shared buffer) → o → [RMSNorm] → SkipSimplifiedLayerNormalization (residual
  add + norm) → gate_up → SiLU(gate) * up (GELU-tanh for Gemma) → down → [RMSNorm] →
  SkipSimplifiedLayerNormalization (into the next layer); the bracketed norms are Gemma's and OLMo 2's
  sandwich norms (Gemma 3's sliding layers also read a second rotary table; SmolLM3's NoPE layers none, do_rotary
  0; Gemma's embeddings are scaled; Gemma 2 soft-caps the attention scores, GroupQueryAttention's softcap, and the
  logits). OLMo 2 has no
  RMSNorm before qkv or gate_up (plain Adds of the residual stream in place of the first norm and the
  SkipSimplifiedLayerNormalization before the MLP and before the next layer) and one RMSNorm over each whole
  q / k projection in place of the per-head ones

then the final norm's outputs flattened to [batch * seq, hidden] (the hidden_states output, which pooling
binds), Gather of the rows that need logits, and lm_head (or the tied embedding; a classifier's `score`). Opset 23 (its
RMSNormalization for norms without a residual) plus com.microsoft ops; weights as external data.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors import safe_open

from llmc.compiler.onnx_linears import (
    INT8_LINEAR, INT8_ZERO_POINT, fallback_reason, float_weight, in_order_as_plain, int8_tensors, log_fallbacks,
    nbits_block_size, nbits_tensors,
)
from llmc.errors import RecipeError
from llmc.kernels.int8 import INT8_MAX, MIN_SCALE
from llmc.quant.formats import make_format
from llmc.runtime import onnx_model as om
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.decoder import rope_tables

logger = logging.getLogger("llmc")

OPSET = 23
MS_DOMAIN = "com.microsoft"
# float32 compute: the quantized model exactly (the torch runtime's tokens); 4 (int8 activation blocks,
# onnxruntime-genai's int4 CPU default) is about 2x faster at batch 1 and rounds the activations too
DEFAULT_INT4_ACCURACY_LEVEL = 1


def check_onnx_recipe(recipe) -> None:
    """What an onnx-cpu target cannot build, refused before any work."""
    if recipe.target.device not in om.ONNX_DEVICES:
        if recipe.target.int4_accuracy_level is not None:
            raise RecipeError(f"target.int4_accuracy_level applies to ONNX targets ({', '.join(om.ONNX_DEVICES)}), "
                              f"not {recipe.target.device}; drop it")
        return
    if recipe.parallel.tensor != 1 or recipe.parallel.pipeline != 1:
        raise RecipeError(f"target.device {recipe.target.device}: one graph on one CPU; "
                          "set parallel.tensor and parallel.pipeline to 1")


class _Graph:
    """Nodes and initializers under construction; names are unique by a counter."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._shared: set[str] = set()
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def shared_const(self, name: str, array: np.ndarray) -> str:
        """A constant every user shares: made on first use."""
        if name not in self._shared:
            self._shared.add(name)
            self.const(name, array)
        return name

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        outputs = [self.name(op_type) for _ in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain or None, **attrs))
        return outputs

    def op1(self, op_type: str, inputs: list[str], domain: str = "", **attrs) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]


class _Emitter:
    """Emits the graph for one artifact; `tensors(name)` reads a packed tensor of the artifact."""

    def __init__(self, config: ModelConfig, module_formats: dict[str, dict], reader, accuracy_level: int):
        self.config, self.formats, self.reader = config, module_formats, reader
        self.accuracy_level = accuracy_level
        self.g = _Graph()
        self.linears: dict[str, str] = {}  # module → "MatMulNBits(bits=4, block=128)" | "MatMul"
        self.fallbacks: dict[str, str] = {}

    def tensor(self, name: str) -> torch.Tensor:
        return self.reader.get_tensor(name)

    def params(self, module: str) -> dict[str, torch.Tensor]:
        prefix = module + "."
        return {key[len(prefix):]: self.tensor(key) for key in self.reader.keys() if key.startswith(prefix)
                and "." not in key[len(prefix):]}

    def linear(self, x: str, module: str, in_features: int, out_features: int) -> str:
        """y = x W^T (+ bias) for the artifact's `module`."""
        spec, params = in_order_as_plain(self.formats[module], self.params(module), in_features)
        bias = params.pop("bias", None)
        if spec["format"] == "w8a8-int8":
            return self.int8_linear(x, module, params, bias)
        fmt = make_format(spec, torch.float32)
        block = nbits_block_size(fmt, in_features) if spec["format"] not in ("dense", "w8a8-fp8", "w8a8-fp8-block") else None
        if block is not None:
            packed = nbits_tensors(fmt, params, in_features, block)
            inputs = [x] + [self.g.const(f"{module}.{k}", v) for k, v in packed.items()]
            if bias is not None:
                inputs += [""] * (5 - len(inputs)) + [self.g.const(f"{module}.bias", bias.float().numpy())]
            self.linears[module] = f"MatMulNBits(bits={fmt.bits}, block_size={block})"
            return self.g.op1("MatMulNBits", inputs, MS_DOMAIN, K=in_features, N=out_features, bits=fmt.bits,
                              block_size=block, accuracy_level=self.accuracy_level)
        if reason := fallback_reason(spec, in_features):
            self.fallbacks[module] = reason
        weight_t = self.g.const(f"{module}.weight_t", float_weight(spec, params, in_features).T)  # [K, N]
        self.linears[module] = "MatMul"
        y = self.g.op1("MatMul", [x, weight_t])
        return y if bias is None else self.g.op1("Add", [y, self.g.const(f"{module}.bias", bias.float().numpy())])

    def int8_linear(self, x: str, module: str, params: dict[str, torch.Tensor], bias: torch.Tensor | None) -> str:
        """w8a8-int8: kernels/int8.int8_linear in standard ops (compiler/onnx_linears.py's docstring), x [.., K]."""
        g, f32 = self.g, np.float32
        tensors = int8_tensors(params)
        amax = g.op1("ReduceMax", [g.op1("Abs", [x]), g.shared_const("int8_last_axis", np.array([-1], np.int64))],
                     keepdims=1)
        # amax / 127 divided (not times 1/127), then floored, as quantize_int8_per_token
        scale = g.op1("Max", [g.op1("Div", [amax, g.shared_const("int8_max", np.array(INT8_MAX, f32))]),
                              g.shared_const("int8_min_scale", np.array(MIN_SCALE, f32))])
        levels = g.op1("Clip", [g.op1("Round", [g.op1("Div", [x, scale])]),
                                g.shared_const("int8_lo", np.array(-INT8_MAX, f32)), "int8_max"])
        shifted = g.op1("Cast", [g.op1("Add", [levels, g.shared_const("int8_shift", np.array(INT8_ZERO_POINT, f32))])],
                        to=TensorProto.UINT8)
        acc = g.op1("MatMulInteger", [shifted, g.const(f"{module}.weight_t", tensors["weight_t"]),
                                      g.shared_const("int8_zero_point", np.array(INT8_ZERO_POINT, np.uint8))])
        y = g.op1("Mul", [g.op1("Mul", [g.op1("Cast", [acc], to=TensorProto.FLOAT), scale]),
                          g.const(f"{module}.weight_scale", tensors["w_scale"])])
        self.linears[module] = INT8_LINEAR
        return y if bias is None else g.op1("Add", [y, g.const(f"{module}.bias", bias.float().numpy())])

    def norm_weight(self, name: str) -> str:
        return self.g.const(name, self.tensor(name).float().numpy())

    def rms_norm(self, x: str, weight_name: str) -> str:
        return self.g.op1("RMSNormalization", [x, self.norm_weight(weight_name)], axis=-1,
                          epsilon=self.config.rms_norm_eps)

    def skip_norm(self, x: str, residual: str, weight_name: str) -> tuple[str, str]:
        """(norm(x + residual), x + residual)."""
        out, _, _, total = self.g.op("SkipSimplifiedLayerNormalization", [x, residual, self.norm_weight(weight_name)],
                                     4, MS_DOMAIN, epsilon=self.config.rms_norm_eps)
        return out, total

    def head_norm(self, x: str, weight_name: str, num_heads: int) -> str:
        """Per-head RMSNorm of [batch, seq, num_heads * head_dim] (Qwen3's q_norm / k_norm)."""
        shape = self.g.const(self.g.name("heads_shape"), np.array([0, 0, num_heads, self.config.head_dim], np.int64))
        flat = self.g.const(self.g.name("flat_shape"), np.array([0, 0, num_heads * self.config.head_dim], np.int64))
        heads = self.g.op1("Reshape", [x, shape])
        return self.g.op1("Reshape", [self.rms_norm(heads, weight_name), flat])

    def attention(self, i: int, x: str) -> str:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = self.linear(x, f"layers.{i}.attn.qkv", c.hidden_size, q_size + 2 * kv_size)
        q, k, v = qkv, "", ""  # packed: GroupQueryAttention splits q, k, v itself (no Split copies)
        if c.qk_norm:
            split = self.g.const(self.g.name("qkv_split"), np.array([q_size, kv_size, kv_size], np.int64))
            q, k, v = self.g.op("Split", [qkv, split], 3, axis=-1)
            if c.qk_norm_full_width:  # OLMo 2: one RMSNorm over the whole projection
                q = self.rms_norm(q, f"layers.{i}.attn.q_norm.weight")
                k = self.rms_norm(k, f"layers.{i}.attn.k_norm.weight")
            else:
                q = self.head_norm(q, f"layers.{i}.attn.q_norm.weight", c.num_heads)
                k = self.head_norm(k, f"layers.{i}.attn.k_norm.weight", c.num_kv_heads)
        past_k, past_v = om.past_names(i)
        present_k, present_v = om.present_names(i)
        inputs = [q, k, v, past_k, past_v, om.SEQLENS_K, om.TOTAL_SEQUENCE_LENGTH, "cos_cache", "sin_cache",
                  *[""] * 7, om.QUERY_SEQLENS]
        if c.uses_local_rope(i):  # Gemma 3's sliding layers: their own rotary table
            inputs[7:9] = ["cos_cache_local", "sin_cache_local"]
        if not c.rotates(i):  # SmolLM3's NoPE layers: no rotary (no tables)
            inputs[7:9] = ["", ""]
        out = self.g.name("attn")
        window = {"local_window_size": c.window_of(i)} if c.window_of(i) else {}
        if c.attn_logit_softcapping:  # Gemma 2: scores cap * tanh(s / cap) after the scale, before the softmax
            window["softcap"] = float(c.attn_logit_softcapping)
        self.g.nodes.append(helper.make_node(
            "GroupQueryAttention", inputs, [out, present_k, present_v], domain=MS_DOMAIN,
            num_heads=c.num_heads, kv_num_heads=c.num_kv_heads, do_rotary=int(c.rotates(i)), rotary_interleaved=0,
            scale=float(c.attention_scale), **window,
        ))
        return self.linear(out, f"layers.{i}.attn.o", q_size, c.hidden_size)

    def mlp(self, i: int, x: str) -> str:
        c = self.config
        gate_up = self.linear(x, f"layers.{i}.mlp.gate_up", c.hidden_size, 2 * c.intermediate_size)
        gate, up = self.g.op("Split", [gate_up, self.g.const(self.g.name("gu_split"),
                                                             np.array([c.intermediate_size] * 2, np.int64))], 2, axis=-1)
        if c.hidden_act == "gelu_pytorch_tanh":  # Gemma: GELU's tanh form (ONNX Gelu, opset 20)
            act = self.g.op1("Mul", [self.g.op1("Gelu", [gate], approximate="tanh"), up])
        else:
            act = self.g.op1("Mul", [self.g.op1("Mul", [gate, self.g.op1("Sigmoid", [gate])]), up])
        return self.linear(act, f"layers.{i}.mlp.down", c.intermediate_size, c.hidden_size)

    def body(self, max_positions: int) -> str:
        """input_ids → logits; returns the logits' name."""
        c = self.config
        # the runtime's tables (Gemma 3: the sliding layers' own too), over the rotated dims: GroupQueryAttention
        # rotates the leading 2 * cos_cache.shape[1] dims of each head and passes the rest (onnxruntime 1.32,
        # measured against transformers' partial rotary, tests/runtime/test_phi3.py)
        for suffix, table in zip(("", "_local"), rope_tables(c, max_positions)):
            if table is not None:
                half = table.shape[1] // 2  # (GLM-4: the whole head's, ModelConfig.rotary_table_dims)
                self.g.const(f"cos_cache{suffix}", table[:, :half].numpy())
                self.g.const(f"sin_cache{suffix}", table[:, half:].numpy())
        embed = self.g.const("embed.weight", self.tensor("embed.weight").float().numpy()[: c.vocab_size])
        residual = self.g.op1("Gather", [embed, om.INPUT_IDS])  # [batch, seq, hidden]
        if c.embed_scale is not None:  # Gemma: sqrt(hidden), as the artifact records it
            residual = self.g.op1("Mul", [residual, self.g.const("embed_scale", np.array(c.embed_scale, np.float32))])
        # OLMo 2 (pre_norms false): the attention and the MLP read the residual stream itself
        x = self.rms_norm(residual, "layers.0.input_norm.weight") if c.pre_norms else residual
        for i in range(c.num_layers):
            attn = self.attention(i, x)
            if c.sandwich_norms:  # Gemma, OLMo 2: the sub-layers' outputs normed before the residual add
                attn = self.rms_norm(attn, f"layers.{i}.attn_out_norm.weight")
            if c.pre_norms:
                x, residual = self.skip_norm(attn, residual, f"layers.{i}.post_attn_norm.weight")
            else:
                x = residual = self.g.op1("Add", [attn, residual])
            mlp = self.mlp(i, x)
            if c.sandwich_norms:
                mlp = self.rms_norm(mlp, f"layers.{i}.mlp_out_norm.weight")
            if c.pre_norms or i + 1 == c.num_layers:
                after = f"layers.{i + 1}.input_norm.weight" if i + 1 < c.num_layers else "norm.weight"
                x, residual = self.skip_norm(mlp, residual, after)
            else:
                x = residual = self.g.op1("Add", [mlp, residual])
        # the final norm's outputs, flattened: a graph output too (om.HIDDEN_STATES, what pooling binds)
        flat = om.HIDDEN_STATES
        self.g.nodes.append(helper.make_node(
            "Reshape", [x, self.g.const("hidden_rows", np.array([-1, c.hidden_size], np.int64))], [flat]))
        rows = self.g.op1("Gather", [flat, om.LOGITS_INDICES], axis=0)  # [rows, hidden]
        if c.is_classifier:  # a sequence classifier's head (dense): what pooling reads too (OnnxRunner.classify)
            score = self.tensor("score.weight").float().numpy()
            logits = self.g.op1("MatMul", [rows, self.g.const(om.CLASSIFIER_WEIGHT, np.ascontiguousarray(score.T))])
        elif c.tie_word_embeddings:
            logits = self.g.op1("Gemm", [rows, embed], transB=1)
        else:
            logits = self.linear(rows, "lm_head", c.hidden_size, c.vocab_size)
        if c.final_logit_softcapping:  # Gemma 2 (and a Gemma 3 that sets it): cap * tanh(logit / cap)
            cap = self.g.const("final_logit_softcap", np.array(c.final_logit_softcapping, np.float32))
            logits = self.g.op1("Mul", [self.g.op1("Tanh", [self.g.op1("Div", [logits, cap])]), cap])
        self.g.nodes.append(helper.make_node("Identity", [logits], [om.LOGITS]))
        return om.LOGITS


def _io(config: ModelConfig) -> tuple[list, list]:
    f32, kv = TensorProto.FLOAT, ["batch", config.num_kv_heads, "capacity", config.head_dim]
    inputs = [helper.make_tensor_value_info(om.INPUT_IDS, TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info(om.LOGITS, f32, ["rows", om.logits_width(config)]),
               helper.make_tensor_value_info(om.HIDDEN_STATES, f32, ["tokens", config.hidden_size])]
    for i in range(config.num_layers):
        inputs += [helper.make_tensor_value_info(name, f32, kv) for name in om.past_names(i)]
        outputs += [helper.make_tensor_value_info(name, f32, kv) for name in om.present_names(i)]
    inputs += [
        helper.make_tensor_value_info(om.SEQLENS_K, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(om.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, []),
        helper.make_tensor_value_info(om.QUERY_SEQLENS, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(om.LOGITS_INDICES, TensorProto.INT64, ["rows"]),
    ]
    return inputs, outputs


def export_onnx(root: Path, config: ModelConfig, module_formats: dict[str, dict], weights: Path,
                max_positions: int, accuracy_level: int) -> dict:
    """Write root/onnx/model.onnx (+ external data) from the packed `weights` file; return the
    manifest's target.onnx record. The graph computes in float32 (what CPUs run fast); MatMulNBits
    at `accuracy_level` (1: float32 on the dequantized weights, 4: int8 activation blocks)."""
    with safe_open(str(weights), framework="pt") as reader:
        emitter = _Emitter(config, module_formats, reader, accuracy_level)
        emitter.body(max_positions)
    log_fallbacks(emitter.fallbacks)
    inputs, outputs = _io(config)
    graph = helper.make_graph(emitter.g.nodes, "llmc", inputs, outputs, emitter.g.initializers)
    model = helper.make_model(graph, producer_name="llmc", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    path = root / om.MODEL_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=om.DATA_NAME, size_threshold=1024)  # small shapes stay inline
    onnx.checker.check_model(str(path))
    return {
        "model": om.MODEL_PATH,
        "opset": OPSET,
        "int4_accuracy_level": accuracy_level,
        "max_positions": max_positions,
        "op_counts": dict(sorted(Counter(n.op_type for n in emitter.g.nodes).items())),
        "linears": emitter.linears,
        "float_fallbacks": emitter.fallbacks,
    }
