"""lm_head, when a recipe quantizes it (`ignore` without lm_head): its calibration inputs are the final
norm of the last layer's outputs. The references: transformers' own final hidden states of the
calibration windows (the decoder layers stay dense here, so they are exactly lm_head's inputs), and a
float64 GPTQ written from Frantar et al. 2022, Algorithm 1."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from llmc.compiler.build import build
from llmc.compiler.calibration import calibration_windows
from llmc.compiler.recipe import recipe_from_dict
from llmc.quant.formats import make_format
from llmc.quant.reference import dequantize

NUM_SAMPLES, SEQ_LEN = 8, 64


def _build(tiny_llama, data_dir, out, quantization):
    calibration = {"data": str(data_dir / "calibration.txt"), "num_samples": NUM_SAMPLES, "seq_len": SEQ_LEN}
    recipe = {"model": str(tiny_llama), "output": str(out), "dtype": "float32", "target": {"device": "cpu"},
              "quantization": {"ignore": [r"re:layers\..*"], "calibration": calibration, "report": False,
                               **quantization}}
    build(recipe_from_dict(recipe), show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    tensors = load_file(out / "rank-00" / "weights.safetensors")
    params = {k.removeprefix("lm_head."): v for k, v in tensors.items() if k.startswith("lm_head.")}
    return manifest["quant"]["modules"]["lm_head"], params


@torch.inference_mode()
def _lm_head_inputs(tiny_llama, data_dir, hf_model) -> torch.Tensor:
    """[tokens, hidden] float64: the final-norm outputs of the build's calibration windows, by transformers."""
    tokenizer = _TokenizerShim(Tokenizer.from_file(str(tiny_llama / "tokenizer.json")))
    windows, _ = calibration_windows(tokenizer, data_dir / "calibration.txt", NUM_SAMPLES, SEQ_LEN, None)
    hidden = hf_model(tiny_llama)(windows, output_hidden_states=True).hidden_states[-1]  # after model.norm
    return hidden.reshape(-1, hidden.shape[-1]).double()


class _TokenizerShim:
    bos_token_id = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text, add_special_tokens=False, verbose=False):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _gptq_reference(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, damp: float = 0.01) -> torch.Tensor:
    """Symmetric GPTQ in float64 (groups' min-max parameters taken when their first column is reached,
    compressed-tensors' scale absmax / ((2^bits - 1) / 2)): the dequantized weight."""
    w = w.double().clone()
    h = 2 * x.T @ x / x.shape[0]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for j in range(w.shape[1]):
        if j % group_size == 0:
            scale = w[:, j : j + group_size].abs().amax(dim=1) / ((2**bits - 1) / 2)
            scale = scale.clamp(min=torch.finfo(torch.float32).eps)
        q[:, j] = (torch.round(w[:, j] / scale).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)) * scale
        err = (w[:, j] - q[:, j]) / hinv[j, j]
        w[:, j:] -= err.unsqueeze(1) * hinv[j, j:].unsqueeze(0)
    return q


def _output_error(w_hat: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    return (x @ (w_hat.double() - w.double()).T).pow(2).mean().item()


@pytest.mark.parametrize("float_targets", [False, True])
def test_gptq_quantizes_lm_head_with_gptq_on_its_calibration_inputs(tiny_llama, data_dir, hf_model, tmp_path,
                                                                    float_targets):
    """It was rounded to nearest, silently, whatever the method (llm-compressor's GPTQModifier runs GPTQ on
    an lm_head it targets)."""
    spec, params = _build(tiny_llama, data_dir, tmp_path / "a", {"method": "gptq", "ignore": [r"re:layers\..*"],
                                                                   "group_size": 32, "float_targets": float_targets})
    x = _lm_head_inputs(tiny_llama, data_dir, hf_model)
    w = hf_model(tiny_llama).lm_head.weight.detach().double()
    ours = dequantize(make_format(spec, torch.float32), params, w.shape[1])
    reference = _gptq_reference(w, x, 4, 32)
    rtn = _gptq_reference(w, torch.eye(w.shape[1], dtype=torch.float64), 4, 32)  # H = 2I: no compensation
    e_ours, e_ref, e_rtn = (_output_error(q, w, x) for q in (ours, reference, rtn))
    assert e_ref < 0.9 * e_rtn  # the reference's compensation matters on these inputs
    assert e_ours <= 1.02 * e_ref, (e_ours, e_ref, e_rtn)


def test_fp8_static_lm_head_takes_its_input_scale_from_the_calibration_inputs(tiny_llama, data_dir, hf_model, tmp_path):
    """It failed at the end of the build ("needs calibration (input_scale is missing)") though the recipe
    had calibration data. scale = absmax / 448 of lm_head's inputs over the calibration windows."""
    spec, params = _build(tiny_llama, data_dir, tmp_path / "a", {"method": "fp8", "activations": "static",
                                                                   "ignore": [r"re:layers\..*"]})
    assert spec["is_static_input"]
    x = _lm_head_inputs(tiny_llama, data_dir, hf_model)
    torch.testing.assert_close(params["input_scale"].double(), x.abs().max().reshape(1) / 448, rtol=1e-5, atol=0)
