"""`Job`: one generation request and its progress through the generator.

Life story: `Job(...)` validates its inputs -> `enqueue` checks it can ever fit, gives it a serial and stamps its
`arrival` from the generator's clock -> the policy admits it when its pages fit (a `started` result) -> prefill
chunks run in the ragged step (`prefill` results) -> the last prompt chunk samples the first token -> one decode row
per step, each sampled token streamed (`streaming` results) -> a stop token, stop string or max_new_tokens ends it
(`eos=True`), its pages are released and stay in the prompt cache. A policy may preempt it on the way (its pages are
released, it waits again with its generated tokens kept, and recomputes them from the prefix cache when re-admitted:
`preemptions` counts how often).

What a policy may read (`paged.policies`): `serial` (enqueue order), `arrival`, `priority`, `deadline` /
`deadline_at`, `expected_new_tokens`, `prompt_len`, `max_new_tokens`, `new_tokens`, `preemptions`, `skips`, and
(running jobs) `kv_position`, `pages`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from paged.embeddings import MMEmbedding
from paged.errors import InvalidJobError, InvalidJobTypeError
from paged.filters import Filter
from paged.settings import SamplingSettings
from paged.validate import Checker, unwrap_0d


def _as_id_list(c: Checker, input_ids: Any) -> list[int]:
    """A non-empty sequence of token ids: a list/tuple of ints, a 1-D integer array, or a (1, n) array."""
    if (type(input_ids) in (list, tuple) and input_ids and set(map(type, input_ids)) == {int}
            and min(input_ids) >= 0 and max(input_ids) < 1 << 63):
        return list(input_ids)  # (what the array below gives for Python ints that fit an int64)
    if type(input_ids) in (list, tuple) and input_ids and set(map(type, input_ids)) == {int}:
        if min(input_ids) < 0:
            c.fail(f"input_ids contain negative ids: {[x for x in input_ids if x < 0][:5]}")
        c.fail(f"input_ids contain ids no vocabulary has (>= 2**63): {[x for x in input_ids if x >= 1 << 63][:5]}")
    if isinstance(input_ids, str):
        c.fail_type("input_ids", input_ids, "token ids (encode text first, e.g. tokenizer.encode(text))")
    if isinstance(input_ids, (bytes, dict, set)) or input_ids is None:
        c.fail_type("input_ids", input_ids, "a list of ints, a 1-D integer array or a (1, n) array")
    try:
        arr = np.asarray(input_ids)
    except (ValueError, TypeError) as e:  # ragged nested lists, unconvertible objects
        raise InvalidJobTypeError(f"Job: input_ids must be one sequence of ints (got a ragged or nested value: {e})"
                                  ) from None
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            c.fail(f"input_ids of shape {arr.shape}: pass one sequence, shape (n,) or (1, n); batch several prompts as "
                   "several jobs")
        arr = arr[0]
    if arr.ndim != 1:
        c.fail(f"input_ids must be a list of ints, a 1-D array or a (1, n) array; got shape {arr.shape}")
    if arr.size == 0:
        c.fail("input_ids is empty: a job needs at least one prompt token")
    if arr.dtype.kind not in "iu":
        bad = next((x for x in arr.tolist() if isinstance(x, bool) or not isinstance(x, int)), arr.dtype)
        c.fail_type("input_ids", bad, f"integer token ids (got dtype {arr.dtype})")
    if isinstance(input_ids, (list, tuple)):  # [True, 2] (or [[True, 2]]) converts to ints
        flat = [x for row in input_ids for x in (row if isinstance(row, (list, tuple)) else [row])]
        bad = next((x for x in flat if isinstance(x, (bool, np.bool_))), None)
        if bad is not None:
            c.fail_type("input_ids", bad, "integer token ids, not bools")
    if (arr < 0).any():
        c.fail(f"input_ids contain negative ids: {arr[arr < 0][:5].tolist()}")
    return [int(x) for x in arr]


def _cfg_pair(c: Checker, input_ids: Any) -> tuple[Any, Any] | None:
    """(positive, negative) when `input_ids` is a CFG pair: a list/tuple of two sequences or a (2, n) array."""
    if hasattr(input_ids, "shape") and hasattr(input_ids, "__array__"):  # numpy, jax, torch (on the CPU) arrays
        arr = np.asarray(input_ids)
        return (arr[0], arr[1]) if arr.ndim == 2 and arr.shape[0] == 2 else None
    if isinstance(input_ids, (list, tuple)) and input_ids and not isinstance(input_ids[0], (int, np.integer)):
        if len(input_ids) == 2 and all(not isinstance(x, (str, bytes)) and hasattr(x, "__len__") for x in input_ids):
            return input_ids[0], input_ids[1]
    return None


def _stop_conditions(c: Checker, value: Any) -> tuple[set[int], list[str]]:
    """Token ids and stop strings; a bare string or a bare int is one condition (not one per character)."""
    if value is None:
        return set(), []
    value = unwrap_0d(value)
    if isinstance(value, (str, int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = [value]
    if isinstance(value, (bytes, dict)) or not isinstance(value, Iterable):
        c.fail_type("stop_conditions", value, "a list of token ids (int) and stop strings (str)")
    tokens, strings = set(), []
    for x in value:
        if isinstance(x, str):
            if not x:
                c.fail("stop_conditions contains an empty string; stop strings must be non-empty")
            strings.append(c.text(f"stop_conditions stop string {x!r}", x))
        elif isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
            tokens.add(c.token_id("stop_conditions token id", x))
        else:
            c.fail_type("stop_conditions entry", x, "a token id (int) or a non-empty stop string (str)")
    return tokens, strings


def _filters(c: Checker, value: Any) -> list:
    if value is None:
        return []
    items = [value] if isinstance(value, Filter) else value
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        c.fail_type("filters", value, "a paged.filters.Filter or a list of them")
    items = list(items)
    for f in items:
        if not isinstance(f, Filter):
            c.fail_type("filters", f, "a paged.filters.Filter (JsonSchemaFilter, RegexFilter, GrammarFilter, "
                        "ChoiceFilter, PrefixFilter)")
    return items


def _embeddings(c: Checker, value: Any) -> list:
    if value is None:
        return []
    items = [value] if isinstance(value, MMEmbedding) else value
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable):
        c.fail_type("embeddings", value, "a list of paged.embeddings.MMEmbedding")
    items = list(items)
    for e in items:
        if not isinstance(e, MMEmbedding):
            c.fail_type("embeddings", e, "a paged.embeddings.MMEmbedding")
    return items


class Job:
    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        *,
        min_new_tokens: int = 0,
        gen_settings: SamplingSettings | None = None,
        stop_conditions: Iterable[int | str] | int | str | None = None,
        seed: int | None = None,
        identifier: Any = None,
        max_skips: int = 4,
        return_top_tokens: int = 0,
        return_probs: bool = False,
        return_logits: bool = False,
        decode_special_tokens: bool = False,
        banned_strings: Iterable[str] | str | None = None,
        token_healing: bool = False,
        priority: int = 0,
        deadline: float | None = None,
        expected_new_tokens: int | None = None,
        filters: Any = None,
        filter_prefer_eos: bool = False,
        embeddings: Any = None,
        lora: str | None = None,
    ):
        """Scheduling hints (read by policies, see `paged.policies`): `priority` (higher first, may be negative),
        `deadline` (an SLO: seconds after arrival by which the job should finish), `expected_new_tokens` (a
        predicted output length, e.g. from a length predictor; `sjf` orders by it when given).

        Constrained decoding (`paged.filters`): `filters`, a filter or a list of them (their allowed sets
        intersect); the job ends with `eos_reason="end_filter"` when its output is complete, or, with
        `filter_prefer_eos`, as soon as the filters accept it.

        Embedding injection (`paged.embeddings`): `embeddings`, a list of `MMEmbedding` whose reserved
        `token_ids` appear in `input_ids` where their vectors take the place of token embeddings.

        Classifier-free guidance: `input_ids=[positive_ids, negative_ids]` (or a (2, n) array) with
        `gen_settings.cfg_scale` set. The negative prompt runs as a second row of the same steps, with its own pages
        (prefix-shared like any prompt); each token is sampled from `cfg_scale * log_softmax(positive logits) +
        (1 - cfg_scale) * log_softmax(negative logits)` and appended to both.

        LoRA: `lora`, the name of an adapter loaded into the generator (`generator.load_lora(name, path)`): this
        job's tokens run through the model with that adapter, in the same batched steps as jobs with other adapters
        or none."""
        c = Checker("Job", InvalidJobError)
        pair = _cfg_pair(c, input_ids)
        self.input_ids = _as_id_list(c, input_ids if pair is None else pair[0])
        # Classifier-free guidance: the negative prompt (None without CFG); see the docstring
        self.negative_ids = None if pair is None else _as_id_list(c, pair[1])
        self.max_new_tokens = c.int_("max_new_tokens", max_new_tokens, 1)
        self.min_new_tokens = c.int_("min_new_tokens", min_new_tokens, 0, self.max_new_tokens,
                                     f"an int in [0, max_new_tokens={self.max_new_tokens}]")
        if gen_settings is None:
            gen_settings = SamplingSettings()
        if not isinstance(gen_settings, SamplingSettings):
            c.fail_type("gen_settings", gen_settings, "a paged.SamplingSettings (or None for the defaults)")
        self.gen_settings = gen_settings
        if pair is not None and gen_settings.cfg_scale is None:
            c.fail("input_ids is a pair of sequences (a CFG job: positive, negative) and gen_settings.cfg_scale is "
                   "None; set cfg_scale, or pass one sequence")
        if pair is None and gen_settings.cfg_scale is not None:
            c.fail(f"gen_settings.cfg_scale={gen_settings.cfg_scale} needs a negative prompt: pass input_ids="
                   "[positive_ids, negative_ids], or leave cfg_scale None")
        self.stop_tokens, self.stop_strings = _stop_conditions(c, stop_conditions)
        self.seed = c.optional_int("seed", seed)
        self.identifier = identifier
        self.max_skips = c.int_("max_skips", max_skips, 0)
        self.return_top_tokens = c.int_("return_top_tokens", return_top_tokens, 0)
        self.return_probs = c.bool_("return_probs", return_probs)
        self.return_logits = c.bool_("return_logits", return_logits)
        self.decode_special_tokens = c.bool_("decode_special_tokens", decode_special_tokens)
        self.banned_strings = c.strings("banned_strings", banned_strings)
        self.token_healing = c.bool_("token_healing", token_healing)
        self.priority = c.int_("priority", priority, None, allowed="an int (higher runs first)")
        self.deadline = None if deadline is None else c.float_(
            "deadline", deadline, 0.0, lo_open=True, allowed="None or a finite number of seconds > 0 after arrival")
        self.expected_new_tokens = c.optional_int("expected_new_tokens", expected_new_tokens, 0)
        self.filters = _filters(c, filters)
        self.filter_prefer_eos = c.bool_("filter_prefer_eos", filter_prefer_eos)
        # the blocks whose reserved ids the prompts hold: one given for another prompt holds no table rows (as in
        # generate(), whose prompts share one list)
        self.embeddings = [e for e in _embeddings(c, embeddings)
                           if e.used_in(self.input_ids) or e.used_in(self.negative_ids or ())]
        if lora is not None and not isinstance(lora, str):
            c.fail_type("lora", lora, "the name of an adapter loaded with generator.load_lora(name, path), or None")
        self.lora = lora
        if pair is not None and self.token_healing:
            c.fail("token_healing cannot be combined with CFG (the healed first token would follow the positive "
                   "prompt only); pass token_healing=False")
        if self.filters and self.banned_strings:
            c.fail("filters and banned_strings cannot be combined (a banned-string rewind would move the grammar "
                   "back under the filter); express the ban in the grammar instead")
        # --- generator-side state (set by enqueue / admission / steps)
        self.serial: int | None = None
        self.queue_position = 0  # its place in the generator's waiting list (the scheduler's, while it waits)
        self.skips = 0
        self.pages: list[int] = []
        self.page_hashes: list[bytes] = []  # chained hashes of the job's complete pages (prompt and output)
        self.kv_position = 0  # tokens whose K/V are in the cache
        self.sequence: list[int] = list(self.input_ids)  # prompt + generated tokens
        self.new_tokens = 0
        self.cached_tokens = 0
        self.full_completion = ""
        self.stream = None
        self.explored: dict[int, set[int]] = {}  # sequence index -> tokens banned there after a rewind
        self.healing_allowed: list[int] = []  # token healing: ids allowed for the first sample
        self.healing_prefix = b""  # token healing: the dropped prompt token's bytes (the first sample starts with them)
        self.filter_state = None  # paged.filters.FilterState: this job's grammar matchers (set at enqueue)
        self.pending_extras: list[dict] = []  # per-token extras (probs, top-k, logits) not yet released with text
        self.time_enqueue = 0.0  # the generator's clock at enqueue() (`arrival`)
        self.preemptions = 0  # times a policy preempted it (pages released, recomputed on re-admission)
        self.kv_at_preemption = 0  # the most tokens it had computed when it was preempted (a recompute's end)
        self.drafted_tokens = 0  # speculative decoding: draft tokens verified for this job, and how many were kept
        self.accepted_draft_tokens = 0
        self.prefix_memo: tuple | None = None  # (sequence length, hashes, page tokens) of its cacheable prefix
        self.time_first_prefill: float | None = None
        self.embedding_rows: dict[int, int] = {}  # reserved id -> row of the engine's embedding table (enqueued)
        self.mirostat_mu: float | None = None  # mirostat's running mu (this job's own, set at enqueue)
        self.sampling_row: Mapping | None = None  # its sampler row (`gen_settings.device_row(seed)`), built once by the
        # scheduler for a job without mirostat, read-only
        self.dry_breakers = None  # packed token sets (np.ndarray i32 [ceil(V/32)]) for DRY and XTC, set at enqueue
        self.xtc_exempt = None
        # CFG: the hidden job of the negative prompt (set at enqueue; scheduled, paged and ended with this one), and
        # on that job, the job it belongs to
        self.lora_slot = 0  # the engine's LoRA slot of `lora` + 1 (0: none), and its digest, hashed into every page
        self.hash_root = b""
        self.cfg_partner: Job | None = None
        self.cfg_owner: Job | None = None
        self.time_first_token: float | None = None
        self.time_last_token: float | None = None

    # ------------------------------------------------------------------ derived
    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def arrival(self) -> float:
        """When it was enqueued, on the generator's clock (virtual seconds under simulation)."""
        return self.time_enqueue

    @property
    def deadline_at(self) -> float | None:
        """`arrival + deadline` on the generator's clock, or None without a deadline."""
        return None if self.deadline is None else self.time_enqueue + self.deadline

    def mark_enqueued(self, serial: int, now: float | None = None) -> None:
        self.serial = serial
        self.time_enqueue = time.perf_counter() if now is None else now

    def __repr__(self) -> str:
        return (f"Job(serial={self.serial}, identifier={self.identifier!r}, prompt={self.prompt_len}, "
                f"new={self.new_tokens}/{self.max_new_tokens})")
