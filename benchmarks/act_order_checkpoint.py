"""A GPTQ act-order (`desc_act`) checkpoint made from a float one, for act-order speed benchmarks.

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/make_checkpoint.py --layers 8 --out /tmp/ck8 \
        && python $R/benchmarks/act_order_checkpoint.py /tmp/ck8 /tmp/ck8-gptq-act

Every decoder linear becomes 4-bit round-to-nearest with groups of 128 taken in a random column order, stored
as GPTQ (AutoGPTQ's v1 format: qweight, qzeros, scales, g_idx) with `desc_act: true`, as GPTQ's act order
leaves them (the groups' columns scattered). The order depends only on the linear's input width and layer,
so linears that share an input (q/k/v, gate/up) share it, as one Hessian per input makes them. Speed does
not depend on the values; the embedding, norms and lm_head are copied as they are.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llmc.quant.formats import QuantizedWeight
from llmc.quant.importers import pack_gptq
from llmc.quant.rtn import rtn_quantize

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def act_order_quantize(weight: torch.Tensor, group_size: int, seed: int) -> QuantizedWeight:
    in_features = weight.shape[1]
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed)).to(weight.device)
    q = rtn_quantize(weight[:, order].float(), 4, group_size, True, scale_dtype=torch.float16)
    levels = torch.empty_like(q.qweight)
    levels[:, order] = q.qweight
    g_idx = torch.empty(in_features, dtype=torch.int32, device=weight.device)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32, device=weight.device) // group_size
    return QuantizedWeight(levels, q.scales, None, 4, group_size, g_idx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.source.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, args.out / path.name)
    for path in sorted(args.source.glob("*.safetensors")):
        tensors = load_file(path)
        out = {}
        for name, tensor in tensors.items():
            parts = name.split(".")
            if name.endswith(".weight") and parts[-2] in LINEARS:
                seed = tensor.shape[1] * 1000 + int(parts[2])  # per input width and layer
                q = act_order_quantize(tensor.to(device), args.group_size, seed)
                base = name.removesuffix(".weight")
                out |= {f"{base}.{key}": value.cpu() for key, value in pack_gptq(q, is_v1=True).items()}
            else:
                out[name] = tensor
        save_file(out, args.out / path.name, metadata={"format": "pt"})
        print(f"{path.name}: {len(out)} tensors", flush=True)
    index = args.source / "model.safetensors.index.json"
    if index.exists():  # the weight map names the new tensors
        data = json.loads(index.read_text())
        weight_map = {}
        for name, shard in data["weight_map"].items():
            parts = name.split(".")
            if name.endswith(".weight") and parts[-2] in LINEARS:
                base = name.removesuffix(".weight")
                weight_map |= {f"{base}.{k}": shard for k in ("qweight", "qzeros", "scales", "g_idx")}
            else:
                weight_map[name] = shard
        (args.out / index.name).write_text(json.dumps({**data, "weight_map": weight_map}, indent=1))
    config = json.loads((args.source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": args.group_size,
                                     "sym": True, "desc_act": True, "checkpoint_format": "gptq"}
    (args.out / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    main()
