"""How far the simulator is from the real engine: the same workload and policies through the real engine and through
`paged.sim.SimulatedEngine` priced by `--step_time_model`, with the same engine configuration; reports, per policy,
the relative error of the mean step time (target: within 15%) and of TTFT p50 (target: within 20%).

    python -m experiments.validate_sim --policies=exllamav2,vllm,sarathi --num_requests=48 --rate=1.5 \\
        --json_out=experiments/results/validate_sim_cpu.json

Takes every flag of experiments/compare_policies.py (workload, policies, engine, --page_budget, ...; `--engine` is
ignored: both run). Mean step time = the generator's time per engine step (scheduling + engine call + results; on
the simulator, the predicted seconds). The real run is only meaningful on an idle machine: the record keeps the
load average.
"""

from __future__ import annotations

from absl import app, flags

from experiments import compare_policies as cp

FLAGS = flags.FLAGS
flags.DEFINE_float("max_step_error", 0.15, "target for |mean step time error| (reported, not enforced)")
flags.DEFINE_float("max_ttft_error", 0.20, "target for |TTFT p50 error| (reported, not enforced)")


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
        out.append({"policy": r.policy, "real_step_ms": None if rs is None else 1e3 * rs,
                    "sim_step_ms": None if ss is None else 1e3 * ss, "step_error": es,
                    "real_ttft_p50_ms": rt, "sim_ttft_p50_ms": st, "ttft_error": et,
                    "real_preemptions": r.preemptions, "sim_preemptions": s.preemptions,
                    "step_ok": es is not None and abs(es) <= FLAGS.max_step_error,
                    "ttft_ok": et is not None and abs(et) <= FLAGS.max_ttft_error})
    return out


def format_rows(rows: list[dict]) -> str:
    f = lambda x, spec: "n/a" if x is None else format(x, spec)
    lines = [f"{'policy':<12} {'step real':>10} {'step sim':>10} {'err':>7}  {'TTFT real':>10} {'TTFT sim':>10} "
             f"{'err':>7}  preempt real/sim"]
    for r in rows:
        mark = lambda ok: " " if ok else "!"
        lines.append(f"{r['policy']:<12} {f(r['real_step_ms'], '.1f'):>10} {f(r['sim_step_ms'], '.1f'):>10} "
                     f"{f(r['step_error'], '+.1%'):>7}{mark(r['step_ok'])} {f(r['real_ttft_p50_ms'], '.0f'):>10} "
                     f"{f(r['sim_ttft_p50_ms'], '.0f'):>10} {f(r['ttft_error'], '+.1%'):>7}{mark(r['ttft_ok'])}"
                     f" {r['real_preemptions']}/{r['sim_preemptions']}")
    lines.append(f"(! = outside the targets: step {FLAGS.max_step_error:.0%}, TTFT p50 {FLAGS.max_ttft_error:.0%}; "
                 "times in ms)")
    return "\n".join(lines)


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from experiments.lib.serving import env

    cp.validate_flags()
    env.load_average("at start")
    real = cp.RealBackend()
    sim = cp.SimBackend()
    sim.config, sim.vocab_size = real.config, real.vocab_size  # the same engine configuration and token ids
    wl, arrivals = cp.build_workload(real.vocab_size, real.special_ids, real.config.max_seq_len)
    real.warm_up(wl.requests[: FLAGS.warmup_requests])
    slo = cp.slo_of_flags()
    real_runs = [cp.run_policy(real, p, wl, arrivals, slo, label=p) for p in FLAGS.policies]
    sim_runs = [cp.run_policy(sim, p, wl, arrivals, slo, label=p) for p in FLAGS.policies]
    rows = validate(real_runs, sim_runs)
    print(format_rows(rows))
    if FLAGS.json_out:
        record = {"schema": "validate_sim/1", "flags": {k: FLAGS[k].value for k in cp.OUR_FLAGS},
                  "git": env.git_info(), "device": real.device, "load_avg": env.load_average(),
                  "step_time_model": sim.step_time.to_dict(), "engine": real.config.to_dict(),
                  "workload": wl.describe(), "errors": rows,
                  "real": [cp.policy_record(r) for r in real_runs], "sim": [cp.policy_record(r) for r in sim_runs]}
        cp.write_json(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
