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
`experiments/fit_and_validate.py` runs the fit and this validation in one command.
"""

from __future__ import annotations

from absl import app, flags

from experiments import compare_policies as cp

FLAGS = flags.FLAGS
flags.DEFINE_float("max_step_error", 0.10, "target for |mean step time error| (reported, not enforced)")
flags.DEFINE_float("max_ttft_error", 0.15, "target for |TTFT p50 error| (reported, not enforced)")
RANK_BY = "ttft_p50_ms"  # the metric the policies are ranked by, per load (lower is better)


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


def validate(real_runs: list[cp.PolicyRun], sim_runs: list[cp.PolicyRun]) -> list[dict]:
    out = []
    for r, s in zip(real_runs, sim_runs):
        rs, ss = mean_step_s(r), mean_step_s(s)
        rt, st = r.metrics["ttft_ms"]["median"], s.metrics["ttft_ms"]["median"]
        es, et = rel_error(ss, rs), rel_error(st, rt)
        out.append({"policy": r.policy, "rate": r.rate, "real_step_ms": None if rs is None else 1e3 * rs,
                    "sim_step_ms": None if ss is None else 1e3 * ss, "step_error": es,
                    "real_ttft_p50_ms": rt, "sim_ttft_p50_ms": st, "ttft_error": et,
                    "real_preemptions": r.preemptions, "sim_preemptions": s.preemptions,
                    "real_attainment": r.metrics["slo_attainment"], "sim_attainment": s.metrics["slo_attainment"],
                    "step_ok": es is not None and abs(es) <= FLAGS.max_step_error,
                    "ttft_ok": et is not None and abs(et) <= FLAGS.max_ttft_error})
    return out


def rank_agreement(real_runs: list[cp.PolicyRun], sim_runs: list[cp.PolicyRun]) -> dict:
    """Kendall's tau between the real and the simulated RANK_BY over the policies of one load, and both orders."""
    from experiments.lib.serving import capacity

    real = [r.row[RANK_BY] for r in real_runs]
    sim = [s.row[RANK_BY] for s in sim_runs]
    if any(v is None for v in real + sim):
        return {"metric": RANK_BY, "tau": None, "real_order": None, "sim_order": None}
    order = lambda vals: [p.policy for _, p in sorted(zip(vals, real_runs), key=lambda t: t[0])]
    return {"metric": RANK_BY, "tau": capacity.kendall_tau(real, sim), "real_order": order(real),
            "sim_order": order(sim), "sim_tie": len(set(sim)) == 1, "real_tie": len(set(real)) == 1}


def format_rows(rows: list[dict], ranks: list[dict] | None = None) -> str:
    f = lambda x, spec: "n/a" if x is None else format(x, spec)
    lines = [f"{'rate/s':>7} {'policy':<12} {'step real':>10} {'step sim':>10} {'err':>7}  {'TTFT real':>10} "
             f"{'TTFT sim':>10} {'err':>7}  preempt real/sim"]
    for r in rows:
        mark = lambda ok: " " if ok else "!"
        lines.append(f"{f(r['rate'], '7.3g')} {r['policy']:<12} {f(r['real_step_ms'], '.1f'):>10} "
                     f"{f(r['sim_step_ms'], '.1f'):>10} {f(r['step_error'], '+.1%'):>7}{mark(r['step_ok'])} "
                     f"{f(r['real_ttft_p50_ms'], '.0f'):>10} {f(r['sim_ttft_p50_ms'], '.0f'):>10} "
                     f"{f(r['ttft_error'], '+.1%'):>7}{mark(r['ttft_ok'])} {r['real_preemptions']}/"
                     f"{r['sim_preemptions']}")
    for k in ranks or []:
        tie = " (the simulator predicts a tie: no order to agree on)" if k.get("sim_tie") else ""
        lines.append(f"rate {f(k['rate'], '.3g')}/s: rank agreement by {k['metric']} (Kendall's tau) "
                     f"{f(k['tau'], '+.2f')}{tie}; real {k['real_order']}, sim {k['sim_order']}")
    lines.append(f"(! = outside the targets: step {FLAGS.max_step_error:.0%}, TTFT p50 {FLAGS.max_ttft_error:.0%}; "
                 "times in ms)")
    return "\n".join(lines)


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from experiments.lib.serving import env
    from paged.sim import engine_setup

    cp.validate_flags()
    rates = cp.rates_of_flags()
    if rates is None:
        raise app.UsageError("validate_sim needs explicit --rates (e.g. one under and one past saturation), not auto")
    env.load_average("at start")
    real = cp.RealBackend()
    sim = cp.SimBackend()
    sim.config, sim.vocab_size = real.config, real.vocab_size  # the same engine configuration and token ids
    here = {**env.host_setup(), **engine_setup(real.config, sim.setup)}
    mismatches = sim.step_time.warn_differences(here, "this machine and engine (the validation measures here)")
    load = cp.build_load(real.vocab_size, real.special_ids, real.config.max_seq_len)
    real.warm_up(load.workload.requests[: FLAGS.warmup_requests])
    slo = cp.slo_of_flags()
    rows, ranks, real_all, sim_all = [], [], [], []
    for rate in rates:
        arrivals = load.arrivals_at(rate)
        real_runs = [cp.run_policy(real, p, load.workload, arrivals, slo, label=p, rate=rate) for p in FLAGS.policies]
        sim_runs = [cp.run_policy(sim, p, load.workload, arrivals, slo, label=p, rate=rate) for p in FLAGS.policies]
        rows += validate(real_runs, sim_runs)
        ranks.append({"rate": rate, **rank_agreement(real_runs, sim_runs)})
        real_all += real_runs
        sim_all += sim_runs
    print(format_rows(rows, ranks))
    if FLAGS.json_out:
        record = {"schema": "validate_sim/2", "flags": {k: FLAGS[k].value for k in cp.OUR_FLAGS},
                  "git": env.git_info(), "device": real.device, "host": env.host_setup(),
                  "load_avg": env.load_average(), "setup_mismatches": mismatches,
                  "step_time_model": sim.step_time.to_dict(), "engine": real.config.to_dict(),
                  "workload": load.workload.describe(), "slo_ms": slo, "errors": rows, "rank_agreement": ranks,
                  "real": [cp.policy_record(r) for r in real_all], "sim": [cp.policy_record(r) for r in sim_all]}
        cp.write_json(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
