"""`vllm`: vLLM's default scheduler: FCFS admission, KV pages allocated on demand as tokens are written, and when
none is left the latest-arriving running job is preempted by recompute (its pages freed, it goes back to the front
of the waiting queue and re-runs its prompt and generated tokens, mostly from the prefix cache).

Source: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP
2023), section 4.5; vllm/core/scheduler.py (`_preempt`, `PreemptionMode.RECOMPUTE`) and the v1 scheduler."""

from __future__ import annotations

from paged.policies.base import Policy


class VLLMPolicy(Policy):
    name = "vllm"
    allocation = "on_demand"
