"""Scheduling policies: moved to the `paged.policies` package (one file per policy); this module re-exports it."""

from paged.policies import (
    ALLOCATIONS,
    POLICIES,
    ExLlamaV2Policy,
    FCFSPolicy,
    LongestPrefixMatch,
    Policy,
    PriorityPolicy,
    SarathiPolicy,
    SchedulerView,
    ShortestJobFirst,
    ShortestPromptFirst,
    VLLMPolicy,
    make_policy,
    policy_names,
    register_policy,
)

__all__ = ["ALLOCATIONS", "POLICIES", "ExLlamaV2Policy", "FCFSPolicy", "LongestPrefixMatch", "Policy",
           "PriorityPolicy", "SarathiPolicy", "SchedulerView", "ShortestJobFirst", "ShortestPromptFirst",
           "VLLMPolicy", "make_policy", "policy_names", "register_policy"]
