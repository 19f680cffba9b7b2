"""Image-prompt throughput of a LLaVA artifact against transformers' LlavaForConditionalGeneration, in one run.

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp
    python -P $R/benchmarks/bench_vision.py make /tmp/llava --text-layers 8      # a LLaVA-1.5-7B-shaped checkpoint
    printf 'model: /tmp/llava\\noutput: /tmp/llava-bf16\\ndtype: bfloat16\\n' > llava.yaml && llmc build llava.yaml
    python -P $R/benchmarks/bench_vision.py run /tmp/llava-bf16 --checkpoint /tmp/llava --num-prompts 32 \\
        --max-tokens 64 --json $OUT/vision.json

`make` writes random weights in LLaVA-1.5-7B's shapes: CLIP ViT-L/14 at 336 px (24 layers, 576 image tokens from
layer -2, CLS dropped), the two-layer GELU projector, and Llama-2-7B's widths (4096 / 11008, 32 heads) with
--text-layers decoder layers; the tokenizer is the repo's reference one plus an <image> token, with
LlavaProcessor's files (a CLIPImageProcessor at 336 px). Speed does not depend on the weight values.

`run`: --num-prompts prompts "USER: <image>\\nDescribe the picture. ASSISTANT:", each with its own random
400x300 image, --max-tokens tokens each (ignore_eos, greedy).
  llmc          LLM(ARTIFACT).generate(prompts), median of --repeats after a warm-up call;
  transformers  the checkpoint's LlavaForConditionalGeneration (sdpa) on the same prompts and images as one
                batch (the processor's padded batch, left padding), generate(max_new_tokens = min_new_tokens).
Reported: output tokens/s of each and their ratio, and whether the first prompt's greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PROMPT = "USER: <image>\nDescribe the picture. ASSISTANT:"
REF_TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "ref-llama-12m"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def make(out: Path, text_layers: int, tiny: bool) -> None:
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = AutoTokenizer.from_pretrained(str(REF_TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    if tiny:  # a CPU check of the script
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=28, patch_size=14)
        text = LlamaConfig(vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
    else:  # LLaVA-1.5-7B: openai/clip-vit-large-patch14-336 and Llama-2-7B's widths
        vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                  num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768,
                                  hidden_act="quick_gelu")
        text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=text_layers,
                           num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                           rms_norm_eps=1e-5)
    text.bos_token_id, text.eos_token_id, text.pad_token_id = 0, 1, 4
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(out))
    size = vision.image_size
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=tokenizer, patch_size=vision.patch_size, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(out))
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)


def images(count: int) -> list:
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    return [Image.fromarray((torch.rand(300, 400, 3, generator=gen) * 255).to(torch.uint8).numpy())
            for _ in range(count)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_seconds(run, repeats: int) -> tuple[float, object]:
    out = run()  # warm-up
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        out = run()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run(args) -> None:
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    pictures = images(args.num_prompts)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": picture}} for picture in pictures]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    llm = LLM(args.artifact, disable_log_stats=True, enable_prefix_caching=False, **options)
    seconds, outputs = _median_seconds(lambda: llm.generate(prompts, params), args.repeats)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "prompt_tokens": len(outputs[0].prompt_token_ids),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "llmc": {"seconds": seconds, "output_tokens_per_s": tokens / seconds}}
    print(f"llmc: {tokens / seconds:.0f} output tokens/s ({seconds:.2f} s, {len(outputs[0].prompt_token_ids)} prompt "
          "tokens each)", flush=True)
    first = outputs[0].outputs[0].token_ids
    del llm
    if args.checkpoint:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        device = "cuda" if torch.cuda.is_available() else "cpu"
        processor = AutoProcessor.from_pretrained(args.checkpoint)
        processor.tokenizer.padding_side = "left"
        model = LlavaForConditionalGeneration.from_pretrained(args.checkpoint, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").to(device).eval()
        inputs = processor(text=[PROMPT] * len(pictures), images=pictures, return_tensors="pt", padding=True).to(device)

        @torch.inference_mode()
        def hf():
            return model.generate(**inputs, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                  do_sample=False)

        hf_seconds, out = _median_seconds(hf, args.repeats)
        hf_tokens = args.max_tokens * len(pictures)
        agree = out[0, inputs["input_ids"].shape[1]:].tolist()[:len(first)] == first
        result["transformers"] = {"seconds": hf_seconds, "output_tokens_per_s": hf_tokens / hf_seconds}
        result["ratio"] = (tokens / seconds) / (hf_tokens / hf_seconds)
        result["first_prompt_tokens_agree"] = agree
        print(f"transformers: {hf_tokens / hf_seconds:.0f} output tokens/s ({hf_seconds:.2f} s); llmc / transformers "
              f"= {result['ratio']:.2f}x; first prompt's greedy tokens agree: {agree}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make")
    made.add_argument("out", type=Path)
    made.add_argument("--text-layers", type=int, default=32)
    made.add_argument("--tiny", action="store_true", help="a small config for CPU checks")
    ran = sub.add_parser("run")
    ran.add_argument("artifact")
    ran.add_argument("--checkpoint", help="the checkpoint it was built from (the transformers row)")
    ran.add_argument("--num-prompts", type=int, default=32)
    ran.add_argument("--max-tokens", type=int, default=64)
    ran.add_argument("--repeats", type=int, default=3)
    ran.add_argument("--option", action="append", default=[], help="KEY=VALUE engine option (JSON value)")
    ran.add_argument("--json")
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.out, args.text_layers, args.tiny)
    else:
        run(args)


if __name__ == "__main__":
    main()
