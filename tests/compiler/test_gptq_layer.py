"""GPTQ on one decoder layer: float targets bring the quantized layer closer to the float model."""

import dataclasses

import torch

from llmc.compiler.calibration import LayerRunner
from llmc.compiler.convert import read_layer
from llmc.compiler.hf_checkpoint import TensorReader, model_config_from_hf, model_spec_for, read_hf_config
from llmc.compiler.quantize import LayerQuantizer, quantize_rtn
from llmc.compiler.recipe import QuantizationConfig
from llmc.quant.reference import dequantize_weight


def test_float_targets_fit_the_float_models_output_better(ref_model_dir):
    hf = read_hf_config(ref_model_dir)
    spec = model_spec_for(hf, ref_model_dir)
    config = model_config_from_hf(hf, spec, "float32")
    with TensorReader(ref_model_dir) as reader:
        layers = [read_layer(reader, spec, config, i) for i in (0, 1)]
        embed = reader.get("model.embed_tokens.weight").float()
    runner = LayerRunner(config, seq_len=64, device=torch.device("cpu"))
    tokens = torch.randint(5, 4000, (16, 64), generator=torch.Generator().manual_seed(0))
    # Layer 1's inputs in the float model, and after a coarsely quantized layer 0 (the drift).
    w3 = {"format": "w3a16", "bits": 3, "group_size": 128, "symmetric": True, "has_g_idx": False}
    coarse = dataclasses.replace(layers[0], linears={n: dequantize_weight(quantize_rtn(w, w3, torch.float32))
                                                     for n, w in layers[0].linears.items()})
    hidden_float = runner.forward(runner.build_layer(layers[0]), embed[tokens])
    hidden = runner.forward(runner.build_layer(coarse), embed[tokens])
    target = runner.forward(runner.build_layer(layers[1]), hidden_float)  # what the float model computes

    w4 = {"format": "w4a16", "bits": 4, "group_size": -1, "symmetric": True, "has_g_idx": False}
    formats = {f"layers.1.{name}": w4 for name in layers[1].linears}

    def error_to_float_model(float_targets: bool) -> float:
        quant = QuantizationConfig(method="gptq", bits=4, group_size=-1, float_targets=float_targets)
        layer = dataclasses.replace(layers[1], linears=dict(layers[1].linears))
        LayerQuantizer(quant, formats, config, runner).quantize(layer, hidden, hidden_float if float_targets else None)
        return (runner.forward(runner.build_layer(layer), hidden) - target).pow(2).mean().item()

    assert error_to_float_model(True) < 0.95 * error_to_float_model(False)
