"""The artifact's tokenizer (HF files copied at build time), loaded offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmc.errors import ArtifactError, ConfigError, RequestError


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise ArtifactError(f"{path}: the artifact has no tokenizer directory; rebuild it")
    _verify(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ArtifactError(f"{path}: the tokenizer cannot be loaded ({e}); rebuild the artifact") from None
    # The engine measures prompts against max_model_len and says so in one line; transformers' own warning
    # about model_max_length ("Token indices sequence length is longer than ...") would be a second one.
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file holding the Jinja template, or the template itself (text with a '{',
    '}' or line break). Compiled here, so a template that cannot be rendered fails at start in one line."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value)
    try:
        template = path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {value}: cannot be read ({e})") from None
    if template is None:
        if not any(c in value for c in "{}\n"):
            raise ConfigError(f"--chat-template {value}: no such file, and not a Jinja template either; give the "
                              "path of a .jinja file or the template text")
        template = value
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return template


def encode_text(tokenizer, text: str, add_special_tokens: bool = True, keep: int | None = None) -> list[int]:
    """`text`'s token ids; with `keep` (truncate_prompt_tokens), at most that many, as vLLM tokenizes a
    truncated text prompt (the tokenizer's truncation from the left): the special tokens the tokenizer
    adds (a BOS) stay, the text's first tokens go. Done here, not by the tokenizer's own truncation,
    which would set it on the tokenizer that the server's threads share."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if keep is None or len(ids) <= keep:
        return ids
    content = tokenizer.encode(text, add_special_tokens=False) if add_special_tokens else ids
    num_added = len(ids) - len(content)
    start = next((p for p in range(num_added + 1) if ids[p:p + len(content)] == content), None)
    if start is None:  # the specials do not wrap the text's tokens: its last `keep` tokens
        return ids[-keep:]
    prefix, suffix = ids[:start], ids[start + len(content):]
    return prefix + (content[len(content) - (keep - num_added):] if keep > num_added else []) + suffix


def encode_pair(tokenizer, text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's input: the two texts' token ids as the tokenizer encodes a pair (its template's special
    tokens around and between them), as vLLM encodes a score request for a classifier of one label."""
    return list(tokenizer(text=text_1, text_pair=text_2, add_special_tokens=True)["input_ids"])


def _verify(path: Path) -> None:
    """The tokenizer files of an artifact must match their sha256 in its manifest before they are parsed."""
    from llmc.runtime import artifact as art

    root = path.parent
    if path.name == art.TOKENIZER_DIR and (root / art.MANIFEST_NAME).exists():
        manifest = art.read_manifest(root)
        art.verify_for_load(root, manifest, art.tokenizer_files(manifest))


# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                                 "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                 "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


# Content part types that hold text, as vLLM reads them, and the field holding it: the chat API's "text",
# the Responses API's "input_text" / "output_text", an assistant's "refusal"
TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def text_of_parts(parts: list) -> str:
    """A message's content given as a list of parts → the text the chat template reads: the text parts
    joined with newlines, as vLLM renders them (a part without its text is skipped, as there); a part of
    another kind (an image, audio) raises ValueError naming it."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        field = TEXT_PART_FIELDS.get(kind)
        if field is None:
            raise ValueError(f"only text parts are supported ({', '.join(TEXT_PART_FIELDS)}), got {kind!r}")
        if part.get(field) is not None:
            texts.append(part[field])
    return "\n".join(texts)


def is_unicode_text(value: str) -> bool:
    """Whether a str is Unicode text a tokenizer can take ("\ud800", a lone surrogate, is a str but not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _template_message(index: int, message: dict) -> dict:
    """One message as vLLM hands it to the template: content parts joined, None content as "", a tool
    call's JSON `arguments` text parsed into an object (templates write it with `tojson`), and an
    assistant's reasoning under both of vLLM's names (`reasoning`, `reasoning_content`). A copy."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("image", "video") for p in content):
        pass  # a vision model's parts (runtime/multimodal.chat_images): its template places each image and video
    elif isinstance(content, list):
        try:
            content = text_of_parts(content)
        except ValueError as e:
            raise RequestError(f"messages.{index}.content: {e}") from None
    message["content"] = "" if content is None else content
    if isinstance(content, str) and not is_unicode_text(content):
        raise RequestError(f"messages.{index}.content: not Unicode text (it holds a lone surrogate, e.g. from "
                           "bytes that are not UTF-8); send valid text")
    if isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = [_parsed_tool_call(index, i, call) for i, call in enumerate(message["tool_calls"])]
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    if reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = reasoning
    return message


def _parsed_tool_call(index: int, number: int, call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), (dict, list)):
        return call
    arguments = function.get("arguments")
    try:
        parsed = json.loads(arguments) if arguments else {}  # OpenAI's clients send JSON text; empty: no arguments
    except (TypeError, ValueError):
        raise RequestError(f"messages.{index}.tool_calls.{number}.function.arguments: not JSON text "
                           f"({str(arguments)[:40]!r}); send the arguments as a JSON object's text") from None
    return {**call, "function": {**function, "arguments": parsed}}


def checked_tools(tools: list | None) -> list[dict]:
    """Tool definitions as OpenAI and vLLM take them ({"type": "function", "function": {"name", "description",
    "parameters", "strict"}}; type "function" when left out, as vLLM reads it), for the chat template;
    RequestError starting with the malformed field ("tools.1.function.name: ...")."""
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools: must be a list of tools, got {type(tools).__name__}")
    checked = []
    for index, tool in enumerate(tools or []):
        where = f"tools.{index}"
        if not isinstance(tool, dict):
            raise RequestError(f'{where}: must be an object {{"type": "function", "function": {{"name": ..., '
                               f'"parameters": ...}}}}, got {type(tool).__name__}')
        if tool.get("type", "function") != "function":
            raise RequestError(f"{where}.type: must be 'function' (the only kind of tool), got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function: is required: an object with the function's name, and its "
                               "description and parameters (a JSON Schema) if any")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name: must be a non-empty string, got {name!r}")
        for field, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON Schema object"),
                                  ("strict", bool, "true or false")):
            value = function.get(field)
            if value is not None and not isinstance(value, kind):
                raise RequestError(f"{where}.function.{field}: must be {what}, got {type(value).__name__}")
        # as given; one that leaves "type" out gets it first, where vLLM's tool model puts it (templates `tojson` tools)
        checked.append(tool if "type" in tool else {"type": "function", **tool})
    return checked


def apply_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        chat_template_kwargs: dict | None = None, add_special_tokens: bool = False,
                        tools: list[dict] | None = None) -> list[int]:
    """Render messages with the artifact's chat template (or `chat_template`, a Jinja string), then
    tokenize the text without adding special tokens again (the template places them), as vLLM does
    (`add_special_tokens`: vLLM's option to add them on top, e.g. a BOS the template leaves out).
    vLLM's options: `add_generation_prompt` (open the assistant's turn), `continue_final_message`
    (leave the last, assistant message open, to be continued), `chat_template_kwargs` (extra
    variables of the template, e.g. Qwen3's enable_thinking), `tools` (OpenAI's tool definitions, which
    the template renders as `tools`, as vLLM hands them)."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise RequestError("this model has no chat template; send a plain prompt instead of messages")
    if add_generation_prompt and continue_final_message:
        raise RequestError("continue_final_message cannot be true while add_generation_prompt is (its default): "
                           "set add_generation_prompt false to continue the last message")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise RequestError("continue_final_message needs the last message to be the assistant's")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(extra.keys() & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise RequestError(f"chat_template_kwargs.{reserved[0]}: set by the request's own fields, not here")
    rendered = [_template_message(index, message) for index, message in enumerate(messages)]
    text = tokenizer.apply_chat_template(rendered, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=False, tools=tools or None,
                                         **extra)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
