"""Scheduling policies (decisions only; the mechanism is `paged.host.scheduler`). See `base.py` for the hooks.

| name | admission order | pages | preempts | source |
|---|---|---|---|---|
| `exllamav2` (default) | FIFO, skip-ahead up to `max_skips` | reserve | never | ExLlamaV2 |
| `fcfs` | strict FIFO | reserve | never | baseline |
| `sjf` | shortest expected output, else shortest prompt | reserve | never | SJF/SRPT serving papers |
| `shortest_prompt_first` | shortest prompt | reserve | never | |
| `priority` | highest `priority`, then arrival | on_demand | lower priority, latest | vLLM priority |
| `vllm` | strict FIFO | on_demand | latest arrival | vLLM |
| `lpm` | longest cached prefix + aging | reserve | never | SGLang |
| `sarathi` | strict FIFO; decodes first, prefill fills a token budget | on_demand | latest arrival | Sarathi-Serve |

`make_policy(spec)` takes a registered name, `"module:Class"` (any importable subclass of `Policy`, built with no
arguments), a `Policy` subclass or an instance. `register_policy(cls)` adds a name.
"""

from __future__ import annotations

import importlib

from paged.errors import InvalidConfigError, InvalidConfigTypeError
from paged.policies.base import ALLOCATIONS, Policy, SchedulerView
from paged.policies.exllamav2 import ExLlamaV2Policy
from paged.policies.fcfs import FCFSPolicy
from paged.policies.lpm import LongestPrefixMatch
from paged.policies.priority import PriorityPolicy
from paged.policies.sarathi import SarathiPolicy
from paged.policies.sjf import ShortestJobFirst, ShortestPromptFirst
from paged.policies.vllm import VLLMPolicy
from paged.policies.waiting import QueueSnapshot

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (
    ExLlamaV2Policy, FCFSPolicy, ShortestJobFirst, ShortestPromptFirst, PriorityPolicy, VLLMPolicy,
    LongestPrefixMatch, SarathiPolicy)}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Make `cls` available by `cls.name` (usable as a decorator). A name already taken by another class is an
    error."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise InvalidConfigTypeError(f"register_policy: expected a subclass of paged.policies.Policy, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name or ":" in cls.name:
        raise InvalidConfigError(f"register_policy: {cls.__name__}.name must be a non-empty string without ':', "
                                 f"got {cls.name!r}")
    if POLICIES.get(cls.name, cls) is not cls:
        raise InvalidConfigError(f"register_policy: the name {cls.name!r} is taken by {POLICIES[cls.name].__name__}; "
                                 "give your policy another `name`")
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> str:
    return ", ".join(sorted(POLICIES))


def _load(spec: str) -> type[Policy]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidConfigError(f"policy {spec!r}: write a user policy as 'module:Class' (e.g. "
                                 "'my_policies:EarliestDeadlineFirst')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidConfigError(f"policy {spec!r}: cannot import module {module_name!r} ({e}); put it on "
                                 "PYTHONPATH or run from its directory") from e
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise InvalidConfigError(f"policy {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        raise InvalidConfigTypeError(f"policy {spec!r} is {obj!r}, not a subclass of paged.policies.Policy")
    return obj


def _construct(cls: type[Policy], spec: str) -> Policy:
    """`cls()`, with whatever its constructor raises turned into an `InvalidConfigError` naming the policy."""
    try:
        return cls()
    except Exception as e:  # noqa: BLE001 (a user policy's constructor: named, the cause chained)
        raise InvalidConfigError(f"policy {spec!r}: constructing {cls.__name__}() raised {type(e).__name__}: {e} "
                                 "(a policy is built with no arguments: give its parameters defaults)") from e


def make_policy(policy: str | Policy | type[Policy], allocation: str | None = None) -> Policy:
    """A policy instance from a name, `"module:Class"`, a class or an instance; `allocation` ("reserve" or
    "on_demand") overrides the policy's page allocation mode."""
    if isinstance(policy, Policy):
        obj = policy
    elif isinstance(policy, type) and issubclass(policy, Policy):
        obj = _construct(policy, policy.__name__)
    elif isinstance(policy, str):
        if ":" in policy:
            obj = _construct(_load(policy), policy)
        elif policy in POLICIES:
            obj = _construct(POLICIES[policy], policy)
        else:
            raise InvalidConfigError(f"unknown policy {policy!r}; available: {policy_names()}, or 'module:Class' "
                                     "for your own subclass of paged.policies.Policy")
    else:
        raise InvalidConfigTypeError(f"policy must be a name ({policy_names()}), 'module:Class', or a "
                                     f"paged.policies.Policy subclass or instance, got {type(policy).__name__}")
    if allocation is not None:
        obj.allocation = allocation
    if obj.allocation not in ALLOCATIONS:
        raise InvalidConfigError(f"policy {obj.name!r}: allocation must be one of {ALLOCATIONS}, got "
                                 f"{obj.allocation!r}")
    return obj


__all__ = ["ALLOCATIONS", "POLICIES", "ExLlamaV2Policy", "FCFSPolicy", "LongestPrefixMatch", "Policy",
           "PriorityPolicy", "QueueSnapshot", "SarathiPolicy", "SchedulerView", "ShortestJobFirst",
           "ShortestPromptFirst", "VLLMPolicy", "make_policy", "policy_names", "register_policy"]
