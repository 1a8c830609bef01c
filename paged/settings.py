"""`SamplingSettings`: a job's sampling configuration (user-facing, validated), turned into one row of the device
`SamplingParams`. Defaults are ExLlamaV2's: temperature 0.8, top_k 50, top_p 0.8, repetition penalty 1.025."""

from __future__ import annotations

import dataclasses
import math

from paged.errors import InvalidSettingsError


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
    token_bias: tuple[tuple[int, float], ...] = ()  # additive logit bias per token id; -inf bans
    banned_tokens: tuple[int, ...] = ()  # never sampled

    def __post_init__(self):
        def bad(msg: str):
            raise InvalidSettingsError(f"SamplingSettings: {msg}")

        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not (0 <= self.min_p < 1):
            bad(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if not (0 <= self.typical <= 1):
            bad(f"typical must be in [0, 1] (0 or 1 = off), got {self.typical}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(f"{name} must be finite, got {getattr(self, name)}")
        if self.penalty_range < 0:
            bad(f"penalty_range must be >= 0, got {self.penalty_range}")
        if isinstance(self.token_bias, dict):  # accept a dict for convenience, store hashable
            object.__setattr__(self, "token_bias", tuple(sorted(self.token_bias.items())))
        object.__setattr__(self, "banned_tokens", tuple(int(t) for t in self.banned_tokens))
        for t, v in self.token_bias:
            if not isinstance(t, int) or math.isnan(v):
                bad(f"token_bias entries must be (int id, float value), got ({t!r}, {v!r})")

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
        """This job's row of `paged.sampling.SamplingParams`."""
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
