"""`sarathi`: stall-free batching. Every step runs all decode rows first; prefill chunks only fill what is left of
a per-step token budget, so a long prompt never stalls the running decodes for a whole chunk. FCFS admission, pages
on demand, latest arrival preempted (the vLLM mechanism it was built on).

Source: Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve" (OSDI 2024),
section 4.1 (stall-free batching, token budget)."""

from __future__ import annotations

from paged.errors import InvalidConfigError
from paged.policies.base import Policy, SchedulerView


class SarathiPolicy(Policy):
    name = "sarathi"
    allocation = "on_demand"

    def __init__(self, token_budget: int | None = None):
        """`token_budget`: tokens per step, decode rows included (default: the engine's max_chunk_size)."""
        if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                         or token_budget < 1):
            raise InvalidConfigError(f"SarathiPolicy: token_budget must be None or an int >= 1, got {token_budget!r}")
        self.token_budget = token_budget

    def prefill_budget(self, decode_rows: int, s: SchedulerView) -> int:
        budget = self.token_budget if self.token_budget is not None else s.config.max_chunk_size
        return max(0, min(budget, s.config.max_chunk_size) - decode_rows)
