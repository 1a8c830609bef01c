"""`SamplingSettings`: a job's sampling configuration (user-facing, validated), turned into one row of the device
`SamplingRows`. Defaults are ExLlamaV2's: temperature 0.8, top_k 50, top_p 0.8, repetition penalty 1.025."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from paged.errors import InvalidSettingsError
from paged.validate import Checker


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

    def __post_init__(self):
        c = Checker("SamplingSettings", InvalidSettingsError)
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        put("temperature", c.float_("temperature", self.temperature, 0.0,
                                    allowed="a finite number >= 0 (< 0.01 = greedy)"))
        put("top_k", c.int_("top_k", self.top_k, 0, allowed="an int >= 0 (0 = off)"))
        put("top_p", c.float_("top_p", self.top_p, 0.0, 1.0, lo_open=True, allowed="a number in (0, 1] (1 = off)"))
        put("min_p", c.float_("min_p", self.min_p, 0.0, 1.0, hi_open=True, allowed="a number in [0, 1) (0 = off)"))
        put("typical", c.float_("typical", self.typical, 0.0, 1.0, allowed="a number in [0, 1] (0 or 1 = off)"))
        put("repetition_penalty", c.float_("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True,
                                           allowed="a finite number > 0 (1 = off)"))
        put("frequency_penalty", c.float_("frequency_penalty", self.frequency_penalty))
        put("presence_penalty", c.float_("presence_penalty", self.presence_penalty))
        put("penalty_range", c.int_("penalty_range", self.penalty_range, 0))
        put("token_bias", _token_bias(c, self.token_bias))
        put("banned_tokens", _token_ids(c, "banned_tokens", self.banned_tokens))

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in `token_bias` / `banned_tokens` must be below `vocab_size` (checked at `enqueue()`)."""
        c = Checker("SamplingSettings", InvalidSettingsError)
        for t, _ in self.token_bias:
            c.token_id("token_bias id", t, vocab_size)
        for t in self.banned_tokens:
            c.token_id("banned_tokens id", t, vocab_size)

    @staticmethod
    def greedy(**kw) -> SamplingSettings:
        """Argmax decoding with no penalties."""
        return SamplingSettings(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **kw})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 0.01

    @property
    def uses_penalties(self) -> bool:
        return self.penalty_range > 0 and (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    def device_row(self, seed: int) -> dict:
        """This job's row of `paged.sampling.SamplingRows`."""
        return dict(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            typical=self.typical, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=seed,
        )

    def bias(self) -> dict[int, float]:
        out = dict(self.token_bias)
        for t in self.banned_tokens:
            out[t] = -math.inf
        return out


def _token_ids(c: Checker, name: str, value: Any) -> tuple[int, ...]:
    """An iterable of token ids (or one id) -> a sorted tuple of distinct ints >= 0."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (value,)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        c.fail_type(name, value, "an iterable of token ids")
    return tuple(sorted({c.token_id(f"{name} entry", t) for t in value}))


def _token_bias(c: Checker, value: Any) -> tuple[tuple[int, float], ...]:
    """{id: value} or (id, value) pairs -> a sorted tuple of pairs. Values are finite or -inf (a ban); +inf and NaN
    have no meaning as a bias."""
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
        if math.isnan(v) or v == math.inf:
            c.fail(f"token_bias[{t}] must be a finite number or -inf (a ban), got {v}")
        if t in out:
            c.fail(f"token_bias names token {t} twice")
        out[t] = v
    return tuple(sorted(out.items()))
