"""Measuring a step-time fit (`paged.sim.StepTimeModel`) of a real engine: the samples and the fit, in slices that can
run one at a time. `experiments/profile_step.py --fit_out` runs them back to back; `experiments/validate_sim.py
--fit_interleaved` runs one slice before each round of its real runs, so the fit and the runs it is checked against
sample the same states of the machine (on a shared host its speed changes from one ten seconds to the next).

What a fit is measured on (`CalibrationPlan.source`):
- `serving`: every step of the generator (policy `exllamav2`) serving a calibration workload of random prompts (each
  length of `serving_prompts`, +-90%, half as many output tokens) at each closed-loop concurrency of
  `serving_concurrency`, each `Engine.run` timed where it ran (`experiments.lib.serving.runner.EngineProbe`). A decode
  step in a serving loop costs more than the same shape timed alone (~12% on the 2-core CPU host: the host thread's
  work beside the device's, caches no longer warm from an identical previous call), a prefill step the same within
  ~2%. The prompts have their own seed (`serving_seed`), apart from any workload a validation replays, and are the
  same in every slice.
- `grid`: a grid of step shapes (`grid_prefill` tokens of one prefill chunk x `grid_decode` decode rows x
  `grid_context` tokens of context per row, plus, with `grid_mixed`, decode steps with one row at each context and
  the others at the shortest), each timed alone: a pass calls every shape once untimed and `iters` times timed; a
  shape's time is the mean over the passes of each pass's median.
- `both`: the serving steps, plus the grid's shapes with a prefill chunk (which serving meets rarely).

The generator's host seconds per step outside `Engine.run` (admission, planning, results) are added to the fit's base.
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections.abc import Sequence

import numpy as np

SOURCES = ("both", "serving", "grid")


@dataclasses.dataclass(frozen=True)
class CalibrationPlan:
    source: str = "both"
    grid_prefill: Sequence[int] = (0, 16, 64, 128, 256)
    grid_decode: Sequence[int] = (0, 1, 2, 4, 8, 15)
    grid_context: Sequence[int] = (32, 256, 768)
    grid_mixed: bool = True
    iters: int = 5
    serving_concurrency: Sequence[int] = (1, 4, 16)
    serving_prompts: Sequence[int] = (64, 256)
    serving_requests_per_row: int = 4
    serving_seed: int = 1000

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"CalibrationPlan.source must be one of {SOURCES}, got {self.source!r}")

    @property
    def grid(self) -> bool:
        return self.source in ("grid", "both")

    @property
    def serving(self) -> bool:
        return self.source in ("serving", "both")


# the flags `define_flags` defines (a script that reads them only in some modes refuses them in the others)
FLAG_NAMES = ("fit_source", "grid_prefill", "grid_decode", "grid_context", "grid_mixed", "serving_concurrency",
              "serving_prompts", "serving_requests_per_row", "serving_seed")


def define_flags() -> None:
    """The flags of a `CalibrationPlan` (`plan_of_flags`), for the scripts that measure fits (profile_step,
    validate_sim); defined once per process."""
    from absl import flags

    if "fit_source" in flags.FLAGS:
        return
    d = CalibrationPlan()
    strs = lambda xs: [str(x) for x in xs]
    flags.DEFINE_enum("fit_source", d.source, list(SOURCES), "fit: what the fit is measured on: 'serving' (every "
                      "step of the generator serving a calibration workload, timed where it ran), 'grid' (the grid's "
                      "shapes, each timed alone) or 'both' (serving's steps and the grid's shapes with a prefill "
                      "chunk)")
    flags.DEFINE_list("grid_prefill", strs(d.grid_prefill), "fit: prefill chunk tokens (0 = none)")
    flags.DEFINE_list("grid_decode", strs(d.grid_decode), "fit: decode rows")
    flags.DEFINE_list("grid_context", strs(d.grid_context), "fit: context tokens per row before the step")
    flags.DEFINE_bool("grid_mixed", d.grid_mixed, "fit: also decode steps with one row at each context and the "
                      "others at the shortest (attention reads every row to the longest row's context bucket)")
    flags.DEFINE_list("serving_concurrency", strs(d.serving_concurrency), "fit (serving): closed-loop concurrencies "
                      "to serve at")
    flags.DEFINE_list("serving_prompts", strs(d.serving_prompts), "fit (serving): prompt lengths to serve at each "
                      "concurrency (+-90%; outputs half as long): short and long contexts, as attention's cost per "
                      "token differs with how many rows share a step")
    flags.DEFINE_integer("serving_requests_per_row", d.serving_requests_per_row, "fit (serving): requests per unit "
                         "of concurrency and prompt length")
    flags.DEFINE_integer("serving_seed", d.serving_seed, "fit (serving): the calibration prompts' seed (apart from "
                         "the workloads a validation replays, seed 0 by default)")


def plan_of_flags(iters: int = CalibrationPlan.iters) -> CalibrationPlan:
    """The CalibrationPlan of the flags `define_flags` defined; `iters`: timed calls per grid shape and pass. A value
    that is not a list of integers (>= 1 for serving's) is an `absl.app.UsageError` naming the flag."""
    from absl import app, flags

    f = flags.FLAGS

    def ints(name: str) -> tuple[int, ...]:
        values = getattr(f, name)
        try:
            out = tuple(int(x) for x in values)
        except ValueError:
            out = ()
        if not out or min(out) < 0:
            raise app.UsageError(f"--{name} takes a comma-separated list of integers >= 0, got {','.join(values)!r}")
        return out

    if f.serving_requests_per_row < 1:
        raise app.UsageError(f"--serving_requests_per_row must be >= 1, got {f.serving_requests_per_row}")
    if min(ints("serving_concurrency")) < 1 or min(ints("serving_prompts")) < 1:
        raise app.UsageError("--serving_concurrency and --serving_prompts take integers >= 1")
    return CalibrationPlan(source=f.fit_source, grid_prefill=ints("grid_prefill"), grid_decode=ints("grid_decode"),
                           grid_context=ints("grid_context"), grid_mixed=f.grid_mixed, iters=iters,
                           serving_concurrency=ints("serving_concurrency"), serving_prompts=ints("serving_prompts"),
                           serving_requests_per_row=f.serving_requests_per_row, serving_seed=f.serving_seed)


def fit_config(*, page_size: int, max_batch_size: int, max_seq_len: int, cache_dtype: str):
    """The engine configuration a fit is measured on: the policy comparison's (max_chunk_size 256, no penalty
    history, `max_batch_size` full-length sequences of pages)."""
    from paged.device.config import EngineConfig

    return EngineConfig(page_size=page_size, max_batch_size=max_batch_size, max_chunk_size=256,
                        max_seq_len=max_seq_len, cache_dtype=cache_dtype, max_penalty_range=0)


def fit_engine(model, config, log=print):
    """An engine of `config` for `model`, every bucket compiled."""
    from paged.device.engine import Engine

    eng = Engine(model, config)
    t0 = time.perf_counter()
    eng.warmup()
    log(f"compiled every bucket in {time.perf_counter() - t0:.1f} s")
    return eng


def fit_setup(eng, *, name: str, model: str, quantization: str, dtype: str) -> dict:
    """What a fit is measured on (paged.sim.SETUP_KEYS): host, kernels, model, weights, cache, date, commit."""
    import datetime

    from experiments.lib.serving import env

    c = eng.config
    return {"name": name, **env.host_setup(), "model": model, "quantization": quantization, "dtype": dtype,
            "attn_impl": c.attn_impl, "matmul_impl": c.matmul_impl, "kernels": env.matmul_auto(),
            "cache_dtype": c.cache_dtype, "page_size": c.page_size, "max_batch_size": c.max_batch_size,
            "max_seq_len": c.max_seq_len, "date": datetime.date.today().isoformat(), "commit": env.git_info()}


def host_per_step(before: dict, after: dict) -> float:
    """The generator's seconds per step outside `Engine.run` (admission and planning, results) between two
    `generator.metrics()`."""
    d = lambda k: after[k] - before[k]
    return (d("time_schedule_s") + d("time_results_s")) / max(d("steps"), 1)


class Calibration:
    """The samples of one fit of `engine` (serving `model`'s token ids), gathered slice by slice (`run_slice`, or
    `grid_pass` and `serve` alone), then fitted (`fit`)."""

    def __init__(self, model, engine, plan: CalibrationPlan, log=print):
        self.model, self.engine, self.plan, self.log = model, engine, plan, log
        self.cases = self._grid_cases() if plan.grid else []
        self.passes: list[list[float]] = [[] for _ in self.cases]  # per grid case, each pass's median seconds
        self.shapes: list = []  # serving steps: their StepShapes and seconds
        self.seconds: list[float] = []
        self.levels: list[dict] = []  # one summary per (slice, concurrency, prompt length)
        self.host_s = 0.0  # host seconds outside Engine.run over host_steps serving steps
        self.host_steps = 0
        self.slices = 0

    # ------------------------------------------------------------------ the grid
    def _grid_cases(self) -> list[tuple[tuple[int, int, int, int], list]]:
        from paged.device.batch import RowInput

        plan, cfg = self.plan, self.engine.config
        ps, batch, seq, per_row = cfg.page_size, cfg.max_batch_size, cfg.max_seq_len, cfg.max_pages_per_row
        contexts = list(plan.grid_context)
        prefill_only = plan.source == "both"  # (with serving: its decode steps price decoding, timed where they ran)
        # every row at context c; then (grid_mixed) decode steps whose first row is at c and the others at the
        # shortest context, as in serving, where attention reads every row up to the longest one's context bucket
        grid = [(c, p, d, c) for c in contexts for p in plan.grid_prefill for d in plan.grid_decode]
        if plan.grid_mixed:
            grid += [(c, 0, d, min(contexts)) for c in contexts if c > min(contexts) for d in plan.grid_decode
                     if d >= 2]
        cases = []
        for c, p, d, c_rest in grid:
            if (p == 0 and (d == 0 or prefill_only)) or d + (p > 0) > batch or c + max(p, 1) > seq:
                continue
            rows = []
            for r in range(d + (p > 0)):
                n = p if (p and r == 0) else 1
                ctx = c if r == 0 else c_rest
                pages = list(range(1 + r * per_row, 1 + (r + 1) * per_row))[: -(-(ctx + n) // ps)]
                rows.append(RowInput(tokens=[7] * n, start_pos=ctx, pages=pages))
            if 1 + len(rows) * per_row <= cfg.num_pages:
                cases.append(((p, d, c, c_rest), rows))
        return cases

    def grid_pass(self) -> None:
        """One pass over the grid: every shape called once untimed, then `iters` times timed (its median kept)."""
        eng = self.engine
        for i, (_, rows) in enumerate(self.cases):
            eng.run(rows)  # untimed: first touch
            times = []
            for _ in range(self.plan.iters):
                t = time.perf_counter()
                eng.run(rows)
                times.append(time.perf_counter() - t)
            self.passes[i].append(float(np.median(times)))

    def grid_points(self) -> tuple[list, list[float], list[dict]]:
        """The grid's shapes, their seconds (the mean of the passes' medians) and one record per shape."""
        from paged.sim import StepShape

        shapes, seconds, points = [], [], []
        for ((p, d, c, c_rest), rows), per_pass in zip(self.cases, self.passes):
            if not per_pass:
                continue
            shape = StepShape.from_rows(rows, self.engine.spec)
            shapes.append(shape)
            seconds.append(float(np.mean(per_pass)))
            points.append(dict(prefill=p, decode=d, context=c, other_context=c_rest, seconds=seconds[-1],
                               passes=per_pass, **shape.__dict__))
        return shapes, seconds, points

    # ------------------------------------------------------------------ serving
    def serve(self) -> None:
        """Serve the calibration workload once at every (concurrency, prompt length), recording every step."""
        from experiments.lib.serving import runner, workloads
        from paged import DynamicGenerator
        from paged.sim import StepShape

        plan, eng = self.plan, self.engine
        runs = [(c, p) for c in plan.serving_concurrency for p in plan.serving_prompts]
        for i, (conc, prompt) in enumerate(runs):
            n, output = plan.serving_requests_per_row * conc, max(prompt // 2, 4)
            wl = workloads.random_workload(n, prompt, output, vocab_size=self.model.config.vocab_size,
                                           range_ratio=0.9, seed=plan.serving_seed + i,
                                           max_seq_len=eng.config.max_seq_len)
            gen = DynamicGenerator(engine=eng, policy="exllamav2")
            t0 = time.perf_counter()
            res = runner.run_benchmark(gen, wl.requests, max_concurrency=conc)
            steps = [s for s in res.steps if s.num_steps == 1]
            for s in steps:
                rows = [types.SimpleNamespace(start_pos=st, tokens=range(k), sample=smp) for st, k, smp in s.rows]
                self.shapes.append(StepShape.from_rows(rows, eng.spec))
                self.seconds.append(s.wall)
            h = host_per_step(res.metrics_before, res.metrics_after)
            self.host_s += h * len(res.steps)
            self.host_steps += len(res.steps)
            walls = [s.wall for s in steps]
            self.levels.append(dict(slice=self.slices, concurrency=conc, prompt_tokens=prompt, output_tokens=output,
                                    requests=n, steps=len(steps), seconds=time.perf_counter() - t0,
                                    mean_step_s=sum(walls) / max(len(walls), 1), host_s_per_step=h))
            lv = self.levels[-1]
            self.log(f"serving at concurrency {conc:3d}, prompts {prompt:4d} +-90%: {n} requests, {len(steps)} "
                     f"steps, mean Engine.run {1e3 * lv['mean_step_s']:.2f} ms + host {1e3 * h:.2f} ms "
                     f"({lv['seconds']:.1f} s)")

    def host_without_serving(self) -> float:
        """The host loop's seconds per step around the engine call on a short decode-heavy run (a grid-only fit)."""
        from paged import DynamicGenerator, Job, SamplingSettings

        gen = DynamicGenerator(engine=self.engine)
        rng = np.random.default_rng(0)
        vocab, jobs = self.model.config.vocab_size, self.engine.config.max_batch_size // 2
        gen.enqueue([Job(rng.integers(0, vocab, 64).tolist(), 48, gen_settings=SamplingSettings.greedy())
                     for _ in range(jobs)])
        m0 = gen.metrics()
        while gen.num_remaining_jobs():
            gen.iterate()
        return host_per_step(m0, gen.metrics())

    # ------------------------------------------------------------------ slices and the fit
    def run_slice(self, grid_passes: int = 1) -> None:
        """One slice: `grid_passes` passes over the grid (if the plan has one), then the serving workload (if it has
        one)."""
        t0 = time.perf_counter()
        for _ in range(grid_passes if self.plan.grid else 0):
            self.grid_pass()
        if self.plan.serving:
            self.serve()
        self.slices += 1
        self.log(f"calibration slice {self.slices}: {time.perf_counter() - t0:.1f} s")

    def fit(self, *, model_name: str, setup: dict, by: str, narrow_tokens: int | None = None):
        """The StepTimeModel over every sample gathered, its base plus the host loop's seconds per step; `by` names
        the script in its notes; `narrow_tokens` (None: what this engine's matmuls take, `env.narrow_path_tokens`)."""
        from experiments.lib.serving import env
        from paged.sim import StepTimeModel

        d = env.device_info()
        device = f"{d['cpu_model'] or d['device_kind']} ({d['backend']}, {d['cpus_usable']} cores)"
        if narrow_tokens is None:
            narrow_tokens = env.narrow_path_tokens(self.model, self.engine)
        gshapes, gseconds, points = self.grid_points()
        shapes, seconds = gshapes + self.shapes, gseconds + self.seconds
        if not shapes:
            raise ValueError("no calibration samples: run at least one slice before fitting")
        host = self.host_s / self.host_steps if self.host_steps else self.host_without_serving()
        plan = self.plan
        what = {"grid": f"{len(points)} grid shapes, each timed alone",
                "serving": f"{len(self.shapes)} steps of serving at concurrency "
                           f"{','.join(map(str, plan.serving_concurrency))}",
                "both": f"{len(points)} grid shapes with a prefill chunk and {len(self.shapes)} steps of serving"}
        fit = StepTimeModel.fit(shapes, seconds, device=device, model=model_name, narrow_tokens=narrow_tokens,
                                notes=f"fitted by {by} on {what[plan.source]} ({self.slices} slice(s)); base_s "
                                f"includes the host loop's {1e3 * host:.2f} ms per step outside Engine.run",
                                setup=setup)
        fit.base_s += host
        fit.fit_stats.update(source=plan.source, slices=self.slices, host_s_per_step=host,
                             load_avg=env.load_average(), grid=points, serving=self.levels,
                             engine=self.engine.config.to_dict())
        return fit
