"""Where a speculative step's time goes at batch 1: the draft burst, the target's forward (plain or verification
bucket), its sampler (plain or `verify_sample`), the draft's mirror forward, and the host work around them.

Each jitted entry point (`step_forward`, `step_sample`, `verify_sample`, `draft_burst_jit`) is wrapped with a timer
that waits for its result (`jax.block_until_ready`), so the parts no longer overlap the host work as they do in a
normal run: the wall time here is a little above a benchmark's, and "host" (wall minus the parts) is what the
generator does between device calls. One seeded copy-workload prompt runs twice on one generator, warmed up (the
first run is discarded; the second finds the prompt's pages in the prompt cache), greedy (or sampled with
`--temperature`, seeded), one job at a time:

    python -m experiments.profile_speculative --drafter=none
    python -m experiments.profile_speculative --drafter=ngram
    python -m experiments.profile_speculative --drafter=distilled --draft_dir=/tmp/smollm2-draft \
        --json_out=experiments/results/profile_speculative_cpu.json   (appends one record per call)

`--ops` adds a third pass of the same prompt under `jax.profiler.trace` and breaks each part down by the XLA
operations its program ran (the CPU runtime's thunks: fusions, custom calls such as the native matmul and
attention, copies), in milliseconds per call of the part. A loop over layers counts as the operations inside it,
summed over its iterations; an operation is labelled with its custom call target and result shape from the
compiled program's HLO where it has them. The traced pass's own timings are not reported (tracing slows the host).

    python -m experiments.profile_speculative --drafter=ngram --ops
"""

from __future__ import annotations

import collections
import tempfile
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, write_record
from experiments.lib.trace_ops import op_breakdown

flags.DEFINE_string("model", "smollm2-135m", "target model")
flags.DEFINE_string("quant", "keep", "target weights: keep (GGUF blocks as stored, as bench_speculative), none, int8")
flags.DEFINE_enum("drafter", "ngram", ["none", "ngram", "self", "distilled"], "what drafts")
flags.DEFINE_string("draft_dir", None, "--drafter=distilled: the draft checkpoint (experiments.distill_draft)")
flags.DEFINE_enum("draft_quant", "int8", ["int8", "int4", "none"], "the distilled draft's weights at load")
flags.DEFINE_integer("self_draft_layers", 4, "--drafter=self: layers of the truncated self-draft")
flags.DEFINE_integer("num_draft_tokens", 4, "drafts per step")
flags.DEFINE_bool("adaptive", False, "adaptive_draft=True")
flags.DEFINE_integer("prompt", 0, "which prompt of the seeded copy workload")
flags.DEFINE_integer("max_new_tokens", 96, "tokens per run")
flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampled, `SamplingSettings(temperature=T)` (its other "
                   "defaults, as bench_speculative), seeded: both runs draw the same tokens")
flags.DEFINE_string("json_out", None, "append the record to this JSON list")
check_out_flag("json_out", append=True)
flags.DEFINE_bool("ops", False, "also break each part down by XLA operation (a traced third pass)")
flags.DEFINE_integer("ops_top", 8, "--ops: operations printed per part (the record keeps all)")
FLAGS = flags.FLAGS

PARTS = {"step_forward": "paged.device.engine", "step_sample": "paged.device.engine",
         "verify_sample": "paged.device.engine", "draft_burst_jit": "paged.device.engine"}


def abstract(a: tuple, k: dict) -> tuple[tuple, dict]:
    """Positional and keyword arguments with every array replaced by its shape and dtype (enough to lower a jitted
    function again; holds no buffer, and a donated one may be gone)."""
    import jax
    import numpy as np

    def shape_of(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, (jax.Array, np.ndarray)) else x

    return jax.tree.map(shape_of, a), jax.tree.map(shape_of, k)


def wrap_parts(times: dict, calls: list | None = None) -> None:
    """Replace each entry point of `PARTS` in its module by a timed, waiting copy; times land in
    `times[(part, detail)]` (detail: the layer count and token layout of a forward, so that the draft's mirror
    and the target's forward are told apart). `calls`, when given, gets (part, detail, function, args, kwargs) of
    every call in order, the arguments for a part's first call only and as shapes (`op_breakdown` reads it)."""
    import importlib

    import jax

    for name, mod_name in PARTS.items():
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            out = _fn(*a, **k)
            jax.block_until_ready(out)
            detail = ""
            if _name == "step_forward":
                lay = k["shape"].layout
                detail = (f"{k['statics'].cfg.num_layers} layers, {lay.num_prefill_rows} prefill rows x "
                          f"{lay.max_q_len}, {lay.num_decode_rows} decode rows")
            elif _name == "draft_burst_jit":  # with a window (a two-slot first forward: catch-up tokens, or rows
                # moved on from a verification on the device: a burst dispatched ahead) or without
                detail = "window" if (a[3] if len(a) > 3 else k.get("window")) is not None else "no catch-up"
            times[(_name, detail)].append(time.perf_counter() - t)
            if calls is not None:  # the arguments of a part's first call only, as shapes (no buffers held)
                first = all((c[0], c[1]) != (_name, detail) for c in calls)
                calls.append((_name, detail, _fn, *(abstract(a, k) if first else (None, None))))
            return out

        setattr(mod, name, timed)


def check_flags() -> None:
    """app.UsageError naming the flag for a value the run would not use or could not take, before the model loads."""
    from paged.speculation.rows import MAX_DRAFT_TOKENS

    if FLAGS.drafter == "none" and FLAGS.adaptive:
        raise app.UsageError("--adaptive needs a drafter (--drafter ngram, self or distilled)")
    if FLAGS.draft_dir and FLAGS.drafter != "distilled":
        raise app.UsageError(f"--draft_dir is --drafter=distilled's checkpoint; this run's drafter is {FLAGS.drafter}")
    if FLAGS.drafter == "distilled" and not FLAGS.draft_dir:
        raise app.UsageError("--drafter=distilled needs --draft_dir")
    if not 1 <= FLAGS.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise app.UsageError(f"--num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {FLAGS.num_draft_tokens}")
    for name in ("self_draft_layers", "max_new_tokens"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if FLAGS.prompt < 0:
        raise app.UsageError(f"--prompt must be >= 0 (which prompt of the copy workload), got {FLAGS.prompt}")
    if not FLAGS.temperature >= 0:
        raise app.UsageError(f"--temperature must be >= 0 (0: greedy), got {FLAGS.temperature}")


def main(argv):
    del argv
    check_flags()
    import numpy as np

    from experiments.lib.common import chat_prompt, model_flag, workload
    from experiments.lib.serving.env import device_info, git_info, load_average
    from models import load_model
    from models.draft import truncated_model
    from paged import DynamicGenerator, Job, SamplingSettings

    times: dict = collections.defaultdict(list)
    calls: list | None = [] if FLAGS.ops else None
    wrap_parts(times, calls)
    with model_flag("model", FLAGS.model):
        target = load_model(FLAGS.model, quant=None if FLAGS.quant == "none" else FLAGS.quant)
    tok = target.tokenizer
    if tok is None:
        raise app.UsageError(f"--model {FLAGS.model} has no tokenizer: this profile runs a chat prompt")
    kw: dict = {}
    if FLAGS.drafter == "ngram":
        kw = dict(use_ngram_draft=True)
    elif FLAGS.drafter == "self":
        if FLAGS.self_draft_layers > target.config.num_layers:
            raise app.UsageError(f"--self_draft_layers={FLAGS.self_draft_layers}: the model has "
                                 f"{target.config.num_layers} layers")
        kw = dict(draft_model=truncated_model(target, FLAGS.self_draft_layers))
    elif FLAGS.drafter == "distilled":
        with model_flag("draft_dir", FLAGS.draft_dir):
            kw = dict(draft_model=load_model(FLAGS.draft_dir, load_tokenizer=False,
                                             quant=None if FLAGS.draft_quant == "none" else FLAGS.draft_quant))
    if kw:
        kw.update(num_draft_tokens=FLAGS.num_draft_tokens, adaptive_draft=FLAGS.adaptive)
    gen = DynamicGenerator(target, max_batch_size=1, max_seq_len=min(1024, target.config.max_position_embeddings),
                           **kw)
    prompt = chat_prompt(tok, workload("copy", FLAGS.prompt + 1, 0)[FLAGS.prompt])
    ids = tok.encode(prompt, encode_special_tokens=True)
    load_before = load_average("profile_speculative")
    settings = (SamplingSettings.greedy() if FLAGS.temperature <= 0
                else SamplingSettings(temperature=FLAGS.temperature))

    emitted: list[int] = []

    def run_prompt() -> int:
        """The prompt once, to the end (its tokens in `emitted`); returns the iterates it took."""
        gen.enqueue(Job(ids, FLAGS.max_new_tokens, gen_settings=settings, seed=0,
                        stop_conditions=[tok.eos_token_id]))
        emitted.clear()
        n = 0
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                emitted.extend(r.get("token_ids", []) if r.get("stage") == "streaming" else [])
            n += 1
        return n

    gen.warmup()  # every bucket: the measured run's prefill of the prompt's uncached tail compiles nothing
    for _ in range(2):  # the first run warms the caches (and fills the prompt cache); the second is measured
        times.clear()
        before = gen.metrics()
        t0 = time.perf_counter()
        iterates = run_prompt()
        wall = time.perf_counter() - t0
    after = gen.metrics()
    out_tokens = list(map(int, emitted))  # the measured run's (a traced pass below runs the prompt again)
    tokens = after["tokens_generated"] - before["tokens_generated"]
    parts = {f"{n} ({d})" if d else n: {"calls": len(v), "median_ms": 1e3 * float(np.median(v)),
                                         "total_s": float(sum(v))} for (n, d), v in sorted(times.items())}
    host = wall - sum(p["total_s"] for p in parts.values())
    ops = None
    if FLAGS.ops:  # a third pass, traced (the parts above are the untraced pass's)
        import jax

        with tempfile.TemporaryDirectory() as trace_dir:
            calls.clear()
            with jax.profiler.trace(trace_dir):
                run_prompt()
            ops = op_breakdown(trace_dir, calls)
    names = ("model", "quant", "drafter", "draft_dir", "draft_quant", "self_draft_layers", "num_draft_tokens",
             "adaptive", "prompt", "max_new_tokens", "temperature")
    rec = {"flags": {k: getattr(FLAGS, k) for k in names},
           "git": git_info(), "device": device_info(), "load_before": load_before,
           "tokens": tokens, "output_tokens": out_tokens, "iterates": iterates, "wall_s": wall,
           "ms_per_iterate": 1e3 * wall / max(iterates, 1),
           "tokens_per_s": tokens / wall, "host_s": host, "parts": parts,
           "drafted_tokens": after["drafted_tokens"] - before["drafted_tokens"],
           "accepted_draft_tokens": after["accepted_draft_tokens"] - before["accepted_draft_tokens"]}
    if ops is not None:
        rec["ops"] = ops
    print(f"{FLAGS.drafter}: {tokens} tokens in {iterates} iterates, {rec['ms_per_iterate']:.2f} ms per iterate, "
          f"{rec['tokens_per_s']:.1f} tok/s")
    for name, p in parts.items():
        print(f"  {name:75s} {p['calls']:5d} calls  median {p['median_ms']:7.2f} ms  total {p['total_s']:.3f} s")
    print(f"  {'host (the rest)':75s} {'':5s}        {'':7s}      total {host:.3f} s")
    for part, b in sorted((ops or {}).items()):
        print(f"{part}: by operation, ms per call ({b['calls']} calls traced)")
        for row in b["ops"][:FLAGS.ops_top]:
            print(f"  {row['ms_per_call']:8.3f}  {row['op']:32s} {row['label']}")
    write_record(FLAGS.json_out, rec, append=True)


if __name__ == "__main__":
    app.run(main)
