"""Measure, fit and validate the simulator's step-time model on this machine, in one command:

1. the fit: `Engine.run` timed on every step of the generator serving a calibration workload and over a grid of
   prefill shapes (`experiments.lib.calibration`), fitted as a `paged.sim.StepTimeModel` that records its setup (CPU
   and instruction sets or GPU, kernels, model, quantization, cache dtype, page size, date, commit);
2. the validation (`experiments.validate_sim`): the same workload and policies through the real engine
   (`--real_repeats` times, interleaved; the median compared, the spread reported) and the simulator priced by the
   new fit, at two loads (`--rates`: one under saturation, one past it): step-time error, TTFT p50 error and the rank
   agreement of the policies (Kendall's tau) per load;
3. with `--install`, the fit goes to `experiments/data/step_time/NAME.json`, where `--step_time_model=NAME` finds it.
   A fit already filed under that name is validated against the same real runs beside the new one
   (`validate_sim --also_fits`), so the record shows what replacing it changes.

By default (`--interleave`) the fit is measured inside the validation's process, one calibration slice before each
round of real runs and one after the last (`validate_sim --fit_interleaved`): on a shared host whose speed drifts
from one ten seconds to the next, the fit and the runs it is checked against then sample the same states of the
machine. `--nointerleave` measures it first (`experiments.profile_step --fit_out`, its own process: 3 passes over the
grid, the serving workload once), then validates.

    python -m experiments.fit_and_validate --name=cpu_epyc_smollm2_q4 --install \\
        --json_out=experiments/results/fit_and_validate/cpu_epyc_smollm2_q4.json

Run it on an idle machine: the record keeps the load average. Takes ~30 minutes on the 2-core CPU host (~12 with
`--nointerleave`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments.lib import step_time_fits
from experiments.lib.common import check_out_flag

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The flags, defined only when this runs as a script: they share names (--model, --policies, --rates, ...) with
    compare_policies and validate_sim, which a test process may import too."""
    flags.DEFINE_string("name", None, "the fit's name: hardware_model_setup, e.g. cpu_epyc_smollm2_q4 (required)")
    flags.DEFINE_string("model", "smollm2-135m", "model to measure (as every experiment's --model)")
    flags.DEFINE_string("quant", "keep", "weights: keep, none, int8, int4 (as every experiment's --quant)")
    flags.DEFINE_string("dtype", "float32", "float weights' dtype: float32, bfloat16 or float16")
    flags.DEFINE_string("cache_dtype", "float32", "KV cache dtype")
    flags.DEFINE_integer("page_size", 64, "tokens per page")
    flags.DEFINE_list("policies", ["exllamav2", "vllm", "sjf"], "policies to validate (>= 3 for a ranking; ones that "
                      "order differently past saturation)")
    flags.DEFINE_list("rates", ["3", "12"], "two request rates: one under saturation, one past it (the defaults "
                      "bracket the 2-core CPU's ~7 requests/s on the default workload)")
    flags.DEFINE_integer("num_requests", 96, "requests per policy and rate in the validation")
    flags.DEFINE_integer("real_repeats", 3, "real runs per policy and rate in the validation (the median is compared, "
                         "the spread reported: the real engine's own repeatability)")
    flags.DEFINE_integer("page_budget", 48, "usable KV pages in the validation (memory pressure separates policies)")
    flags.DEFINE_list("validate_flags", ["--range_ratio=0.5", "--output_len=64"], "more flags for validate_sim (the "
                      "workload: 128 +-50% prompt and 64 +-50% output tokens by default)")
    flags.DEFINE_bool("interleave", True, "measure the fit between the validation's real runs (validate_sim "
                      "--fit_interleaved) instead of before them (profile_step)")
    flags.DEFINE_bool("install", False, "copy the fit to experiments/data/step_time/NAME.json")
    flags.DEFINE_string("json_out", None, "write the validation record here (the fit is inside it)")
    check_out_flag("json_out")


def run(module: str, args: list[str]) -> None:
    cmd = [sys.executable, "-m", module, *args]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.run(cmd).returncode
    if rc:
        raise SystemExit(f"{module} failed (exit status {rc})")


def check_validate_args(args: list[str]) -> None:
    """validate_sim's own flag checks on the flags it will get (`--check_flags_only`: a few seconds, nothing loaded),
    before anything is measured: a bad --num_requests, --policies, --rates or --validate_flags is an app.UsageError
    now, not after profile_step's minutes. (In a process of its own: its flags share names with this script's.)"""
    cmd = [sys.executable, "-m", "experiments.validate_sim", *args, "--check_flags_only"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        lines = [x for x in (p.stderr or p.stdout).strip().splitlines() if x.strip() and "--helpshort" not in x]
        raise app.UsageError("the flags passed on to experiments.validate_sim (--policies, --rates, --num_requests, "
                             "--page_budget, --validate_flags, ...) are refused: "
                             + (lines[-1] if lines else f"exit status {p.returncode}"))


def read_record(path: str) -> dict:
    """validate_sim's JSON record (gzip-compressed when `path` ends with .gz, as validate_sim writes it)."""
    import gzip

    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def main(argv):
    del argv
    if not FLAGS.name or any(c in FLAGS.name for c in "/\\. "):  # (checked here: a required flag would bind every
        # process that imports this module)
        raise app.UsageError(f"--name must be a plain name such as cpu_epyc_smollm2_q4, got {FLAGS.name!r}")
    if len(FLAGS.rates) != 2:
        raise app.UsageError(f"--rates takes two rates (under and past saturation), got {FLAGS.rates}")
    if FLAGS.real_repeats < 1:
        raise app.UsageError(f"--real_repeats must be >= 1, got {FLAGS.real_repeats}")
    if len(FLAGS.policies) < 3:
        raise app.UsageError("--policies needs at least 3 policies for a rank agreement")
    common = [f"--model={FLAGS.model}", f"--quant={FLAGS.quant}", f"--dtype={FLAGS.dtype}",
              f"--cache_dtype={FLAGS.cache_dtype}",
              f"--page_size={FLAGS.page_size}"]
    with tempfile.TemporaryDirectory() as tmp:
        fit = os.path.join(tmp, FLAGS.name + ".json")
        record = FLAGS.json_out or os.path.join(tmp, "validate.json")
        if FLAGS.interleave:
            measure = ["--fit_interleaved", f"--fit_out={fit}", f"--fit_name={FLAGS.name}"]
        else:
            measure = [f"--step_time_model={fit}"]  # (written by profile_step below)
        installed = os.path.join(step_time_fits.FITS_DIR, FLAGS.name + ".json")
        also = [f"--also_fits={installed}"] if os.path.exists(installed) else []  # the fit this one would replace
        validate_args = [*common, *measure, *also, f"--policies={','.join(FLAGS.policies)}",
                         f"--rates={','.join(FLAGS.rates)}", f"--num_requests={FLAGS.num_requests}",
                         f"--real_repeats={FLAGS.real_repeats}", f"--page_budget={FLAGS.page_budget}", "--noprogress",
                         "--nosave_steps", f"--json_out={record}", *FLAGS.validate_flags]
        check_validate_args(validate_args)  # (before anything is measured)
        if not FLAGS.interleave:
            run("experiments.profile_step", [*common, f"--fit_out={fit}", f"--fit_name={FLAGS.name}"])
        run("experiments.validate_sim", validate_args)
        rec = read_record(record)
        errors = rec["errors"]
        step_ok = sum(r["step_ok"] for r in errors)
        ttft_ok = sum(r["ttft_ok"] for r in errors)
        print(f"fit {FLAGS.name}: step time within target for {step_ok}/{len(errors)} (policy, rate) pairs, TTFT p50 "
              f"for {ttft_ok}/{len(errors)}; rank agreement (Kendall's tau) "
              + ", ".join((f"{k['tau']:+.2f} at {k['rate']}/s" if k["tau"] is not None else f"n/a at {k['rate']}/s")
                          + (f" (the same order for {sum(p['sim_agrees'] for p in k['pairs'])} of the "
                             f"{len(k['pairs'])} pairs the real runs order reproducibly)" if k.get("pairs") is not None
                             else "")
                          for k in rec["rank_agreement"]))
        if FLAGS.json_out:  # the fit beside its validation record
            shutil.copyfile(fit, os.path.splitext(FLAGS.json_out.removesuffix(".gz"))[0] + "_fit.json")
        if FLAGS.install:
            os.makedirs(step_time_fits.FITS_DIR, exist_ok=True)
            dest = os.path.join(step_time_fits.FITS_DIR, FLAGS.name + ".json")
            shutil.copyfile(fit, dest)
            print(f"installed {dest}: --step_time_model={FLAGS.name}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
