"""Request traces read from files: when each request arrived and how many prompt and output tokens it had.

`read_trace(path)` returns a `Trace` of `TraceRow`s from one of three layouts, detected from the header (CSV) or the
first object (JSONL), or named with `format=`:

- `native` CSV or JSONL: `arrival_s, prompt_tokens, output_tokens` and, optionally, `priority` (int), `deadline_s`
  (seconds after arrival, > 0), `prefix_id` (str or int: rows with the same id share a prompt prefix) and
  `prefix_len` (tokens of that shared prefix, <= prompt_tokens; needs a prefix_id). Empty CSV cells and JSON nulls
  mean "absent"; any other key is an error;
- `azure`: the public Azure LLM inference traces (2023, 2024), CSV `TIMESTAMP,ContextTokens,GeneratedTokens` with
  datetime stamps such as `2023-11-16 18:15:46.6805900` (100 ns digits; an optional UTC offset). A row with 0
  generated tokens cannot be replayed with an exact output length: it is skipped and counted in `Trace.num_skipped`;
- `burstgpt`: BurstGPT's CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type` (Timestamp in
  seconds). A row with 0 response tokens is a failed request in BurstGPT: it is skipped and counted in
  `Trace.num_skipped`.

Arrival times are seconds from the earliest row (so the first request arrives at 0), divided by `speedup`. Rows out
of arrival order are sorted stably and `Trace.was_sorted` says so. Every bad line raises `TraceError` naming
`file:line` and what to fix. `write_trace` writes rows in any of the layouts (experiments/make_trace.py uses it).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import difflib
import io
import json
import math
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np

FORMATS = ("auto", "native", "azure", "burstgpt")
NATIVE_REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens")
NATIVE_OPTIONAL = ("priority", "deadline_s", "prefix_id", "prefix_len")
NATIVE_COLUMNS = NATIVE_REQUIRED + NATIVE_OPTIONAL
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
_BURSTGPT_USED = ("Timestamp", "Request tokens", "Response tokens")
_LAYOUTS = (f"a native trace ({','.join(NATIVE_REQUIRED)}[,{','.join(NATIVE_OPTIONAL)}], CSV or JSONL), "
            f"an Azure LLM inference trace ({','.join(AZURE_COLUMNS)}) or a BurstGPT trace "
            f"({','.join(BURSTGPT_COLUMNS)})")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names `file:line` and what to fix."""


class _Bad(ValueError):
    """A bad field; the reader adds `file:line`."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float  # seconds after the first request (already divided by the speedup)
    prompt_tokens: int
    output_tokens: int
    priority: int | None = None
    deadline_s: float | None = None  # seconds after arrival
    prefix_id: str | int | None = None  # rows with the same id start with the same prefix_len tokens
    prefix_len: int | None = None


@dataclasses.dataclass
class Trace:
    rows: list[TraceRow]
    path: str
    format: str  # "native", "azure" or "burstgpt"
    syntax: str = "csv"  # "csv" or "jsonl"
    speedup: float = 1.0
    num_skipped: int = 0  # rows with no output (BurstGPT's failures, Azure's 0 GeneratedTokens), not in `rows`
    was_sorted: bool = False  # the file's rows were out of arrival order and have been sorted (stably)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def arrivals(self) -> np.ndarray:
        return np.fromiter((r.arrival_s for r in self.rows), dtype=np.float64, count=len(self.rows))

    @property
    def span_s(self) -> float:
        return self.rows[-1].arrival_s - self.rows[0].arrival_s if self.rows else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the span: (rows - 1) / (last arrival - first); inf when the span is 0."""
        span = self.span_s
        return (len(self.rows) - 1) / span if span > 0 else math.inf

    def describe(self) -> dict:
        """JSON-able summary of the file and its rows."""
        d = {"path": self.path, "format": self.format, "syntax": self.syntax, "rows": len(self.rows),
             "span_s": self.span_s, "mean_rate": self.mean_rate, "speedup": self.speedup,
             "num_skipped": self.num_skipped, "was_sorted": self.was_sorted,
             "rows_with_priority": sum(r.priority is not None for r in self.rows),
             "rows_with_deadline": sum(r.deadline_s is not None for r in self.rows),
             "prefix_ids": len({r.prefix_id for r in self.rows if r.prefix_id is not None})}
        if self.was_sorted:
            d["note"] = "the file's rows were not in arrival order; they were sorted stably by arrival time"
        if self.num_skipped:
            d["skipped_note"] = "BurstGPT rows with 0 response tokens (failed requests) were skipped"
        return d


# ------------------------------------------------------------------------------------------------ fields
def _int(v, name: str, minimum: int | None = None) -> int:
    if isinstance(v, bool):
        raise _Bad(f"{name} must be an integer, got {v!r}")
    if isinstance(v, int):
        n = v
    else:
        try:
            n = int(v)
        except (TypeError, ValueError):
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise _Bad(f"{name} must be an integer, got {v!r}") from None
            if not f.is_integer():
                raise _Bad(f"{name} must be an integer, got {v!r}") from None
            n = int(f)
    if minimum is not None and n < minimum:
        raise _Bad(f"{name} must be >= {minimum}, got {n}")
    return n


def _float(v, name: str) -> float:
    if isinstance(v, bool):
        raise _Bad(f"{name} must be a number, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise _Bad(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f):
        raise _Bad(f"{name} must be a finite number, got {v!r}")
    return f


def _native_row(d: dict) -> TraceRow:
    """A native row from {column: value} (values: CSV strings or JSON values; absent / None: not given)."""
    for k in NATIVE_REQUIRED:
        if d.get(k) is None:
            raise _Bad(f"{k} is missing; every row needs {', '.join(NATIVE_REQUIRED)}")
    t = _float(d["arrival_s"], "arrival_s")
    if t < 0:
        raise _Bad(f"arrival_s must be >= 0, got {t}")
    p = _int(d["prompt_tokens"], "prompt_tokens", 1)
    o = _int(d["output_tokens"], "output_tokens", 1)
    prio = d.get("priority")
    prio = None if prio is None else _int(prio, "priority")
    dl = d.get("deadline_s")
    if dl is not None:
        dl = _float(dl, "deadline_s")
        if dl <= 0:
            raise _Bad(f"deadline_s (seconds after arrival) must be > 0, got {dl}")
    pid = d.get("prefix_id")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
        raise _Bad(f"prefix_id must be a string or an integer, got {pid!r}")
    plen = d.get("prefix_len")
    if plen is not None:
        plen = _int(plen, "prefix_len", 1)
        if pid is None:
            raise _Bad("prefix_len is given without a prefix_id; add the prefix_id or drop the prefix_len")
        if plen > p:
            raise _Bad(f"prefix_len {plen} is larger than prompt_tokens {p}; the shared prefix is part of the prompt")
    return TraceRow(t, p, o, prio, dl, pid, plen)


_AZURE_TS = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?\s*(Z|[+-]\d\d:?\d\d)?")
_EPOCH = datetime.datetime(1970, 1, 1)


def _azure_time(s: str) -> tuple[int, float]:
    """`2023-11-16 18:15:46.6805900` -> (whole seconds since 1970 in UTC, fraction): Python's datetime keeps only
    6 fractional digits, so the fraction (up to 9 digits) is read apart; an optional `Z` / `+hh:mm` is honoured."""
    m = _AZURE_TS.fullmatch(s.strip())
    if m is None:
        raise _Bad(f"TIMESTAMP must look like 2023-11-16 18:15:46.6805900, got {s!r}")
    base, frac, tz = m.groups()
    try:
        secs = int((datetime.datetime.fromisoformat(base) - _EPOCH).total_seconds())
    except ValueError as e:
        raise _Bad(f"TIMESTAMP {s!r} is not a valid date and time ({e})") from None
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        hh, mm = int(tz[1:3]), int(tz[-2:])
        secs -= sign * (hh * 3600 + mm * 60)
    return secs, (int(frac) / 10 ** len(frac) if frac else 0.0)


# ------------------------------------------------------------------------------------------------ reading
def _unknown(names: list[str], what: str) -> str:
    hints = [f"{n!r} -> {m[0]!r}?" for n in names if (m := difflib.get_close_matches(n, NATIVE_COLUMNS, 1))]
    return (f"unknown {what}(s) {', '.join(map(repr, names))}; a native trace has {', '.join(NATIVE_COLUMNS)}"
            + (f" (did you mean {', '.join(hints)})" if hints else ""))


def _detect(header: list[str]) -> str | None:
    names = set(header)
    if set(AZURE_COLUMNS) <= names:
        return "azure"
    if set(_BURSTGPT_USED) <= names:
        return "burstgpt"
    if "arrival_s" in names:
        return "native"
    return None


def _read_csv(path: str, text: str, fmt: str) -> tuple[list, str, int]:
    """(rows, format, skipped); native and BurstGPT rows are TraceRows, Azure rows ((secs, frac), prompt, output)."""
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    hline = 0
    for cells in reader:
        if any(c.strip() for c in cells):
            header, hline = [c.strip() for c in cells], reader.line_num
            break
    if header is None:
        raise TraceError(f"{path}: the trace is empty; it needs a header line and at least one request")
    where = f"{path}:{hline}"
    detected = _detect(header)
    if fmt == "auto":
        if detected is None:
            raise TraceError(f"{where}: unrecognised header {','.join(header)!r}; expected {_LAYOUTS}, or pass the "
                             f"format explicitly")
        fmt = detected
    need = {"native": NATIVE_REQUIRED, "azure": AZURE_COLUMNS, "burstgpt": _BURSTGPT_USED}[fmt]
    missing = [c for c in need if c not in header]
    if missing:
        raise TraceError(f"{where}: a {fmt} trace's header needs the column(s) {', '.join(missing)}; it has "
                         f"{','.join(header)!r}")
    dup = sorted({c for c in header if header.count(c) > 1})
    if dup:
        raise TraceError(f"{where}: column(s) {', '.join(dup)} appear more than once in the header")
    if fmt == "native":
        unknown = [c for c in header if c not in NATIVE_COLUMNS]
        if unknown:
            raise TraceError(f"{where}: {_unknown(unknown, 'column')}")
    ncol = len(header)
    rows: list = []
    skipped = 0
    if fmt == "native":
        columns = list(enumerate(header))
    elif fmt == "azure":
        ti, pi, oi = (header.index(c) for c in AZURE_COLUMNS)
    else:
        ti, pi, oi = (header.index(c) for c in _BURSTGPT_USED)
    for cells in reader:
        line = reader.line_num
        if len(cells) != ncol:
            if not any(c.strip() for c in cells):
                continue  # a blank line
            raise TraceError(f"{path}:{line}: {len(cells)} columns, but the header (line {hline}) has {ncol}; "
                             f"fix the row (a comma too many or too few?)")
        try:
            if fmt == "native":
                rows.append(_native_row({c: v for i, c in columns if (v := cells[i].strip())}))
            elif fmt == "azure":
                p = _int(cells[pi], "ContextTokens", 1)
                o = _int(cells[oi], "GeneratedTokens", 0)
                stamp = _azure_time(cells[ti])
                if o == 0:  # nothing generated: it cannot be replayed with an exact output length
                    skipped += 1
                    continue
                rows.append((stamp, p, o))
            else:
                t = _float(cells[ti], "Timestamp")
                if t < 0:
                    raise _Bad(f"Timestamp must be >= 0 seconds, got {t}")
                o = _int(cells[oi], "Response tokens", 0)
                p = _int(cells[pi], "Request tokens", 1)
                if o == 0:  # a failed request in BurstGPT
                    skipped += 1
                    continue
                rows.append(TraceRow(t, p, o))
        except _Bad as e:
            raise TraceError(f"{path}:{line}: {e}") from None
    return rows, fmt, skipped


def _read_jsonl(path: str, text: str) -> list[TraceRow]:
    rows = []
    for line, s in enumerate(text.split("\n"), 1):
        if not s.strip():
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{line}: invalid JSON ({e.msg} at column {e.colno}); each line must be one "
                             f"JSON object") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{line}: expected a JSON object with {', '.join(NATIVE_REQUIRED)}, got a "
                             f"{type(obj).__name__}")
        unknown = [k for k in obj if k not in NATIVE_COLUMNS]
        if unknown:
            raise TraceError(f"{path}:{line}: {_unknown(unknown, 'key')}")
        try:
            rows.append(_native_row(obj))
        except _Bad as e:
            raise TraceError(f"{path}:{line}: {e}") from None
    return rows


def read_trace(path: str | os.PathLike, *, speedup: float = 1.0, format: str = "auto") -> Trace:
    """Read a trace file (layouts: the module docstring). `speedup` > 1 compresses time (arrivals / speedup);
    `format` is "auto" (from the header or first object) or one of "native", "azure", "burstgpt"."""
    if isinstance(speedup, bool) or not (isinstance(speedup, (int, float)) and math.isfinite(speedup)
                                         and speedup > 0):
        raise ValueError(f"the trace speedup must be a finite number > 0, got {speedup!r}")
    if format not in FORMATS:
        raise ValueError(f"unknown trace format {format!r}; choose one of {', '.join(FORMATS)}")
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace ({e})") from e
    first = text.lstrip()[:1]
    if not first:
        raise TraceError(f"{path}: the trace is empty; it needs at least one request")
    skipped = 0
    if first == "{":
        if format not in ("auto", "native"):
            raise TraceError(f"{path}: this is a JSONL file, but {format} traces are CSV files; only native traces "
                             f"may be JSONL")
        rows = _read_jsonl(path, text)
        fmt, syntax = "native", "jsonl"
    else:
        raw, fmt, skipped = _read_csv(path, text, format)
        syntax = "csv"
        if fmt == "azure":
            s0, f0 = raw[0][0] if raw else (0, 0.0)
            rows = [TraceRow((s - s0) + (fr - f0), p, o) for (s, fr), p, o in raw]
        else:
            rows = raw
    if not rows:
        what = f" ({skipped} failed BurstGPT rows with 0 response tokens were skipped)" if skipped else ""
        raise TraceError(f"{path}: the trace has no requests{what}")
    was_sorted = any(b.arrival_s < a.arrival_s for a, b in zip(rows, rows[1:]))
    if was_sorted:
        order = sorted(range(len(rows)), key=lambda i: rows[i].arrival_s)  # stable
        rows = [rows[i] for i in order]
    t0 = rows[0].arrival_s
    if t0 != 0.0 or speedup != 1.0:
        rows = [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) / speedup) for r in rows]
    return Trace(rows, path, fmt, syntax, float(speedup), skipped, was_sorted)


# ------------------------------------------------------------------------------------------------ writing
def _fmt(v) -> str:
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def write_trace(path: str | os.PathLike, rows: Sequence[TraceRow], *, layout: str = "native",
                start: str = "2024-01-01 00:00:00", model: str = "ChatGPT", failed_at: Iterable[int] = ()) -> None:
    """Write `rows` as a trace file that `read_trace` reads back:

    - `native`: CSV, or JSONL when `path` ends with `.jsonl`; an optional column is written only when some row
      has it; floats are written exactly (`repr`), so the rows read back equal;
    - `azure`: TIMESTAMP = `start` + arrival, with 7 fractional digits (100 ns), ContextTokens, GeneratedTokens;
      the optional fields are dropped;
    - `burstgpt`: BurstGPT's six columns (Model = `model`, Log Type "Conversation log"); before each index in
      `failed_at` (an index into `rows`) a failed request (0 response tokens) is written at the same time."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if layout == "native" and path.endswith(".jsonl"):
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                d = {k: v for k, v in dataclasses.asdict(r).items() if v is not None}
                f.write(json.dumps(d) + "\n")
        return
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        if layout == "native":
            cols = list(NATIVE_REQUIRED) + [c for c in NATIVE_OPTIONAL if any(getattr(r, c) is not None for r in rows)]
            w.writerow(cols)
            w.writerows([_fmt(getattr(r, c)) for c in cols] for r in rows)
        elif layout == "azure":
            t0 = datetime.datetime.fromisoformat(start)
            w.writerow(AZURE_COLUMNS)
            for r in rows:
                ticks = round(r.arrival_s * 1e7)  # 100 ns
                stamp = t0 + datetime.timedelta(seconds=ticks // 10**7)
                w.writerow([f"{stamp:%Y-%m-%d %H:%M:%S}.{ticks % 10**7:07d}", r.prompt_tokens, r.output_tokens])
        elif layout == "burstgpt":
            failed = set(failed_at)
            w.writerow(BURSTGPT_COLUMNS)
            for i, r in enumerate(rows):
                t = round(r.arrival_s, 3)
                if i in failed:
                    w.writerow([t, model, r.prompt_tokens, 0, r.prompt_tokens, "Conversation log"])
                w.writerow([t, model, r.prompt_tokens, r.output_tokens, r.prompt_tokens + r.output_tokens,
                            "Conversation log"])
        else:
            raise ValueError(f"unknown trace layout {layout!r}; choose native, azure or burstgpt")
