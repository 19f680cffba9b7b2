"""AWQ's folds leave a float layer's function unchanged, and the layer-level choice never loses to RTN."""

import dataclasses

import pytest
import torch

from llmc.compiler.awq_layer import _awq_folds, _fold, awq_quantize_layer
from llmc.compiler.calibration import LayerRunner
from llmc.compiler.convert import read_layer
from llmc.compiler.hf_checkpoint import TensorReader, model_config_from_hf, model_spec_for, read_hf_config
from llmc.compiler.quantize import LayerQuantizer, quantize_rtn
from llmc.compiler.recipe import QuantizationConfig
from llmc.quant.reference import dequantize_weight


def _setup(checkpoint, num_heads=None):
    hf = read_hf_config(checkpoint)
    spec = model_spec_for(hf, checkpoint)
    config = model_config_from_hf(hf, spec, "float32")
    with TensorReader(checkpoint) as reader:
        layer = read_layer(reader, spec, config, 0)
    return config, layer


@pytest.mark.parametrize("mha", [False, True])
def test_folding_scales_keeps_the_float_layer_output(hf_checkpoint_factory, tmp_path, mha):
    overrides = {"num_key_value_heads": 4} if mha else {}  # with MHA, o's scale folds into v
    checkpoint = hf_checkpoint_factory(tmp_path / "c", "llama", **overrides)
    config, layer = _setup(checkpoint)
    runner = LayerRunner(config, seq_len=32, device=torch.device("cpu"), windows_per_chunk=4)
    hidden = torch.randn(4, 32, config.hidden_size)
    before = runner.forward(runner.build_layer(layer), hidden)
    folded = dataclasses.replace(layer, linears=dict(layer.linears), norms=dict(layer.norms))
    folds = _awq_folds(config)
    assert (("attn.o", "attn.qkv") in folds) == mha
    for name, target in folds:
        in_features = folded.linears[name].shape[1]
        _fold(folded, name, target, torch.rand(in_features) * 3 + 0.2)
    after = runner.forward(runner.build_layer(folded), hidden)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert not torch.equal(folded.linears["mlp.down"], layer.linears["mlp.down"])


def _folded_at_random(layer, config):
    """A copy of `layer` with every AWQ fold the model allows applied at random scales in [0.2, 3.2)."""
    folded = dataclasses.replace(layer, linears=dict(layer.linears), norms=dict(layer.norms))
    gen = torch.Generator().manual_seed(0)
    for name, target in _awq_folds(config):
        _fold(folded, name, target, torch.rand(folded.linears[name].shape[1], generator=gen) * 3 + 0.2)
    return folded


@torch.inference_mode()
def test_gemma3_layer_read_as_the_build_reads_it_is_transformers_layer_and_folds_keep_it(tiny_gemma3, hf_model):
    """Gemma 3's layer 0 (sliding window, local rope, sandwich norms) read through the build's norm fold
    (1 + w) and run by the calibration's LayerRunner gives transformers' layer output from transformers'
    scaled embeddings; AWQ's scales folded into those (1 + w) norms (before qkv and gate_up) and into
    up's rows leave it unchanged."""
    from llmc.compiler.hf_checkpoint import norm_fold

    hf = read_hf_config(tiny_gemma3)
    spec = model_spec_for(hf, tiny_gemma3)
    config = model_config_from_hf(hf, spec, "float32")
    with TensorReader(tiny_gemma3, merge=norm_fold(spec, config)) as reader:
        layer = read_layer(reader, spec, config, 0)
    ids = torch.arange(100, 132).view(1, 32)  # 32 positions, the window 8
    states = hf_model(tiny_gemma3)(input_ids=ids, output_hidden_states=True).hidden_states
    runner = LayerRunner(config, seq_len=32, device=torch.device("cpu"))
    torch.testing.assert_close(runner.forward(runner.build_layer(layer), states[0]), states[1], atol=1e-4, rtol=1e-4)
    folded = _folded_at_random(layer, config)
    assert not torch.equal(folded.norms["input_norm"], layer.norms["input_norm"])
    torch.testing.assert_close(runner.forward(runner.build_layer(folded), states[0]), states[1], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_olmo2_layer_read_as_the_build_reads_it_is_transformers_layer_and_folds_keep_it(tiny_olmo2, hf_model):
    """OLMo 2's layer 0 (no pre-norms, output norms, full-width q/k norms) run by the calibration's LayerRunner gives
    transformers' layer output; AWQ has no norm to fold qkv's and gate_up's scales into (they read the residual
    stream), only up's rows for down, and that fold leaves it unchanged."""
    hf = read_hf_config(tiny_olmo2)
    spec = model_spec_for(hf, tiny_olmo2)
    config = model_config_from_hf(hf, spec, "float32")
    with TensorReader(tiny_olmo2) as reader:
        layer = read_layer(reader, spec, config, 0)
    ids = torch.arange(100, 132).view(1, 32)
    states = hf_model(tiny_olmo2)(input_ids=ids, output_hidden_states=True).hidden_states
    runner = LayerRunner(config, seq_len=32, device=torch.device("cpu"))
    torch.testing.assert_close(runner.forward(runner.build_layer(layer), states[0]), states[1], atol=1e-4, rtol=1e-4)
    assert _awq_folds(config) == [("mlp.down", "mlp.gate_up")]  # GQA 4/2: o's inputs are not v's rows alone
    folded = _folded_at_random(layer, config)
    assert not torch.equal(folded.linears["mlp.gate_up"], layer.linears["mlp.gate_up"])
    torch.testing.assert_close(runner.forward(runner.build_layer(folded), states[0]), states[1], atol=1e-4, rtol=1e-4)


def test_layer_choice_is_never_worse_than_rtn(ref_model_dir):
    config, layer = _setup(ref_model_dir)
    quant = QuantizationConfig(method="awq", bits=3, group_size=128, symmetric=False)
    spec = {"format": "w3a16", "bits": 3, "group_size": 128, "symmetric": False, "has_g_idx": False}
    formats = {f"layers.0.{name}": spec for name in layer.linears}
    runner = LayerRunner(config, seq_len=64, device=torch.device("cpu"))
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    with TensorReader(ref_model_dir) as reader:
        embed.weight.data = reader.get("model.embed_tokens.weight").float()
    hidden = embed(torch.randint(5, 4000, (8, 64))).detach()
    target = runner.forward(runner.build_layer(layer), hidden)
    rtn = dataclasses.replace(layer, linears={n: dequantize_weight(quantize_rtn(w, spec, torch.float32))
                                              for n, w in layer.linears.items()})
    rtn_error = (runner.forward(runner.build_layer(rtn), hidden) - target).pow(2).mean()
    quantizer = LayerQuantizer(quant, formats, config, runner)
    awq = dataclasses.replace(layer, linears=dict(layer.linears), norms=dict(layer.norms))
    awq_quantize_layer(quantizer, awq, hidden)
    awq_error = (runner.forward(runner.build_layer(awq), hidden) - target).pow(2).mean()
    assert awq_error <= rtn_error


def test_model_tail_loss_is_transformers_loss(ref_model_dir, hf_model, data_dir):
    """The rest of the model that judges AWQ's variants: from layer 2's output, against transformers."""
    from transformers import AutoTokenizer

    from llmc.compiler.pipeline import ModelTail

    hf = read_hf_config(ref_model_dir)
    spec = model_spec_for(hf, ref_model_dir)
    config = model_config_from_hf(hf, spec, "float32")
    text = (data_dir / "heldout.txt").read_text()[:4000]
    tokens = torch.tensor(AutoTokenizer.from_pretrained(str(ref_model_dir))(text)["input_ids"][: 3 * 64]).view(3, 64)
    runner = LayerRunner(config, seq_len=64, device=torch.device("cpu"), windows_per_chunk=2)
    with TensorReader(ref_model_dir) as reader:
        hidden = reader.get("model.embed_tokens.weight").float()[tokens]
        for index in range(3):
            hidden = runner.forward(runner.build_layer(read_layer(reader, spec, config, index)), hidden)
        tail = ModelTail(reader, spec, config, runner, tokens)
        (loss, noisy_loss) = tail.losses(2, [hidden, hidden + 0.5 * torch.randn_like(hidden)], slice(None))
    with torch.no_grad():
        expected = hf_model(ref_model_dir)(tokens, labels=tokens).loss.item()  # equal lengths: mean of window means
    assert loss == pytest.approx(expected, rel=1e-4)
    assert noisy_loss > loss
