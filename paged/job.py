"""`Job`: one generation request and its progress through the generator.

Life story: `Job(...)` validates its inputs -> `enqueue` checks it can ever fit and gives it a serial -> the policy
admits it when its pages fit (a `started` result) -> prefill chunks run in the ragged step (`prefill` results) ->
the last prompt chunk samples the first token -> one decode row per step, each sampled token streamed
(`streaming` results) -> a stop token, stop string or max_new_tokens ends it (`eos=True`), its pages are released
and stay in the prompt cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from paged.errors import InvalidJobError
from paged.settings import SamplingSettings


def _as_id_list(input_ids: Any) -> list[int]:
    arr = np.asarray(input_ids)
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise InvalidJobError(f"input_ids of shape {arr.shape}: pass one sequence, shape (n,) or (1, n)")
        arr = arr[0]
    if arr.ndim != 1:
        raise InvalidJobError(f"input_ids must be a list of ints, a 1-D array or a (1, n) array; got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidJobError("input_ids is empty: a job needs at least one prompt token")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise InvalidJobError(f"input_ids must be integers, got dtype {arr.dtype}")
    if (arr < 0).any():
        raise InvalidJobError(f"input_ids contain negative ids: {arr[arr < 0][:5].tolist()}")
    return [int(x) for x in arr]


class Job:
    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        *,
        min_new_tokens: int = 0,
        gen_settings: SamplingSettings | None = None,
        stop_conditions: Iterable[int | str] | None = None,
        seed: int | None = None,
        identifier: Any = None,
        max_skips: int = 4,
        return_top_tokens: int = 0,
        return_probs: bool = False,
        return_logits: bool = False,
        decode_special_tokens: bool = False,
        banned_strings: Iterable[str] | None = None,
        token_healing: bool = False,
    ):
        self.input_ids = _as_id_list(input_ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InvalidJobError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not isinstance(min_new_tokens, (int, np.integer)) or not 0 <= min_new_tokens <= max_new_tokens:
            raise InvalidJobError(f"min_new_tokens must be an int in [0, max_new_tokens], got {min_new_tokens!r}")
        if gen_settings is None:
            gen_settings = SamplingSettings()
        if not isinstance(gen_settings, SamplingSettings):
            raise InvalidJobError(f"gen_settings must be a SamplingSettings, got {type(gen_settings).__name__}")
        self.stop_tokens: set[int] = set()
        self.stop_strings: list[str] = []
        for c in stop_conditions or ():
            if isinstance(c, bool) or not isinstance(c, (int, np.integer, str)):
                raise InvalidJobError(
                    f"stop condition {c!r} has type {type(c).__name__}; use int token ids or non-empty strings")
            if isinstance(c, str):
                if not c:
                    raise InvalidJobError("empty stop string")
                self.stop_strings.append(c)
            else:
                self.stop_tokens.add(int(c))
        if max_skips is None or not isinstance(max_skips, int) or max_skips < 0:
            raise InvalidJobError(f"max_skips must be an int >= 0, got {max_skips!r}")
        if not isinstance(return_top_tokens, int) or return_top_tokens < 0:
            raise InvalidJobError(f"return_top_tokens must be an int >= 0, got {return_top_tokens!r}")
        if seed is not None and not isinstance(seed, (int, np.integer)):
            raise InvalidJobError(f"seed must be an int or None, got {seed!r}")
        self.banned_strings = [str(b) for b in banned_strings or ()]
        if any(not b for b in self.banned_strings):
            raise InvalidJobError("empty banned string")
        self.token_healing = bool(token_healing)
        self.max_new_tokens = int(max_new_tokens)
        self.min_new_tokens = int(min_new_tokens)
        self.gen_settings = gen_settings
        self.seed = seed
        self.identifier = identifier
        self.max_skips = max_skips
        self.return_top_tokens = return_top_tokens
        self.return_probs = return_probs
        self.return_logits = return_logits
        self.decode_special_tokens = decode_special_tokens
        # --- generator-side state (set by enqueue / admission / steps)
        self.serial: int | None = None
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
        self.pending_extras: list[dict] = []  # per-token extras (probs, top-k, logits) not yet released with text
        self.time_enqueue = 0.0
        self.time_first_prefill: float | None = None
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
    def prefill_done(self) -> bool:
        """All prompt tokens but the last are cached; the next row feeds the last token (or a generated one)."""
        return self.kv_position >= len(self.sequence) - 1

    @property
    def is_active(self) -> bool:
        return bool(self.pages)

    def mark_enqueued(self, serial: int) -> None:
        self.serial = serial
        self.time_enqueue = time.perf_counter()

    def __repr__(self) -> str:
        return (f"Job(serial={self.serial}, identifier={self.identifier!r}, prompt={self.prompt_len}, "
                f"new={self.new_tokens}/{self.max_new_tokens})")
