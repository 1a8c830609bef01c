"""OpenAI-style errors: `APIError` carries the HTTP status and the body's `message`, `type`, `param` and `code`;
`from_generator_error` maps the generator's named errors (`paged.errors`) onto it, naming the request field at fault.

Body: `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, as OpenAI's API and vLLM answer.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from pydantic import BaseModel

from paged.errors import (
    GeneratorError,
    InvalidJobError,
    InvalidSettingsError,
    JobTooLargeError,
    UnsupportedFeatureError,
)
from paged.server.protocol import ChatCompletionRequest, CompletionRequest


class APIError(Exception):
    """An error answered to the client: `status` (400, 404, 429, 503, 500) and the OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(404, f"The model {name!r} does not exist; this server serves {served}", param="model",
                    code="model_not_found")


def queue_full(waiting: int, limit: int) -> APIError:
    return APIError(429, f"The server's queue is full ({waiting} jobs waiting, --max_queue={limit}); retry later",
                    type="rate_limit_error", code="queue_full")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and accepts no new requests", type="server_error",
                    code="shutting_down")


# The generator's names for a setting -> the request fields that set it (the first one the request has).
PARAM_OF: dict[str, tuple[str, ...]] = {
    "token_bias": ("logit_bias",),
    "max_new_tokens": ("max_tokens",),
    "min_new_tokens": ("min_tokens",),
    "stop_conditions": ("stop",),
    "return_top_tokens": ("top_logprobs", "logprobs"),  # chat's name, then completions'
    "filters": ("banned_strings",),  # (the one Job message about filters: they exclude banned strings)
    "input_ids": (),  # the prompt: the caller's default
}
# Generator messages whose first word is no setting -> the request field at fault (None: none is; the server's
# configuration or a bug)
MESSAGES: tuple[tuple[str, str | None], ...] = (
    ("stop token ids", "stop_token_ids"),
    ("stop_conditions token id", "stop_token_ids"),
    ("ban every token of the vocabulary", "banned_tokens"),
    ("the stop tokens are banned too", "min_tokens"),
    ("a CFG job takes two rows", "negative_prompt"),
    ("DRY reads the token history", "dry_multiplier"),
    ("default DRY sequence breakers and XTC exempt tokens", None),
    ("token healing needs a text token", "token_healing"),
    ("need a tokenizer", None),
)
_NAMED = re.compile(r"^(?:SamplingSettings|Job|DynamicGenerator): (?:gen_settings\.)?([a-z_]+)")
ALL_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


def param_of(message: str, default: str | None = None, fields: Collection[str] = ALL_FIELDS) -> str | None:
    """The request field a generator error message names ("SamplingSettings: top_p must be ..." -> "top_p"), one
    of `fields` (the request's); `default` when it names none of them."""
    for said, field in MESSAGES:
        if said in message:
            return field if field is None or field in fields else default
    m = _NAMED.match(message)
    if m is None:
        return default
    name = m.group(1)
    return next((f for f in PARAM_OF.get(name, (name,)) if f in fields), default)


# a filter's class -> the request field that asked for it
FILTER_PARAMS = {"JsonSchemaFilter": "response_format", "RegexFilter": "regex", "GrammarFilter": "grammar",
                 "ChoiceFilter": "choice"}
_TOO_LARGE = re.compile(r"\b(\w+Filter): the constraint is too large for llguidance")


def job_failed(index: int, message: str) -> APIError:
    """The error for choice `index` whose job failed with `message` once running: a 400 naming the field when the
    request's own constraint outgrew the grammar library's limits while decoding (`paged.filters`), else a 500
    `job_failed`."""
    m = _TOO_LARGE.search(message)
    if m is not None:
        return bad_request(f"choice {index} failed: {message}", param=FILTER_PARAMS.get(m.group(1)),
                           code="constraint_too_large")
    return APIError(500, f"choice {index} failed: {message}", type="server_error", code="job_failed")


def from_generator_error(e: GeneratorError, request: type[BaseModel] | None = None) -> APIError:
    """A 400 for a job the generator rejected (`Job()`, `SamplingSettings()`, `enqueue()`), naming a field of
    `request` (the endpoint's request model; None: either endpoint's): its prompt field ("prompt" or "messages")
    for errors about the prompt."""
    fields = ALL_FIELDS if request is None else frozenset(request.model_fields)
    prompt_param = "messages" if "messages" in fields else "prompt"
    message = str(e)
    if isinstance(e, JobTooLargeError):
        return bad_request(f"This request does not fit the model's context: {message}", param=prompt_param,
                           code="context_length_exceeded")
    if isinstance(e, UnsupportedFeatureError):
        return bad_request(message, param=param_of(message, None, fields), code="unsupported")
    if isinstance(e, (InvalidJobError, InvalidSettingsError)):
        return bad_request(message, param=param_of(message, prompt_param if "input_ids" in message else None,
                                                   fields))
    return bad_request(message)
