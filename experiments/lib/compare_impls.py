"""`generate --compare_to=IMPL`: greedy text from the implementation under test against a reference implementation,
every other implementation pinned to the same one in both runs, and the first token where they part.

Which family IMPL names: the one it is an implementation of (a `module:function` path registers in one family
only); for a name both families have ("xla", "native", "pallas", "reference", "auto") the family whose flag
(`--attn_impl` or `--matmul_impl`) gives the implementation under test, i.e. is given with another value; or the
family named in IMPL itself: `attn_impl=xla`, `matmul_impl=xla`. The implementation under test is that family's flag
value ("auto" when not given).

What is pinned: the other family runs the same implementation in both runs: the one its flag gives; else, for the
matmul, "xla" wherever "auto" would run the native CPU kernel (its int8 activation quantization turns float
differences of 1e-6 in the attention's output into different tokens at near-ties; its own error is ~0.5% of a dot);
else "auto" (which resolves the same way in both runs).

A divergence is reported with the reference run's logit margin at that position (top-1 minus top-2): the two runs
have the same tokens before it, so the same inputs there, and a margin of the size of float rounding (1e-4..1e-2) is a
near-tie, not a bug; the under-test run's margin, and how far apart the reference run puts the two tokens, come with
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

FAMILIES = {"attention": "attn", "matmul": "matmul"}  # family -> its EngineConfig fields' prefix (attn_impl, ...)
QUANTIZED_ACTIVATIONS = ("the native CPU matmul quantizes activations to int8 (~0.5% error per dot), which turns "
                         "float differences into different tokens at near-ties")


class CompareError(ValueError):
    """A --compare_to that cannot be planned: the message says what to change."""


@dataclasses.dataclass(frozen=True)
class ComparePlan:
    """family: "attention" or "matmul"; under_test / reference: its implementation in each run; pinned: the other
    family's implementation in both runs, and why that one."""

    family: str
    under_test: str
    reference: str
    pinned: str
    pinned_why: str

    @property
    def other(self) -> str:
        return "matmul" if self.family == "attention" else "attention"

    def configs(self, base: Any) -> tuple[Any, Any]:
        """(under-test config, reference config) from `base` (an `EngineConfig`): the compared family's
        implementation set in each (its tuning only in the run under test), the other family's pinned in both."""
        mine, other = FAMILIES[self.family], FAMILIES[self.other]
        pin = {f"{other}_impl": self.pinned}
        test = dataclasses.replace(base, **{f"{mine}_impl": self.under_test}, **pin)
        ref = dataclasses.replace(base, **{f"{mine}_impl": self.reference, f"{mine}_tuning": None}, **pin)
        return test, ref

    def describe(self) -> str:
        return (f"compare {self.family}: {self.under_test!r} (under test) against {self.reference!r} (reference); "
                f"{self.other} {self.pinned!r} in both runs ({self.pinned_why})")


def families_of(impl: str) -> dict[str, str | None]:
    """family -> None where `impl` names one of its implementations, else why not (the registry's message)."""
    from pallas_kernels.registry import ATTENTION, MATMUL, KernelError

    out = {}
    for family, reg in (("attention", ATTENTION), ("matmul", MATMUL)):
        try:
            reg.get(impl)
            out[family] = None
        except KernelError as e:
            out[family] = str(e)
    return out


def plan_comparison(compare_to: str, impls: dict[str, str], given: dict[str, bool], *,
                    auto_matmul_quantizes: bool) -> ComparePlan:
    """The comparison `--compare_to=compare_to` asks for. `impls`: family -> its flag's value; `given`: family ->
    whether its flag was given; `auto_matmul_quantizes`: whether "auto" runs the native CPU matmul here (it does on
    the CPU wherever the kernel is built). Raises `CompareError` saying what to change."""
    named, eq, impl = compare_to.partition("=")
    flags_ = {f"{prefix}_impl": family for family, prefix in FAMILIES.items()}
    if eq and named not in flags_:
        raise CompareError(f"{named!r} before '=' names no family: attn_impl or matmul_impl (e.g. attn_impl=xla)")
    compare_to = impl if eq else compare_to
    fits = families_of(compare_to)
    if eq:
        family = flags_[named]
        if fits[family] is not None:
            raise CompareError(f"not a{'n' if family == 'attention' else ''} {family} implementation: {fits[family]}")
        names = [family]
    else:
        names = [f for f, why in fits.items() if why is None]
    if not names:
        raise CompareError(f"not an attention implementation ({fits['attention']}) nor a matmul one "
                           f"({fits['matmul']})")
    if len(names) == 2:
        names = [f for f in names if given[f] and impls[f] != compare_to]
        if len(names) != 1:
            raise CompareError(f"{compare_to!r} is both an attention and a matmul implementation: give the "
                               "implementation under test with --attn_impl (to compare attention) or --matmul_impl "
                               f"(to compare the matmul), exactly one of them with a value other than {compare_to!r}, "
                               f"or name the family: --compare_to=attn_impl={compare_to} or matmul_impl={compare_to}")
    family = names[0]
    flag = f"--{FAMILIES[family]}_impl"
    under_test = impls[family]
    if under_test == compare_to:
        raise CompareError(f"{compare_to!r} is also the implementation under test ({flag}={under_test}): give the "
                           f"one to test with {flag}")
    other = "matmul" if family == "attention" else "attention"
    if given[other]:
        pinned, why = impls[other], f"as --{FAMILIES[other]}_impl gives"
    elif other == "matmul" and auto_matmul_quantizes:
        pinned, why = "xla", f"not auto: {QUANTIZED_ACTIVATIONS}; --matmul_impl pins another"
    else:
        pinned, why = impls[other], "the same in both runs; --" + FAMILIES[other] + "_impl pins another"
    return ComparePlan(family, under_test, compare_to, pinned, why)


# ------------------------------------------------------------------------------------------------ the runs
@dataclasses.dataclass
class Trace:
    """One job's greedy output in one run: its tokens and per token the top-2 logits (the margin). With `watch`
    (the other run's tokens), the whole logit row at the first token that differs from them (`keep_at`, `row`)."""

    watch: Sequence[int] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    top2: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    keep_at: int | None = None
    row: np.ndarray | None = None
    text: str = ""

    def add(self, token_ids: Sequence[int], logits: np.ndarray | None) -> None:
        """The tokens a streaming result released and their logit rows ([n, vocab], or None)."""
        for i, t in enumerate(token_ids):
            n = len(self.tokens)
            if logits is not None:
                row = np.asarray(logits[i], np.float32)
                second, first = np.partition(row, -2)[-2:]
                self.top2.append((float(first), float(second)))
                differs = self.watch is not None and (n >= len(self.watch) or self.watch[n] != t)
                if differs and self.keep_at is None:
                    self.keep_at, self.row = n, row
            self.tokens.append(int(t))

    def margin(self, index: int) -> float | None:
        return self.top2[index][0] - self.top2[index][1] if index < len(self.top2) else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the token lists differ (one ending first counts, at its end), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(test: Trace, ref: Trace, prompt_tokens: int, piece) -> dict | None:
    """The first divergent token of one job (None: the same tokens): its index among the generated tokens, its
    position in the sequence, each run's token (id and text) and logit margin (top-1 minus top-2), and how far the
    reference's logits put the two tokens apart (`logit_gap`, when its row there was kept). `piece`: id -> text."""
    i = first_divergence(test.tokens, ref.tokens)
    if i is None:
        return None

    def side(trace: Trace) -> dict:
        token = trace.tokens[i] if i < len(trace.tokens) else None
        return {"id": token, "text": None if token is None else piece(token), "margin": trace.margin(i)}

    out = {"index": i, "position": prompt_tokens + i, "under_test": side(test), "reference": side(ref)}
    a, b = out["under_test"]["id"], out["reference"]["id"]
    if ref.row is not None and ref.keep_at == i and a is not None and b is not None:
        out["reference"]["logit_gap"] = float(ref.row[b] - ref.row[a])
    return out


def describe_divergence(d: dict | None, compared: int) -> str:
    if d is None:
        return f"no divergence: the same {compared} tokens"
    t, r = d["under_test"], d["reference"]

    def tok(x: dict) -> str:
        return "(ended)" if x["id"] is None else f"{x['id']} {x['text']!r}"

    def num(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4g}"

    gap = f", the reference's logits put its token {num(r['logit_gap'])} above the other" if "logit_gap" in r else ""
    return (f"first divergent token at generated token {d['index']} (sequence position {d['position']}): under test "
            f"{tok(t)}, reference {tok(r)}; logit margin (top-1 minus top-2) in the reference run {num(r['margin'])}, "
            f"under test {num(t['margin'])}{gap} (a margin of the size of float rounding is a near-tie, not a bug)")
