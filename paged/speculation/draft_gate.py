"""Adaptive speculation: verify a job's drafts only where they are expected to pay for their verification.

A verification step costs more than a decode step: every row of a verification bucket carries k + 1 query tokens
(rows without drafts are padded to that width), and low acceptance makes speculation slower than plain decoding
(docs/speculative.md measured 0.44-0.84x on the 2-core CPU). `DraftGate` decides per step, before anything is
drafted (n-gram) or the draft model runs, whether the step verifies:

    verify  iff  sum over the decoding rows of (alpha_i + alpha_i^2 + ... + alpha_i^m_i)  >  cost(R)

Each term is the expected number of extra tokens of a row verifying m_i drafts when each is accepted with probability
alpha_i (a geometric run: acceptance stops at the first rejection). alpha_i is a Beta-posterior mean per job and
*evidence class*, pulled towards the class's global rate: for prompt lookup the class is the length of the suffix
that matched (a 1-token match predicts far worse than a 4-token one), for a draft model there is one class.

The right side prices the verification step in tokens of a plain step, from a linear step-time model
`t = a + b * query_tokens` (a: reading the weights once per step, b: the compute of one query token) with
`rho = b / a`: a plain step of R rows takes a + bR for R tokens; the verification step adds b R k, which is
`k * rho * R^2 / (1 + rho * R)` tokens' worth; a draft model adds its k draft steps, `k * draft_step_cost * R`
tokens' worth (draft_step_cost: a draft step in target steps, its weight bytes over the target's). rho is a
constant of the device, never a timing taken during the run, so the decisions depend only on what the generator has
run: the same jobs in the same order on a fresh generator verify in the same steps and give the same output. Which
steps verify never changes a greedy output, nor a sampled output's distribution; but a seeded sampled token drawn in
a verification step uses other random draws than a plain step's, so a seeded sampled job's output can depend on the
other jobs the generator ran before or beside it (through the shared acceptance statistics and the step's rows).
The defaults (`TOKEN_COST`) were measured for SmolLM2-135M (Q4_1) with `experiments.bench_speculative`: on the
2-core CPU a 5-token verification row took 1.67x a decode step at batch 1 (24 -> 40 ms), rho ~= 0.2 (2026-11-26,
with the AVX512-VNNI kernel on another host: 1.56x, 16.1 -> 25.1 ms, rho ~= 0.16; with its weight prefetch 1.7x,
9.1 -> 15.6 ms, rho ~= 0.2); on an H200 1.09x (5.6 -> 6.1 ms),
rho ~= 0.02. On the AMD EPYC host with the native kernels of 2026-11-27 (later: the folded q4 epilogue, finer attention
tasks; `experiments.ngram_bound --price`) verifications of 2 / 3 / 5 / 9 / 17 tokens cost 1.16 / 1.21 / 1.39 / 1.91 /
2.63 plain steps (5.7-6.2 ms): rho ~= 0.11-0.13 from 3 tokens on, the CPU's default since. On an H200 the same
pricing (2026-11-28) gave 1.05 / 1.06 / 1.09 / 1.10 / 1.24 plain steps (4.1-4.6 ms): rho ~= 0.012-0.024 from 5
tokens on, which the GPU's 0.02 matches. `draft_token_cost=` overrides it.

After `explore_every` gated steps in a row, one step verifies anyway, so that alpha keeps learning after a bad start.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

import jax

# rho = (cost of one more query token) / (fixed cost of a step), per JAX backend; see the module docstring.
TOKEN_COST = {"cpu": 0.12, "gpu": 0.02}
DEFAULT_TOKEN_COST = 0.1  # another backend: between the two


def default_token_cost() -> float:
    return TOKEN_COST.get(jax.default_backend(), DEFAULT_TOKEN_COST)


class DraftGate:
    """Per-step verify-or-not decisions and the acceptance statistics they rest on (see the module docstring).

    `num_draft_tokens` k; `token_cost` rho (None: `default_token_cost()`); `draft_step_cost`: one draft-model step
    in target steps (0 for prompt lookup); `prior_weight`: how many of its own drafts a job needs before its rate
    outweighs the global one; `explore_every`: after that many gated steps in a row, one verifies."""

    def __init__(self, num_draft_tokens: int, token_cost: float | None = None, draft_step_cost: float = 0.0,
                 prior_weight: float = 4.0, explore_every: int = 16):
        self.k = num_draft_tokens
        self.rho = default_token_cost() if token_cost is None else float(token_cost)
        self.draft_step_cost = float(draft_step_cost)
        self.prior_weight = prior_weight
        self.explore_every = explore_every
        self._global: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])  # class -> [accepted, trials]
        self._jobs: dict[Hashable, dict[int, list[int]]] = {}
        self._gated_in_a_row = 0
        self.gated_steps = 0  # steps that could have verified and did not
        self.explored_steps = 0  # steps that verified only to keep learning

    # ------------------------------------------------------------------ the model
    def alpha(self, key: Hashable, cls: int) -> float:
        """The probability that one draft of this job and evidence class is accepted."""
        acc, n = self._global.get(cls, (0, 0))
        prior = (acc + 1) / (n + 2)  # Laplace: 0.5 before any evidence
        jacc, jn = self._jobs.get(key, {}).get(cls, (0, 0))
        return (jacc + self.prior_weight * prior) / (jn + self.prior_weight)

    @staticmethod
    def expected_extra(alpha: float, m: int) -> float:
        """Expected accepted drafts of a row verifying `m` drafts at per-draft acceptance `alpha`."""
        return sum(alpha ** i for i in range(1, m + 1))

    def step_cost(self, rows: int) -> float:
        """A verification step's extra cost over a plain step of `rows` sampling rows, in that step's tokens."""
        r = max(rows, 1)
        return self.k * self.rho * r * r / (1 + self.rho * r) + self.k * self.draft_step_cost * r

    # ------------------------------------------------------------------ decisions and outcomes
    def decide(self, candidates: list[tuple[Hashable, int, int]], rows: int) -> bool:
        """Whether a step of `rows` sampling rows verifies, given its decoding rows' `(job key, evidence class,
        drafts)`."""
        candidates = [c for c in candidates if c[2] > 0]
        if not candidates:
            return False
        gain = sum(self.expected_extra(self.alpha(key, cls), m) for key, cls, m in candidates)
        if gain > self.step_cost(rows):
            self._gated_in_a_row = 0
            return True
        self._gated_in_a_row += 1
        if self._gated_in_a_row > self.explore_every:
            self._gated_in_a_row = 0
            self.explored_steps += 1
            return True
        self.gated_steps += 1
        return False

    def record(self, key: Hashable, cls: int, drafted: int, accepted: int) -> None:
        """A verification row's outcome: `accepted` of `drafted` drafts (a geometric run: `accepted` successes and,
        if it stopped early, one failure)."""
        trials = accepted + (accepted < drafted)
        g = self._global[cls]
        g[0] += accepted
        g[1] += trials
        j = self._jobs.setdefault(key, {}).setdefault(cls, [0, 0])
        j[0] += accepted
        j[1] += trials

    def release(self, key: Hashable) -> None:
        self._jobs.pop(key, None)

    def stats(self) -> dict:
        return {"gated_steps": self.gated_steps, "explored_steps": self.explored_steps,
                "acceptance_by_class": {c: (a / n if n else None) for c, (a, n) in sorted(self._global.items())}}
