"""Plots of serving runs (matplotlib, Agg backend): latency CDFs, latency and goodput against offered load,
concurrency sweeps and per-policy bars."""

from __future__ import annotations

import math
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


STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "v", "D", "P", "X", "*"]


def style(i: int) -> dict:
    """Line style number i: colour, dash pattern and marker all vary, so policies with equal curves stay visible
    (later lines are drawn thinner over the earlier ones)."""
    return {"color": f"C{i % 10}", "linestyle": STYLES[i % len(STYLES)], "marker": MARKERS[i % len(MARKERS)],
            "linewidth": max(2.6 - 0.3 * i, 1.0)}


def positive_cdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of `values` at its positive values, sorted (what a log axis can draw): y counts every value,
    so the curve starts at the fraction of zeros and each y is the fraction of all values <= x."""
    every = np.sort(np.asarray(values, dtype=np.float64))
    x = every[every > 0]
    return x, (every.size - x.size + np.arange(1, x.size + 1)) / max(every.size, 1)


def plot_latency_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], path: str, title: str = "") -> str:
    """One panel per latency (TTFT, TPOT, ITL, E2EL), one empirical CDF line per (label, records) run; time axes in
    seconds on a log scale (an overloaded run spans milliseconds to minutes), distinct line styles."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, LATENCIES):
        for i, (label, records) in enumerate(runs):
            x, y = positive_cdf(latencies(records)[name])
            if x.size:
                st = style(i)
                ax.step(x, y, where="post", label=label, color=st["color"], linestyle=st["linestyle"],
                        linewidth=st["linewidth"])
        ax.set_title(TITLES[name])
        ax.set_xlabel("seconds (log)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
        if ax.has_data():
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(plt.NullFormatter())  # (minor labels crowd a short log range)
            ax.legend(fontsize="small", loc="lower right")
    return _save(plt, fig, path, title)


def plot_load_curves(series: Sequence[tuple[str, Sequence[dict], float | None]], slo: dict[str, float], path: str,
                     title: str = "") -> str:
    """Latency against offered load, one line per (policy, its rows by rate, its capacity or None): TTFT, TPOT and
    E2EL p50 (solid markers) and p99 (hollow), queue time p50, in seconds on log axes, with the SLO as a horizontal
    line; goodput and SLO attainment against load; each policy's capacity as a vertical dashed line in its colour."""
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("e2el", "E2EL (s)"), ("queue", "queue time p50 (s)"),
              ("goodput", "goodput (requests/s meeting the SLO)"), ("attainment", "SLO attainment")]
    # an offered load of inf (every request at once) has no place on a load axis: the finite rates are drawn (the
    # record and the CDF plot keep it)
    series = [(name, [r for r in rows if math.isfinite(r["rate"])], cap) for name, rows, cap in series]
    rates = sorted({r["rate"] for _, rows, _ in series for r in rows})
    for ax, (key, label) in zip(axes.flat, panels):
        for i, (name, rows, cap) in enumerate(series):
            st = style(i)
            rows = sorted(rows, key=lambda r: r["rate"])
            x = [r["rate"] for r in rows]
            kw = dict(color=st["color"], linestyle=st["linestyle"], marker=st["marker"], linewidth=st["linewidth"])
            if key in ("ttft", "tpot", "e2el"):
                for pct, fill in (("p50", True), ("p99", False)):
                    pts = [(a, r[f"{key}_{pct}_ms"] / 1e3) for a, r in zip(x, rows) if r.get(f"{key}_{pct}_ms")]
                    if pts:
                        ax.plot(*zip(*pts), label=f"{name} {pct}", **kw,
                                markerfacecolor=st["color"] if fill else "none", alpha=1.0 if fill else 0.6)
            else:
                src = {"queue": "queue_p50_ms", "goodput": "goodput", "attainment": "attainment"}[key]
                scale = 1e-3 if key == "queue" else 1.0
                pts = [(a, r[src] * scale) for a, r in zip(x, rows) if r.get(src) is not None]
                if key == "queue":
                    pts = [p for p in pts if p[1] > 0]
                if pts:
                    ax.plot(*zip(*pts), label=name, **kw)
            if cap is not None:
                ax.axvline(cap, color=st["color"], linestyle="--", linewidth=1, alpha=0.7)
        if key in slo:
            ax.axhline(slo[key] / 1e3, color="k", linestyle=":", linewidth=1, label=f"SLO {slo[key]:g} ms")
        ax.set_title(label)
        ax.set_xlabel("offered load (requests/s)")
        if len(rates) > 1 and rates[-1] / rates[0] > 4:
            ax.set_xscale("log")
            ax.minorticks_off()
        pos = np.log(rates) if ax.get_xscale() == "log" else np.asarray(rates, float)
        spaced = len(rates) < 2 or np.diff(pos).min() > 0.05 * (pos[-1] - pos[0])  # labels that do not overlap
        if len(rates) <= 12 and spaced:  # (a capacity search's close rates keep matplotlib's own ticks)
            ax.set_xticks(rates, [f"{r:.3g}" for r in rates])
        if key in ("ttft", "tpot", "e2el", "queue") and ax.has_data():
            ax.set_yscale("log")
            low, high = ax.get_ylim()
            if high / low < 10:  # within one decade a log axis has no major tick: label the minor ones instead
                ax.yaxis.set_minor_formatter(plt.FormatStrFormatter("%.3g"))
            else:
                ax.yaxis.set_minor_formatter(plt.NullFormatter())
        if key == "attainment":
            ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3, which="both")
        if ax.has_data():
            ax.legend(fontsize="x-small", loc="best")
    return _save(plt, fig, path, title + " (dashed verticals: capacity)")


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
