"""How far the simulator is from the real engine: the same workload and policies through the real engine and through
`paged.sim.SimulatedEngine` priced by `--step_time_model`, with the same engine configuration, at one or more loads
(`--rates`, e.g. one under and one past saturation). Reports, per load and policy, the relative error of the mean
step time (target: within 10%) and of TTFT p50 (target: within 15%), and per load the rank agreement of the
policies (Kendall's tau between the real and the simulated TTFT p50: 1 = the same order).

    python -m experiments.validate_sim --policies=exllamav2,vllm,sarathi,sjf --num_requests=48 --rates=1,4 \
        --step_time_model=cpu_epyc_smollm2_q4 --json_out=experiments/results/validate_sim_cpu.json

Takes every flag of experiments/compare_policies.py (workload, policies, engine, --page_budget, ...; `--engine` is
ignored: both run). Mean step time = the generator's time per engine step (scheduling + engine call + results; on
the simulator, the predicted seconds). The real run is only meaningful on an idle machine: the record keeps the
load average. A fit measured on another host or setup is warned (it is validated here, on this one).

`--real_repeats=N` runs the real engine N times per policy and rate (interleaved over the policies), compares the
simulator with the median and reports the runs' spread: the real engine's own repeatability, under which no
simulator can be judged. On the shared 2-core CPU host the machine's speed changes from one ten seconds to the next
(a 200-token prefill takes 70 or 86 ms), and past saturation a few percent of speed moves TTFT p50 by several
times as much (the queue grows with the difference between arrival and service rates). The pairs of policies the
real runs order reproducibly (no overlap, more than `--min_rank_gap` apart) are listed with whether the simulator
agrees; `--also_fits` prices the same workload with other fits against the same real runs.
`--fit_interleaved` measures the fit here instead of taking `--step_time_model`'s: one calibration slice
(`experiments/lib/calibration.py`: a pass over the grid's prefill shapes, the calibration workload served once) before
each round of real runs over the policies and one after the last, on an engine of the same flags with a full page
pool; the fit and the runs it is checked against then sample the same states of the machine. The record's
`timeline` lists what ran in order. `experiments/fit_and_validate.py` runs the fit and this validation in one
command.
"""

from __future__ import annotations

import os
import statistics

from absl import app, flags

from experiments import compare_policies as cp
from experiments.lib import calibration
from experiments.lib.common import check_out_flag

FLAGS = flags.FLAGS
flags.DEFINE_float("max_step_error", 0.10, "target for |mean step time error| (reported, not enforced)")
flags.DEFINE_float("max_ttft_error", 0.15, "target for |TTFT p50 error| (reported, not enforced)")
flags.DEFINE_float("min_rank_gap", 0.15, "a pair of policies counts as ordered by the real engine when their real "
                   "runs do not overlap and their medians differ by more than this (relative): by default the TTFT "
                   "target, the finest difference the simulator is asked to resolve")
flags.DEFINE_list("also_fits", [], "more step-time fits (names or paths) to price the same workload with, compared "
                  "against the same real runs (e.g. the fit a new one replaces)")
flags.DEFINE_integer("real_repeats", 1, "real runs per policy and rate, interleaved over the policies: the real "
                     "figure is their median and their spread is reported (the real engine's own repeatability: "
                     "the floor under any simulator's error)")
flags.DEFINE_bool("fit_interleaved", False, "measure the fit here, in slices between the real runs (one before each "
                  "round of real runs over the policies and one after the last: `experiments.lib.calibration`, on an "
                  "engine of this one's flags with a full page pool), and price the simulator with it, so the fit and "
                  "the runs it is checked against sample the same states of the machine; --step_time_model is then "
                  "not used (name it in --also_fits to compare)")
flags.DEFINE_string("fit_out", None, "--fit_interleaved: write the fit measured here to this path")
check_out_flag("fit_out")
flags.DEFINE_string("fit_name", None, "--fit_interleaved: the fit's name (hardware_model_setup; default: --fit_out's "
                    "stem)")
calibration.define_flags()  # --fit_interleaved: what the fit is measured on (--fit_source, --grid_*, --serving_*)
flags.DEFINE_bool("check_flags_only", False, "check the flags (as before a run) and exit: loads no model, runs "
                  "nothing (experiments/fit_and_validate.py checks the flags it passes on this way before it starts)")
RANK_BY = "ttft_p50_ms"  # the metric the policies are ranked by, per load (lower is better)
# the record's flags: compare_policies' and this script's own (the calibration's included: min_rank_gap decides the
# reproducible pairs, and had been left out)
RECORD_FLAGS = sorted(set(FLAGS) - cp._BEFORE)


def mean_step_s(run: cp.PolicyRun) -> float | None:
    """Seconds per engine step as the generator saw them: real: scheduling + engine call + results; simulated: the
    predicted step time (virtual seconds, host work included in the model's base)."""
    res = run.result
    delta = lambda k: res.metrics_after.get(k, 0.0) - res.metrics_before.get(k, 0.0)
    steps = delta("steps")
    if not steps:
        return None
    if "time_engine_simulated_s" in res.metrics_after:
        return delta("time_engine_simulated_s") / steps
    return (delta("time_schedule_s") + delta("time_engine_s") + delta("time_results_s")) / steps


def rel_error(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


def median(xs: list) -> float | None:
    """The median of the values that are not None (None if there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs: list) -> float | None:
    """(max - min) / median of repeated real figures: how far two runs of the same thing land apart."""
    mid = median(xs)
    xs = [x for x in xs if x is not None]
    return None if not mid or len(xs) < 2 else (max(xs) - min(xs)) / mid


def validate(real_runs: list[list[cp.PolicyRun]], sim_runs: list[cp.PolicyRun]) -> list[dict]:
    """One row per policy: `real_runs[i]` holds the repeated real runs of `sim_runs[i]`'s policy; the real figures
    are their medians, with every run's value and the spread beside them."""
    out = []
    for reps, s in zip(real_runs, sim_runs):
        steps = [mean_step_s(r) for r in reps]
        ttfts = [r.metrics["ttft_ms"]["median"] for r in reps]
        rs, ss = median(steps), mean_step_s(s)
        rt, st = median(ttfts), s.metrics["ttft_ms"]["median"]
        es, et = rel_error(ss, rs), rel_error(st, rt)
        r0 = reps[0]
        out.append({"policy": r0.policy, "rate": r0.rate, "real_step_ms": None if rs is None else 1e3 * rs,
                    "sim_step_ms": None if ss is None else 1e3 * ss, "step_error": es,
                    "real_ttft_p50_ms": rt, "sim_ttft_p50_ms": st, "ttft_error": et,
                    "real_runs": len(reps), "real_step_ms_runs": [None if x is None else 1e3 * x for x in steps],
                    "real_ttft_p50_ms_runs": ttfts, "real_step_spread": spread(steps),
                    "real_ttft_spread": spread(ttfts),
                    "real_preemptions": median([r.preemptions for r in reps]), "sim_preemptions": s.preemptions,
                    "real_attainment": median([r.metrics["slo_attainment"] for r in reps]),
                    "sim_attainment": s.metrics["slo_attainment"],
                    "step_ok": es is not None and abs(es) <= FLAGS.max_step_error,
                    "ttft_ok": et is not None and abs(et) <= FLAGS.max_ttft_error})
    return out


def rank_agreement(real_runs: list[list[cp.PolicyRun]], sim_runs: list[cp.PolicyRun]) -> dict:
    """Kendall's tau between the real (median over repeats) and the simulated RANK_BY over the policies of one
    load, and both orders."""
    from experiments.lib.serving import capacity

    real = [median([r.row[RANK_BY] for r in reps]) for reps in real_runs]
    sim = [s.row[RANK_BY] for s in sim_runs]
    if any(v is None for v in real + sim):
        return {"metric": RANK_BY, "tau": None, "real_order": None, "sim_order": None}
    order = lambda vals: [p.policy for _, p in sorted(zip(vals, sim_runs), key=lambda t: t[0])]
    return {"metric": RANK_BY, "tau": capacity.kendall_tau(real, sim), "real_order": order(real),
            "sim_order": order(sim), "sim_tie": len(set(sim)) == 1, "real_tie": len(set(real)) == 1,
            "pairs": separated_pairs(real_runs, sim_runs)}


def separated_pairs(real_runs: list[list[cp.PolicyRun]], sim_runs: list[cp.PolicyRun],
                    min_gap: float | None = None) -> list[dict]:
    """Every pair of policies the real engine orders reproducibly: their repeated real RANK_BY values do not overlap
    (every run of one below every run of the other) and their medians differ by more than `min_gap` (relative to
    the smaller; default --min_rank_gap), and whether the simulator orders them the same way. Other pairs are left
    out: the real engine itself does not tell their order, or tells it by less than the simulator is asked to
    resolve (with one run per policy, every pair of values `min_gap` apart counts)."""
    gap = FLAGS.min_rank_gap if min_gap is None else min_gap
    vals = [[r.row[RANK_BY] for r in reps] for reps in real_runs]
    out = []
    for i in range(len(vals)):
        for j in range(i + 1, len(vals)):
            a, b = vals[i], vals[j]
            if None in a or None in b or not (max(a) < min(b) or max(b) < min(a)):
                continue
            lo, hi = sorted((median(a), median(b)))
            if hi <= lo * (1 + gap):
                continue
            first, second = (i, j) if max(a) < min(b) else (j, i)
            si, sj = sim_runs[first].row[RANK_BY], sim_runs[second].row[RANK_BY]
            out.append({"faster": sim_runs[first].policy, "slower": sim_runs[second].policy,
                        "sim_agrees": si is not None and sj is not None and si < sj})
    return out


def format_rows(rows: list[dict], ranks: list[dict] | None = None) -> str:
    """The table; with repeated real runs, their spread ((max - min) / median) beside the real step and TTFT."""
    f = lambda x, spec: "n/a" if x is None else format(x, spec)
    reps = max((r.get("real_runs", 1) for r in rows), default=1)
    spr = (lambda r, k: " " + format("±" + (f(r[k] / 2, ".0%") if r.get(k) is not None else "n/a"), ">5")) \
        if reps > 1 else (lambda r, k: "")
    w = 6 if reps > 1 else 0
    lines = [f"{'rate/s':>7} {'policy':<12} {'step real':>{10 + w}} {'step sim':>10} {'err':>7}  "
             f"{'TTFT real':>{10 + w}} {'TTFT sim':>10} {'err':>7}  preempt real/sim"]
    for r in rows:
        mark = lambda ok: " " if ok else "!"
        lines.append(f"{f(r['rate'], '7.3g')} {r['policy']:<12} {f(r['real_step_ms'], '.1f'):>10}"
                     f"{spr(r, 'real_step_spread')} {f(r['sim_step_ms'], '.1f'):>10} "
                     f"{f(r['step_error'], '+.1%'):>7}{mark(r['step_ok'])} {f(r['real_ttft_p50_ms'], '.0f'):>10}"
                     f"{spr(r, 'real_ttft_spread')} {f(r['sim_ttft_p50_ms'], '.0f'):>10} "
                     f"{f(r['ttft_error'], '+.1%'):>7}{mark(r['ttft_ok'])} {f(r['real_preemptions'], 'g')}/"
                     f"{r['sim_preemptions']}")
    for k in ranks or []:
        tie = " (the simulator predicts a tie: no order to agree on)" if k.get("sim_tie") else ""
        lines.append(f"rate {f(k['rate'], '.3g')}/s: rank agreement by {k['metric']} (Kendall's tau) "
                     f"{f(k['tau'], '+.2f')}{tie}; real {k['real_order']}, sim {k['sim_order']}")
        pairs = k.get("pairs")
        if pairs is not None and reps > 1:
            n = len(k["real_order"] or ())
            lines.append(f"  pairs the real runs order reproducibly (> {FLAGS.min_rank_gap:.0%} apart): "
                         f"{len(pairs)} of {n * (n - 1) // 2}; the simulator orders "
                         f"{sum(p['sim_agrees'] for p in pairs)} of them the same way"
                         + "".join(f"; {p['faster']} < {p['slower']}{'' if p['sim_agrees'] else ' (sim: reversed)'}"
                                   for p in pairs))
    lines.append(f"(! = outside the targets: step {FLAGS.max_step_error:.0%}, TTFT p50 {FLAGS.max_ttft_error:.0%}; "
                 "times in ms" + (f"; real: the median of {reps} runs, ± half their spread)" if reps > 1 else ")"))
    return "\n".join(lines)


def interleaved_calibration(real, plan):
    """--fit_interleaved: the calibration of an engine like the real one (its flags, its model), with a full page
    pool (the calibration workload runs up to max_batch_size long sequences), every bucket compiled."""
    import dataclasses

    config = dataclasses.replace(real.config, num_pages=None)
    engine = calibration.fit_engine(real.model, config)
    return calibration.Calibration(real.model, engine, plan)


def check_flags():
    """Every flag problem, before the model loads or anything is measured: app.UsageError naming the flag. Returns
    (the rates, the --also_fits models by name, the calibration plan of --fit_interleaved or None)."""
    import math

    from experiments.lib import step_time_fits
    from paged.errors import InvalidConfigError
    from paged.sim import StepTimeModel

    cp.validate_flags()  # (the workload included: built once over a stand-in vocabulary)
    if FLAGS.plot:  # (a compare_policies flag this script inherits and had ignored)
        raise app.UsageError("--plot is not used by validate_sim (it writes its record only); plot the record "
                             "with compare_policies' runs")
    if FLAGS.real_repeats < 1:
        raise app.UsageError(f"--real_repeats must be >= 1, got {FLAGS.real_repeats}")
    for name in ("min_rank_gap", "max_step_error", "max_ttft_error"):
        if not (FLAGS[name].value >= 0 and math.isfinite(FLAGS[name].value)):
            raise app.UsageError(f"--{name} must be a finite fraction >= 0, got {FLAGS[name].value}")
    if not FLAGS.fit_interleaved:  # (the docs: these flags belong to the fit --fit_interleaved measures)
        for name in ("fit_out", "fit_name"):
            if FLAGS[name].value is not None:
                raise app.UsageError(f"--{name} names the fit --fit_interleaved measures: add --fit_interleaved "
                                     "(without it no fit is measured here)")
        for name in calibration.FLAG_NAMES:
            if FLAGS[name].present:
                raise app.UsageError(f"--{name} says how --fit_interleaved measures its fit: add --fit_interleaved, "
                                     "or drop it (without --fit_interleaved the fit is --step_time_model's)")
    rates = cp.rates_of_flags()
    if rates is None:
        raise app.UsageError("validate_sim needs explicit --rates (e.g. one under and one past saturation), not auto")
    also = {}
    for name in FLAGS.also_fits:  # (checked before the model loads)
        try:
            also[name] = StepTimeModel.load(step_time_fits.fit_path(name))
        except (InvalidConfigError, ValueError) as e:
            raise app.UsageError(f"--also_fits={name}: {e}") from None
    plan = calibration.plan_of_flags() if FLAGS.fit_interleaved else None  # (its errors before the model loads)
    return rates, also, plan


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from experiments.lib.serving import env
    from paged.sim import engine_setup

    rates, also, plan = check_flags()
    if FLAGS.check_flags_only:
        print("validate_sim: the flags are fine (--check_flags_only: nothing run)")
        return
    env.load_average("at start")
    sim = None if FLAGS.fit_interleaved else cp.SimBackend(warn=False)  # (a bad --step_time_model: an error now)
    real = cp.RealBackend()
    # each fit's setup against this machine and engine, warned once, before the real runs (--fit_interleaved's own
    # fit, measured here, after them)
    here = {**env.host_setup(), **engine_setup(real.config, {"model": FLAGS.model, "quantization": FLAGS.quant})}
    what = "this machine and engine (the validation measures here)"
    for fit in ([sim.step_time] if sim is not None else []) + list(also.values()):
        cp.setup_mismatches(fit, here, what)
    cal = interleaved_calibration(real, plan) if plan is not None else None
    load = cp.build_load(real.vocab_size, real.special_ids, real.config.max_seq_len)
    real.warm_up(load.workload.requests[: FLAGS.warmup_requests])
    slo = cp.slo_of_flags()
    real_by_rate = []  # per rate, per policy, its repeated real runs
    timeline = []  # what ran, in order: real runs and calibration slices
    for rate in rates:
        arrivals = load.arrivals_at(rate)
        real_runs = [[] for _ in FLAGS.policies]
        for repeat in range(FLAGS.real_repeats):  # (interleaved: a drift in the machine's speed reaches every policy)
            if cal is not None:
                cal.run_slice()
                timeline.append({"calibration_slice": cal.slices})
            for reps, p in zip(real_runs, FLAGS.policies):
                reps.append(cp.run_policy(real, p, load.workload, arrivals, slo, label=p, rate=rate))
                timeline.append({"real": p, "rate": rate, "repeat": repeat})
        real_by_rate.append(real_runs)
    fit = None
    if cal is not None:
        cal.run_slice()  # (the calibration brackets every real run)
        timeline.append({"calibration_slice": cal.slices})
        name = FLAGS.fit_name or os.path.splitext(os.path.basename(FLAGS.fit_out or "interleaved"))[0]
        setup = calibration.fit_setup(cal.engine, name=name, model=FLAGS.model, quantization=FLAGS.quant,
                                      dtype=FLAGS.dtype)
        fit = cal.fit(model_name=FLAGS.model, setup=setup, by="experiments/validate_sim.py --fit_interleaved")
        if FLAGS.fit_out:
            fit.save(FLAGS.fit_out)
            print(f"the fit measured between the real runs ({cal.slices} slices): {FLAGS.fit_out}")
    if sim is None:
        sim = cp.SimBackend(fit, warn=False)
    # the simulator priced by each fit (the main one first, then --also_fits'), against the same real runs
    backends = [sim, *(cp.SimBackend(f, warn=False) for f in also.values())]
    for b in backends:
        b.config, b.vocab_size = real.config, real.vocab_size  # the same engine configuration and token ids
    # (recorded; warned above, or now for the fit measured here)
    mismatches = cp.setup_mismatches(sim.step_time, here, what, show=FLAGS.fit_interleaved)
    priced = [{"backend": b, "errors": [], "rank_agreement": [], "runs": []} for b in backends]
    for rate, real_runs in zip(rates, real_by_rate):
        arrivals = load.arrivals_at(rate)
        for o in priced:
            runs = [cp.run_policy(o["backend"], p, load.workload, arrivals, slo, label=p, rate=rate)
                    for p in FLAGS.policies]
            o["errors"] += validate(real_runs, runs)
            o["rank_agreement"].append({"rate": rate, **rank_agreement(real_runs, runs)})
            o["runs"] += runs
    real_all = [r for real_runs in real_by_rate for reps in real_runs for r in reps]
    rows, ranks, sim_all = priced[0]["errors"], priced[0]["rank_agreement"], priced[0]["runs"]
    print(format_rows(rows, ranks))
    for name, o in zip(also, priced[1:]):
        print(f"\nthe same real runs against the fit {name!r}:\n" + format_rows(o["errors"], o["rank_agreement"]))
    if FLAGS.json_out:
        record = {"schema": "validate_sim/3", "flags": {k: FLAGS[k].value for k in RECORD_FLAGS},
                  "targets": {"max_step_error": FLAGS.max_step_error, "max_ttft_error": FLAGS.max_ttft_error},
                  "real_repeats": FLAGS.real_repeats, "fit_interleaved": FLAGS.fit_interleaved, "timeline": timeline,
                  "git": env.git_info(), "device": real.device, "host": env.host_setup(),
                  "load_avg": env.load_average(), "setup_mismatches": mismatches,
                  "step_time_model": sim.step_time.to_dict(), "engine": real.config.to_dict(),
                  "workload": load.workload.describe(), "slo_ms": slo, "errors": rows, "rank_agreement": ranks,
                  "real": [cp.policy_record(r) for r in real_all], "sim": [cp.policy_record(r) for r in sim_all],
                  "also_fits": {name: {"step_time_model": o["backend"].step_time.to_dict(), "errors": o["errors"],
                                       "rank_agreement": o["rank_agreement"]} for name, o in zip(also, priced[1:])}}
        cp.write_json(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
