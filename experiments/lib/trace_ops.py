"""Where a jitted program's time goes, operation by operation, from a `jax.profiler` trace: the CPU runtime records
each executed thunk (a fusion, a custom call such as the native matmul or paged attention, a copy, a loop) as an
event carrying its HLO module and operation name. `experiments.profile_speculative --ops` uses these helpers to
break each part of a speculative step down by operation."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re


def leaf_times(events: list[dict]) -> dict[str, float]:
    """Microseconds per operation name over one program execution's trace events, counting only the events that
    contain no other (a loop or a conditional counts as what ran inside it)."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    out: dict[str, float] = collections.defaultdict(float)
    for i, e in enumerate(events):
        end = e["ts"] + e["dur"]
        nxt = events[i + 1] if i + 1 < len(events) else None
        if nxt is not None and nxt["ts"] < end and nxt["ts"] + nxt["dur"] <= end:
            continue  # it holds the next event: a container
        out[e["name"]] += e["dur"]
    return out


def hlo_labels(hlo_text: str) -> dict[str, str]:
    """Operation name -> "target -> result type" for the custom calls of a compiled HLO module's text."""
    labels = {}
    for m in re.finditer(r"%?([\w.\-]+) = (\S+(?: \S+)*?) custom-call\(.*?custom_call_target=\"([^\"]+)\"", hlo_text):
        labels[m.group(1)] = f"{m.group(3)} -> {m.group(2)}"
    return labels


def op_breakdown(trace_dir: str, calls: list) -> dict:
    """Per part (as `experiments.profile_speculative.wrap_parts` names it; `calls` holds (part, detail, the jitted
    function, its args, its kwargs) in call order): milliseconds per call of each XLA operation its program ran,
    from the `jax.profiler` trace in `trace_dir` of exactly those calls. A part's executions are the trace's runs of
    the module `jit_<part>`, in time order, matched one to one with its calls; each operation is labelled
    (`hlo_labels`) from the HLO of the part compiled again for the first of its calls whose
    arguments `calls` holds (None elsewhere)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    runs: dict = collections.defaultdict(list)
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_module" in a and "run_id" in a:
            runs[(a["hlo_module"], a["run_id"])].append(e)
    by_module: dict = collections.defaultdict(list)
    for (module, _), evs in runs.items():
        by_module[module].append(evs)
    for execs in by_module.values():
        execs.sort(key=lambda evs: min(e["ts"] for e in evs))
    seen: dict = collections.defaultdict(int)
    totals: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    counts: dict = collections.Counter()
    labels: dict = {}
    for name, detail, fn, a, k in calls:
        execs = by_module.get(f"jit_{name}", [])
        i = seen[name]
        seen[name] += 1
        if i >= len(execs):
            continue
        key = f"{name} ({detail})" if detail else name
        counts[key] += 1
        for op, us in leaf_times(execs[i]).items():
            totals[key][op] += us
        if key not in labels and a is not None:
            try:
                labels[key] = hlo_labels(fn.lower(*a, **k).compile().as_text())
            except Exception:  # noqa: BLE001 (labels are a convenience)
                labels[key] = {}
    out = {}
    for key, ops in totals.items():
        n = counts[key]
        rows = sorted(ops.items(), key=lambda kv: -kv[1])
        names = labels.get(key, {})
        out[key] = {"calls": n, "ops": [{"op": op, "label": names.get(op, ""), "ms_per_call": us / n / 1e3}
                                        for op, us in rows]}
    return out
