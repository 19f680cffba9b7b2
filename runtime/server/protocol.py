"""Request bodies of the OpenAI-compatible API (pydantic), and how they become `SamplingParams`.

Field names and defaults are OpenAI's, plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, priority, stop_token_ids, ...). Unknown fields are
kept in `model_extra` so the handler can name them in a warning; fields OpenAI has and llmc does
not implement (suffix, tools, non-text response_format) are refused with a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.errors import invalid

# The most logprobs per token a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    allowed_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "only allowed with stream=true")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise invalid("best_of", "cannot be larger than n when streaming")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises RequestError naming the field for a value out of range."""
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
        }
        return SamplingParams(
            **{k: v for k, v in optional.items() if v is not None},
            n=self.n, best_of=self.best_of, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
        )


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    suffix: str | None = None
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        self.check_stream_options()
        if self.suffix:
            raise invalid("suffix", "is not supported")
        _check_logprobs("logprobs", self.logprobs)
        _check_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens", "must be at least 1 (0 is allowed only with echo=true)")

    @property
    def wants_prompt_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing (one token is generated and dropped)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        # echo + logprobs returns the prompt's logprobs too (lm-eval's loglikelihood).
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        max_tokens = 1 if self.wants_prompt_only else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise invalid(f"messages.{index}.content", f"only text parts are supported, got {part.type!r}")
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(_Body):
    type: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def check(self) -> None:
        self.check_stream_options()
        if self.response_format is not None and self.response_format.type != "text":
            raise invalid("response_format", f"only type 'text' is supported, got {self.response_format.type!r}")
        if self.tools:
            raise invalid("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none"):
            raise invalid("tool_choice", "tool calling is not supported")
        _check_logprobs("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs=true")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise invalid(name, f"must be at least 1, got {value}")

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict]:
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("prompt", "give exactly one of prompt or messages")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class BatchRequestLine(BaseModel):
    """One line of an OpenAI batch input file."""

    model_config = ConfigDict(extra="ignore")
    custom_id: str
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict


def _check_logprobs(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(name, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
