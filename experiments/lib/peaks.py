"""The peaks a benchmark's utilisation is measured against, chosen so that no point shows more than 100%.

A peak measured while the machine is busy comes out low (on 2 shared cores, several times too low), and every point
then shows more than 100% of it. So a benchmark gathers candidates and takes the highest:

- measurements in the run (`hardware.measure_peaks`, best of several timings each), before the points and again
  after them (the machine may have been busy at one of the two moments);
- the recorded peak of this device (`experiments/data/peaks.json`, by `device_key`), from an earlier idle run;
- and, where a point's achieved rate still exceeds them all, that rate: the device evidently does at least that
  much, so the peak is raised to it, and the source says which point raised it.

Each peak keeps where it came from (`Peak.source`), so a record says which peak it used and why.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

TABLE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "peaks.json")
METRICS = ("bandwidth_gbps", "matmul_gflops")  # the copy rate (GB/s) and the dense dot rate (GFLOP/s)


@dataclasses.dataclass(frozen=True)
class Peak:
    """One candidate peak: its value (GB/s or GFLOP/s) and where it came from, in words."""

    value: float
    source: str


def device_key(device: Mapping) -> str:
    """The table's key for a device (`experiments.lib.serving.env.device_info()`): an accelerator's device kind
    ("NVIDIA H100 80GB HBM3"); on the CPU the processor's model and the CPUs this process may use (the copy rate and
    dot rate of XLA:CPU scale with its threads)."""
    if device.get("backend", "cpu") != "cpu":
        return str(device["device_kind"])
    return f"cpu: {device.get('cpu_model') or 'unknown'}, {device.get('cpus_usable')} CPUs"


def load_table(path: str = TABLE_PATH) -> dict:
    """The recorded peaks: {device key: {metric: {"value", "date", "source", ...}}}; empty without a file."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)["devices"]


def recorded_peaks(table: Mapping, key: str, matmul_dtype: str | None = None) -> dict[str, Peak]:
    """The recorded peaks of device `key` as `Peak`s (none for an unknown device). A recorded dot rate of another
    dtype than `matmul_dtype` (the one measured here) is left out: it is another peak."""
    out = {}
    for metric, entry in table.get(key, {}).items():
        if metric not in METRICS:
            continue
        if metric == "matmul_gflops" and matmul_dtype and entry.get("dtype", matmul_dtype) != matmul_dtype:
            continue
        out[metric] = Peak(float(entry["value"]), f"recorded for {key} on {entry.get('date', '?')} "
                                                  f"({entry.get('source', 'experiments/data/peaks.json')})")
    return out


def pick_peak(candidates: Sequence[Peak | None]) -> Peak:
    """The highest candidate (the first of equal ones); None entries (nothing recorded) are skipped."""
    present = [c for c in candidates if c is not None]
    if not present:
        raise ValueError("pick_peak needs at least one candidate peak")
    best = present[0]
    for c in present[1:]:
        if c.value > best.value:
            best = c
    return best


def raise_to_achieved(peak: Peak, achieved: Mapping[str, float]) -> Peak:
    """`peak`, or the highest achieved rate (point label -> rate) where that exceeds it: the device did that much,
    so no point is above 100% of the peak used."""
    if not achieved:
        return peak
    label = max(achieved, key=lambda k: achieved[k])
    rate = achieved[label]
    if rate <= peak.value:
        return peak
    return Peak(rate, f"raised to the rate achieved by {label} (above every measured and recorded peak: the best "
                      f"of them was {peak.value:.4g}, {peak.source})")


def utilisation(rate: float, peak: Peak) -> float:
    """`rate` as a fraction of `peak`; never above 1 once the peak has been through `raise_to_achieved`."""
    frac = rate / peak.value
    if frac > 1.0 + 1e-12:
        raise ValueError(f"rate {rate} is above the peak {peak.value} ({peak.source}): raise_to_achieved first")
    return min(frac, 1.0)


def choose_peaks(measured: Sequence[Mapping[str, Peak]], recorded: Mapping[str, Peak],
                 achieved: Mapping[str, Mapping[str, float]]) -> dict[str, Peak]:
    """Per metric: the highest of the measurements (`measured`: one {metric: Peak} per moment) and the recorded
    peak, raised to the highest achieved rate (`achieved`: metric -> point label -> rate) where that is higher."""
    out = {}
    for metric in METRICS:
        best = pick_peak([m.get(metric) for m in measured] + [recorded.get(metric)])
        out[metric] = raise_to_achieved(best, achieved.get(metric, {}))
    return out


def measured_peaks(peaks: Mapping, when: str) -> dict[str, Peak]:
    """`hardware.measure_peaks()`'s answer as `Peak`s, the source naming the moment (`when`) and the method."""
    return {"bandwidth_gbps": Peak(peaks["bandwidth_gbps"], f"measured {when}: {peaks['bandwidth']['method']}"),
            "matmul_gflops": Peak(peaks["matmul_gflops"], f"measured {when}: {peaks['matmul']['method']}")}


def updated_table(table: Mapping, key: str, measured: Mapping[str, Peak], *, date: str, source: str,
                  matmul_dtype: str) -> tuple[dict, list[str]]:
    """`table` with device `key`'s entries replaced by the `measured` peaks that exceed them (only measured ones:
    a peak raised to a point's rate is not a measurement of the peak); and the metrics that changed."""
    out = {k: dict(v) for k, v in table.items()}
    entry = out.setdefault(key, {})
    changed = []
    for metric, peak in measured.items():
        old = recorded_peaks(out, key, matmul_dtype).get(metric)
        if old is None or peak.value > old.value:
            entry[metric] = {"value": round(peak.value, 3), "date": date, "source": source, "method": peak.source}
            if metric == "matmul_gflops":
                entry[metric]["dtype"] = matmul_dtype
            changed.append(metric)
    return out, changed


def write_table(table: Mapping, path: str = TABLE_PATH) -> None:
    notes = ("Peaks per device (experiments/lib/peaks.py): the highest copy rate (GB/s, jit(a * 1.0001): read + "
             "write) and dense dot rate (GFLOP/s; float32 on the CPU, bfloat16 on a GPU) measured on an idle "
             "machine. Benchmarks take the higher of these and their own measurements. Add or raise an entry with "
             "python -m experiments.bench_kernels --record_peaks on an idle machine.")
    with open(path, "w") as f:
        json.dump({"notes": notes, "devices": table}, f, indent=1, sort_keys=True)
        f.write("\n")
