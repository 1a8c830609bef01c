"""Model and engine flags shared by the experiment scripts (`generate`, `bench_serving`).

absl flags live in one process-wide registry, so a flag two scripts both need is defined once, here: a script calls
`define()` at import (a second call is a no-op) and gets the same `--model`, `--quant`, cache and engine flags as
every other script, with the same meaning and defaults. `validate()` checks them with messages that name the flag
and the allowed values; `load_model()` and `generator_kwargs()` turn them into the library's arguments.
"""

from __future__ import annotations

from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS

NAMES = ("model", "dtype", "quant", "num_pages", "page_size", "max_seq_len", "max_chunk_size", "max_batch_size",
         "cache_dtype", "attn_impl", "matmul_impl", "policy", "compilation_cache_dir", "decode_steps", "progress",
         "seed", "temperature")


def define() -> None:
    if "decode_steps" in FLAGS:
        return
    flags.DEFINE_string("model", "smollm2-135m", "'smollm2-135m' (embedded), 'tiny' (random 2-layer test model, "
                        "no tokenizer), an HF directory or a .gguf file")
    flags.DEFINE_string("dtype", "float32", "float weights' dtype: float32, bfloat16 or float16")
    flags.DEFINE_string("quant", "keep", "weights: keep (a GGUF's Q4_0/Q4_1/Q8_0 blocks stay quantized; float "
                        "checkpoints load as float), int8, int4, or none (dequantize everything to --dtype)")
    flags.DEFINE_integer("num_pages", None, "KV-cache pages (default: max_batch_size full-length sequences + 1)")
    flags.DEFINE_integer("page_size", 64, "KV-cache page size in tokens (a power of two >= 8)")
    flags.DEFINE_integer("max_seq_len", None, "longest prompt + output (default: min(model max positions, 2048))")
    flags.DEFINE_integer("max_chunk_size", 256, "prefill tokens per step")
    flags.DEFINE_integer("max_batch_size", None, "jobs per step (default: set by the script)")
    flags.DEFINE_string("cache_dtype", "float32", "KV-cache dtype: float32, bfloat16, float16 or int8")
    flags.DEFINE_string("attn_impl", "auto", "paged attention: auto, xla, pallas or reference")
    flags.DEFINE_string("matmul_impl", "auto", "quantized matmul: auto, xla, pallas or reference")
    flags.DEFINE_string("policy", "exllamav2", "admission policy: exllamav2, fcfs or shortest_prompt_first")
    flags.DEFINE_string("compilation_cache_dir", None, "persistent JAX compilation cache directory")
    flags.DEFINE_integer("decode_steps", 4, "decode steps per device call once every job decodes (1 = one token "
                         "per step; more = fewer host round trips, tokens arrive in bursts)")
    flags.DEFINE_bool("progress", True, "progress bars on stderr")
    flags.DEFINE_integer("seed", None, "seed (generate: sampling seed, None = random, job i uses seed + i; "
                         "bench_serving: workload, arrivals and sampling seeds, None = 0)")
    flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)")


def validate() -> None:
    """Raise app.UsageError naming the flag and the allowed values."""
    from models.linear import MATMUL_IMPLS
    from models.loader import DTYPES
    from models.weights import QUANT_MODES
    from paged.engine import CACHE_DTYPES
    from paged.policy import POLICIES
    from paged.step import ATTN_IMPLS

    def one_of(name: str, allowed) -> None:
        value = getattr(FLAGS, name)
        if value not in allowed:
            raise app.UsageError(f"--{name}={value} is not one of: {', '.join(str(a) for a in allowed)}")

    one_of("cache_dtype", tuple(CACHE_DTYPES))
    one_of("dtype", tuple(DTYPES))
    one_of("attn_impl", ATTN_IMPLS)
    one_of("matmul_impl", MATMUL_IMPLS)
    one_of("policy", tuple(POLICIES))
    one_of("quant", ("none", *(q for q in QUANT_MODES if q)))
    ps = FLAGS.page_size
    if ps < 8 or ps & (ps - 1):
        raise app.UsageError(f"--page_size must be a power of two >= 8, got {ps}")
    for name in ("max_seq_len", "max_batch_size", "max_chunk_size", "decode_steps"):
        value = getattr(FLAGS, name)
        if value is not None and value < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {value}")
    if FLAGS.num_pages is not None and FLAGS.num_pages < 2:
        raise app.UsageError(f"--num_pages must be >= 2 (page 0 is reserved), got {FLAGS.num_pages}")
    if FLAGS.temperature < 0:
        raise app.UsageError(f"--temperature must be >= 0 (0 = greedy), got {FLAGS.temperature}")


def load_model() -> Any:
    """The model the flags name (`tiny`: the random test model of `experiments.common`)."""
    from experiments.common import load_experiment_model

    return load_experiment_model(FLAGS.model, dtype=FLAGS.dtype, quant=None if FLAGS.quant == "none" else FLAGS.quant)


def generator_kwargs(max_batch_size: int) -> dict[str, Any]:
    """DynamicGenerator keyword arguments from the flags; `max_batch_size` is the script's default for it."""
    return dict(num_pages=FLAGS.num_pages, page_size=FLAGS.page_size, max_batch_size=FLAGS.max_batch_size or
                max_batch_size, max_chunk_size=FLAGS.max_chunk_size, max_seq_len=FLAGS.max_seq_len,
                policy=FLAGS.policy, cache_dtype=FLAGS.cache_dtype, attn_impl=FLAGS.attn_impl,
                matmul_impl=FLAGS.matmul_impl, compilation_cache_dir=FLAGS.compilation_cache_dir,
                decode_steps=FLAGS.decode_steps)
