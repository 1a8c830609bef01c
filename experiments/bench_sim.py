"""How fast the policy simulator runs: requests through the REAL host loop (`DynamicGenerator`, `Scheduler`, the
policies, `PagePool`, `JobOutput`, text streams) over `paged.sim.SimulatedEngine` (the fake model on a virtual clock
priced by a fitted step-time model), in wall seconds of this machine.

    python -m experiments.bench_sim                                   # 100,000 requests x every built-in policy
    python -m experiments.bench_sim --policies=vllm --num_requests=10000
    python -m experiments.bench_sim --workload=sharegpt --num_requests=20000 --json_out=/tmp/sim_speed.json
    python -m experiments.bench_sim --policies=lpm --num_requests=2000 --profile=/tmp/lpm.prof

For each policy it times one `experiments.lib.serving.runner.run_benchmark` call (what `compare_policies
--engine=sim` runs per policy: the engine of `compare_policies`, max_batch_size 16, max_seq_len 1024, greedy, one
decode step per call) and prints the wall seconds, requests and generated tokens per wall second, engine steps,
simulated seconds, the wall time extrapolated to 100,000 requests, how loaded the simulated server was (peak
queue, mean batch rows, mean page use) and the machine's load average before and after. Building the workload
(`workloads.make_scenario`) and the generator is not timed. `--json_out` writes the figures as one JSON record.

The default `--rate` is near the simulated server's saturation for the workload (about 9 of 16 rows per step, a
queue that comes and goes without growing for good; `DEFAULT_RATES`); a higher rate runs past saturation, where the
queue grows with the run: a check that nothing in the host loop is quadratic in the queue length.
"""

from __future__ import annotations

import os
import platform
import sys
import time

from absl import app, flags

from experiments.lib import step_time_fits
from experiments.lib.common import check_out_flag, out_path_problem, write_record

FLAGS = flags.FLAGS
POLICIES = ["exllamav2", "fcfs", "sjf", "priority", "vllm", "lpm", "sarathi"]
# Near saturation with the default fit (cpu_epyc_smollm2_q4) and the engine below: about 9 of 16 rows per step
# (9.2 measured, 2026-12-07), a queue of tens that comes and goes while the server keeps up (10k requests: poisson
# 5.2/s, sharegpt 2.3/s; at 5.4/s and 2.4/s it falls behind). With the older fit
# experiments/results/step_time_smollm2_cpu.json (the runs in experiments/results/sim_speed/) those rates were 1.1/s
# and 0.53/s.
DEFAULT_RATES = {"poisson": 5.2, "sharegpt": 2.3}
EXTRAPOLATE_TO = 100_000
SIM_VOCAB = 258  # the simulated engine's fake model (paged.testing.FakeEngine)
SCHEMA = "bench_sim/1"

flags.DEFINE_list("policies", POLICIES, "policies to time: names or 'module:Class'")
flags.DEFINE_integer("num_requests", EXTRAPOLATE_TO, "requests per policy")
flags.DEFINE_enum("workload", "poisson", ["poisson", "sharegpt"], "poisson: random prompts of ~--input_len and "
                  "outputs of ~--output_len tokens (+-range_ratio); sharegpt: ShareGPT-like length pairs; both with "
                  "Poisson arrivals (experiments/lib/serving/workloads.py, make_scenario)")
flags.DEFINE_float("rate", None, "mean arrivals per second (default: the workload's near-saturation rate, "
                   f"{DEFAULT_RATES})")
flags.DEFINE_integer("input_len", 256, "poisson: prompt tokens (make_scenario's default)")
flags.DEFINE_integer("output_len", 64, "poisson: output tokens (make_scenario's default)")
flags.DEFINE_float("range_ratio", 0.5, "poisson: lengths uniform in [len*(1-r), len*(1+r)] (make_scenario's default)")
flags.DEFINE_integer("priority_levels", 3, "requests get a seeded priority in [0, levels) (for `priority`), as in "
                     "compare_policies")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_string("step_time_model", step_time_fits.DEFAULT_FIT, "the step-time fit that prices each simulated "
                    "step: a name in experiments/data/step_time/ or a path to a StepTimeModel JSON")
flags.DEFINE_string("json_out", None, "write the JSON record here")
flags.DEFINE_bool("append", False, "add the record to the JSON list of records in --json_out (a sweep)")
check_out_flag("json_out")
flags.DEFINE_string("profile", None, "write a cProfile of the timed runs here (the timings then include the "
                    "profiler's overhead)")
check_out_flag("profile")


def engine_config():
    from paged.device.config import EngineConfig

    # compare_policies' engine (its flag defaults): max_batch_size 16, max_seq_len 1024, no penalty history
    return EngineConfig(max_batch_size=16, max_seq_len=1024, max_penalty_range=0, decode_steps=1).resolve()


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def time_policy(policy: str, config, step_time, wl, arrivals, profiler=None) -> dict:
    """One policy's run through the real host loop, timed (the generator is built before the clock starts)."""
    from experiments.lib.serving import runner
    from paged import DynamicGenerator
    from paged.settings import SamplingSettings
    from paged.sim import SimulatedEngine

    sim = SimulatedEngine(config, step_time, vocab_size=SIM_VOCAB)
    gen = DynamicGenerator(engine=sim, policy=policy)
    load_before = load_average()
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    res = runner.run_benchmark(gen, wl.requests, gen_settings=SamplingSettings.greedy(), arrivals=arrivals,
                               clock=sim.clock, sleep=sim.clock.sleep, seed=FLAGS.seed, oracle_lengths=True,
                               max_stalls=100_000)
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    m = gen.metrics()
    n = len(wl.requests)
    errors = sum(1 for r in res.records if r.error)
    return {
        "policy": policy, "allocation": gen.policy.allocation, "requests": n, "wall_s": wall,
        "requests_per_s": n / wall, "generated_tokens": m["tokens_generated"],
        "generated_tokens_per_s": m["tokens_generated"] / wall, "prefilled_tokens": m["tokens_prefilled"],
        "engine_steps": m["steps"], "us_per_step": 1e6 * wall / max(m["steps"], 1),
        "simulated_s": sim.timings["simulated_s"], "wall_s_per_100k": wall * EXTRAPOLATE_TO / n,
        "max_waiting": max((t[2] for t in res.trace), default=0),
        "mean_rows_per_step": res.step_summary["mean_rows_per_step"], "mean_page_use": res.mean_page_utilisation,
        "preemptions": m["preemptions"], "errors": errors, "load_avg_before": load_before,
        "load_avg_after": load_average(),
        "host_timings_s": {k: m[f"time_{k}"] for k in ("schedule_s", "engine_s", "results_s")},
    }


COLUMNS = [("policy", "policy", "{}"), ("wall_s", "wall s", "{:.1f}"), ("requests_per_s", "req/s", "{:.0f}"),
           ("generated_tokens_per_s", "gen tok/s", "{:.0f}"), ("engine_steps", "steps", "{}"),
           ("us_per_step", "us/step", "{:.0f}"), ("simulated_s", "sim s", "{:.0f}"),
           ("wall_s_per_100k", "wall s/100k", "{:.0f}"), ("max_waiting", "max queue", "{}"),
           ("mean_rows_per_step", "rows/step", "{:.1f}"), ("mean_page_use", "page use", "{:.2f}"),
           ("preemptions", "preempt", "{}"), ("load_avg_before", "load before", "{}")]


def format_table(rows: list[dict]) -> str:
    def cell(r, k, f):
        v = r.get(k)
        if isinstance(v, list):
            return "/".join(f"{x:.2f}" for x in v)
        return "n/a" if v is None else f.format(v)

    cells = [[h for _, h, _ in COLUMNS]] + [[cell(r, k, f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from experiments.lib.serving import env, workloads
    from paged.errors import InvalidConfigError
    from paged.policies import make_policy
    from paged.sim import StepTimeModel

    problem = FLAGS.json_out and out_path_problem(FLAGS.json_out, append=FLAGS.append)
    if problem:
        raise app.UsageError(f"--json_out: {problem}")
    if FLAGS.num_requests < 1:
        raise app.UsageError(f"--num_requests must be >= 1, got {FLAGS.num_requests}")
    rate = DEFAULT_RATES[FLAGS.workload] if FLAGS.rate is None else FLAGS.rate
    if not rate > 0:
        raise app.UsageError(f"--rate must be > 0, got {rate}")
    for name in ("input_len", "output_len", "priority_levels"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if not 0 <= FLAGS.range_ratio < 1:
        raise app.UsageError(f"--range_ratio must be in [0, 1), got {FLAGS.range_ratio}")
    if FLAGS.seed < 0:
        raise app.UsageError(f"--seed must be >= 0, got {FLAGS.seed}")
    if FLAGS.workload != "poisson":
        given = [n for n in ("input_len", "output_len", "range_ratio") if FLAGS[n].present]
        if given:
            raise app.UsageError(f"--{', --'.join(given)}: only for --workload=poisson (--workload={FLAGS.workload} "
                                 "has lengths of its own)")
    if FLAGS.json_out and FLAGS.profile and os.path.realpath(FLAGS.json_out) == os.path.realpath(FLAGS.profile):
        raise app.UsageError(f"--json_out and --profile name the same file {FLAGS.json_out}")
    if not FLAGS.policies:
        raise app.UsageError("--policies needs at least one policy")
    for p in FLAGS.policies:
        try:
            make_policy(p)
        except InvalidConfigError as e:
            raise app.UsageError(f"--policies: {e}") from None
    try:
        step_time_path = step_time_fits.fit_path(FLAGS.step_time_model)
        step_time = StepTimeModel.load(step_time_path)
    except (InvalidConfigError, ValueError) as e:
        raise app.UsageError(f"--step_time_model: {e}") from None
    config = engine_config()
    t0 = time.perf_counter()
    try:
        wl, arrivals = workloads.make_scenario(
            FLAGS.workload, FLAGS.num_requests, rate=rate, vocab_size=SIM_VOCAB, seed=FLAGS.seed,
            max_seq_len=config.max_seq_len, input_len=FLAGS.input_len, output_len=FLAGS.output_len,
            range_ratio=FLAGS.range_ratio, priority_levels=FLAGS.priority_levels)
    except ValueError as e:  # (a combination the checks above let through, e.g. lengths past max_seq_len)
        raise app.UsageError(f"the workload flags: {e}") from None
    build_s = time.perf_counter() - t0
    described = wl.describe()
    print(f"{FLAGS.workload}: {FLAGS.num_requests} requests at {rate}/s, mean input "
          f"{described['input_len']['mean']:.0f} / output {described['output_len']['mean']:.0f} tokens "
          f"(built in {build_s:.1f} s, not timed); {cpu_model()}, {os.cpu_count()} CPUs, load {load_average()}",
          file=sys.stderr)
    profiler = None
    if FLAGS.profile:
        import cProfile

        profiler = cProfile.Profile()
    rows = []
    for p in FLAGS.policies:
        rows.append(time_policy(p, config, step_time, wl, arrivals, profiler))
        r = rows[-1]
        print(f"  {p}: {r['wall_s']:.1f} s wall, {r['engine_steps']} steps, {r['generated_tokens']} tokens, "
              f"{r['wall_s_per_100k']:.0f} s per 100k requests (load {r['load_avg_after']})", file=sys.stderr)
    print(format_table(rows))
    if profiler is not None:
        profiler.dump_stats(FLAGS.profile)
        print(f"wrote {FLAGS.profile}", file=sys.stderr)
    write_record(FLAGS.json_out, {
        "schema": SCHEMA, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": env.git_info(),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "load_avg_end": load_average(), "command": " ".join(["python -m experiments.bench_sim", *sys.argv[1:]]),
        "workload": {**described, "rate": rate, "build_s": build_s}, "engine": config.to_dict(),
        "step_time_model": os.path.relpath(step_time_path), "profiled": bool(FLAGS.profile),
        "policies": rows,
    }, append=FLAGS.append)


if __name__ == "__main__":
    app.run(main)
