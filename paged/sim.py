"""Simulation: the real generator, scheduler, policies and page pool driving a `SimulatedEngine` instead of the
model, on a virtual clock, so policies can be compared at scales (and on hardware) this machine cannot serve.

- `StepShape`: what a step's cost depends on: prefill tokens, decode rows, KV tokens attended (the sum over rows of
  the context after the step's tokens), the token slots of the shape bucket the batch is padded to, and the KV slots
  attention reads (`kv_read`: every padded token slot against the context bucket of the longest row, as the XLA
  attention reads them, larger than `kv_tokens` when the rows' contexts differ; with the Pallas kernel, which has
  no context buckets, each row's own pages).
- `StepTimeModel`: seconds of one engine step as `base_s + sum(coef[f] * shape.f)`, plus `coef["wide_step"]` once for
  a step wider than `narrow_tokens` token slots (where the CPU engine leaves its native decode kernel for XLA's
  dequantize-then-dot path: a cost of its own); `constant(s)` for hand-checkable tests, `fit(samples)`
  (non-negative least squares) for measured step times. Saved as JSON with its `setup`: what it was measured on
  (host CPU and instruction sets or GPU, kernels, model, quantization, cache dtype, page size, date, commit).
  `experiments/fit_and_validate.py` measures, fits and validates one; the named fits are in
  `experiments/data/step_time/`.
- `SimulatedEngine`: implements `paged.device.engine_api.EngineProtocol`. Tokens come from the deterministic fake
  model of `paged.testing.FakeEngine` (next token = last token + 1); each `run` advances its `clock` (a
  `VirtualClock`) by the model's prediction for the step's shape. A generator built on it takes that clock
  (`DynamicGenerator(engine=sim)`), so arrival, TTFT, ITL and queue times are virtual seconds. A fit measured on
  another setup than the engine it simulates is warned (`StepTimeMismatchWarning`, naming the differences).

    sim = SimulatedEngine(EngineConfig(num_pages=257, max_seq_len=2048, max_batch_size=32),
                          StepTimeModel.load("experiments/data/step_time/cpu_epyc_smollm2_q4.json"))
    gen = DynamicGenerator(engine=sim, policy="vllm")
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paged.clock import VirtualClock
from paged.device.buckets import BucketSpec
from paged.device.config import EngineConfig
from paged.device.engine_api import StepOutput
from paged.errors import InvalidConfigError
from paged.testing import FakeEngine

FEATURES = ("prefill_tokens", "decode_rows", "kv_tokens", "padded_tokens", "wide_step", "kv_read", "attn_pairs",
            "padded_rows")
SCHEMA = "step_time_model/1"
MAX_SECONDS = 3600.0  # the largest base or coefficient a fit may hold (an hour a step, or per unit of a feature)
# `StepTimeModel.fit` refits this many times with each sample weighted by 1 / its *fitted* time: weighting by the
# sample's own time favours the samples that came out fast, so on noisy timings (steps measured while serving, where
# one in a few is slowed by the host) the fit lands under the mean step time (-5 to -10% on the 2-core CPU host).
REWEIGHTS = 3
# What a fit records it was measured on (`StepTimeModel.setup`): the host (CPU model and instruction sets, or the GPU),
# the kernels, the model and its weights, the cache, and when and from which commit. `ENGINE_SETUP` must match the
# engine simulated; `HOST_SETUP` must match the machine when a fit is validated against the real engine there.
ENGINE_SETUP = ("model", "quantization", "attn_impl", "matmul_impl", "cache_dtype", "page_size")
HOST_SETUP = ("cpu", "isa", "gpu")
SETUP_KEYS = (*HOST_SETUP, *ENGINE_SETUP, "backend", "cpus", "max_batch_size", "max_seq_len", "date", "commit")


class StepTimeMismatchWarning(UserWarning):
    """A step-time fit is used for an engine (or on a machine) other than the one it was measured on."""


@dataclasses.dataclass(frozen=True)
class StepShape:
    prefill_tokens: int  # tokens of the step's prefill chunks (rows with more than one token, or not sampling)
    decode_rows: int  # single-token sampling rows
    kv_tokens: int  # sum over rows of start_pos + row tokens: the KV positions attention reads
    padded_tokens: int  # token slots of the bucket the batch is padded to (0 without buckets)
    kv_read: int = 0  # KV slots attention reads: XLA, padded slots x the longest row's context bucket; the Pallas
    # kernel, each row's own pages (0: not counted)
    attn_pairs: int = 0  # (query, key) pairs attention scores: a row of n tokens from start_pos s scores
    # n * s + n * (n + 1) / 2 (a decode row: its context); a prefill chunk's grows with where it starts
    padded_rows: int = 0  # rows of the bucket (prefill windows + decode slots), each through the final norm, the LM
    # head and the sampler, padding included (0 without buckets)

    @classmethod
    def from_rows(cls, rows: Sequence[Any], spec: BucketSpec | None = None) -> StepShape:
        """The shape of a step over `RowInput`s, padded as `spec` pads it (None: no padding term)."""
        prefill, decode, kv, lens, max_end, pairs = 0, 0, 0, [], 0, 0
        ps = spec.page_size if spec is not None else 1
        for r in rows:
            n = len(r.tokens)
            end = r.start_pos + n
            kv += end
            if n == 1 and r.sample:  # (its pairs are its context, `end`: counted with kv below)
                decode += 1
            else:
                prefill += n
                lens.append(n)
                pairs += n * r.start_pos + n * (n + 1) // 2 - end
            if end > max_end:
                max_end = end
        max_pages = max(1, -(-max_end // ps))  # the longest row's pages
        padded, read, padded_rows = 0, 0, 0
        if spec is not None and rows:
            pages = min(max_pages, spec.max_pages_per_row)
            layout = spec.shape_for(lens, len(rows) - len(lens), pages).layout
            padded = layout.num_tokens
            padded_rows = layout.num_rows
            if spec.page_switch:  # XLA attention: every padded slot reads the longest row's context bucket
                buckets = spec.pages  # (sorted, up to max_pages_per_row: the smallest holding `pages`)
                read = padded * buckets[bisect.bisect_left(buckets, pages)] * ps
            else:  # the Pallas kernel visits each row's own pages
                read = sum(-(-(r.start_pos + len(r.tokens)) // ps) for r in rows) * ps
        return cls(prefill, decode, kv, padded, read, pairs + kv, padded_rows)

    @property
    def tokens(self) -> int:
        """Token slots of the step: the bucket's (`padded_tokens`), or without buckets its real tokens."""
        return self.padded_tokens or self.prefill_tokens + self.decode_rows

    def features(self, narrow_tokens: int = 0) -> list[float]:
        """The values of FEATURES; `wide_step` is 1 for a step of more than `narrow_tokens` token slots (0: never)."""
        wide = float(bool(narrow_tokens) and self.tokens > narrow_tokens)
        return [wide if f == "wide_step" else float(getattr(self, f)) for f in FEATURES]


@dataclasses.dataclass
class StepTimeModel:
    """seconds(step) = base_s + sum over FEATURES of coef[f] * shape.f (every coefficient >= 0); the `wide_step`
    feature is 1 for steps of more than `narrow_tokens` token slots (0: no such term, as in fits without it)."""

    base_s: float
    coef: dict[str, float] = dataclasses.field(default_factory=dict)
    device: str = "unspecified"
    model: str = "unspecified"
    notes: str = ""
    fit_stats: dict = dataclasses.field(default_factory=dict)
    narrow_tokens: int = 0
    setup: dict = dataclasses.field(default_factory=dict)  # what it was measured on (SETUP_KEYS); {}: unrecorded

    def __post_init__(self):
        if not isinstance(self.coef, Mapping):
            raise InvalidConfigError(f"StepTimeModel: coef must be a dict of feature -> seconds (features among "
                                     f"{list(FEATURES)}), got {type(self.coef).__name__}")
        unknown = sorted(set(self.coef) - set(FEATURES))
        if unknown:
            raise InvalidConfigError(f"StepTimeModel: unknown coefficient(s) {unknown}; known: {list(FEATURES)}")
        for name, v in [("base_s", self.base_s), *self.coef.items()]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v <= MAX_SECONDS):
                raise InvalidConfigError(f"StepTimeModel: {name} must be a number of seconds in [0, {MAX_SECONDS:g}] "
                                         f"(per step, or per unit of its feature), got {v!r}")
        if not isinstance(self.setup, Mapping):
            raise InvalidConfigError(f"StepTimeModel: setup must be a dict (keys among {list(SETUP_KEYS)}), got "
                                     f"{type(self.setup).__name__}")
        isa = self.setup.get("isa")
        if isa is not None and (isinstance(isa, str) or not isinstance(isa, (list, tuple))
                                or not all(isinstance(x, str) for x in isa)):
            raise InvalidConfigError(f"StepTimeModel: setup['isa'] must be a list of instruction-set names, got "
                                     f"{isa!r}")
        for name in ("device", "model", "notes"):
            if not isinstance(getattr(self, name), str):
                raise InvalidConfigError(f"StepTimeModel: {name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.fit_stats, Mapping):
            raise InvalidConfigError(f"StepTimeModel: fit_stats must be a dict, got {type(self.fit_stats).__name__}")
        n = self.narrow_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidConfigError(f"StepTimeModel: narrow_tokens must be an int >= 0 (0: no wide_step term), got "
                                     f"{n!r}")

    def differences(self, setup: Mapping[str, Any]) -> list[str]:
        """How `setup` (the engine simulated, or the machine validated on) differs from what this fit was measured
        on, one line per key both name (an "auto" kernel on the engine side matches anything). A fit loaded from a
        file that records no setup gives one line saying so; one built in code without a setup, none."""
        if self.setup.get("unrecorded"):
            return ["the fit records no setup (host, kernels, model, cache): it may come from other hardware, "
                    "kernels or weights; refit with `python -m experiments.fit_and_validate`"] if setup else []
        if not self.setup or self.setup.get("synthetic"):  # built in code, or constant(): nothing to compare
            return []
        out = []
        for k in (*HOST_SETUP, *ENGINE_SETUP):
            a, b = self.setup.get(k), setup.get(k)
            if a is None or b is None or b == "auto":
                continue
            if k == "isa":  # instruction sets: the fit's must all be there
                missing = sorted(set(a) - set(b))
                if missing:
                    out.append(f"isa: the fit used {', '.join(missing)}, which this host lacks")
            elif str(a) != str(b):
                out.append(f"{k}: fit {a!r}, here {b!r}")
        return out

    def warn_differences(self, setup: Mapping[str, Any], what: str = "the engine simulated") -> list[str]:
        """`differences(setup)`, each warned as a `StepTimeMismatchWarning` naming `what` and the fit."""
        diffs = self.differences(setup)
        if diffs:
            name = self.setup.get("name") or f"{self.device} / {self.model}"
            warnings.warn(f"step-time fit {name!r} was measured on a different setup than {what}: "
                          + "; ".join(diffs) + " (its step times may not transfer)", StepTimeMismatchWarning,
                          stacklevel=3)
        return diffs

    def predict(self, shape: StepShape) -> float:
        """`base_s + sum(coef[f] * shape's feature f)`, the features as `shape.features(narrow_tokens)` gives them
        (summed in `coef`'s order; `predictor()` is the same function, built once)."""
        return self.predictor()(shape)

    def predictor(self):
        """A function pricing a `StepShape` as `predict` documents, for the coefficients as they are now, with the
        terms whose coefficient is 0 left out: the simulator prices every step with it, millions of times in a long
        run."""
        base, n = self.base_s, self.narrow_tokens
        terms = tuple((f, c) for f, c in self.coef.items() if c)

        def price(shape: StepShape) -> float:
            t = 0.0
            for f, c in terms:
                t += c * (float(bool(n) and shape.tokens > n) if f == "wide_step" else getattr(shape, f))
            return base + t

        return price

    @classmethod
    def constant(cls, seconds: float) -> StepTimeModel:
        """Every step takes `seconds` (hand-checkable tests)."""
        return cls(base_s=seconds, notes="constant", setup={"synthetic": True})

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float], *, device: str = "unspecified",
            model: str = "unspecified", notes: str = "", narrow_tokens: int = 0,
            setup: Mapping[str, Any] | None = None) -> StepTimeModel:
        """Non-negative least squares of `seconds` on the features (plus an intercept), minimising relative error
        (each sample weighted by 1 / its fitted time, so short decode steps count as much as long prefill steps;
        iteratively reweighted from a first fit weighted by 1 / the sample's own time, see REWEIGHTS).
        `narrow_tokens`: the widest step of the engine's narrow matmul path (0: one path, no `wide_step` term);
        `setup`: what the times were measured on (SETUP_KEYS)."""
        if len(shapes) != len(seconds) or len(shapes) < len(FEATURES) + 1:
            raise InvalidConfigError(f"StepTimeModel.fit: need as many times as shapes and at least "
                                     f"{len(FEATURES) + 1} samples, got {len(shapes)} shapes, {len(seconds)} times")
        y = np.asarray(seconds, np.float64)
        if not (np.all(np.isfinite(y)) and np.all(y > 0)):
            raise InvalidConfigError("StepTimeModel.fit: step times must be finite and > 0")
        x = np.asarray([[1.0, *s.features(narrow_tokens)] for s in shapes], np.float64)
        w = 1.0 / y
        coef = _nnls(x * w[:, None], y * w)
        for _ in range(REWEIGHTS):  # weights from the fitted times, not the samples' own (see REWEIGHTS)
            pred = x @ coef
            w = 1.0 / np.maximum(pred, 1e-3 * y.min())
            coef = _nnls(x * w[:, None], y * w)
        pred = x @ coef
        rel = np.abs(pred - y) / y
        stats = {"samples": int(len(y)), "mean_abs_rel_error": float(rel.mean()),
                 "max_abs_rel_error": float(rel.max()),
                 "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-30))}
        return cls(base_s=float(coef[0]), coef={f: float(c) for f, c in zip(FEATURES, coef[1:])}, device=device,
                   model=model, notes=notes, fit_stats=stats, narrow_tokens=narrow_tokens, setup=dict(setup or {}))

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}

    def save(self, path: str | os.PathLike) -> None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> StepTimeModel:
        if not isinstance(d, Mapping):
            raise InvalidConfigError(f"StepTimeModel: a fit is a JSON object with schema {SCHEMA!r}, got "
                                     f"{type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise InvalidConfigError(f"StepTimeModel: expected schema {SCHEMA!r}, got {d.get('schema')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        if "setup" not in d:  # a file written before fits recorded what they were measured on
            kw["setup"] = {"unrecorded": True}
        if "base_s" not in kw:
            raise InvalidConfigError("StepTimeModel: the fit has no base_s (the seconds of an empty step)")
        return cls(**kw)

    @classmethod
    def load(cls, path: str | os.PathLike) -> StepTimeModel:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
            raise InvalidConfigError(f"StepTimeModel.load({os.fspath(path)!r}): {e}; write one with "
                                     "`python -m experiments.profile_step --fit_out PATH`") from e
        return cls.from_dict(d)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by elimination: solve, drop the most negative coefficient, repeat (exact for the
    few well-separated features here; `scipy.optimize.nnls` is not a dependency)."""
    active = list(range(a.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if not active or sol.min() >= 0:
            out = np.zeros(a.shape[1])
            out[active] = sol
            return out
        del active[int(np.argmin(sol))]


def engine_setup(config: EngineConfig, extra: Mapping[str, Any] | None = None) -> dict:
    """The setup keys an `EngineConfig` fixes (page size, cache dtype, kernels), plus `extra` (the model and its
    quantization, which the config does not name)."""
    out = {"page_size": config.page_size, "cache_dtype": config.cache_dtype, "attn_impl": config.attn_impl,
           "matmul_impl": config.matmul_impl}
    return {**out, **dict(extra or {})}


class SimulatedEngine(FakeEngine):
    """The fake model on a virtual clock: each step advances `clock` by `step_time.predict(StepShape)`.

    The step-time fit is checked against the engine simulated (`engine_setup(config, setup)`; `setup` adds the
    model and quantization): a difference is warned (`StepTimeMismatchWarning`), naming it, unless `warn_setup` is
    False (a caller that has checked the fit once for many engines, as compare_policies does per comparison).

    `records` (when `record_steps`) holds one `(StepShape, seconds)` per step for the experiment's per-step log."""

    def __init__(self, config: EngineConfig, step_time: StepTimeModel, *, vocab_size: int = 258,
                 clock: VirtualClock | None = None, record_steps: bool = False, pad_to_buckets: bool = True,
                 setup: Mapping[str, Any] | None = None, warn_setup: bool = True):
        if not isinstance(config, EngineConfig) or not config.resolved:
            raise InvalidConfigError("SimulatedEngine: config must be a resolved paged.device.config.EngineConfig "
                                     "(num_pages and max_seq_len set: EngineConfig(...).resolve())")
        if not isinstance(step_time, StepTimeModel):
            raise InvalidConfigError(f"SimulatedEngine: step_time must be a paged.sim.StepTimeModel, got "
                                     f"{type(step_time).__name__}")
        self.setup = engine_setup(config, setup)
        if warn_setup:
            step_time.warn_differences(self.setup)
        super().__init__(config=config, vocab_size=vocab_size, record=False)
        self.spec = BucketSpec.from_config(config, attn_impl="xla")
        self.step_time = step_time
        self._price = step_time.predictor()  # (priced with the coefficients as they are now)
        self.clock = clock if clock is not None else VirtualClock()
        self.pad_to_buckets = pad_to_buckets
        self.record_steps = record_steps
        self.records: list[tuple[StepShape, float]] = []
        self.timings = {"simulated_s": 0.0}

    def run(self, rows, *, return_top_k=0, return_logits=False, num_steps=1) -> StepOutput:
        if num_steps > 1:  # FakeEngine runs the burst as single steps through self.run: each advances the clock
            t0 = self.clock()
            out = super().run(rows, return_top_k=return_top_k, return_logits=return_logits, num_steps=num_steps)
            out.seconds = self.clock() - t0
            return out
        shape = StepShape.from_rows(rows, self.spec if self.pad_to_buckets else None)
        dt = self._price(shape)
        out = super().run(rows, return_top_k=return_top_k, return_logits=return_logits)
        self.clock.advance(dt)
        self.timings["simulated_s"] += dt
        if self.record_steps:
            self.records.append((shape, dt))
        out.seconds = dt
        return out
