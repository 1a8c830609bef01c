"""`fcfs`: strict first-come-first-served admission; pages reserved up front; never preempts.

Source: the textbook baseline (and vLLM's default admission order). A job that does not fit blocks every later job
(head-of-line blocking), which is what `exllamav2`'s skip-ahead relaxes."""

from __future__ import annotations

from paged.policies.base import Policy


class FCFSPolicy(Policy):
    name = "fcfs"
