"""`DynamicGenerator`: the thin host loop. Each `iterate()` admits jobs (`Scheduler` + `Policy`), plans one ragged
step of prefill chunks and decode rows, runs it on the engine, and turns the sampled tokens into streamed result
dicts (`JobOutput`).

The device work is one call to `engine.run`; everything here is bookkeeping on Python ints. The engine is anything
that implements `paged.device.engine_api.EngineProtocol`, which is how the scheduler is tested with a hand-checkable
fake model.

Faults stay where they belong. Arguments are validated before a job touches the generator (`enqueue` is atomic).
A failure that belongs to one job while it runs ends that job alone: its pages are released and its final result
has `eos_reason="error"` and an `error` message; the other jobs go on. If the step as a whole fails (the engine
raises), `iterate()` raises `StepError`, the results produced earlier in that call are returned by the next call,
no job has advanced, and the generator stays usable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from models.errors import NonFiniteWeightError
from paged.clock import wall_clock
from paged.device.batch import mask_words
from paged.device.buckets import next_pow2
from paged.device.config import EngineConfig
from paged.device.engine import Engine
from paged.device.engine_api import EngineProtocol
from paged.device.sharding import shared_seed
from paged.embeddings import EmbeddingSlots, MMEmbedding, encode_with_embeddings
from paged.errors import (
    InvalidConfigError,
    InvalidConfigTypeError,
    InvalidJobError,
    InvalidJobTypeError,
    JobFailure,
    JobTooLargeError,
    NonFiniteAdapterError,
    PolicyError,
    StepError,
)
from paged.filters import FilterState, compute_masks, mask_without
from paged.host.job_output import JobOutput
from paged.host.page_pool import PagePool
from paged.host.scheduler import Scheduler, members
from paged.job import Job
from paged.policies import Policy, make_policy
from paged.settings import SamplingSettings
from paged.speculation.config import SpeculationConfig
from paged.speculation.rows import Accepted
from paged.speculation.spec_step import SpeculativeStep, empty_metrics
from paged.streaming import TextStream
from paged.token_sets import DRY_BREAKER_CHARS, XTC_EXEMPT_CHARS, TokenSets
from paged.validate import Checker


@dataclasses.dataclass
class _Prepared:
    """What `DynamicGenerator._prepare` builds for one job before any job of an `enqueue` list is committed."""

    stream: TextStream
    healing: list[int] | None  # token healing: the tokens the first sample may take
    healing_prefix: bytes | None  # ... and the dropped prompt token's bytes they start with
    filter_state: FilterState | None
    negative: Job | None  # CFG: the negative prompt's hidden job
    dry_breakers: Any
    xtc_exempt: Any


# Settings that belong to the engine (they shape the cache and the compiled buckets) rather than to the host loop.
_HOST_SETTINGS = ("decode_steps",)


class _PlainRow:
    """Row `i` of a plain step's output (or of one step of a burst, `_StepView`) as `_collect_row` reads an
    `Accepted`: the token the row sampled (none for a prefill chunk that does not sample) and its log-probability,
    every token of the row having K/V. Its top-k and logits are sliced from the step's arrays only when read (only
    for a job that asked for them)."""

    __slots__ = ("tokens", "logprobs", "kv_advance", "_out", "_at")

    def __init__(self, out: Any, i: int, token: int, logprob: float, row: Any):
        self.tokens = [token] if row.sample else []
        self.logprobs = [logprob]
        self.kv_advance = len(row.tokens)
        self._out = out
        self._at = slice(i, i + 1)

    @property
    def top_ids(self) -> np.ndarray:
        return self._out.top_ids[self._at]

    @property
    def top_logprobs(self) -> np.ndarray:
        return self._out.top_logprobs[self._at]

    @property
    def logits(self) -> np.ndarray | None:
        return None if self._out.logits is None else self._out.logits[self._at]


class _StepView:
    """Step `i` of a multi-step `StepOutput` (arrays `[steps, n]`), restricted to the input rows `cols`."""

    def __init__(self, out: Any, i: int, cols: list[int]):
        self.seconds = out.seconds
        self.token = out.token[i][cols]
        self.logprob = out.logprob[i][cols]
        self.top_ids = out.top_ids[i][cols]
        self.top_logprobs = out.top_logprobs[i][cols]
        self.logits = None


class DynamicGenerator:
    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        *,
        num_pages: int | None = None,
        page_size: int | None = None,
        max_batch_size: int | None = None,
        max_chunk_size: int | None = None,
        max_seq_len: int | None = None,
        max_prefill_rows: int | None = None,
        max_penalty_range: int | None = None,
        decode_steps: int | None = None,
        fuse_sampler: bool | None = None,
        cache_dtype: str | None = None,
        attn_impl: str | None = None,
        matmul_impl: str | None = None,
        attn_tuning: Any = None,
        matmul_tuning: Any = None,
        max_embedding_tokens: int | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        mesh: str | None = None,
        policy: str | Policy | type[Policy] = "exllamav2",
        compilation_cache_dir: str | os.PathLike | None = None,
        config: EngineConfig | None = None,
        engine: EngineProtocol | None = None,
        clock: Callable[[], float] | None = None,
        draft_model: Any = None,
        num_draft_tokens: int = 4,
        use_ngram_draft: bool = False,
        max_ngram: int = 4,
        adaptive_draft: bool = False,
        draft_token_cost: float | None = None,
        draft_acceptance: str = "rejection",
        ngram_corpus: Any = None,
    ):
        """model: a `models.Model`; tokenizer: None -> model.tokenizer.

        Engine settings (see `paged.device.config.EngineConfig` for each one's meaning, default and range) come from
        `config`, overridden by any keyword given here; None means "the default". `engine`: an object implementing
        `EngineProtocol` to use instead of building one (tests, simulators); its own config then applies, and only
        the host-loop setting `decode_steps` may still be given here.

        `policy`: a name from `paged.policies.POLICIES`, `"module:Class"`, a `Policy` subclass or instance
        (`paged.policies`; the policy's `allocation` decides between reserved and on-demand pages). `clock`: the
        zero-argument callable (seconds) behind every job timestamp (arrival, first and last token); default: the
        engine's `clock` attribute if it has one (a simulated engine's virtual clock), else `time.perf_counter`.

        Speculative decoding (docs/speculative.md): `draft_model` (a `models.Model` with the model's vocabulary and
        tokenizer, e.g. `models.draft.truncated_model(model, n)`) or `use_ngram_draft=True` (prompt lookup over the
        last `max_ngram` tokens) drafts up to `num_draft_tokens` tokens per decoding job and step, verified in the same
        ragged step; the output is the one without speculation (greedy: token for token; sampled: in distribution,
        seeded reruns identical). Without a drafter nothing changes. Decode bursts (`decode_steps`) are off while
        speculating. `adaptive_draft=True`: a step verifies only where its drafts are expected to pay for the
        verification (`paged.speculation.draft_gate`: per-job acceptance estimates against a step-cost model whose
        per-token cost
        ratio is `draft_token_cost`; None: the backend's measured default); else every step with drafts verifies.
        Adaptive gating never changes greedy output or a sampled output's distribution, but a seeded sampled job's
        tokens may then depend on the other jobs the generator ran (they share the acceptance statistics), except
        with sample-then-match acceptance.
        `draft_acceptance`: how sampled jobs accept drafts: "rejection" (lossless rejection sampling, the default),
        "match" (sample-then-match: a draft is kept where it equals the target's own draw, a draft model drawing
        with the target's keys so that the two draws are coupled; a seeded job then emits the tokens it would without
        speculation whatever the drafter, and a draft model's drafts are accepted a little less often than by
        rejection sampling), or "exllamav2" (the same, a draft model proposing its argmax, as ExLlamaV2 does).
        `ngram_corpus` (with `use_ngram_draft=True`): a `paged.speculation.ngram_corpus.NgramCorpus`, or the path of
        a saved one, that drafts where prompt lookup finds no match of 2 or more tokens (the continuations the model
        wrote most often in a corpus of its own answers: experiments/build_ngram_corpus.py). The speculation
        arguments become one `paged.speculation.config.SpeculationConfig` (`self.speculation_config`), checked once.
        """
        try:
            spec = SpeculationConfig.of(draft_model=draft_model, use_ngram_draft=use_ngram_draft,
                                        num_draft_tokens=num_draft_tokens, max_ngram=max_ngram, adaptive=adaptive_draft,
                                        draft_token_cost=draft_token_cost, acceptance=draft_acceptance,
                                        ngram_corpus=ngram_corpus)
        except InvalidConfigError as e:
            raise type(e)(f"DynamicGenerator: {e}") from None
        given = {k: v for k, v in dict(
            num_pages=num_pages, page_size=page_size, max_batch_size=max_batch_size, max_chunk_size=max_chunk_size,
            max_seq_len=max_seq_len, max_prefill_rows=max_prefill_rows, max_penalty_range=max_penalty_range,
            decode_steps=decode_steps, fuse_sampler=fuse_sampler, cache_dtype=cache_dtype,
            attn_impl=attn_impl, matmul_impl=matmul_impl, attn_tuning=attn_tuning, matmul_tuning=matmul_tuning,
            max_embedding_tokens=max_embedding_tokens, max_loras=max_loras, max_lora_rank=max_lora_rank, mesh=mesh,
        ).items() if v is not None}
        if config is not None and not isinstance(config, EngineConfig):
            raise InvalidConfigTypeError(f"DynamicGenerator: config must be a paged.EngineConfig, got "
                                         f"{type(config).__name__}")
        if engine is None:
            _check_model(model)
            base = config if config is not None else EngineConfig()
            # its role: verifying this speculation's drafts, or none (fixed when the engine is built)
            role = {"verification": None if spec is None else spec.verification()}
            cfg = EngineConfig.from_kwargs(**{**base.to_dict(), **given, **role})
            engine = Engine(model, cfg, compilation_cache_dir=compilation_cache_dir)
        else:
            if not isinstance(engine, EngineProtocol):
                missing = [m for m in ("config", "spec", "vocab_size", "timings", "run", "warmup")
                           if not hasattr(engine, m)]
                raise InvalidConfigTypeError(f"DynamicGenerator: engine {type(engine).__name__} does not implement "
                                             f"paged.device.engine_api.EngineProtocol (missing: {', '.join(missing)})")
            clash = sorted(set(given) - set(_HOST_SETTINGS)) + (["config"] if config is not None else [])
            if clash:
                raise InvalidConfigError(f"DynamicGenerator: {clash} configure the engine; with engine= given, set "
                                         "them on the engine instead")
        self.engine = engine
        self.config: EngineConfig = EngineConfig.from_kwargs(
            **{**engine.config.to_dict(), **{k: v for k, v in given.items() if k in _HOST_SETTINGS}})
        if model is not None and tokenizer is None:
            tokenizer = getattr(model, "tokenizer", None)
        _check_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.vocab_size = engine.vocab_size
        self.token_sets = TokenSets(tokenizer, self.vocab_size)
        self.embedding_slots = EmbeddingSlots(engine, self.vocab_size)
        self.hidden_size = getattr(getattr(getattr(engine, "model", None), "config", None), "hidden_size", None)
        self.page_size = self.config.page_size
        self.max_seq_len = self.config.max_seq_len
        self.max_batch_size = self.config.max_batch_size
        self.decode_steps = self.config.decode_steps
        if clock is None:
            clock = getattr(engine, "clock", None) or wall_clock
        if not callable(clock):
            raise InvalidConfigTypeError(f"DynamicGenerator: clock must be a zero-argument callable returning seconds "
                                         f"(e.g. time.perf_counter or a paged.clock.VirtualClock), got "
                                         f"{type(clock).__name__}")
        self.clock = clock
        self.policy = make_policy(policy)
        self.pool = PagePool(self.config.num_pages, self.page_size)
        self.pending: list[Job] = []  # waiting: never admitted, or preempted (at the front)
        self.active: list[Job] = []
        self.scheduler = Scheduler(self.config, self.pool, self.policy, self.vocab_size, self.pending, self.active,
                                   self.clock)
        self.output = JobOutput(self.pool, self.page_size, self._piece)
        self.speculation: SpeculativeStep | None = None
        self.speculation_config = spec
        if spec is not None:
            self.speculation = SpeculativeStep(engine, self.scheduler, spec, draft_model=draft_model,
                                               tokenizer=tokenizer)
            self.scheduler.on_release = self.speculation.release  # preempted: its drafter state starts over
        self.loras: dict[str, tuple[int, Any]] = {}  # LoRA adapters by name: (engine slot, models.lora.LoraAdapter)
        self._stash: list[dict] = []  # results not handed out yet (other callers' jobs in generate(), failed steps)
        self._claimed: dict[Job, list[dict]] = {}  # generate()'s jobs -> the list that call reads their results from
        self._serial = 0
        # the same in every process of a multi-process run (the engine's mesh spans them)
        self._rng = random.Random(shared_seed(getattr(self.engine, "mesh", None)))
        self._vocab_bytes: list[bytes] | None = None
        self.lock = threading.RLock()
        self.steps = 0
        self.tokens_prefilled = 0  # prompt (and recomputed) tokens run through the model: `_prefilled`
        self.tokens_recomputed = 0  # of them, tokens a preempted job had computed before (`Job.kv_at_preemption`)
        self.tokens_generated = 0
        self.jobs_completed = 0
        self.jobs_failed = 0
        self.steps_failed = 0
        # Fault injection for tests (`paged.testing.FaultInjector`): called with "step", "draft" or "masks" right
        # before the engine step, after drafting and before each mask computation; what it raises happens there.
        self.fault_hook: Callable[[str], None] | None = None
        # host-loop profile (seconds, cumulative): admission + planning, the engine call, turning samples into results
        self.timings = {"schedule_s": 0.0, "engine_s": 0.0, "results_s": 0.0}

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, source: Any) -> None:
        """Load a LoRA adapter under `name` for jobs to use (`Job(lora=name)`): `source` is a PEFT adapter directory
        (`adapter_config.json` + `adapter_model.safetensors`) or a `models.lora.LoraAdapter`. It takes a free slot of
        the engine's stack (`max_loras`; no recompilation). Errors: a name in use, no free slot, an engine without
        LoRA (`InvalidConfigError`); a NaN or infinity in a weight (`NonFiniteAdapterError`, an `InvalidConfigError`
        naming the file and tensor); a bad adapter or one that does not fit the model (`models.ModelLoadError`)."""
        from models.lora import LoraAdapter, check_adapter, content_digest, load_lora

        with self.lock:
            if not isinstance(name, str) or not name:
                raise InvalidConfigTypeError(f"load_lora: name must be a non-empty string, got {name!r}")
            if name in self.loras:
                raise InvalidConfigError(f"load_lora: an adapter named {name!r} is loaded already; unload_lora it "
                                         "first or pick another name")
            capacity = int(getattr(self.engine, "lora_slots", 0) or 0)
            if not capacity:
                raise InvalidConfigError("load_lora: this generator's engine holds no LoRA adapters; construct it "
                                         "with max_loras=N (N >= 1)")
            free = sorted(set(range(capacity)) - {slot for slot, _ in self.loras.values()})
            if not free:
                raise InvalidConfigError(f"load_lora: all {capacity} LoRA slots are taken ({sorted(self.loras)}); "
                                         "unload_lora one or raise max_loras")
            model_cfg = getattr(getattr(self.engine, "model", None), "config", None)
            try:
                if not isinstance(source, (str, os.PathLike, LoraAdapter)):
                    raise InvalidConfigTypeError(f"load_lora({name!r}): source must be a PEFT adapter directory (a "
                                                 "path) or a models.lora.LoraAdapter, got "
                                                 f"{source!r} ({type(source).__name__})")
                if isinstance(source, LoraAdapter):
                    check_adapter(source, model_cfg)
                    # the pages are keyed by the content, whatever digest the object carries
                    adapter = dataclasses.replace(source, digest=content_digest(source.rank, source.weights))
                else:
                    adapter = load_lora(source, model_cfg)
            except NonFiniteWeightError as e:
                raise NonFiniteAdapterError(f"load_lora({name!r}): {e}", tensor=e.tensor) from e
            try:
                self.engine.load_lora(free[0], adapter)
            except InvalidConfigError as e:  # (the engine's checks do not know the name)
                raise type(e)(f"load_lora({name!r}): {e}") from e
            self.loras[name] = (free[0], adapter)

    def unload_lora(self, name: str) -> None:
        """Remove adapter `name` (its slot is free again). It must not be in use by a queued or running job."""
        with self.lock:
            if name not in self.loras:
                raise InvalidConfigError(f"unload_lora: no adapter named {name!r} (loaded: {sorted(self.loras)})")
            users = [j for j in self.pending + self.active if j.lora == name]
            if users:
                raise InvalidConfigError(f"unload_lora: adapter {name!r} is used by {len(users)} queued or running "
                                         "job(s); cancel them or let them finish first")
            slot, _ = self.loras.pop(name)
            self.engine.load_lora(slot, None)

    # ------------------------------------------------------------------ queue
    def num_remaining_jobs(self) -> int:
        """Jobs pending or active, plus finished jobs whose final result `iterate()` has not handed out yet."""
        return len(self.pending) + len(self.active) + sum(1 for r in self._stash if r["eos"])

    def enqueue(self, job: Job | Sequence[Job]) -> int | list[int]:
        """Queue a job (or a list of jobs); returns its serial (or serials). Atomic: every job is checked and
        prepared, the clock read and the embedding rows taken before any is queued, so whatever raises (a bad job,
        a failing `clock`, the embedding table's device write), nothing was queued and nothing is held."""
        single = not isinstance(job, (list, tuple))
        jobs = [job] if single else list(job)
        with self.lock:
            seen: set[int] = set()
            for j in jobs:
                self._validate(j)
                if id(j) in seen:
                    raise InvalidJobError(f"enqueue(): {j!r} appears twice in the list; create one Job per request")
                seen.add(id(j))
            self.embedding_slots.check(jobs, self.hidden_size)  # together: the table rows they need at once
            prepared = [self._prepare(j) for j in jobs]
            now = self.clock()  # one enqueue time for the list, read before anything changes
            self.embedding_slots.acquire_all(jobs)  # the one fallible change: all jobs' rows, or none
            serials = [self._commit(j, p, now) for j, p in zip(jobs, prepared)]
        return serials[0] if single else serials

    def _validate(self, job: Job) -> None:
        """Everything about the job that depends on this generator (vocabulary, tokenizer, sizes)."""
        if not isinstance(job, Job):
            raise InvalidJobTypeError(f"enqueue() takes paged.Job objects (or a list of them), got "
                                      f"{type(job).__name__}")
        if job.serial is not None:
            raise InvalidJobError(f"{job!r} was already enqueued; create a new Job")
        if job.lora is not None and job.lora not in self.loras:
            raise InvalidJobError(f"Job: lora={job.lora!r} is not loaded (loaded: {sorted(self.loras)}); call "
                                  "generator.load_lora(name, path) first")
        v = self.vocab_size
        reserved = {t for e in job.embeddings for t in e.token_ids}
        bad = [t for t in job.input_ids + (job.negative_ids or []) if t >= v and t not in reserved]
        if bad:
            raise InvalidJobError(f"Job: input_ids contain ids >= the vocabulary size {v}: {bad[:5]}"
                                  + (" (not the reserved ids of the job's embeddings)" if job.embeddings else ""))
        self.embedding_slots.check([job], self.hidden_size)
        if job.token_healing and job.input_ids[-1] >= v:
            raise InvalidJobError("Job: token healing needs a text token last in the prompt, and it ends with an "
                                  "embedding; pass token_healing=False")
        if (job.token_healing and job.prompt_len > 1
                and job.input_ids[-1] in getattr(self.tokenizer, "special_token_ids", ())):
            # (no text token starts with a special token's text: the prompt had lost the token and the first sample
            # had gone unconstrained)
            raise InvalidJobError(f"Job: token healing needs a text token last in the prompt, and it ends with the "
                                  f"special token {job.input_ids[-1]}; pass token_healing=False")
        bad = [t for t in job.stop_tokens if t >= v]
        if bad:
            raise InvalidJobError(f"Job: stop token ids outside the vocabulary (size {v}): {bad[:5]}")
        if job.return_top_tokens > v:
            raise InvalidJobError(f"Job: return_top_tokens must be an int in [0, vocabulary size {v}], got "
                                  f"{job.return_top_tokens}")
        job.gen_settings.check_vocab(v)
        banned = job.gen_settings.banned_ids
        if len(banned) >= v:
            raise InvalidJobError(f"Job: gen_settings ban every token of the vocabulary ({v}); nothing could be "
                                  "sampled. Allow at least one token")
        if job.min_new_tokens and len(banned | job.stop_tokens) >= v:
            raise InvalidJobError(f"Job: with min_new_tokens={job.min_new_tokens} the stop tokens are banned too, and "
                                  "together with gen_settings' bans that is every token; allow at least one token")
        if (job.stop_strings or job.banned_strings or job.token_healing or job.filters) and self.tokenizer is None:
            raise InvalidJobError("Job: stop strings, banned strings, token healing and filters need a tokenizer; "
                                  "pass tokenizer= to the generator")
        gs = job.gen_settings
        if self.tokenizer is None and ((gs.uses_dry and gs.dry_sequence_breakers is None)
                                       or (gs.uses_xtc and gs.xtc_ignore_tokens is None)):
            raise InvalidJobError("Job: the default DRY sequence breakers and XTC exempt tokens come from the "
                                  "tokenizer; pass tokenizer= to the generator, or give dry_sequence_breakers / "
                                  "xtc_ignore_tokens as token ids (() for none)")
        if self.tokenizer is not None:  # the default sets, computed (once per generator) before anything is queued
            if gs.uses_dry and gs.dry_sequence_breakers is None:
                self.token_sets.get(None, DRY_BREAKER_CHARS)
            if gs.uses_xtc and gs.xtc_ignore_tokens is None:
                self.token_sets.get(None, XTC_EXEMPT_CHARS)
        if gs.uses_dry and not self.config.max_penalty_range:
            raise InvalidJobError("Job: DRY reads the token history, and this generator keeps none "
                                  "(max_penalty_range=0); raise max_penalty_range or set dry_multiplier=0")
        for what, n in (("prompt", job.prompt_len), ("negative prompt", len(job.negative_ids or ()))):
            if n + job.max_new_tokens > self.max_seq_len:
                raise JobTooLargeError(
                    f"{what} ({n}) + max_new_tokens ({job.max_new_tokens}) = {n + job.max_new_tokens} tokens "
                    f"exceeds max_seq_len={self.max_seq_len}; shorten the prompt, lower max_new_tokens or raise "
                    "max_seq_len")
        if job.negative_ids is not None and self.max_batch_size < 2:
            raise InvalidJobError("Job: a CFG job takes two rows of the batch (positive and negative prompt) and "
                                  "this generator has max_batch_size=1; raise max_batch_size")
        need = self.scheduler.pages_for(job)
        if job.negative_ids is not None:
            need += -(-(len(job.negative_ids) + job.max_new_tokens) // self.page_size)
        if need > self.pool.num_pages:
            raise JobTooLargeError(
                f"job needs {need} pages of {self.page_size} tokens but the cache has only {self.pool.num_pages}; "
                "raise num_pages or lower max_new_tokens")

    def _prepare(self, job: Job) -> _Prepared:
        """Everything the job needs from this generator (text stream, token-healing set, filter state, DRY / XTC
        token sets, CFG negative job), built without changing the job or the generator: whatever can fail while
        enqueueing fails here, before any job of the list is queued."""
        filter_state = None
        if job.filters:  # InvalidJobError from the grammar engine propagates as is
            filter_state = FilterState(job.filters, self.tokenizer, mask_words(self.vocab_size),
                                       prefer_eos=job.filter_prefer_eos, stop_tokens=job.stop_tokens,
                                       vocab_size=self.vocab_size)
        try:
            stream = TextStream(self._token_bytes(job), job.stop_strings, job.banned_strings)
            healing = prefix = None
            if job.token_healing and job.prompt_len > 1:
                prefix = self.tokenizer.token_bytes(job.input_ids[-1])
                if self._vocab_bytes is None:
                    self._vocab_bytes = [self.tokenizer.token_bytes(i) for i in range(self.vocab_size)]
                special = getattr(self.tokenizer, "special_token_ids", frozenset())
                healing = [i for i, b in enumerate(self._vocab_bytes)
                           if b.startswith(prefix) and b and i not in special]
                stream.strip_prefix = prefix.decode("utf-8", errors="replace")
        except Exception as e:  # noqa: BLE001 (a tokenizer failing on this job's ids)
            raise InvalidJobError(f"{job!r}: preparing its text stream failed: {type(e).__name__}: {e}") from e
        if filter_state is not None and healing is not None:  # the healed first token must also fit the grammar
            filter_state.first_mask = filter_state.healing_mask(healing, prefix)
            if not filter_state.first_mask.any():
                raise InvalidJobError(f"{job!r}: token healing and its filters exclude each other: no token that "
                                      f"starts with the dropped prompt text {prefix!r} continues into the filters' "
                                      "language; pass token_healing=False")
        gs = job.gen_settings
        negative = None
        if job.negative_ids is not None:  # CFG: the negative prompt's hidden job, scheduled and ended with this one
            negative = Job(job.negative_ids, job.max_new_tokens, gen_settings=SamplingSettings.greedy(), seed=0)
        return _Prepared(
            stream=stream, healing=healing, healing_prefix=prefix, filter_state=filter_state, negative=negative,
            dry_breakers=self.token_sets.get(gs.dry_sequence_breakers, DRY_BREAKER_CHARS) if gs.uses_dry else None,
            xtc_exempt=self.token_sets.get(gs.xtc_ignore_tokens, XTC_EXEMPT_CHARS) if gs.uses_xtc else None)

    def _commit(self, job: Job, prep: _Prepared, now: float) -> int:
        """Queue a prepared job: assignments only, nothing here can fail (`enqueue` stays all-or-nothing)."""
        self._serial += 1
        job.mark_enqueued(self._serial, now)
        if job.seed is None:
            job.seed = self._rng.getrandbits(32)
        job.stream, job.filter_state = prep.stream, prep.filter_state
        gs = job.gen_settings
        job.mirostat_mu = gs.initial_mirostat_mu() if gs.uses_mirostat else None
        job.dry_breakers, job.xtc_exempt = prep.dry_breakers, prep.xtc_exempt
        if prep.negative is not None:
            neg = prep.negative
            neg.cfg_owner, neg.stream, neg.serial = job, prep.stream, job.serial
            job.cfg_partner = neg
        if job.lora is not None:  # its tokens run through the adapter; its pages are keyed by it
            slot, adapter = self.loras[job.lora]
            for m in members(job):
                m.lora_slot, m.hash_root = slot + 1, adapter.digest
        if prep.healing is not None:  # drop the last prompt token; the first sample must start with its text
            job.healing_allowed = prep.healing
            job.healing_prefix = prep.healing_prefix
            job.input_ids = job.input_ids[:-1]
            job.sequence = list(job.input_ids)
        self.scheduler.add_waiting(job)
        return job.serial

    def _token_bytes(self, job: Job):
        tok = self.tokenizer
        if tok is None:
            return None  # (no text)
        special = getattr(tok, "special_token_ids", frozenset())
        keep = job.decode_special_tokens
        return lambda t: b"" if (t in special and not keep) else tok.token_bytes(t)

    def cancel(self, job: Job) -> None:
        """Remove a pending or active job; its pages are released, and no result is emitted for it from then on. No-op
        if it has finished (its last results, which `generate()` may have kept for the next `iterate()`, are still
        returned) or was never enqueued here."""
        if not isinstance(job, Job):
            raise InvalidJobTypeError(f"cancel() takes the paged.Job that enqueue() was given, got {job!r} "
                                      f"({type(job).__name__})")
        with self.lock:
            running = job in self.pending or job in self.active
            if running and any(r["job"] is job for r in self._stash):  # (kept results: none after a cancel)
                self._stash = [r for r in self._stash if r["job"] is not job]
            if job in self.pending:
                self._unqueue(job)
            elif job in self.active:
                self._retire(job)

    def clear_queue(self) -> None:
        with self.lock:
            for job in list(self.active):
                self._retire(job)
            for job in list(self.pending):
                self._unqueue(job)
            self._stash.clear()

    def _unqueue(self, job: Job) -> None:
        self.scheduler.remove_waiting(job)
        self.embedding_slots.release(job)

    def _retire(self, job: Job) -> None:
        self.active.remove(job)
        for m in members(job):  # (a CFG job's negative prompt too)
            if self.speculation is not None:
                self.speculation.release(m)
            self.pool.release(m.pages)
            m.pages = []
        self.embedding_slots.release(job)

    def _fail(self, job: Job, exc: BaseException, now: float) -> dict:
        """End `job` alone after a failure of its own; returns its final `eos_reason="error"` result."""
        if job in self.active:
            self._retire(job)
        elif job in self.pending:
            self._unqueue(job)
        self.jobs_failed += 1
        return self.output.error(job, exc, now)

    # ------------------------------------------------------------------ stepping
    def iterate(self) -> list[dict]:
        """Run one step; return the result dicts it produced (possibly none).

        Raises `StepError` if the step as a whole failed; nothing is lost then (see the module docstring)."""
        with self.lock:
            t0 = time.perf_counter()
            results: list[dict] = self._stash
            self._stash = []
            try:
                results = self._step(results, t0)
            except PolicyError:  # (a StepError already: rejected before anything changed)
                self._stash = results + self._stash
                self.steps_failed += 1
                raise
            except Exception as e:
                self._stash = results + self._stash  # handed out by the next call
                self.steps_failed += 1
                raise StepError(f"the step failed and no job advanced ({type(e).__name__}: {e}); results produced "
                                "so far are kept for the next iterate(), and the generator is still usable") from e
            if not self._claimed:
                return results
            out = []
            for r in results:  # the results of generate()'s jobs go to that call, whoever steps
                claimed = self._claimed.get(r["job"])
                (out if claimed is None else claimed).append(r)
            return out

    def _step(self, results: list[dict], t0: float) -> list[dict]:
        self.scheduler.admit(lambda job: results.append(self.output.base(job, "started")))
        rows, owners, failed = self.scheduler.plan()
        for job, e in failed:
            results.append(self._fail(job, e, self.clock()))
        if not rows:
            self.timings["schedule_s"] += time.perf_counter() - t0
            return results
        rows, owners = self._mask_rows(rows, owners, results)
        if not rows:
            self.timings["schedule_s"] += time.perf_counter() - t0
            return results
        top_k, want_logits = 0, False
        for j in owners:  # (one pass over the rows' jobs)
            if j.return_top_tokens > top_k:
                top_k = j.return_top_tokens
            want_logits = want_logits or j.return_logits
        top_k = next_pow2(top_k)
        # (only a burst asks: with decode_steps 1 there is none)
        waiting = self.decode_steps > 1 and bool(self.pending) and self.scheduler.rows_used() < self.max_batch_size
        items = None
        if self.speculation is None:
            k = self.scheduler.burst(rows, owners, want_logits, waiting)
            t1 = time.perf_counter()
            self._fault("step")
            out = self.engine.run(rows, return_top_k=top_k, return_logits=want_logits, num_steps=k)
        else:  # draft, verify, accept (paged/speculation/spec_step.py); one step, no bursts
            k = 1
            t1 = time.perf_counter()
            out, items = self.speculation.run(self.engine, rows, owners, return_top_k=top_k,
                                              return_logits=want_logits, fault=self._fault)
        self.steps += k
        t2 = time.perf_counter()
        now = self.clock()
        self.timings["schedule_s"] += t1 - t0
        self.timings["engine_s"] += t2 - t1
        try:
            if items is not None:  # a speculative step: accepted drafts, then the target's token, per row
                self._collect(rows, owners, items, out.seconds, now, results)
            elif k == 1:
                self._collect_plain(rows, owners, out, out.seconds, now, results)
            else:  # step i's tokens are fed as if they came from single steps, skipping jobs that ended
                live = [(r, j, i) for i, (r, j) in enumerate(zip(rows, owners))]
                for i in range(k):
                    live = [(r, j, c) for r, j, c in live if j in self.active]
                    self._collect_plain([r for r, _, _ in live], [j for _, j, _ in live],
                                        _StepView(out, i, [c for _, _, c in live]), out.seconds, now, results)
        finally:
            self.timings["results_s"] += time.perf_counter() - t2
        return results

    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point)

    def _masks(self, states: list) -> list:
        self._fault("masks")
        return compute_masks(states)

    def _mask_rows(self, rows: list, owners: list[Job], results: list[dict]) -> tuple[list, list[Job]]:
        """Set the token mask of every sampling row of a filtered job (one parallel grammar call for the batch).
        A job whose grammar engine fails is ended alone (`eos_reason="error"`) and its row dropped from the step."""
        filtered = [i for i, j in enumerate(owners) if j.filter_state is not None and rows[i].sample]
        if not filtered:
            return rows, owners
        healing = [i for i in filtered if owners[i].healing_allowed and owners[i].new_tokens == 0]
        for i in healing:  # the first token of a healed job: starts with the dropped text, then fits the grammar
            rows[i].mask = owners[i].filter_state.first_mask
        plain = [i for i in filtered if i not in healing]
        try:
            masks: list = self._masks([owners[i].filter_state for i in plain])
        except Exception:  # noqa: BLE001 (find the job that failed: the others go on)
            masks = []
            for i in plain:
                try:
                    masks.append(self._masks([owners[i].filter_state])[0])
                except Exception as e:  # noqa: BLE001
                    masks.append(e)
        bad = set()
        for i, mask in zip(plain, masks):
            if isinstance(mask, Exception):
                bad.add(i)
                results.append(self._fail(owners[i], JobFailure(f"its filter failed: {type(mask).__name__}: {mask}"),
                                          self.clock()))
            elif not np.any(mask):  # (every engine would fail it after the step; this names the cause first)
                bad.add(i)
                results.append(self._fail(owners[i], JobFailure(
                    f"its filters allow no token after {owners[i].new_tokens} new tokens (filters that exclude each "
                    "other, or text so far that none of them can continue)"), self.clock()))
            elif not np.any(mask_without(mask, self._banned_by_settings(owners[i]))):
                bad.add(i)
                results.append(self._fail(owners[i], JobFailure(
                    f"its filters allow only tokens its settings ban after {owners[i].new_tokens} new tokens "
                    "(gen_settings' banned_tokens or a -inf token_bias, or the stop tokens before min_new_tokens)"),
                    self.clock()))
            else:
                rows[i].mask = mask
        if not bad:
            return rows, owners
        ended = {id(owners[i]) for i in bad}  # (and the rows of their CFG negative prompts)
        keep = [i for i in range(len(rows)) if i not in bad and id(owners[i].cfg_owner) not in ended]
        return [rows[i] for i in keep], [owners[i] for i in keep]

    @staticmethod
    def _banned_by_settings(job: Job) -> list[int]:
        """The ids the sampler will not draw for `job` now: its settings' bans and -inf biases, and its stop tokens
        until min_new_tokens are out."""
        if job.new_tokens < job.min_new_tokens:
            return [*job.gen_settings.banned_ids, *job.stop_tokens]
        return list(job.gen_settings.banned_ids)

    def _collect(self, rows: list, owners: list[Job], items: list[Accepted | _PlainRow], seconds: float, now: float,
                 results: list[dict]) -> None:
        """Advance each row's job by what its row produced (`items`: one `Accepted` per row of a speculative step)
        and append its result dicts. A failure while handling one job's output ends that job alone."""
        for row, job, item in zip(rows, owners, items):
            try:
                self._collect_row(row, job, item, seconds, now, results)
            except Exception as e:  # noqa: BLE001 (one job's failure must not stop the others)
                results.append(self._fail(job, e, now))

    def _collect_plain(self, rows: list, owners: list[Job], out: Any, seconds: float, now: float,
                       results: list[dict]) -> None:
        """`_collect` for a plain step's output (or one step of a burst, `_StepView`), a `_PlainRow` per row. The
        usual row, one sampled token with a finite log-probability for a job that asked for no extras (no CFG, no
        mirostat), goes straight to the job's output: what `_collect_row` does for it, without the row's item."""
        tokens, logprobs = out.token.tolist(), out.logprob.tolist()
        advance, receive, isfinite = self.output.advance, self.output.receive, math.isfinite
        for i, (row, job) in enumerate(zip(rows, owners)):
            try:
                if (row.sample and len(row.tokens) == 1 and job.cfg_owner is None and job.cfg_partner is None
                        and job.mirostat_mu is None and isfinite(logprobs[i])
                        and not (job.return_probs or job.return_top_tokens or job.return_logits)):
                    if job.time_first_prefill is None:
                        job.time_first_prefill = now - seconds
                    if row.start_pos < job.prompt_len:  # a prompt's last chunk of one token, not a decode row
                        self._prefilled(row, job)
                    advance(job, 1)
                    r = receive(job, tokens[i], {}, now)
                    self.tokens_generated += 1
                    results.append(r)
                    if r["eos"]:
                        self._retire(job)
                        self.jobs_completed += 1
                else:
                    self._collect_row(row, job, _PlainRow(out, i, tokens[i], logprobs[i], row), seconds, now,
                                      results)
            except Exception as e:  # noqa: BLE001 (one job's failure must not stop the others)
                results.append(self._fail(job, e, now))

    def _prefilled(self, row: Any, job: Job) -> None:
        """Count a row's prefill tokens (not a verification row): all of them but a sampling row's last token when
        that is a generated one (a decode row's whole row, the pending token after a preempted job's recompute).
        Those below the job's `kv_at_preemption` were computed before it was preempted: recomputed."""
        start, end = row.start_pos, row.start_pos + len(row.tokens)
        if row.sample and end - 1 >= job.prompt_len:
            end -= 1
        if end > start:
            self.tokens_prefilled += end - start
            self.tokens_recomputed += max(0, min(end, job.kv_at_preemption) - start)

    def _collect_row(self, row: Any, job: Job, item: Accepted | _PlainRow, seconds: float, now: float,
                     results: list[dict]) -> None:
        """One row's output: none (a prefill chunk that does not sample), one token, or a speculative row's accepted
        drafts and the target's next token, fed one at a time (`JobOutput.feed`) as if each came from its own step;
        `item.kv_advance` of the row's tokens now have K/V."""
        if not row.verify:
            self._prefilled(row, job)
        if job.cfg_owner is not None:  # a CFG negative prompt: its prefill chunks (its job's row samples for both)
            if not item.tokens:
                self.output.advance(job, item.kv_advance)
            return
        if job.time_first_prefill is None:
            job.time_first_prefill = now - seconds
        if not item.tokens:
            self.output.advance(job, item.kv_advance)
            results.append({**self.output.base(job, "prefill"), "curr_progress": job.kv_position,
                            "max_progress": len(job.sequence)})
            return
        extras, error = [], None
        for i, t in enumerate(item.tokens):  # tokens up to a non-finite one are kept, then the job fails
            try:
                extras.append(_extras(job, t, float(item.logprobs[i]), item, i))
            except JobFailure as e:
                error = e
                break
        if job.mirostat_mu is not None:
            for i in range(len(extras)):
                _mirostat_update(job, float(item.logprobs[i]))
        if job.cfg_partner is not None and extras:  # (one token: CFG jobs are not drafted for)
            self.output.advance(job.cfg_partner, 1)
        fed = self.output.feed(job, item.tokens[: len(extras)], item.kv_advance, extras, now)
        if job.cfg_partner is not None:
            self.output.follow(job, final=any(r["eos"] for r in fed))
        for k, r in enumerate(fed):
            self.tokens_generated += 1
            results.append(r)
            if r["eos"]:
                if getattr(item, "num_accepted", 0) > k and self.speculation is not None:
                    self.speculation.ended_after(job, item, k + 1)  # it ended inside its accepted drafts
                    r.update(accepted_draft_tokens=job.accepted_draft_tokens,
                             rejected_draft_tokens=job.drafted_tokens - job.accepted_draft_tokens)
                self._retire(job)
                self.jobs_completed += 1
                return
        if error is not None:
            raise error

    def _piece(self, token: int) -> str:
        tok = self.tokenizer
        return "" if tok is None else tok.token_bytes(token).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ conveniences
    def metrics(self) -> dict:
        pool = self.pool
        return {
            "pages_total": pool.num_pages, "pages_used": pool.num_referenced, "pages_cached": pool.num_cached,
            "pages_free": pool.num_free, "prefix_queries": pool.prefix_queries, "prefix_hits": pool.prefix_hits,
            "prefix_hit_rate": pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0,
            "steps": self.steps, "tokens_prefilled": self.tokens_prefilled,
            "tokens_generated": self.tokens_generated, "jobs_completed": self.jobs_completed,
            "jobs_failed": self.jobs_failed, "steps_failed": self.steps_failed,
            "jobs_pending": len(self.pending), "jobs_active": len(self.active),
            "preemptions": self.scheduler.preemptions, "tokens_recomputed": self.tokens_recomputed,
            **(self.speculation.metrics() if self.speculation is not None else empty_metrics()),
            **{f"time_{k}": v for k, v in self.timings.items()},
            **{f"time_engine_{k}": v for k, v in getattr(self.engine, "timings", {}).items()},
        }

    def warmup(self, progress: bool = False) -> int:
        """Compile every step bucket (and the multi-step decode variants with decode_steps > 1), then forget the
        prompt cache. Returns the number of variants compiled."""
        with self.lock:
            if self.speculation is None:
                n = self.engine.warmup(progress=progress, decode_steps=self.decode_steps)
            else:  # no bursts while speculating; the verification buckets, and the draft model's variants
                n = self.engine.warmup(progress=progress) + self.speculation.warmup(progress)
            self.pool.reset_cache()
            return n

    def generate(
        self,
        prompt: str | Sequence[str],
        max_new_tokens: int,
        *,
        min_new_tokens: int = 0,
        gen_settings: SamplingSettings | Sequence[SamplingSettings] | None = None,
        stop_conditions: Sequence[int | str] | int | str | None = None,
        seed: int | None = None,
        completion_only: bool = True,
        add_bos: bool = False,
        encode_special_tokens: bool = False,
        decode_special_tokens: bool = False,
        abort_event: threading.Event | None = None,
        return_last_results: bool = False,
        token_healing: bool = False,
        banned_strings: Sequence[str] | str | None = None,
        filters: Sequence[Any] | None = None,
        filter_prefer_eos: bool = False,
        embeddings: Sequence[MMEmbedding] | None = None,
        lora: str | None = None,
    ):
        """Generate completions for one prompt (-> str) or a list (-> list[str]) through the job API. Jobs enqueued
        by other callers keep running; their results are kept for the next `iterate()`. With `seed`, prompt i
        uses seed + i. `filters` (`paged.filters`): for one prompt, a list of filters; for a list of prompts, one
        list per prompt (as ExLlamaV2), or None. With `abort_event` set, the jobs are cancelled and None is returned.
        A tuple prompt `(positive, negative)` is a CFG pair, as in ExLlamaV2: its gen_settings must set
        `cfg_scale` (`Job` has the details). `embeddings` (`paged.embeddings.MMEmbedding`): each one's
        `text_alias` in a prompt stands for its vectors (as ExLlamaV2's `embeddings=`). `lora`: the name of a loaded
        adapter every prompt runs through (`load_lora`). If a job fails while running (`eos_reason="error"`),
        `JobFailure` is raised once all the prompts are done."""
        if self.tokenizer is None:
            raise InvalidJobError("generate() needs a tokenizer; pass tokenizer= to the generator")
        c = Checker("generate()", InvalidJobError)
        seed = c.optional_int("seed", seed)
        if abort_event is not None and not callable(getattr(abort_event, "is_set", None)):
            c.fail_type("abort_event", abort_event, "a threading.Event (or None)")
        single = isinstance(prompt, (str, tuple))
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, (list, Sequence)) or isinstance(prompts, (bytes, str)):
            raise InvalidJobTypeError(f"generate(): prompt must be a string or a list of strings, got "
                                      f"{type(prompt).__name__}")
        prompts = list(prompts)
        if not prompts:  # no prompts, no completions (as ExLlamaV2's generate)
            return ([], []) if return_last_results else []
        for i, p in enumerate(prompts):
            if isinstance(p, tuple):
                if len(p) != 2 or not all(isinstance(x, str) for x in p):
                    raise InvalidJobTypeError(f"generate(): prompt {i} is a tuple; a CFG pair is two strings "
                                              "(positive, negative)")
            elif not isinstance(p, str):
                raise InvalidJobTypeError(f"generate(): prompt {i} must be a string or a (positive, negative) pair of "
                                          f"strings, got {type(p).__name__}")
        if isinstance(gen_settings, (list, tuple)):
            settings = list(gen_settings)
            if len(settings) != len(prompts):
                raise InvalidJobError(f"generate(): {len(settings)} gen_settings for {len(prompts)} prompts")
        else:
            settings = [gen_settings] * len(prompts)
        if not filters:
            per_prompt = [None] * len(prompts)
        elif single:
            per_prompt = [filters]
        else:
            if not isinstance(filters, (list, tuple)):
                c.fail_type("filters", filters, "one list of filters per prompt when prompt is a list (e.g. [[f], "
                            "[f]] to constrain two prompts by f)")
            per_prompt = list(filters)
            flat = [i for i, f in enumerate(per_prompt) if f is not None and not isinstance(f, (list, tuple))]
            if flat:
                raise InvalidJobError(f"generate(): filters[{flat[0]}] is not a list; for a list of prompts, pass one "
                                      "list of filters per prompt (e.g. [[f], [f]] to constrain two prompts by f, "
                                      "[] or None for an unfiltered one)")
            if len(per_prompt) != len(prompts):
                raise InvalidJobError(f"generate(): {len(per_prompt)} filter lists for {len(prompts)} prompts; pass "
                                      "one list of filters per prompt (an empty list for none)")
        if isinstance(embeddings, MMEmbedding):  # (one, as Job takes it)
            embeddings = [embeddings]
        if embeddings is not None and (isinstance(embeddings, (str, bytes, dict)) or
                                       not isinstance(embeddings, Iterable)):
            c.fail_type("embeddings", embeddings, "a list of paged.embeddings.MMEmbedding")
        embeddings = list(embeddings or ())
        # ExLlamaV2's batched form: one list (or None) per prompt of a list of prompts
        nested = not single and any(e is None or isinstance(e, (list, tuple)) for e in embeddings)
        if nested and len(embeddings) != len(prompts):
            raise InvalidJobError(f"generate(): {len(embeddings)} embedding lists for {len(prompts)} prompts; pass "
                                  "one list of MMEmbedding per prompt (None or [] for none), or one flat list")
        per_prompt_embeddings = [list(e or ()) for e in embeddings] if nested else [embeddings] * len(prompts)
        for e in (x for group in per_prompt_embeddings for x in group):
            if not isinstance(e, MMEmbedding):
                raise InvalidJobTypeError(f"generate(): embeddings must be paged.embeddings.MMEmbedding objects (or, "
                                          f"for a list of prompts, one list of them per prompt), got "
                                          f"{type(e).__name__}")
        jobs = []
        for i, (p, s) in enumerate(zip(prompts, settings)):
            encoded = []
            embeddings = per_prompt_embeddings[i]
            for text in (p if isinstance(p, tuple) else (p,)):
                try:
                    ids = encode_with_embeddings(self.tokenizer, text, embeddings, add_bos=add_bos,
                                                 encode_special_tokens=encode_special_tokens)
                except (ValueError, TypeError) as e:
                    raise InvalidJobError(f"generate(): prompt {i} cannot be encoded: {e}") from e
                if not ids:
                    raise InvalidJobError(f"generate(): prompt {i} encodes to no tokens; pass a non-empty prompt or "
                                          "add_bos=True")
                encoded.append(ids)
            ids = encoded[0] if len(encoded) == 1 else encoded
            used = {t for seq in encoded for t in seq}
            if isinstance(p, tuple) and (s is None or s.cfg_scale is None):
                raise InvalidJobError(f"generate(): prompt {i} is a CFG pair (positive, negative) and its gen_settings "
                                      "have no cfg_scale; pass SamplingSettings(cfg_scale=...)")
            jobs.append(Job(ids, max_new_tokens, min_new_tokens=min_new_tokens, gen_settings=s,
                            stop_conditions=stop_conditions, seed=None if seed is None else seed + i,
                            decode_special_tokens=decode_special_tokens, identifier=("generate", i),
                            token_healing=token_healing, banned_strings=banned_strings,
                            filters=per_prompt[i] or None, filter_prefer_eos=filter_prefer_eos,
                            embeddings=[e for e in embeddings if e.used_in(used)] or None, lora=lora))
        # This call's jobs are claimed: whichever thread's iterate() produces their results routes them to `mine`
        # (another thread looping iterate() had taken them: generate() lost tokens, or took its jobs for cancelled).
        mine: list[dict] = []
        with self.lock:
            self.enqueue(jobs)
            self._claimed.update(dict.fromkeys(jobs, mine))
        index = {id(j): i for i, j in enumerate(jobs)}
        texts = [""] * len(jobs)
        last: list[dict | None] = [None] * len(jobs)
        remaining = len(jobs)
        try:
            while remaining:
                if abort_event is not None and abort_event.is_set():
                    return None
                with self.lock:  # the step, the stash and the check at once: no other caller's step in between
                    others = self.iterate()  # (before reading self._stash: iterate() replaces the list)
                    self._stash.extend(others)  # other callers' results: theirs at their next iterate()
                    got = mine[:]
                    del mine[:]
                    for r in got:
                        i = index[id(r["job"])]
                        texts[i] += r.get("text", "")
                        if r["eos"]:
                            last[i] = r
                            remaining -= 1
                    if remaining and not any(j in self.active or j in self.pending for j in jobs):
                        break  # (cancelled by another caller: other callers' jobs may still run)
        finally:  # aborted, or iterate() raised: none of this call's jobs stays queued
            with self.lock:
                for j in jobs:
                    self._claimed.pop(j, None)
                    if remaining:
                        self.cancel(j)
        errors = [(i, r["error"]) for i, r in enumerate(last) if r is not None and r["eos_reason"] == "error"]
        errors += [(i, "it was cancelled before it finished (cancel() or clear_queue() from another caller)")
                   for i, r in enumerate(last) if r is None]
        if errors:
            raise JobFailure("generate(): " + "; ".join(f"prompt {i} failed: {e}" for i, e in sorted(errors)))
        if not completion_only:  # (a CFG pair's positive prompt)
            texts = [(p[0] if isinstance(p, tuple) else p) + t for p, t in zip(prompts, texts)]
        out = texts[0] if single else texts
        if return_last_results:
            return out, (last[0] if single else last)
        return out


def _extras(job: Job, token: int, logprob: float, item: Accepted | _PlainRow, i: int) -> dict:
    """The per-token extras a job asked for (probability, top-k, logits) of `item`'s token `i`; a non-finite
    log-probability fails it. The arrays are read only for what the job asked for."""
    if not math.isfinite(logprob):
        raise JobFailure(f"the sampler returned token {token} with log-probability {logprob}: no "
                         "token was allowed at this position, or the model produced non-finite logits")
    extras = {}
    if job.return_probs:
        extras["token_probs"] = float(np.exp(logprob))
    if job.return_top_tokens:
        k = job.return_top_tokens
        extras["top_k_tokens"] = item.top_ids[i][:k].tolist()
        extras["top_k_probs"] = np.exp(item.top_logprobs[i][:k]).tolist()
    if job.return_logits:
        extras["logits"] = None if item.logits is None else item.logits[i]
    return extras


def _check_model(model: Any) -> None:
    if model is None:
        raise InvalidConfigError("DynamicGenerator needs a model (models.load_model(...)) or an engine=")
    if isinstance(model, (str, os.PathLike)):
        raise InvalidConfigTypeError(
            f"DynamicGenerator: model must be a loaded models.Model, got the {type(model).__name__} {str(model)!r}; "
            f"load it first: models.load_model({str(model)!r})")
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "max_position_embeddings") or not hasattr(model, "params"):
        raise InvalidConfigTypeError(f"DynamicGenerator: model must be a models.Model (with .config and .params), "
                                     f"got {type(model).__name__}")


def _check_tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        return
    missing = [m for m in ("encode", "decode", "token_bytes") if not callable(getattr(tokenizer, m, None))]
    if missing:
        raise InvalidConfigTypeError(f"DynamicGenerator: tokenizer {type(tokenizer).__name__} lacks "
                                     f"{', '.join(missing)}(); pass a models.tokenizer.Tokenizer or None")


def _mirostat_update(job: Job, logprob: float) -> None:
    """Mirostat's feedback after each sampled token: mu += eta * (tau - surprise), the surprise -log2 of the
    token's probability in the distribution it was drawn from (the job's own mu, as ExLlamaV2 keeps per Settings)."""
    if job.mirostat_mu is not None:
        s = job.gen_settings
        job.mirostat_mu += s.mirostat_eta * (s.mirostat_tau + logprob / math.log(2.0))
