"""A quantized build holds one layer at a time: nothing a layer's calibration made outlives the layer, and
AWQ's model tail holds one later layer and none of the checkpoint's files open (benchmarks/RESULTS.md,
session 36). Checked with weak references, not by measuring memory."""

import weakref

import pytest
import torch

from llmc.compiler import calibration, pipeline, quantize
from llmc.compiler.calibration import LayerRunner
from llmc.compiler.convert import read_layer
from llmc.compiler.hf_checkpoint import TensorReader, model_config_from_hf, model_spec_for, read_hf_config
from llmc.compiler.pipeline import ModelTail, QuantizingPacker
from llmc.compiler.quantize import linear_in_features, plan_formats
from llmc.compiler.recipe import QuantizationConfig


def _model(checkpoint):
    hf = read_hf_config(checkpoint)
    spec = model_spec_for(hf, checkpoint)
    return spec, model_config_from_hf(hf, spec, "bfloat16")


def _track_modules(runner: LayerRunner, monkeypatch) -> list:
    """Weak references to every layer module `runner` builds from now on."""
    built = []
    real_build = runner.build_layer

    def build_layer(layer):
        module = real_build(layer)
        built.append(weakref.ref(module))
        return module

    monkeypatch.setattr(runner, "build_layer", build_layer)
    return built


def test_model_tail_holds_one_later_layer_and_no_shard_open(ref_model_dir, monkeypatch):
    spec, config = _model(ref_model_dir)
    runner = LayerRunner(config, seq_len=16, device=torch.device("cpu"), windows_per_chunk=2)
    built = _track_modules(runner, monkeypatch)
    reads = []  # (layer index, shard files open, layer modules alive) as each later layer is read
    real_read = pipeline.read_layer

    def read(reader, spec_, config_, index):
        reads.append((index, len(reader._handles), sum(ref() is not None for ref in built)))
        return real_read(reader, spec_, config_, index)

    monkeypatch.setattr(pipeline, "read_layer", read)
    tokens = torch.randint(5, 4000, (2, 16))
    with TensorReader(ref_model_dir) as reader:
        hidden = reader.get("model.embed_tokens.weight").float()[tokens]
        tail = ModelTail(reader, spec, config, runner, tokens)
        tail.losses(0, [hidden, hidden + 0.1], slice(None))
    assert [index for index, _, _ in reads] == list(range(1, config.num_layers))
    # From the second later layer on: the one before it is freed, and its files closed (their pages released)
    assert [(open_files, alive) for _, open_files, alive in reads[1:]] == [(0, 0)] * (config.num_layers - 2)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_nothing_a_layer_calibrated_with_outlives_it(ref_model_dir, monkeypatch, method):
    """After the packer returns a layer (and the writer dropped it): its input hidden states, the tensors
    read for it, the layer modules built for it and every linear input its hooks saw are all freed."""
    spec, config = _model(ref_model_dir)
    quant = QuantizationConfig(method=method, bits=4, group_size=128, report=False)
    formats = plan_formats(quant, spec, config, linear_in_features(spec, config))
    seen = []  # weak references to what one layer made

    def observing(capture):
        def capture_inputs(module, names, observe):
            def observe_and_track(name, x, *rest):
                seen.append(weakref.ref(x))
                return observe(name, x, *rest)
            return capture(module, names, observe_and_track)
        return capture_inputs

    monkeypatch.setattr(quantize, "capture_inputs", observing(quantize.capture_inputs))
    monkeypatch.setattr(calibration, "capture_inputs", observing(calibration.capture_inputs))
    tokens = torch.randint(5, 4000, (4, 16))
    with TensorReader(ref_model_dir) as reader:
        packer = QuantizingPacker(quant, formats, config, spec, reader, tokens, None, torch.device("cpu"))
        built = _track_modules(packer.runner, monkeypatch)
        for index in range(config.num_layers):
            layer = read_layer(reader, spec, config, index)
            seen += [weakref.ref(t) for t in (*layer.linears.values(), *layer.norms.values())]
            seen += [weakref.ref(h) for h in (packer.hidden, packer.hidden_float) if h is not None]
            packer(layer)  # the writer's part: its result is packed and written, then dropped
            del layer
            assert built and seen
            alive = [ref for ref in built + seen if ref() is not None]
            assert not alive, f"layer {index}: {len(alive)} of its tensors and modules still referenced"
            built.clear()
            seen.clear()
