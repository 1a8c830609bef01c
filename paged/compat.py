"""ExLlamaV2 names over the native classes, so code written for ExLlamaV2's dynamic generator runs with only its
imports and model-loading lines changed:

    from models import load_model
    from paged.compat import ExLlamaV2Cache, ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    model = load_model("smollm2-135m")                     # was: ExLlamaV2Config / ExLlamaV2 / load_autosplit
    cache = ExLlamaV2Cache(model, max_seq_len=8192)         # the total token budget of the paged cache
    tokenizer = model.tokenizer                             # was: ExLlamaV2Tokenizer(config)
    generator = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer)

Everything maps onto `DynamicGenerator`, `Job`, `SamplingSettings` and `AsyncDynamicGenerator`; there is no second
implementation. ExLlamaV2's argument names and defaults are kept (`gen_settings`, `token_repetition_*`, `top_p=0`
meaning off, `completion_only=False` in `generate()`, ...). What ExLlamaV2 has and this project does not (yet)
raises `UnsupportedFeatureError` (a `NotImplementedError`) naming the setting: never silently ignored. Knobs that only
tune ExLlamaV2's CUDA implementation (`max_q_size`, sampling threads, background filter evaluation) have no
equivalent here; a non-default value gives a warning. The mapping is documented in docs/compat.md.
"""

from __future__ import annotations

import copy
import numbers
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from paged.embeddings import MMEmbedding
from paged.errors import (
    InvalidConfigError,
    InvalidConfigTypeError,
    InvalidJobError,
    InvalidSettingsError,
    UnsupportedFeatureError,
)
from paged.host.async_generator import AsyncDynamicGenerator, AsyncJob
from paged.host.generator import DynamicGenerator
from paged.job import Job
from paged.settings import SamplingSettings
from paged.validate import Checker

WHOLE_CONTEXT = 1 << 30  # token_repetition_range=-1: the penalties see the whole context (clipped by the generator)


def _unsupported(what: str, value: Any, hint: str = "") -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"ExLlamaV2 setting {what}={value!r} is not implemented in this project"
                                   + (f"; {hint}" if hint else ""))


# ---------------------------------------------------------------------------------------------- sampler settings
class ExLlamaV2Sampler:
    """Namespace holding `Settings`, as in ExLlamaV2."""

    class Settings:
        """ExLlamaV2's mutable sampler settings. Attributes can be set after construction, as in ExLlamaV2; they are
        checked and turned into a native `SamplingSettings` (`to_native()`) when a job is created. Settings that
        are not implemented raise `UnsupportedFeatureError` unless left at their neutral default."""

        # name -> ExLlamaV2 default; the supported ones map to SamplingSettings fields in to_native()
        SUPPORTED = {
            "temperature": 0.8, "top_k": 50, "top_p": 0.8, "min_p": 0.0, "typical": 0.0,
            "token_repetition_penalty": 1.025, "token_repetition_range": -1, "token_repetition_decay": 0,
            "token_frequency_penalty": 0.0, "token_presence_penalty": 0.0, "token_bias": None,
            "smoothing_factor": 0.0, "min_temp": 0.0, "max_temp": 0.0, "temp_exponent": 1.0, "top_a": 0.0,
            "tfs": 0.0, "skew": 0.0, "temperature_last": False, "mirostat": False, "mirostat_tau": 1.5,
            "mirostat_eta": 0.1, "mirostat_mu": None,
            "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_sequence_breakers": None,
            "dry_range": 0, "dry_max_ngram": 20, "xtc_probability": 0.0, "xtc_threshold": 0.1,
            "xtc_ignore_tokens": None, "cfg_scale": None,
        }
        # Same names, same meaning in SamplingSettings (mirostat's mu, DRY's and XTC's state are per job there)
        DIRECT = ("smoothing_factor", "min_temp", "max_temp", "temp_exponent", "top_a", "temperature_last", "skew",
                  "mirostat", "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length",
                  "dry_range", "dry_max_ngram", "xtc_probability", "xtc_threshold", "cfg_scale")
        # name -> neutral default; any other value is not implemented here
        UNSUPPORTED = {"post_sampling_hooks": None}

        # ExLlamaV2 attributes that belong to the job here; set on the settings, they would be ignored
        TO_THE_JOB = {"filters": "filters", "filter_prefer_eos": "filter_prefer_eos"}
        _STATE = ("banned_tokens", "allowed_tokens", "_vocab_size")

        def __setattr__(self, name: str, value: Any) -> None:
            """Only the known settings (a typo such as `temprature` had been kept as a new attribute and ignored)."""
            if name in self.TO_THE_JOB:
                raise _unsupported(f"Settings.{name}", value, f"pass it to the job: ExLlamaV2DynamicJob("
                                   f"{self.TO_THE_JOB[name]}=...) or generate({self.TO_THE_JOB[name]}=...)")
            if name not in self.SUPPORTED and name not in self.UNSUPPORTED and name not in self._STATE:
                raise InvalidSettingsError(f"ExLlamaV2Sampler.Settings has no setting {name!r}; known: "
                                           f"{', '.join(sorted(self.SUPPORTED))}")
            object.__setattr__(self, name, value)

        def __init__(self, **kwargs: Any):
            known = {**self.SUPPORTED, **self.UNSUPPORTED}
            unknown = sorted(set(kwargs) - set(known))
            if unknown:
                raise InvalidSettingsError(f"ExLlamaV2Sampler.Settings: unknown setting(s) {unknown}")
            for name, default in known.items():
                setattr(self, name, copy.copy(default))
            self.banned_tokens: set[int] = set()  # from disallow_tokens()
            self.allowed_tokens: set[int] | None = None  # from allow_tokens()
            for name, value in kwargs.items():
                setattr(self, name, value)
            self._check_unsupported()

        @staticmethod
        def greedy(**kwargs: Any) -> ExLlamaV2Sampler.Settings:
            """Argmax decoding (ExLlamaV2: temperature 1, top_k 1, top_p 0, no repetition penalty)."""
            return ExLlamaV2Sampler.Settings(**{"temperature": 1.0, "top_k": 1, "top_p": 0.0,
                                                "token_repetition_penalty": 1.0, **kwargs})

        def clone(self) -> ExLlamaV2Sampler.Settings:
            """A copy (ExLlamaV2's is shallow; this one also copies the token sets, which are per-object here)."""
            c = copy.copy(self)
            c.banned_tokens = set(self.banned_tokens)
            c.allowed_tokens = None if self.allowed_tokens is None else set(self.allowed_tokens)
            return c

        def disallow_tokens(self, tokenizer: Any, tokens: Iterable[int]) -> None:
            """Never sample these token ids."""
            self.banned_tokens.update(_ids(tokens))

        def allow_tokens(self, tokenizer: Any, tokens: Iterable[int]) -> None:
            """Sample only among these token ids (and any allowed by later calls)."""
            self.allowed_tokens = (self.allowed_tokens or set()) | set(_ids(tokens))
            self._vocab_size = getattr(tokenizer, "vocab_size", None)

        def _check_unsupported(self) -> None:
            for name, neutral in self.UNSUPPORTED.items():
                value = getattr(self, name)
                if name == "post_sampling_hooks" and not value:
                    continue
                if value != neutral:
                    raise _unsupported(name, value, "leave it at its default " + repr(neutral))

        def to_native(self, vocab_size: int | None = None) -> SamplingSettings:
            """The equivalent native `SamplingSettings` (raises for unsupported settings)."""
            self._check_unsupported()
            rng = self.token_repetition_range
            if _is_number(rng) and rng < 0:
                rng = WHOLE_CONTEXT
            top_p = self.top_p
            if _is_number(top_p) and (top_p <= 0 or top_p >= 1):
                top_p = 1.0  # ExLlamaV2: active only for 0 < top_p < 1
            bias = _bias_dict(self.token_bias, vocab_size or getattr(self, "_vocab_size", None))
            banned = set(self.banned_tokens)
            if self.allowed_tokens is not None:
                v = vocab_size or getattr(self, "_vocab_size", None)
                if v is None:
                    raise InvalidSettingsError("allow_tokens() needs the vocabulary size: pass a tokenizer with "
                                               "vocab_size")
                banned |= set(range(v)) - self.allowed_tokens
            tfs = self.tfs
            if _is_number(tfs) and tfs >= 1:
                tfs = 0.0  # ExLlamaV2: active only for 0 < tfs < 1
            mu = self.mirostat_mu
            if isinstance(mu, np.ndarray):
                mu = mu.tolist() if mu.ndim else mu.item()
            if isinstance(mu, (list, tuple)):  # ExLlamaV2 keeps one mu per batch row here
                if len(mu) > 1:
                    raise InvalidSettingsError("mirostat_mu: one value per job here (a job's mu is its own), got "
                                               f"{len(mu)}")
                mu = mu[0] if mu else None
            if mu == 0:
                mu = None  # ExLlamaV2: 0 means "not started", i.e. 2 * tau
            ids = lambda v: None if v is None else sorted(_ids(list(v)))  # noqa: E731 (sets of ids)
            return SamplingSettings(
                temperature=self.temperature, top_k=self.top_k, top_p=top_p, min_p=self.min_p,
                typical=self.typical, repetition_penalty=self.token_repetition_penalty,
                frequency_penalty=self.token_frequency_penalty, presence_penalty=self.token_presence_penalty,
                penalty_range=rng, penalty_decay=self.token_repetition_decay, token_bias=bias,
                banned_tokens=sorted(banned), tfs=tfs, mirostat_mu=mu,
                dry_sequence_breakers=ids(self.dry_sequence_breakers), xtc_ignore_tokens=ids(self.xtc_ignore_tokens),
                **{name: getattr(self, name) for name in self.DIRECT},
            )


def _ids(tokens: Any) -> list[int]:
    arr = np.asarray(tokens).reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidSettingsError(f"token ids must be integers, got dtype {arr.dtype}")
    return [int(t) for t in arr]


def _bias_dict(token_bias: Any, vocab_size: int | None = None) -> dict[int, float]:
    """ExLlamaV2's dense bias vector (tensor or array of the padded vocabulary size, or one row of one) or a dict ->
    {id: bias}. Entries past `vocab_size` are the padding, which ExLlamaV2 masks anyway (`allow_tokens` fills them
    with -inf): dropped."""
    if token_bias is None:
        return {}
    if isinstance(token_bias, dict):
        return dict(token_bias)
    try:
        arr = np.asarray(token_bias, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidSettingsError(f"ExLlamaV2Sampler.Settings: token_bias must be a dict {{id: bias}} or a vector of "
                                   f"biases (one per token id), got {token_bias!r} ({e})") from None
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise InvalidSettingsError(f"ExLlamaV2Sampler.Settings: token_bias must be a vector of biases (one per token "
                                   f"id, or a (1, vocab) row), got shape {arr.shape}")
    if vocab_size is not None:
        arr = arr[:vocab_size]
    return {int(i): float(arr[i]) for i in np.flatnonzero(arr)}


def _is_number(value: Any) -> bool:
    """A real number (NumPy's too), not a bool: where ExLlamaV2 maps a value to "off"."""
    return isinstance(value, (numbers.Real, np.number)) and not isinstance(value, (bool, np.bool_))


# ---------------------------------------------------------------------------------------------- jobs
def _input_ids(input_ids: Any) -> Any:
    if isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]):
        if len(input_ids) == 2:  # a CFG pair of (1, n) tensors
            return [_one(x) for x in input_ids]
        if len(input_ids) == 1:
            return input_ids[0]
        raise InvalidJobError(f"ExLlamaV2DynamicJob: input_ids is a list of {len(input_ids)} sequences; pass one, or "
                              "two (positive, negative) for CFG")
    return input_ids


def _one(seq: Any) -> list[int]:
    """One sequence of a CFG pair, from a (1, n) tensor or array, or a flat sequence."""
    arr = np.asarray(seq.cpu() if hasattr(seq, "cpu") else seq)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise InvalidJobError(f"ExLlamaV2DynamicJob: each sequence of a CFG pair must have shape (n,) or (1, n), got "
                              f"{arr.shape}")
    return arr.tolist()


class ExLlamaV2DynamicJob(Job):
    """`Job` with ExLlamaV2's constructor (keyword names, defaults and the `(1, n)` tensor prompt)."""

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        max_skips: int = 4,
        gen_settings: ExLlamaV2Sampler.Settings | SamplingSettings | None = None,
        seed: int | None = None,
        stop_conditions: list | tuple | set | None = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: list | None = None,
        filter_prefer_eos: bool = False,
        token_healing: bool = False,
        identifier: Any = None,
        banned_strings: list[str] | None = None,
        embeddings: list | None = None,
        lora: str | None = None,
        **kwargs: Any,
    ):
        if kwargs:
            raise InvalidJobError(f"ExLlamaV2DynamicJob: unknown argument(s) {sorted(kwargs)}")
        if gen_settings is None:
            gen_settings = ExLlamaV2Sampler.Settings()
        self.exl2_settings = gen_settings
        native = gen_settings.to_native() if isinstance(gen_settings, ExLlamaV2Sampler.Settings) else gen_settings
        if isinstance(stop_conditions, set):
            stop_conditions = sorted(stop_conditions, key=lambda x: (isinstance(x, str), x))
        super().__init__(
            _input_ids(input_ids), max_new_tokens, min_new_tokens=min_new_tokens, gen_settings=native,
            stop_conditions=stop_conditions, seed=seed, identifier=identifier, max_skips=max_skips,
            return_top_tokens=return_top_tokens, return_probs=return_probs, return_logits=return_logits,
            decode_special_tokens=decode_special_tokens, banned_strings=banned_strings, token_healing=token_healing,
            filters=filters or None, filter_prefer_eos=filter_prefer_eos, embeddings=embeddings or None, lora=lora,
        )


def ExLlamaV2MMEmbedding(model: Any = None, embeddings: Any = None, text_alias: str | None = None):  # noqa: N802
    """ExLlamaV2's `ExLlamaV2MMEmbedding(model, embeddings, text_alias)`: a `paged.embeddings.MMEmbedding` (the model
    argument is not needed: the generator checks the width against its model)."""
    return MMEmbedding(embeddings, text_alias)


# ---------------------------------------------------------------------------------------------- cache and generator
class ExLlamaV2Cache:
    """Stands for ExLlamaV2's cache object: its `max_seq_len` is the total token budget of the paged cache (shared
    by all jobs), which becomes the generator's number of pages. The cache itself is created by the generator."""

    def __init__(self, model: Any, max_seq_len: int = -1, batch_size: int = 1, lazy: bool = False, **kwargs: Any):
        if batch_size != 1:
            raise InvalidConfigError(f"ExLlamaV2Cache: batch_size must be 1 for the dynamic generator, got "
                                     f"{batch_size}")
        if kwargs:
            raise InvalidConfigError(f"ExLlamaV2Cache: unknown argument(s) {sorted(kwargs)}")
        self.model = model
        max_seq_len = Checker("ExLlamaV2Cache", InvalidConfigError).int_(
            "max_seq_len", max_seq_len, allowed="an int (the cache's token budget; <= 0: the default)")
        self.max_seq_len = max_seq_len if max_seq_len > 0 else None


class ExLlamaV2DynamicGenerator(DynamicGenerator):
    """`DynamicGenerator` with ExLlamaV2's constructor and `generate()` defaults."""

    def __init__(
        self,
        model: Any,
        cache: ExLlamaV2Cache | None = None,
        tokenizer: Any = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_chunk_size: int | None = None,
        max_q_size: int = 8,
        draft_model: Any = None,
        draft_cache: Any = None,
        num_draft_tokens: int = 4,
        use_ngram_draft: bool = False,
        max_ngram: int = 4,
        max_sampling_threads: int = 16,
        min_sampling_threads: int = 3,
        paged: bool = True,
        filter_background_eval: bool = True,
        **kwargs: Any,
    ):
        if draft_cache is not None and draft_model is None:
            raise InvalidConfigError("ExLlamaV2DynamicGenerator: draft_cache without draft_model")
        # draft_cache: the draft model's paged cache is built here, mirroring the main cache's pages
        if not paged:
            raise _unsupported("paged", paged, "only the paged cache exists")
        for name, value, default in (("max_q_size", max_q_size, 8), ("max_sampling_threads", max_sampling_threads, 16),
                                     ("min_sampling_threads", min_sampling_threads, 3),
                                     ("filter_background_eval", filter_background_eval, True)):
            if value != default:
                warnings.warn(f"ExLlamaV2DynamicGenerator: {name}={value!r} has no effect here (it tunes ExLlamaV2's "
                              "own implementation)", stacklevel=2)
        native = {k: kwargs.pop(k) for k in list(kwargs) if k in _NATIVE_KWARGS}
        if kwargs:
            raise InvalidConfigError(f"ExLlamaV2DynamicGenerator: unknown argument(s) {sorted(kwargs)}")
        if cache is not None and not isinstance(cache, ExLlamaV2Cache):
            raise InvalidConfigError(f"ExLlamaV2DynamicGenerator: cache must be a paged.compat.ExLlamaV2Cache (or "
                                     f"None), got {type(cache).__name__}")
        page_size = native.get("page_size") or 64
        if cache is not None and cache.max_seq_len is not None and "num_pages" not in native:
            if not hasattr(getattr(model, "config", None), "max_position_embeddings"):  # (read below: it had been
                raise InvalidConfigTypeError(  # an AttributeError)
                    f"ExLlamaV2DynamicGenerator: model must be a loaded models.Model, got {type(model).__name__}; "
                    "load it first: models.load_model(...)")
            native["num_pages"] = 1 + -(-cache.max_seq_len // page_size)
            if max_seq_len is None:  # one job may use the whole budget, up to the model's positions
                max_seq_len = min(cache.max_seq_len, model.config.max_position_embeddings)
        super().__init__(model, tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         max_chunk_size=max_chunk_size, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
                         use_ngram_draft=use_ngram_draft, max_ngram=max_ngram, **native)

    def reset_page_table(self) -> None:
        """Forget the prompt cache (live jobs keep their pages)."""
        with self.lock:
            self.pool.reset_cache()

    def generate(
        self,
        prompt: str | tuple | Sequence[str | tuple],
        max_new_tokens: int,
        min_new_tokens: int = 0,
        seed: int | None = None,
        gen_settings: Any = None,
        token_healing: bool = False,
        encode_special_tokens: bool = False,
        decode_special_tokens: bool = False,
        stop_conditions: list | tuple | set | None = None,
        add_bos: bool = False,
        abort_event: Any = None,
        completion_only: bool = False,
        filters: list | None = None,
        filter_prefer_eos: bool = False,
        return_last_results: bool = False,
        embeddings: list | None = None,
        banned_strings: list[str] | None = None,
        lora: str | None = None,
        **kwargs: Any,
    ):
        """ExLlamaV2's `generate()`: the prompt is included in the output unless `completion_only=True`. `lora`
        (this framework's; ExLlamaV2 sets adapters on the model) names an adapter loaded with `load_lora`;
        `embeddings` may be one list per prompt, as ExLlamaV2's batched form."""
        if kwargs:
            raise InvalidJobError(f"generate(): unknown argument(s) {sorted(kwargs)}")
        vocab = getattr(self.tokenizer, "vocab_size", None)

        def native(s: Any) -> SamplingSettings | None:
            return s.to_native(vocab) if isinstance(s, ExLlamaV2Sampler.Settings) else s

        settings = [native(s) for s in gen_settings] if isinstance(gen_settings, (list, tuple)) else \
            native(gen_settings if gen_settings is not None else ExLlamaV2Sampler.Settings())
        if isinstance(stop_conditions, set):
            stop_conditions = sorted(stop_conditions, key=lambda x: (isinstance(x, str), x))
        return super().generate(
            prompt, max_new_tokens, min_new_tokens=min_new_tokens, gen_settings=settings,
            stop_conditions=stop_conditions, seed=seed, completion_only=completion_only, add_bos=add_bos,
            encode_special_tokens=encode_special_tokens, decode_special_tokens=decode_special_tokens,
            abort_event=abort_event, return_last_results=return_last_results, token_healing=token_healing,
            banned_strings=banned_strings, filters=filters, filter_prefer_eos=filter_prefer_eos, embeddings=embeddings,
            lora=lora,
        )


# Native settings the compat generator passes through (there is no ExLlamaV2 name for them).
_NATIVE_KWARGS = ("num_pages", "page_size", "max_prefill_rows", "max_penalty_range", "max_embedding_tokens",
                  "max_loras", "max_lora_rank", "mesh",
                  "decode_steps", "fuse_sampler", "cache_dtype",
                  "attn_impl", "matmul_impl", "attn_tuning", "matmul_tuning", "policy", "compilation_cache_dir",
                  "config", "clock",
                  "adaptive_draft", "draft_token_cost", "draft_acceptance", "ngram_corpus")


# ---------------------------------------------------------------------------------------------- async
class ExLlamaV2DynamicGeneratorAsync(AsyncDynamicGenerator):
    """`ExLlamaV2DynamicGeneratorAsync(*args, **kwargs)` builds an `ExLlamaV2DynamicGenerator(*args, **kwargs)` and
    serves it asynchronously (an already built generator may be passed instead)."""

    def __init__(self, *args: Any, **kwargs: Any):
        if len(args) == 1 and not kwargs and isinstance(args[0], DynamicGenerator):
            generator = args[0]
        else:
            generator = ExLlamaV2DynamicGenerator(*args, **kwargs)
        super().__init__(generator)


class ExLlamaV2DynamicJobAsync(AsyncJob):
    """`ExLlamaV2DynamicJobAsync(generator, **job_kwargs)`: creates the job, enqueues it, and iterates its results
    (`async for result in job`); `await job.cancel()`."""

    def __init__(self, generator: ExLlamaV2DynamicGeneratorAsync, **job_kwargs: Any):
        if not isinstance(generator, AsyncDynamicGenerator):
            raise InvalidJobError(f"ExLlamaV2DynamicJobAsync: generator must be an ExLlamaV2DynamicGeneratorAsync, "
                                  f"got {type(generator).__name__}")
        vocab = getattr(generator.generator.tokenizer, "vocab_size", None)
        settings = job_kwargs.get("gen_settings")
        if isinstance(settings, ExLlamaV2Sampler.Settings) and settings.allowed_tokens is not None:
            job_kwargs["gen_settings"] = settings.to_native(vocab)
        job = ExLlamaV2DynamicJob(**job_kwargs)
        super().__init__(generator, job)
        generator.register(self)


__all__ = ["ExLlamaV2Cache", "ExLlamaV2DynamicGenerator", "ExLlamaV2DynamicGeneratorAsync", "ExLlamaV2DynamicJob",
           "ExLlamaV2DynamicJobAsync", "ExLlamaV2MMEmbedding", "ExLlamaV2Sampler", "WHOLE_CONTEXT"]
