"""Errors a user can cause. The CLI prints them in one line and exits non-zero.

Every message says what to change. Internal bugs stay ordinary exceptions (with tracebacks).
"""


class LlmcError(Exception):
    """Base class: a problem the user can fix. `exit_code` is what the CLI exits with."""

    exit_code = 1


class RecipeError(LlmcError):
    """A recipe field is unknown, mistyped or out of range."""

    exit_code = 2


class CheckpointError(LlmcError):
    """The input checkpoint cannot be read (missing files, unsupported architecture, ...)."""


class ArtifactError(LlmcError):
    """The artifact is missing, corrupted, truncated or of an unknown format version."""


class RequestError(LlmcError, ValueError):
    """A request is invalid: bad sampling value, prompt too long, ... Also a ValueError, as vLLM's
    validation errors are (`except ValueError` around `SamplingParams(...)` or `LLM.generate` works).
    `param`: the request field at fault where the message does not name a SamplingParams field (the
    server's 400 names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(LlmcError):
    """A runtime option is invalid or the configuration cannot run (e.g. the KV cache does not fit)."""


class WorkerError(LlmcError):
    """A rank of a parallel engine died, could not start, or stopped answering; the engine is down."""
