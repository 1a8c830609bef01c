"""`SamplingSettings`: a job's sampling configuration (user-facing, validated), turned into one row of the device
`SamplingRows`. Defaults are ExLlamaV2's: temperature 0.8, top_k 50, top_p 0.8, repetition penalty 1.025."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from paged.errors import InvalidSettingsError
from paged.validate import Checker, unwrap_0d

BIG = 1 << 30  # int settings go to the device as int32: anything larger means "all" and is clamped to this
# The largest magnitude a float setting (or a token bias) may have. The sampler computes in float32 (max 3.4e38);
# this headroom keeps its sums, products and quotients (by a temperature down to 0.01) finite. 1e39 is finite in
# Python and infinite on the device, where it turned every logit into NaN and failed the job at its first token.
FLOAT_LIMIT = 1e30


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.8  # < 0.01 means greedy
    top_k: int = 50  # 0 = off
    top_p: float = 0.8  # 1 = off; must be in (0, 1]
    min_p: float = 0.0  # 0 = off; keep tokens with p >= min_p * p_max
    typical: float = 0.0  # 0 = off; locally typical sampling mass in (0, 1)
    repetition_penalty: float = 1.025  # 1 = off; HF-style multiplicative, over the last `penalty_range` tokens
    frequency_penalty: float = 0.0  # subtract freq * count
    presence_penalty: float = 0.0  # subtract pres once per present token
    penalty_range: int = 1024  # how many recent tokens (prompt + output) the penalties look at
    token_bias: tuple[tuple[int, float], ...] = ()  # additive logit bias per token id ({id: value} accepted); -inf bans
    banned_tokens: tuple[int, ...] = ()  # never sampled (an iterable of ids, or one id)
    # --- ExLlamaV2's full sampler (docs/api.md, "The full sampler"); every default is off
    penalty_decay: int = 0  # penalties fade linearly to neutral over this many tokens beyond penalty_range
    top_a: float = 0.0  # 0 = off; keep p >= top_a * p_max^2
    tfs: float = 0.0  # tail-free sampling, on for 0 < tfs < 1
    smoothing_factor: float = 0.0  # quadratic sampling, on for > 0: exp(-factor * (logit - max)^2 / temperature)
    min_temp: float = 0.0  # dynamic temperature, on when max_temp > min_temp:
    max_temp: float = 0.0  # T = min_temp + (max_temp - min_temp) * (entropy / max entropy)^temp_exponent
    temp_exponent: float = 1.0
    temperature_last: bool = False  # apply temperature after truncation (as p^(1/T)) instead of before
    skew: float = 0.0  # 0 = off; warps the draw towards (skew < 0) or away from (> 0) the most likely tokens
    xtc_probability: float = 0.0  # XTC, on for > 0: how often the tokens above xtc_threshold are excluded
    xtc_threshold: float = 0.1
    xtc_ignore_tokens: tuple[int, ...] | None = None  # never excluded; None: tokens with a newline, special tokens
    mirostat: bool = False  # mirostat v2: truncate to surprise <= mu, steer mu towards mirostat_tau (per job)
    mirostat_tau: float = 1.5
    mirostat_eta: float = 0.1
    mirostat_mu: float | None = None  # the initial mu; None: 2 * mirostat_tau
    dry_multiplier: float = 0.0  # DRY, on for > 0: penalise continuing a repeated sequence
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[int, ...] | None = None  # ids; None: tokens with any of .,!?<>[](){} newline tab "
    dry_range: int = 0  # 0: the whole history window (the generator's max_penalty_range)
    dry_max_ngram: int = 20
    # --- classifier-free guidance: the job's input_ids are [positive, negative]; None = no CFG
    cfg_scale: float | None = None

    def __post_init__(self):
        c = Checker("SamplingSettings", InvalidSettingsError)
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        put("temperature", c.float_("temperature", self.temperature, 0.0,
                                    allowed="a finite number >= 0 (< 0.01 = greedy)"))
        put("top_k", c.int_("top_k", self.top_k, 0, allowed="an int >= 0 (0 = off)"))
        put("top_p", c.float_("top_p", self.top_p, 0.0, 1.0, lo_open=True, allowed="a number in (0, 1] (1 = off)"))
        put("min_p", c.float_("min_p", self.min_p, 0.0, 1.0, hi_open=True, allowed="a number in [0, 1) (0 = off)"))
        put("typical", c.float_("typical", self.typical, 0.0, 1.0, allowed="a number in [0, 1] (0 or 1 = off)"))
        put("repetition_penalty", c.float_("repetition_penalty", self.repetition_penalty, 1 / FLOAT_LIMIT,
                                           allowed=f"a number >= {1 / FLOAT_LIMIT:g} (1 = off)"))
        put("frequency_penalty", c.float_("frequency_penalty", self.frequency_penalty))
        put("presence_penalty", c.float_("presence_penalty", self.presence_penalty))
        put("penalty_range", c.int_("penalty_range", self.penalty_range, 0))
        put("token_bias", _token_bias(c, self.token_bias))
        put("banned_tokens", _token_ids(c, "banned_tokens", self.banned_tokens))
        put("penalty_decay", c.int_("penalty_decay", self.penalty_decay, 0))
        put("top_a", c.float_("top_a", self.top_a, 0.0, allowed="a finite number >= 0 (0 = off)"))
        put("tfs", c.float_("tfs", self.tfs, 0.0, 1.0, allowed="a number in [0, 1] (0 or 1 = off)"))
        put("smoothing_factor", c.float_("smoothing_factor", self.smoothing_factor, 0.0,
                                         allowed="a finite number >= 0 (0 = off)"))
        put("min_temp", c.float_("min_temp", self.min_temp, 0.0))
        put("max_temp", c.float_("max_temp", self.max_temp, 0.0))
        put("temp_exponent", c.float_("temp_exponent", self.temp_exponent, 0.0, lo_open=True))
        put("temperature_last", c.bool_("temperature_last", self.temperature_last))
        put("skew", c.float_("skew", self.skew, -20.0, 20.0, allowed="a number in [-20, 20] (0 = off)"))
        put("xtc_probability", c.float_("xtc_probability", self.xtc_probability, 0.0, 1.0,
                                        allowed="a number in [0, 1] (0 = off)"))
        put("xtc_threshold", c.float_("xtc_threshold", self.xtc_threshold, 0.0, 1.0, lo_open=True,
                                      allowed="a number in (0, 1]"))
        if self.xtc_ignore_tokens is not None:
            put("xtc_ignore_tokens", _token_ids(c, "xtc_ignore_tokens", self.xtc_ignore_tokens))
        put("mirostat", c.bool_("mirostat", self.mirostat))
        put("mirostat_tau", c.float_("mirostat_tau", self.mirostat_tau, 0.0, lo_open=True,
                                     allowed="a finite number > 0 (target surprise in bits)"))
        put("mirostat_eta", c.float_("mirostat_eta", self.mirostat_eta, 0.0))
        if self.mirostat_mu is not None:
            put("mirostat_mu", c.float_("mirostat_mu", self.mirostat_mu, 0.0,
                                        allowed="a finite number >= 0, or None (2 * mirostat_tau)"))
        put("dry_multiplier", c.float_("dry_multiplier", self.dry_multiplier, 0.0,
                                       allowed="a finite number >= 0 (0 = off)"))
        put("dry_base", c.float_("dry_base", self.dry_base, 1.0, allowed="a finite number >= 1"))
        put("dry_allowed_length", c.int_("dry_allowed_length", self.dry_allowed_length, 1))
        put("dry_max_ngram", c.int_("dry_max_ngram", self.dry_max_ngram, 2))
        put("dry_range", c.int_("dry_range", self.dry_range, 0))
        if self.dry_range and self.dry_range <= self.dry_max_ngram:
            c.fail(f"dry_range must be 0 (the whole history) or > dry_max_ngram ({self.dry_max_ngram}), "
                   f"got {self.dry_range}")
        if self.cfg_scale is not None:
            put("cfg_scale", c.float_("cfg_scale", self.cfg_scale, allowed="a finite number, or None (no CFG)"))
        if self.dry_sequence_breakers is not None:
            put("dry_sequence_breakers", _token_ids(c, "dry_sequence_breakers", self.dry_sequence_breakers))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and abs(v) > FLOAT_LIMIT:
                c.fail(f"{f.name} must be at most {FLOAT_LIMIT:g} in size (the sampler computes in float32), got {v}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in `token_bias` / `banned_tokens` must be below `vocab_size` (checked at `enqueue()`)."""
        c = Checker("SamplingSettings", InvalidSettingsError)
        for t, _ in self.token_bias:
            c.token_id("token_bias id", t, vocab_size)
        for t in self.banned_tokens:
            c.token_id("banned_tokens id", t, vocab_size)
        for name in ("xtc_ignore_tokens", "dry_sequence_breakers"):
            for t in getattr(self, name) or ():
                c.token_id(f"{name} id", t, vocab_size)

    @staticmethod
    def greedy(**kw) -> SamplingSettings:
        """Argmax decoding with no penalties."""
        return SamplingSettings(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **kw})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 0.01

    @property
    def uses_penalties(self) -> bool:
        return (self.penalty_range > 0 or self.penalty_decay > 0) and (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0  # a logit penalty: greedy jobs too

    @property
    def uses_xtc(self) -> bool:
        return self.xtc_probability > 0 and not self.is_greedy

    @property
    def uses_mirostat(self) -> bool:
        return self.mirostat and not self.is_greedy

    def history_window(self, max_penalty_range: int) -> int:
        """Tokens of history the device needs for this job (penalties over penalty_range + penalty_decay, DRY over
        dry_range or the whole window), at most the generator's `max_penalty_range`."""
        want, dry = self._history_needs
        if dry:
            want = max(want, self.dry_range or max_penalty_range)
        return min(want, max_penalty_range)

    @functools.cached_property
    def _history_needs(self) -> tuple[int, bool]:
        """(tokens the penalties look back over, whether DRY is on): what `history_window` needs (built once)."""
        return (self.penalty_range + self.penalty_decay if self.uses_penalties else 0), self.uses_dry

    def initial_mirostat_mu(self) -> float:
        return 2.0 * self.mirostat_tau if self.mirostat_mu is None else self.mirostat_mu

    def device_row(self, seed: int, mirostat_mu: float | None = None) -> dict:
        """This job's row of `paged.device.sampling.SamplingRows` (`mirostat_mu`: the job's current mu): a fresh dict
        each call, copied from the settings' own row (they are frozen, so it is built once)."""
        row = self._device_row.copy()
        row["seed"] = seed
        if mirostat_mu is not None:
            row["mirostat_mu"] = mirostat_mu
        return row

    @functools.cached_property
    def _device_row(self) -> dict:
        """`device_row` with seed 0 and the initial mirostat mu (in the row's key order)."""
        return dict(
            temperature=self.temperature, top_k=min(self.top_k, BIG), top_p=self.top_p, min_p=self.min_p,
            typical=self.typical, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            penalty_range=min(self.penalty_range, BIG), penalty_decay=min(self.penalty_decay, BIG), top_a=self.top_a,
            tfs=self.tfs, smoothing_factor=self.smoothing_factor, min_temp=self.min_temp, max_temp=self.max_temp,
            temp_exponent=self.temp_exponent, temperature_last=int(self.temperature_last), skew=self.skew,
            xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold, mirostat=int(self.mirostat),
            mirostat_mu=self.initial_mirostat_mu(),
            dry_multiplier=self.dry_multiplier, dry_base=self.dry_base,
            dry_allowed_length=min(self.dry_allowed_length, BIG), dry_max_ngram=min(self.dry_max_ngram, BIG),
            dry_range=min(self.dry_range, BIG), seed=0,
            cfg_scale=1.0 if self.cfg_scale is None else self.cfg_scale,
        )

    def bias(self) -> dict[int, float]:
        """The settings' logit bias, `token_bias` with `banned_tokens` at -inf: a fresh dict each call."""
        return self._bias.copy()

    @functools.cached_property
    def bias_view(self) -> Mapping[int, float]:
        """`bias()` without the copy: a read-only view of the settings' own dict (the scheduler's usual row)."""
        return MappingProxyType(self._bias)

    @functools.cached_property
    def banned_ids(self) -> frozenset[int]:
        """The ids never sampled: `banned_tokens` and the -inf entries of `token_bias`."""
        return frozenset(t for t, b in self._bias.items() if b == -math.inf)

    @functools.cached_property
    def _bias(self) -> dict[int, float]:
        out = dict(self.token_bias)
        for t in self.banned_tokens:
            out[t] = -math.inf
        return out


def _token_ids(c: Checker, name: str, value: Any) -> tuple[int, ...]:
    """An iterable of token ids (or one id) -> a sorted tuple of distinct ints >= 0."""
    value = unwrap_0d(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (value,)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        c.fail_type(name, value, "an iterable of token ids")
    return tuple(sorted({c.token_id(f"{name} entry", t) for t in value}))


def _token_bias(c: Checker, value: Any) -> tuple[tuple[int, float], ...]:
    """{id: value} or (id, value) pairs -> a sorted tuple of pairs. Values are finite or -inf (a ban); +inf and NaN
    have no meaning as a bias."""
    value = unwrap_0d(value)
    if isinstance(value, Mapping):
        value = value.items()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        c.fail_type("token_bias", value, "a dict {token id: bias} or (id, bias) pairs")
    out: dict[int, float] = {}
    for pair in value:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            c.fail_type("token_bias entry", pair, "an (id, bias) pair")
        t = c.token_id("token_bias id", pair[0])
        if isinstance(pair[1], (bool, np.bool_)) or not isinstance(pair[1], (int, float, np.integer, np.floating)):
            c.fail_type(f"token_bias[{t}]", pair[1], "a number")
        v = float(pair[1])
        if math.isnan(v) or v == math.inf or (v != -math.inf and abs(v) > FLOAT_LIMIT):
            c.fail(f"token_bias[{t}] must be a number in [-{FLOAT_LIMIT:g}, {FLOAT_LIMIT:g}] or -inf (a ban), got {v}")
        if t in out:
            c.fail(f"token_bias names token {t} twice")
        out[t] = v
    return tuple(sorted(out.items()))
