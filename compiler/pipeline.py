"""The layer-by-layer build pipeline: calibration and held-out hidden states carried from layer to layer.

`QuantizingPacker` is the `LayerPacker` of a quantized build: called for layer 0, 1, ... in order
by the build's weight writer, it quantizes the layer (compiler/quantize.py), hands the quantized
weights back (the writer shards them per rank, then packs each shard in its format), and advances
the hidden states through it. `report()` then measures, on the held-out windows,
the perplexity of the float and the quantized model and how far apart their predictions are.
"""

from __future__ import annotations

import math
import resource
import time

import torch
from torch import Tensor

from llmc.compiler.calibration import LayerRunner, embed_windows
from llmc.compiler.convert import LayerWeights, UnpackedLinear, read_layer
from llmc.compiler.hf_checkpoint import TensorReader
from llmc.compiler.quantize import LayerQuantizer, quantize_rtn, uses_gptq
from llmc.compiler.recipe import QuantizationConfig
from llmc.kernels.norm import rms_norm
from llmc.quant.formats import QuantizedWeight
from llmc.quant.fp8 import input_scale_from_absmax
from llmc.quant.gptq import HessianAccumulator
from llmc.quant.reference import dequantize_weight
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.spec import ModelSpec


class QuantizingPacker:
    def __init__(self, quant: QuantizationConfig, formats: dict[str, dict], config: ModelConfig, spec: ModelSpec,
                 reader: TensorReader, calibration: Tensor | None, held_out: Tensor | None, device: torch.device):
        self.formats = formats
        self.config = config
        self.spec = spec
        self.reader = reader
        self.dtype = getattr(torch, config.dtype)
        windows = calibration if calibration is not None else held_out
        self.runner = LayerRunner(config, windows.shape[1], device) if windows is not None else None
        # AWQ picks each layer's variant by the loss the float rest of the model reaches from it (a classifier has no
        # next-token loss: its variants are compared by the layer's output error)
        has_tail = quant.method == "awq" and calibration is not None and not config.is_classifier
        tail = ModelTail(reader, spec, config, self.runner, calibration) if has_tail else None
        self.quantizer = LayerQuantizer(quant, formats, config, self.runner, tail)
        embed = reader.get(spec.global_tensors["embed.weight"]).float()
        self.hidden = embed_windows(embed, calibration, config) if calibration is not None else None  # [num_samples, seq_len, hidden]
        # Float targets: the same windows through the float model, for GPTQ's W* (quant/gptq.py).
        is_float_target = quant.float_targets and uses_gptq(quant) and self.hidden is not None
        self.hidden_float = self.hidden.clone() if is_float_target else None
        self.held_out = held_out
        self.eval_float = embed_windows(embed, held_out, config) if held_out is not None else None
        self.eval_quant = self.eval_float.clone() if held_out is not None else None
        self.start = time.perf_counter()

    def __call__(self, layer: LayerWeights) -> LayerWeights:
        float_layer = LayerWeights(layer.index, dict(layer.linears), dict(layer.biases), dict(layer.norms))
        quantized = self.quantizer.quantize(layer, self.hidden, self.hidden_float)
        # None: stays dense (AWQ may have rescaled it); the quantizer left dequantized weights in `layer`.
        result = {name: layer.linears[name] if q is None else q for name, q in quantized.items()}
        self._advance(float_layer, layer)
        return LayerWeights(layer.index, result, dict(layer.biases), dict(layer.norms))

    def _advance(self, float_layer: LayerWeights, quant_layer: LayerWeights) -> None:
        if self.runner is None:
            return
        module = self.runner.build_layer(quant_layer)
        if self.hidden_float is not None or self.eval_float is not None:
            float_module = self.runner.build_layer(float_layer)
        if self.hidden is not None:
            self.hidden = self.runner.forward(module, self.hidden)
        if self.hidden_float is not None:
            self.hidden_float = self.runner.forward(float_module, self.hidden_float)
        if self.eval_quant is not None:
            self.eval_quant = self.runner.forward(module, self.eval_quant)
            self.eval_float = self.runner.forward(float_module, self.eval_float)

    def pack_global(self, module: str, weight: Tensor) -> UnpackedLinear:
        """Embedding and final norm stay dense; lm_head takes its planned format, quantized by
        `_quantize_lm_head`. lm_head rows past the vocabulary (padding for vocab-parallel ranks) are
        zero and stay zero."""
        if module != "lm_head":
            return weight
        spec = self.formats["lm_head"]
        if spec["format"] == "dense":
            self.lm_head_quant = weight[: self.config.vocab_size]
            return weight
        q = self._quantize_lm_head(weight, spec)
        self.lm_head_quant = dequantize_weight(q)[: self.config.vocab_size]
        return q

    def _quantize_lm_head(self, weight: Tensor, spec: dict) -> QuantizedWeight:
        """lm_head's inputs are the final norm of the calibration hidden states (through the quantized
        layers, which the writer has all packed by now): GPTQ takes its Hessian (and, with float targets,
        its drift from the float model's) from them, FP8 static its input scale. RTN and AWQ round to
        nearest (no op before the final norm takes an AWQ scale; llm-compressor's AWQ rounds it too)."""
        quant = self.quantizer.quant
        if self.hidden is None or not (uses_gptq(quant) or spec.get("is_static_input")):
            return quantize_rtn(weight, spec, self.dtype)
        device = self.runner.device
        norm = self.reader.get(self.spec.global_tensors["norm.weight"]).float().to(device)
        step = self.runner.windows_per_chunk

        def normed(states: Tensor, start: int) -> Tensor:  # [tokens, hidden] of a chunk of windows
            chunk = states[start : start + step].to(device).float()
            return rms_norm(chunk, norm, self.config.rms_norm_eps).flatten(0, 1)

        starts = range(0, self.hidden.shape[0], step)
        if spec["format"] == "w8a8-fp8":
            q = quantize_rtn(weight, spec, self.dtype)
            q.input_scale = input_scale_from_absmax(max(normed(self.hidden, i).abs().max().item() for i in starts))
            return q
        acc = HessianAccumulator(weight.shape[1], device, self.hidden_float is not None)
        for i in starts:
            acc.add_batch(normed(self.hidden, i), None if self.hidden_float is None else normed(self.hidden_float, i))
        return self.quantizer.gptq(weight, acc, spec)

    def report(self) -> dict:
        """Quality on the held-out windows and the cost of the build."""
        report = {"build_seconds": round(time.perf_counter() - self.start, 1),
                  "peak_memory_gib": round(peak_memory_bytes(self.runner) / 2**30, 3)}
        if self.config.moe_layers and self.runner is not None:
            # experts quantized by round-to-nearest for lack of routed calibration tokens → their token counts
            report["moe_min_expert_tokens"] = self.quantizer.quant.min_expert_tokens
            report["moe_rtn_fallbacks"] = dict(self.quantizer.expert_fallbacks)
        if self.eval_quant is None:
            return report
        norm = self.reader.get(self.spec.global_tensors["norm.weight"]).float()
        report |= {"heldout_windows": int(self.held_out.shape[0]), "heldout_seq_len": int(self.held_out.shape[1])}
        if self.config.is_classifier:
            score = self.reader.get(self.spec.global_tensors["score.weight"]).float()
            float_logits, quant_logits = (torch.nn.functional.linear(rms_norm(h, norm, self.config.rms_norm_eps), score)
                                          for h in (self.eval_float, self.eval_quant))
            return report | classifier_agreement(float_logits, quant_logits, self.config.classifier_activation)
        lm_head_name = "embed.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        lm_float = self.reader.get(self.spec.global_tensors[lm_head_name]).float()
        lm_quant = getattr(self, "lm_head_quant", lm_float).float()
        float_logits = _logits(self.eval_float, norm, lm_float, self.config.rms_norm_eps)
        quant_logits = _logits(self.eval_quant, norm, lm_quant, self.config.rms_norm_eps)
        targets = self.held_out[:, 1:]
        report |= {
            "perplexity_unquantized": round(_perplexity(float_logits, targets), 3),
            "perplexity_quantized": round(_perplexity(quant_logits, targets), 3),
            "mean_kl_divergence": round(kl_divergence(float_logits, quant_logits), 5),
            "top1_agreement": round(top1_agreement(float_logits, quant_logits), 4),
        }
        return report


class ModelTail:
    """The float model after a layer (its later layers, final norm and lm_head): scores a layer's
    candidate outputs on calibration windows by the next-token loss the rest of the model reaches
    from them. Later layers are read from the checkpoint one at a time and run on every candidate, so
    memory stays at one more layer; the cost is reading layers i+1.. again for every layer i."""

    def __init__(self, reader: TensorReader, spec: ModelSpec, config: ModelConfig, runner: LayerRunner, tokens: Tensor):
        self.reader, self.spec, self.config, self.runner = reader, spec, config, runner
        self.tokens = tokens  # [num_samples, seq_len] the calibration windows

    def losses(self, after: int, outputs: list[Tensor], windows: slice) -> list[float]:
        """Mean next-token loss for each of `outputs`, layer `after`'s outputs on the calibration
        windows `windows` ([w, seq_len, hidden] each), run through the float layers after it."""
        for index in range(after + 1, self.config.num_layers):
            module = self.runner.build_layer(read_layer(self.reader, self.spec, self.config, index))
            # The build releases the checkpoint's pages after each layer it writes, but the tail reads all
            # the layers after this one within it: their pages stayed resident until the layer was written,
            # a peak growing by the checkpoint's size with depth.
            self.reader.release()
            outputs = [self.runner.forward(module, hidden) for hidden in outputs]
            del module  # before the next layer is read: one later layer's float weights alive at a time, not two
        norm = self.reader.get(self.spec.global_tensors["norm.weight"]).float().to(self.runner.device)
        head_name = "embed.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        lm_head = self.reader.get(self.spec.global_tensors[head_name]).float().to(self.runner.device)
        targets = self.tokens[windows][:, 1:].to(self.runner.device)  # [w, seq_len - 1]
        step = self.runner.windows_per_chunk  # [step, seq_len, vocab] logits at a time
        return [torch.cat([window_losses(_logits(hidden[i : i + step].to(self.runner.device), norm, lm_head,
                                                 self.config.rms_norm_eps), targets[i : i + step])
                           for i in range(0, hidden.shape[0], step)]).mean().item() for hidden in outputs]


def classifier_agreement(float_logits: Tensor, quant_logits: Tensor, activation: str) -> dict:
    """How a quantized classifier's outputs follow the float one's, over every position of the held-out windows
    (each a prefix the classifier reads at its last token): the mean absolute difference of the activated
    outputs (probabilities, scores) and, with several labels, how often the top label agrees."""
    act = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid, "identity": lambda x: x}[activation]
    out = {"classifier_mean_abs_difference": round((act(float_logits) - act(quant_logits)).abs().mean().item(), 6)}
    if float_logits.shape[-1] > 1:
        agree = (float_logits.argmax(-1) == quant_logits.argmax(-1)).float().mean().item()
        out["classifier_label_agreement"] = round(agree, 4)
    return out


def _logits(hidden: Tensor, norm: Tensor, lm_head: Tensor, eps: float) -> Tensor:
    return torch.nn.functional.linear(rms_norm(hidden, norm, eps), lm_head)[:, :-1]  # [w, seq_len - 1, vocab]


def window_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token loss of each window: logits [w, n, vocab] predicting targets [w, n] → [w]."""
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return nll.view(targets.shape).mean(dim=1)


def _perplexity(logits: Tensor, targets: Tensor) -> float:
    return math.exp(window_losses(logits, targets).mean().item())


def kl_divergence(p_logits: Tensor, q_logits: Tensor) -> float:
    """Mean KL(P || Q) over positions, P the reference."""
    p = torch.log_softmax(p_logits.float(), dim=-1)
    q = torch.log_softmax(q_logits.float(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1).mean().item()


def top1_agreement(p_logits: Tensor, q_logits: Tensor) -> float:
    return (p_logits.argmax(dim=-1) == q_logits.argmax(dim=-1)).float().mean().item()


def peak_memory_bytes(runner: LayerRunner | None) -> int:
    """Peak GPU memory when calibrating on a GPU, else the process's peak resident memory."""
    if runner is not None and runner.device.type == "cuda":
        return torch.cuda.max_memory_allocated(runner.device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
