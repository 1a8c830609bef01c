"""Write a synthetic request trace, for when no real one is at hand (docs/traces.md).

    python -m experiments.make_trace --num_requests 1000 --rate 2 --burstiness 0.3 --input_len 256 \\
        --output_len 64 --range_ratio 0.5 --seed 0 --out experiments/data/traces/bursty_example.csv

Arrival times are the serving workloads' gamma process (`workloads.arrival_times`: mean rate `--rate`, shape
`--burstiness`, 1 = Poisson, < 1 burstier), rounded to the microsecond; prompt and output lengths are uniform within
+-range_ratio of `--input_len` / `--output_len`. With `--num_prefixes N --prefix_len L` each row gets one of N prefix
ids (`p0`, `p1`, ...) and a prompt of L shared tokens plus a ~input_len suffix; `--priority_levels K > 1` gives each
row a priority in [0, K); `--deadline_s D` gives each a deadline D seconds after its arrival. All seeded by `--seed`.

The file is the native CSV (or JSONL when `--out` ends with `.jsonl`) that `traces.read_trace` reads back to the same
rows (checked after writing). `--layout azure` / `burstgpt` writes the same requests in the Azure LLM inference /
BurstGPT layout instead (their optional fields dropped; `--failed_requests` adds BurstGPT's failed rows with 0
response tokens), to try those readers.

The flags are defined only when this runs as a script: several of their names (--rate, --seed, --input_len, ...) are
the serving benchmarks' flags with other defaults, and `make_rows` is importable without them.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from absl import app, flags

from experiments.lib.serving.traces import TraceRow, read_trace, write_trace
from experiments.lib.serving.workloads import arrival_times, sample_lengths

FLAGS = flags.FLAGS


def make_rows(num_requests: int, rate: float, *, burstiness: float = 1.0, input_len: int = 256, output_len: int = 64,
              range_ratio: float = 0.0, seed: int = 0, num_prefixes: int = 0, prefix_len: int = 0,
              priority_levels: int = 1, deadline_s: float | None = None) -> list[TraceRow]:
    """`num_requests` synthetic trace rows (the module docstring); a pure function of the arguments."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if num_prefixes < 0 or (num_prefixes > 0 and prefix_len < 1):
        raise ValueError(f"prefixes need num_prefixes >= 1 and prefix_len >= 1, got {num_prefixes}, {prefix_len}")
    if priority_levels < 1:
        raise ValueError(f"priority_levels must be >= 1, got {priority_levels}")
    if deadline_s is not None and not (deadline_s > 0 and math.isfinite(deadline_s)):
        raise ValueError(f"deadline_s must be a finite number > 0, got {deadline_s}")
    arrivals = np.round(arrival_times(num_requests, rate, burstiness, seed), 6)
    rng = np.random.default_rng([seed, 3])  # independent of the arrival stream
    ins = sample_lengths(rng, input_len, range_ratio, num_requests)
    outs = sample_lengths(rng, output_len, range_ratio, num_requests)
    which = rng.integers(0, max(num_prefixes, 1), size=num_requests)
    prio = rng.integers(0, priority_levels, size=num_requests)
    rows = []
    for t, n, o, k, p in zip(arrivals, ins, outs, which, prio):
        shared = prefix_len if num_prefixes else 0
        rows.append(TraceRow(float(t), shared + int(n), int(o), priority=int(p) if priority_levels > 1 else None,
                             deadline_s=deadline_s, prefix_id=f"p{k}" if num_prefixes else None,
                             prefix_len=shared or None))
    return rows


def define_flags() -> None:
    from experiments.lib.common import check_out_flag

    flags.DEFINE_integer("num_requests", 1000, "rows to write")
    flags.DEFINE_float("rate", 2.0, "mean arrivals per second")
    flags.DEFINE_float("burstiness", 1.0, "gamma shape of the inter-arrival times (1 = Poisson, < 1 burstier)")
    flags.DEFINE_integer("input_len", 256, "prompt tokens (with prefixes: the suffix after the shared prefix)")
    flags.DEFINE_integer("output_len", 64, "output tokens")
    flags.DEFINE_float("range_ratio", 0.0, "lengths uniform in [len*(1-r), len*(1+r)]")
    flags.DEFINE_integer("seed", 0, "seed of the arrivals and lengths")
    flags.DEFINE_integer("num_prefixes", 0, "rows get one of this many prefix ids (0: none)")
    flags.DEFINE_integer("prefix_len", 128, "with --num_prefixes: tokens of the shared prefix")
    flags.DEFINE_integer("priority_levels", 1, "> 1: each row gets a priority in [0, levels)")
    flags.DEFINE_float("deadline_s", None, "each row's deadline, seconds after its arrival (default: none)")
    flags.DEFINE_enum("layout", "native", ["native", "azure", "burstgpt"], "file layout (native: CSV, or JSONL for "
                      "an --out ending in .jsonl)")
    flags.DEFINE_integer("failed_requests", 0, "burstgpt: also write this many failed rows (0 response tokens)")
    flags.DEFINE_string("start", "2024-01-01 00:00:00", "azure: the first row's TIMESTAMP")
    flags.DEFINE_string("out", None, "where to write the trace", required=True)
    check_out_flag("out")


def main(argv) -> None:
    del argv
    try:
        rows = make_rows(FLAGS.num_requests, FLAGS.rate, burstiness=FLAGS.burstiness, input_len=FLAGS.input_len,
                         output_len=FLAGS.output_len, range_ratio=FLAGS.range_ratio, seed=FLAGS.seed,
                         num_prefixes=FLAGS.num_prefixes, prefix_len=FLAGS.prefix_len,
                         priority_levels=FLAGS.priority_levels, deadline_s=FLAGS.deadline_s)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if FLAGS.failed_requests < 0:
        raise app.UsageError(f"--failed_requests must be >= 0, got {FLAGS.failed_requests}")
    if FLAGS.failed_requests and FLAGS.layout != "burstgpt":
        raise app.UsageError("--failed_requests is for --layout=burstgpt")
    if FLAGS.layout == "azure":  # (checked before --out is opened: a bad one had left it truncated)
        import datetime

        try:
            datetime.datetime.fromisoformat(FLAGS.start)
        except ValueError as e:
            raise app.UsageError(f"--start={FLAGS.start!r} is not a date and time like 2024-01-01 00:00:00 ({e})") \
                from None
    failed = np.random.default_rng([FLAGS.seed, 4]).choice(len(rows), size=min(FLAGS.failed_requests, len(rows)),
                                                           replace=False)
    write_trace(FLAGS.out, rows, layout=FLAGS.layout, start=FLAGS.start, failed_at=failed.tolist())
    back = read_trace(FLAGS.out)
    if FLAGS.layout == "native" and back.rows != rows:
        raise SystemExit(f"{FLAGS.out} does not read back to the rows written (a bug in make_trace or read_trace)")
    print(f"wrote {len(rows)} requests to {FLAGS.out} ({FLAGS.layout}): mean rate {back.mean_rate:.3g} req/s over "
          f"{back.span_s:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    app.run(main)
