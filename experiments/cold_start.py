"""Cold start of the main job: seconds from launching `python -m experiments.generate` to the first byte of streamed
text, in a fresh process each time — without a compilation cache, then twice with a persistent one (the first run
fills it, the second reads it).

    python -m experiments.cold_start --json_out experiments/results/cold_start_cpu.json

Each run is a new Python process (imports, model load, tokenizer, engine, compilation or cache reads, prefill,
first sample); the parent only watches the child's stdout. The child's own timing line (stderr) is kept too.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, write_record

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", "Give me three facts about octopuses.", "the prompt (the README's)")
flags.DEFINE_integer("max_new_tokens", 16, "tokens per run")
flags.DEFINE_list("extra_args", [], "more flags for experiments.generate, e.g. --quant=none")
flags.DEFINE_string("json_out", None, "write the record here")
check_out_flag("json_out")


def first_token_seconds(args: list[str]) -> tuple[float, float, str]:
    """(seconds to the first stdout byte, seconds to exit, the child's stderr)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.generate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    proc.stdout.read()
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0 and "Traceback (most recent call last)" not in err:  # generate refused a flag (usage)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        fatal = [ln for ln in lines if "Flags parsing error" in ln or ln.startswith("Error: ")]
        raise app.UsageError(f"--extra_args: experiments.generate refused its flags: {(fatal or lines or ['?'])[-1]}")
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"experiments.generate failed (exit {proc.returncode}):\n{err}")
    return t_first, time.perf_counter() - t0, err


def main(argv):
    del argv
    if FLAGS.max_new_tokens < 1:
        raise app.UsageError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
    load = os.getloadavg()
    if load[0] > 0.5:
        print(f"warning: load average {load[0]:.2f}; timings are only valid on an idle machine")
    base = [f"--prompt={FLAGS.prompt}", f"--max_new_tokens={FLAGS.max_new_tokens}", "--noprogress", *FLAGS.extra_args]
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        for label, args in (("no compilation cache", base),
                            ("cache: first run (fills it)", base + [f"--compilation_cache_dir={cache}"]),
                            ("cache: second run (reads it)", base + [f"--compilation_cache_dir={cache}"])):
            t_first, t_exit, err = first_token_seconds(args)
            runs.append(dict(run=label, first_token_s=t_first, exit_s=t_exit, child_timing=err.strip().splitlines()))
            print(f"{label:30s} first token after {t_first:5.1f} s, exit after {t_exit:5.1f} s", flush=True)
    if FLAGS.json_out:
        import jax

        write_record(FLAGS.json_out, dict(
            prompt=FLAGS.prompt, max_new_tokens=FLAGS.max_new_tokens, extra_args=FLAGS.extra_args,
            machine=platform.machine(), cpus=os.cpu_count(), jax=jax.__version__, load_avg_before=load,
            load_avg_after=os.getloadavg(), runs=runs))


if __name__ == "__main__":
    app.run(main)
