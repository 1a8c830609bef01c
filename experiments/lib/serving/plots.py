"""Plots of serving runs (matplotlib, Agg backend): latency CDFs and concurrency sweeps."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from experiments.lib.serving.metrics import LATENCIES, RequestRecord, latencies

TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str, title: str) -> str:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_latency_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], path: str, title: str = "") -> str:
    """One panel per latency (TTFT, TPOT, ITL, E2EL), one empirical CDF line per (label, records) run."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, LATENCIES):
        for label, records in runs:
            v = np.sort(np.asarray(latencies(records)[name]) * 1e3)
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
        ax.set_title(TITLES[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small", loc="lower right")
    return _save(plt, fig, path, title)


def plot_sweep(points: Sequence[tuple[float, float, float | None]], path: str, title: str = "",
               xlabel: str = "max concurrency") -> str:
    """(x, output tok/s, median TPOT ms) points: throughput and median TPOT against x."""
    plt = _plt()
    pts = sorted(points)
    x = [p[0] for p in pts]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(x, [p[1] for p in pts], "o-")
    a1.set_ylabel("output tokens / s")
    a2.plot([p[0] for p in pts if p[2] is not None], [p[2] for p in pts if p[2] is not None], "o-", color="C1")
    a2.set_ylabel("median TPOT (ms)")
    for ax in (a1, a2):
        ax.set_xlabel(xlabel)
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    return _save(plt, fig, path, title)


def plot_policy_bars(rows: Sequence[dict], path: str, title: str = "") -> str:
    """One bar per policy in each panel: TTFT p50 / p99, E2EL p50, output throughput, preemptions, mean page
    utilisation (`rows`: compare_policies' summary rows)."""
    plt = _plt()
    panels = [("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"), ("e2el_p50_ms", "E2EL p50 (ms)"),
              ("output_tok_s", "output tokens / s"), ("preemptions", "preemptions"),
              ("page_util", "mean page utilisation")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    names = [r["policy"] for r in rows]
    for ax, (key, label) in zip(axes.flat, panels):
        vals = [r.get(key) or 0.0 for r in rows]
        ax.bar(range(len(names)), vals, color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize="small")
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path, title)
