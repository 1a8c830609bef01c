"""A validated request body -> the `Job`s it asks for (`Plan`): prompts through the chat template and the
tokenizer, OpenAI's sampling fields and the extras into `SamplingSettings`, stop strings and tokens,
`response_format` and the grammar extras into `paged.filters`, `n` choices per prompt.

Defaults are OpenAI's, not ExLlamaV2's: an unset `temperature` is 1, `top_p` 1, and the sampler's truncations and
penalties are off (`top_k` 0, `repetition_penalty` 1); `max_tokens` defaults to 16 on `/v1/completions` and to the
rest of the context on `/v1/chat/completions`. The end-of-sequence token stops a job unless `ignore_eos`.
Everything here raises `APIError` (400) naming the field; nothing touches the generator.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from paged.errors import GeneratorError
from paged.filters import ChoiceFilter, GrammarFilter, JsonSchemaFilter, RegexFilter
from paged.job import Job
from paged.server.errors import bad_request, from_generator_error
from paged.server.protocol import MAX_CHOICES, MAX_SEED, ChatCompletionRequest, CompletionRequest, SamplingRequest
from paged.settings import SamplingSettings

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# A plain template for models without one (the tests' byte-tokenizer model): "<|role|>content" lines, then the
# assistant's turn.
SIMPLE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclasses.dataclass
class Context:
    """What translating a request needs from the server."""

    tokenizer: Any
    max_seq_len: int
    chat_template: str | None = None  # overrides the tokenizer's
    loras: frozenset[str] = frozenset()  # adapters loaded into the generator (a model name may be one)
    max_penalty_range: int | None = None  # the generator's token history (0: none, so no penalties); None: unchecked
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-reply ids (`Model.stop_token_ids`) besides the tokenizer's


@dataclasses.dataclass
class Plan:
    """One request's jobs, choice i = `jobs[i]` (prompt i // n, its choice i % n), and how to report them."""

    jobs: list[Job]
    prompt_lens: list[int]  # per prompt
    n: int
    logprobs: int | None  # None: no logprobs; else how many top alternatives per token
    echo: list[str] | None = None  # completions with echo: each prompt's text, put before its choices' text


_ids = itertools.count()


def choices_of(req: SamplingRequest) -> int:
    """The jobs a request asks for: its prompts (a completions request may send a list of them) times `n`; a 400
    naming the field when past `MAX_CHOICES`. Counted before any prompt is encoded or any job built."""
    p = getattr(req, "prompt", None)
    prompts = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
    if prompts * req.n > MAX_CHOICES:
        raise bad_request(f"{prompts} prompts x n={req.n} is {prompts * req.n} choices, more than the "
                          f"{MAX_CHOICES} a request may ask for; split the request", param="n" if req.n > 1 else
                          "prompt")
    return prompts * req.n


def _encode(tok: Any, text: str, param: str) -> list[int]:
    try:
        ids = tok.encode(text, encode_special_tokens=True)
    except Exception as e:  # noqa: BLE001 (the tokenizer's named errors: a lone surrogate, ...)
        raise bad_request(f"{param} cannot be encoded: {type(e).__name__}: {e}", param=param) from None
    return list(ids)


def render_chat(ctx: Context, messages: list[dict]) -> str:
    """The chat template over `messages` (`[{"role", "content"}]`), with the assistant's turn opened."""
    tok = ctx.tokenizer
    template = ctx.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise bad_request("This model has no chat template: use /v1/completions, or start the server with "
                          "--chat_template", param="messages")
    try:
        if hasattr(tok, "apply_chat_template"):
            return tok.apply_chat_template(messages, add_generation_prompt=True, chat_template=ctx.chat_template)
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="",
                                                eos_token="")
    except Exception as e:  # noqa: BLE001 (a template that fails on these messages)
        raise bad_request(f"The chat template failed on these messages: {type(e).__name__}: {e}",
                          param="messages") from None


def settings_of(req: SamplingRequest) -> SamplingSettings:
    """OpenAI's sampling fields (OpenAI's defaults) and the extras, as one `SamplingSettings`."""
    kw: dict[str, Any] = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.top_k is not None:
        kw["top_k"] = max(req.top_k, 0)
    kw.update(req.sampling_extras())
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                                  param="logit_bias") from None
        kw["token_bias"] = bias
    if req.cfg_scale is not None:
        kw["cfg_scale"] = req.cfg_scale
    try:
        return SamplingSettings(**kw)
    except GeneratorError as e:
        raise from_generator_error(e, type(req)) from None


def _filters(req: SamplingRequest, response_format: Any = None) -> list:
    out = []

    def build(param: str, make, value):
        try:
            out.append(make(value))
        except GeneratorError as e:
            raise bad_request(f"{param}: {e}", param=param) from None

    if response_format is not None and response_format.type == "json_object":
        build("response_format", JsonSchemaFilter, {"type": "object"})
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema object",
                              param="response_format")
        build("response_format", JsonSchemaFilter, response_format.json_schema.schema_)
    if req.regex is not None:
        build("regex", RegexFilter, req.regex)
    if req.grammar is not None:
        build("grammar", GrammarFilter, req.grammar)
    if req.choice is not None:
        build("choice", ChoiceFilter, req.choice)
    return out


# the sampler's fields that read the token history -> their neutral value (set to it, they ask for nothing)
HISTORY_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "dry_multiplier": 0.0}


def _check_common(req: SamplingRequest, ctx: Context) -> None:
    if ctx.max_penalty_range == 0:  # the generator keeps no history: the penalties would be ignored, DRY refused
        for name, neutral in HISTORY_FIELDS.items():
            if getattr(req, name) not in (None, neutral):
                raise bad_request(f"{name} reads the generated tokens' history, and this server keeps none "
                                  f"(--max_penalty_range 0): start the server with --max_penalty_range > 0, or leave "
                                  f"{name} unset", param=name, code="unsupported")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    if req.negative_prompt is not None and req.cfg_scale is None:
        raise bad_request("negative_prompt needs cfg_scale (classifier-free guidance)", param="negative_prompt")
    if req.cfg_scale is not None and req.negative_prompt is None:
        raise bad_request("cfg_scale needs a negative_prompt", param="cfg_scale")


def _jobs(req: SamplingRequest, ctx: Context, prompts: list[list[int]], negative: list[int] | None,
          max_tokens: int | None, default_max: int | None, logprobs: int | None, filters: list,
          prompt_param: str, lora: str | None, max_tokens_param: str = "max_tokens") -> list[Job]:
    settings = settings_of(req)
    stops: list[Any] = [] if req.stop is None else ([req.stop] if isinstance(req.stop, str) else list(req.stop))
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty", param="stop")
    eos = {t for t in (getattr(ctx.tokenizer, "eos_token_id", None), *ctx.eos_token_ids) if t is not None}
    stops += sorted(set(req.stop_token_ids or []) | (eos if not req.ignore_eos else set()))
    if negative is not None and not negative:
        raise bad_request("negative_prompt is empty (or encodes to no tokens)", param="negative_prompt")
    tag = next(_ids)
    jobs = []
    for p, ids in enumerate(prompts):
        longest = max(len(ids), len(negative or ()))
        for name, param, n in (("prompt", prompt_param, len(ids)), ("negative_prompt", "negative_prompt",
                                                                       len(negative or ()))):
            if n >= ctx.max_seq_len:
                raise bad_request(f"The {name} is {n} tokens long and the model's context is {ctx.max_seq_len} "
                                  "tokens: no room for a completion", param=param, code="context_length_exceeded")
        if max_tokens is not None:
            new = max_tokens
        else:  # the endpoint's default, cut to the context left
            new = min(default_max or ctx.max_seq_len, ctx.max_seq_len - longest)
        if longest + new > ctx.max_seq_len:
            raise bad_request(f"{max_tokens_param}={new} plus the prompt's {longest} tokens exceeds the model's "
                              f"context of {ctx.max_seq_len} tokens", param=max_tokens_param,
                              code="context_length_exceeded")
        if req.min_tokens > new:
            raise bad_request(f"min_tokens={req.min_tokens} exceeds {max_tokens_param}={new}", param="min_tokens")
        for c in range(req.n):
            try:
                jobs.append(Job(
                    ids if negative is None else [ids, negative], new, min_new_tokens=req.min_tokens,
                    gen_settings=settings, stop_conditions=stops,
                    seed=None if req.seed is None else (req.seed + c) % (MAX_SEED + 1),
                    identifier=("http", tag, p * req.n + c), return_probs=logprobs is not None,
                    return_top_tokens=logprobs or 0, banned_strings=req.banned_strings,
                    token_healing=req.token_healing, priority=req.priority, filters=filters or None, lora=lora))
            except GeneratorError as e:
                raise from_generator_error(e, type(req)) from None
    return jobs


def _lora(req: SamplingRequest, ctx: Context, model_is_lora: bool) -> str | None:
    if model_is_lora and req.lora is not None and req.lora != req.model:
        raise bad_request(f"model names the adapter {req.model!r} and lora names {req.lora!r}; give one",
                          param="lora")
    name = req.model if model_is_lora else req.lora
    if name is not None and name not in ctx.loras:
        raise bad_request(f"lora={name!r} is not loaded on this server (loaded: {sorted(ctx.loras)})", param="lora")
    return name


def completion_plan(req: CompletionRequest, ctx: Context, model_is_lora: bool = False) -> Plan:
    choices_of(req)
    _check_common(req, ctx)
    if req.suffix is not None:
        raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of", code="unsupported")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (no prompt logprobs)", param="echo",
                          code="unsupported")
    p = req.prompt
    if isinstance(p, str):
        texts: list[str | None] = [p]
        prompts = [_encode(ctx.tokenizer, p, "prompt")]
    elif p and isinstance(p[0], str):
        texts = list(p)
        prompts = [_encode(ctx.tokenizer, t, "prompt") for t in p]
    elif p and isinstance(p[0], int):
        texts, prompts = [None], [list(p)]
    else:
        texts, prompts = [None] * len(p), [list(x) for x in p]
    if not prompts or any(not ids for ids in prompts):
        raise bad_request("prompt is empty (or encodes to no tokens)", param="prompt")
    vocab = getattr(ctx.tokenizer, "vocab_size", None)
    for ids in prompts:
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise bad_request(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="prompt")
    negative = None if req.negative_prompt is None else _encode(ctx.tokenizer, req.negative_prompt,
                                                                "negative_prompt")
    jobs = _jobs(req, ctx, prompts, negative, req.max_tokens, DEFAULT_COMPLETION_TOKENS, req.logprobs,
                 _filters(req), "prompt", _lora(req, ctx, model_is_lora))
    echo = None
    if req.echo:
        echo = [t if t is not None else ctx.tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
    return Plan(jobs=jobs, prompt_lens=[len(ids) for ids in prompts], n=req.n, logprobs=req.logprobs, echo=echo)


def chat_plan(req: ChatCompletionRequest, ctx: Context, model_is_lora: bool = False) -> Plan:
    _check_common(req, ctx)
    if req.tools:
        raise bad_request("tools are not supported", param="tools", code="unsupported")
    if req.tool_choice not in (None, "none"):
        raise bad_request("tool_choice is not supported (only 'none')", param="tool_choice", code="unsupported")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    ids = _encode(ctx.tokenizer, render_chat(ctx, messages), "messages")
    negative = None
    if req.negative_prompt is not None:  # formatted like the prompt: the same system messages, one user turn
        system = [m for m in messages if m["role"] == "system"]
        negative = _encode(ctx.tokenizer, render_chat(ctx, system + [{"role": "user",
                                                                       "content": req.negative_prompt}]),
                           "negative_prompt")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    jobs = _jobs(req, ctx, [ids], negative, max_tokens, None, logprobs, _filters(req, req.response_format),
                 "messages", _lora(req, ctx, model_is_lora),
                 "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    return Plan(jobs=jobs, prompt_lens=[len(ids)], n=req.n, logprobs=logprobs)
