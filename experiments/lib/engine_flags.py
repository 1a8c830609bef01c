"""Model and engine flags shared by the experiment scripts (`generate`, `bench_serving`, `bench_peers`).

absl flags live in one process-wide registry, so a flag two scripts both need is defined once, here: a script calls
`define()` at import (a second call is a no-op) and gets the same `--model`, `--quant`, cache and engine flags as
every other script, with the same meaning and defaults. `validate()` checks them with messages that name the flag
and the allowed values; `load_model()` and `generator_kwargs()` turn them into the library's arguments.

The flags count as the calling script's own (`flags.disclaim_key_flags()` below), so `--help` lists them, not only
`--helpfull`.
"""

from __future__ import annotations

from typing import Any

from absl import app, flags

from paged.device.config import EngineConfig, config_fields
from paged.device.cpu_runtime import MODES as CPU_DISPATCH_MODES
from paged.errors import InvalidConfigError

FLAGS = flags.FLAGS
flags.disclaim_key_flags()  # flags defined by define() belong to the script that calls it (and show in its --help)

# Experiments differ from the library's defaults here (None: the script decides, see `engine_config`).
EXPERIMENT_DEFAULTS = {"decode_steps": 4, "max_batch_size": None, "max_penalty_range": None}
ENGINE_NAMES = tuple(f.name for f in config_fields())
NAMES = ("model", "dtype", "quant", *ENGINE_NAMES, "policy", "compilation_cache_dir", "progress", "seed",
         "temperature", "cpu_dispatch")


def define() -> None:
    """Define the shared flags (a second call is a no-op). Every `paged.device.config.EngineConfig` field becomes a
    flag of the same name, type, default (unless `EXPERIMENT_DEFAULTS` says otherwise) and help text."""
    if "decode_steps" in FLAGS:
        return
    flags.DEFINE_string("model", "smollm2-135m", "'smollm2-135m' (embedded), 'tiny' (random 2-layer test model, "
                        "no tokenizer), an HF directory or a .gguf file")
    flags.DEFINE_string("dtype", "float32", "float weights' dtype: float32, bfloat16 or float16")
    flags.DEFINE_string("quant", "keep", "weights: keep (a GGUF's Q4_0/Q4_1/Q8_0 blocks stay quantized; float "
                        "checkpoints load as float), int8, int4, or none (dequantize everything to --dtype)")
    for f in config_fields():
        define_config_flag(f.name)
    from paged.policies import policy_names

    flags.DEFINE_string("policy", "exllamav2", f"scheduling policy: one of {policy_names()}, or 'module:Class' for "
                        "your own paged.policies.Policy subclass (docs/scheduling.md)")
    flags.DEFINE_string("compilation_cache_dir", None, "persistent JAX compilation cache directory")
    flags.DEFINE_bool("progress", True, "progress bars on stderr")
    flags.DEFINE_integer("seed", None, "seed (generate: sampling seed, None = random, job i uses seed + i; "
                         "bench_serving: workload, arrivals and sampling seeds, None = 0)")
    flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)")
    define_cpu_dispatch()


def define_config_flag(name: str) -> None:
    """The flag of `EngineConfig` field `name`: same name, type, default (unless `EXPERIMENT_DEFAULTS` says
    otherwise) and help text; for a script with flags of its own (`bench_speculative --fuse_sampler`). A second call
    is a no-op."""
    if name in FLAGS:
        return
    f = next(f for f in config_fields() if f.name == name)
    default = EXPERIMENT_DEFAULTS.get(f.name, f.default)
    help_text = f.metadata["help"]
    if f.name in EXPERIMENT_DEFAULTS and default is None:
        help_text += " (default: set by the script)"
    if f.type in ("str", str, "Any"):  # Any: a kernel tuning, given as text ("block_q=16,..." or a JSON file)
        flags.DEFINE_string(f.name, default, help_text)
    elif f.type in ("bool", bool):
        flags.DEFINE_bool(f.name, default, help_text)
    else:
        flags.DEFINE_integer(f.name, default, help_text)


def define_cpu_dispatch() -> None:
    """`--cpu_dispatch` alone, for a script with model flags of its own (`bench_speculative`); `define()` includes
    it. A second call is a no-op. `apply_cpu_dispatch()` sets the mode it names."""
    if "cpu_dispatch" in FLAGS:
        return
    flags.DEFINE_enum("cpu_dispatch", "async", list(CPU_DISPATCH_MODES), "how XLA's CPU client runs the step's "
                      "programs: async (JAX's default: in a worker thread) or sync (in the calling thread: 6-7% "
                      "faster batch-1 decoding at --decode_steps=1 on a 2-core CPU, no gain with decode bursts or "
                      "a draft model; no effect on a GPU); process-wide (one mode for the whole run), see "
                      "paged/device/cpu_runtime.py")


def engine_config(max_batch_size: int, max_penalty_range: int = 0) -> EngineConfig:
    """The `EngineConfig` the flags describe; `max_batch_size` and `max_penalty_range` are the script's defaults
    for the flags of that name. Invalid values raise app.UsageError naming the flag."""
    values = {name: getattr(FLAGS, name) for name in ENGINE_NAMES}
    if values["max_batch_size"] is None:
        values["max_batch_size"] = max_batch_size
    if values["max_penalty_range"] is None:
        values["max_penalty_range"] = max_penalty_range
    try:
        return EngineConfig(**values)
    except InvalidConfigError as e:
        raise app.UsageError(str(e).replace("EngineConfig: ", "--", 1)) from None


def validate() -> None:
    """Raise app.UsageError naming the flag and the allowed values. Sets `--cpu_dispatch` first
    (`apply_cpu_dispatch()`): checking the engine flags starts JAX's backend."""
    from models.loader import DTYPES
    from models.weights import QUANT_MODES

    apply_cpu_dispatch()

    def one_of(name: str, allowed) -> None:
        value = getattr(FLAGS, name)
        if value not in allowed:
            raise app.UsageError(f"--{name}={value} is not one of: {', '.join(str(a) for a in allowed)}")

    one_of("dtype", tuple(DTYPES))
    check_policy("policy", FLAGS.policy)
    one_of("quant", ("none", *(q for q in QUANT_MODES if q)))
    engine_config(1)
    if FLAGS.temperature < 0:
        raise app.UsageError(f"--temperature must be >= 0 (0 = greedy), got {FLAGS.temperature}")


def check_policy(flag: str, value: str) -> None:
    """A policy name or 'module:Class' that `paged.policies.make_policy` accepts; else app.UsageError."""
    from paged.errors import GeneratorError
    from paged.policies import make_policy, policy_names

    try:
        make_policy(value)
    except GeneratorError as e:
        if ":" in value:
            raise app.UsageError(f"--{flag}={value}: {e}") from None
        raise app.UsageError(f"--{flag}={value} is not one of: {policy_names()} (or 'module:Class' for your own "
                             "paged.policies.Policy subclass)") from None


def apply_cpu_dispatch() -> str:
    """Set the CPU dispatch mode `--cpu_dispatch` asks for, before JAX's backend starts; returns it. app.UsageError
    when the backend already runs in the other mode."""
    from paged.device.cpu_runtime import set_cpu_dispatch

    try:
        set_cpu_dispatch(FLAGS.cpu_dispatch)
    except InvalidConfigError as e:
        raise app.UsageError(f"--cpu_dispatch={FLAGS.cpu_dispatch}: {e}") from None
    return FLAGS.cpu_dispatch


def load_model() -> Any:
    """The model the flags name (`tiny`: the random test model of `experiments.lib.common`), loaded after
    `apply_cpu_dispatch()` (loading starts JAX's backend)."""
    from experiments.lib.common import load_experiment_model, model_flag

    apply_cpu_dispatch()
    with model_flag("model", FLAGS.model):  # (an unknown or broken --model: a usage error, in every script)
        return load_experiment_model(FLAGS.model, dtype=FLAGS.dtype,
                                     quant=None if FLAGS.quant == "none" else FLAGS.quant)


def generator_kwargs(max_batch_size: int, max_penalty_range: int = 0) -> dict[str, Any]:
    """DynamicGenerator keyword arguments from the flags (see `engine_config` for the two script defaults)."""
    return dict(config=engine_config(max_batch_size, max_penalty_range), policy=FLAGS.policy,
                compilation_cache_dir=FLAGS.compilation_cache_dir)
