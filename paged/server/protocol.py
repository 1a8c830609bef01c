"""The request bodies the server accepts, as pydantic models: OpenAI's fields for `/v1/completions` and
`/v1/chat/completions`, plus this project's extra body fields (ExLlamaV2's sampler, banned strings, CFG, LoRA,
grammars; docs/server.md lists them all).

Validation is strict: `null` for an optional field is its default (OpenAI's optional fields are nullable), and an
unknown field, a value of the wrong JSON type (`"temperature": "hot"`, `"n": 1.5`) or out
of the range below is a 400 naming the field. Ranges the generator checks itself (`top_p` in (0, 1], the sampler's
extras) are left to it, so one rule holds in one place; its errors are mapped to 400s naming the field too
(`paged.server.errors`).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 128  # choices per prompt (each is a job of the same batch)
MAX_CHOICES = 2048  # choices per request: its prompts x n (OpenAI takes up to 2048 prompts in one request)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_SEED = 2**32 - 1  # the sampler's seeds are 32-bit: choice j of a request samples with (seed + j) mod 2**32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """`null` for a field that has a default means the default, as in OpenAI's API (its optional fields are
        "or null": the official client sends `"logprobs": null` for `logprobs=None`); a required field stays
        required."""
        if not isinstance(data, dict):
            return data
        optional = {name for n, f in cls.model_fields.items() if not f.is_required() for name in (n, f.alias) if name}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class SamplingRequest(_Strict):
    """Fields both endpoints share: OpenAI's, then the extras (docs/server.md, "Extra body fields")."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # the sampler keeps 32 bits: a wider seed would collide
    user: str | None = None  # accepted and ignored, as an end-user id for the caller's own records
    # --- extras: sampling (ExLlamaV2's sampler, paged.SamplingSettings; same names and meanings)
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM's "off") or 0: off
    min_p: float | None = None
    typical: float | None = None
    repetition_penalty: float | None = None
    penalty_range: int | None = None
    penalty_decay: int | None = None
    top_a: float | None = None
    tfs: float | None = None
    smoothing_factor: float | None = None
    min_temp: float | None = None
    max_temp: float | None = None
    temp_exponent: float | None = None
    temperature_last: bool | None = None
    skew: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    xtc_ignore_tokens: list[int] | None = None
    mirostat: bool | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    mirostat_mu: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_range: int | None = None
    dry_max_ngram: int | None = None
    dry_sequence_breakers: list[int] | None = None
    banned_tokens: list[int] | None = None
    # --- extras: the job
    min_tokens: int = Field(0, ge=0)  # vLLM's name for min_new_tokens
    ignore_eos: bool = False  # vLLM's: do not stop at the tokenizer's end-of-sequence token
    stop_token_ids: list[int] | None = None
    banned_strings: str | list[str] | None = None
    negative_prompt: str | None = None  # classifier-free guidance, with cfg_scale
    cfg_scale: float | None = None
    lora: str | None = None  # an adapter the server loaded (--lora name=path); or name it as the model
    regex: str | None = None  # constrained output: a regular expression the whole output matches
    grammar: str | None = None  # ... a Lark grammar (start rule `start`)
    choice: list[str] | None = None  # ... one of these strings
    token_healing: bool = False
    priority: int = 0

    def sampling_extras(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SAMPLING_EXTRAS if getattr(self, k) is not None}


SAMPLING_EXTRAS = ("min_p", "typical", "repetition_penalty", "penalty_range", "penalty_decay", "top_a", "tfs",
                   "smoothing_factor", "min_temp", "max_temp", "temp_exponent", "temperature_last", "skew",
                   "xtc_probability", "xtc_threshold", "xtc_ignore_tokens", "mirostat", "mirostat_tau", "mirostat_eta",
                   "mirostat_mu", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_range", "dry_max_ngram",
                   "dry_sequence_breakers", "banned_tokens")


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(_Strict):
    name: str
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def error_param(loc: tuple, model: type[BaseModel] | None) -> str | None:
    """The request field a validation error's `loc` names, for `param`: its field names and list indices, walked
    through `model`'s fields, without pydantic's union-member tags or a dict's keys
    (`("stop", "str")` -> "stop", `("messages", 0, "content", "list[TextPart]", 0, "text")` ->
    "messages.0.content.0.text", `("logit_bias", "65")` -> "logit_bias"). An unknown field (last in its `loc`) is
    named as sent. None when `loc` names nothing (a body that is not a JSON object)."""
    loc = tuple(loc[1:] if loc and loc[0] == "body" else loc)
    if model is None:  # no model to walk: the top-level field
        return str(loc[0]) if loc and isinstance(loc[0], str) else None
    out: list[str] = []
    kinds: list[Any] = [model]
    for i, part in enumerate(loc):
        members = [m for k in kinds for m in _members(k)]
        if isinstance(part, int):
            inner = [typing.get_args(m)[0] for m in members if typing.get_origin(m) is list and typing.get_args(m)]
            if not inner:
                break
            out.append(str(part))
            kinds = inner
            continue
        models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        field = next((f for m in models for name, f in m.model_fields.items() if part in (name, f.alias)), None)
        if field is not None:
            out.append(part)
            kinds = [field.annotation]
        elif models and i == len(loc) - 1:  # a field the model does not have (extra_forbidden)
            out.append(part)
        elif any(m is dict or typing.get_origin(m) is dict for m in members):
            break  # a key of a dict field (logit_bias's token ids): the field is named
        # else: a union member's tag ("str", "list[int]", "function-after[...]"): not a field
    return ".".join(out) or None


def _members(kind: Any) -> list[Any]:
    """A union's members (None left out); any other type as itself."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [m for k in typing.get_args(kind) if k is not type(None) for m in _members(k)]
    return [kind]
