"""What the vision models' tests (Gemma 3, Mistral 3, LLaVA-NeXT) share: transformers' greedy generation as the
oracle, an output checked against it, and the four requests every family answers (one image, another image, both in
one prompt, no image, then the processor's already-expanded ids)."""

import pytest
import torch


def hf_greedy_with_logprobs(model, inputs: dict, max_tokens: int):
    """(the prompt ids, transformers' greedy tokens, each one's logprob) of `inputs` (the processor's tensors)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    prompt_ids = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return prompt_ids, tokens, logprobs


def check_output(output, expected, atol=2e-4):
    prompt_ids, tokens, logprobs = expected
    assert output.prompt_token_ids == prompt_ids
    assert output.outputs[0].token_ids == tokens
    ours = [step[t].logprob for step, t in zip(output.outputs[0].logprobs, tokens)]
    assert ours == pytest.approx(logprobs, abs=atol)


def check_image_requests(llm, greedy, expected, prompt: str, two: str, plain_ids: list[int], first, second, atol):
    """`llm`'s replies to `prompt` with `first`, with `second`, to `two` with both and to `plain_ids` without images
    against transformers' (`expected`, in that order); the two images' replies differ; the third prompt given as
    transformers' expanded ids gets the same reply."""
    outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": first}},
                            {"prompt": prompt, "multi_modal_data": {"image": second}},
                            {"prompt": two, "multi_modal_data": {"image": [first, second]}},
                            {"prompt_token_ids": plain_ids}], greedy)
    for output, want in zip(outputs, expected):
        check_output(output, want, atol)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids
    [expanded] = llm.generate({"prompt_token_ids": expected[2][0], "multi_modal_data": {"image": [first, second]}},
                              greedy)
    check_output(expanded, expected[2], atol)


def record_chunks(monkeypatch) -> list:
    """(request, its computed tokens, the step's new tokens) of every request the scheduler schedules from now on."""
    from llmc.runtime.scheduler import Scheduler

    chunks, schedule = [], Scheduler.schedule

    def recording(self):
        batch = schedule(self)
        chunks.extend((s.request, s.request.num_computed_tokens, s.num_new_tokens) for s in batch.requests)
        return batch

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return chunks


def check_chunked_image_prefill(artifact, monkeypatch, greedy, requests: list[dict], expected) -> None:
    """`requests` (prompts with images) served 8 tokens a step on the CPU: each reply equal to transformers'
    (`expected`, in order), and some chunk ended inside an image (split across chunks)."""
    from llmc.runtime.llm import LLM

    chunks = record_chunks(monkeypatch)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=8, max_num_seqs=2, num_kv_blocks=64, block_size=8)
    for output, want in zip(llm.generate(requests, greedy), expected, strict=True):
        check_output(output, want)
    inside = [(start, n) for request, start, n in chunks
              if request.images and request.images.positions[0] < start + n <= request.images.positions[-1]]
    assert inside  # some chunk ended inside an image


def check_chat_image_parts(llm, greedy, picture, text: str, expected) -> None:
    """`llm.chat` with `picture` as an image_url (a data URL) and as vLLM's image_pil part, then `text`: each reply
    equal to transformers' (`expected`, for the same prompt as the chat template renders it)."""
    from tests.runtime.test_llava import data_url

    for part in ({"type": "image_url", "image_url": {"url": data_url(picture)}},
                 {"type": "image_pil", "image_pil": picture}):
        [output] = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": text}]}], greedy)
        check_output(output, expected)
