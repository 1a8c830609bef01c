"""OpenAI-style errors: `APIError` carries the HTTP status and the body's `message`, `type`, `param` and `code`;
`from_generator_error` maps the generator's named errors (`paged.errors`) onto it, naming the request field at fault.

Body: `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, as OpenAI's API and vLLM answer.
"""

from __future__ import annotations

import re

from paged.errors import (
    GeneratorError,
    InvalidJobError,
    InvalidSettingsError,
    JobTooLargeError,
    UnsupportedFeatureError,
)


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


# The generator's names for a setting -> the request field that sets it.
PARAM_OF = {
    "token_bias": "logit_bias",
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop_conditions": "stop",
    "stop token ids": "stop_token_ids",
    "return_top_tokens": "top_logprobs",
    "filters": "banned_strings",  # (the one Job message about filters: they exclude banned strings)
}
_NAMED = re.compile(r"^(?:SamplingSettings|Job|DynamicGenerator): (?:gen_settings\.)?([a-z_]+)")


def param_of(message: str, default: str | None = None) -> str | None:
    """The request field a generator error message names ("SamplingSettings: top_p must be ..." -> "top_p")."""
    if "stop token ids" in message:
        return "stop_token_ids"
    m = _NAMED.match(message)
    if m is None:
        return default
    name = m.group(1)
    if name == "input_ids":
        return default
    if name == "lora":
        return "lora"
    return PARAM_OF.get(name, name)


def from_generator_error(e: GeneratorError, prompt_param: str = "prompt") -> APIError:
    """A 400 for a job the generator rejected (`Job()`, `SamplingSettings()`, `enqueue()`), naming the field:
    `prompt_param` ("prompt" or "messages") for errors about the prompt."""
    message = str(e)
    if isinstance(e, JobTooLargeError):
        return bad_request(f"This request does not fit the model's context: {message}", param=prompt_param,
                           code="context_length_exceeded")
    if isinstance(e, UnsupportedFeatureError):
        return bad_request(message, param=param_of(message), code="unsupported")
    if isinstance(e, (InvalidJobError, InvalidSettingsError)):
        return bad_request(message, param=param_of(message, prompt_param if "input_ids" in message else None))
    return bad_request(message)
