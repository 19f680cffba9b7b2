"""runtime/models/mamba2.py's mixer functions (Granite 4.0's Mamba-2; the wired layer: test_granite4_hybrid.py)
against transformers' GraniteMoeHybridMambaLayer (its torch path, float32, no cache: the whole sequence at once) on a
random layer of 8 heads of 16 in 2 groups, d_state 16, a conv of 4, transformers' chunk 8: the sequence prefilled in
pieces of 13 (chunks of 8 and 5, the conv and SSM states carried across pieces), then decoded one token at a time by
the recurrence."""

import pytest
import torch

from llmc.runtime.models.mamba2 import mamba2_mixer


@pytest.fixture(scope="module")
def layer():
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    config = GraniteMoeHybridConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, mamba_n_heads=8,
                                    mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                    mamba_chunk_size=8, layer_types=["mamba"])
    torch.manual_seed(0)
    module = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape))
        module.A_log.copy_(torch.rand(8).log())  # decays exp(dt A) well inside (0, 1)
        module.norm.weight.add_(1.0)
    return config, module


def _weights(module) -> dict:
    return {"in_proj": module.in_proj.weight, "conv_weight": module.conv1d.weight.squeeze(1),
            "conv_bias": module.conv1d.bias, "dt_bias": module.dt_bias, "A_log": module.A_log, "D": module.D,
            "norm": module.norm.weight, "out_proj": module.out_proj.weight}


@torch.inference_mode()
def test_chunked_prefill_and_decode_match_transformers(layer):
    config, module = layer
    hidden = torch.randn(1, 40, 64)
    want = module(hidden)[0]
    assert want.abs().mean() > 0.1
    cfg = {"heads": 8, "head_dim": 16, "groups": 2, "d_state": 16, "chunk": 8, "eps": config.rms_norm_eps,
           "time_step_limit": config.time_step_limit}
    conv_state, ssm_state = torch.zeros(64 * 2 + 2 * 2 * 16, 3), torch.zeros(8, 16, 16)
    got = []
    for start in range(0, 26, 13):  # two prefill pieces of 13, then 14 decodes
        out, conv_state = mamba2_mixer(hidden[0, start:start + 13], _weights(module), cfg, conv_state, ssm_state,
                                       decode=False)
        got.append(out)
    for t in range(26, 40):
        out, conv_state = mamba2_mixer(hidden[0, t:t + 1], _weights(module), cfg, conv_state, ssm_state, decode=True)
        got.append(out)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)
    # the state matters: the last decodes from a zero state are far off
    cold, _ = mamba2_mixer(hidden[0, 39:40], _weights(module), cfg, torch.zeros_like(conv_state),
                           torch.zeros_like(ssm_state), decode=True)
    assert (cold - want[39:]).abs().mean() > 0.1 * want[39:].abs().mean()
