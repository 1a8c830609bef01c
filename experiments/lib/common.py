"""Helpers shared by the experiment scripts."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Callable
from typing import IO, Any


def _json_default(o: Any) -> Any:
    """What `json.dump` cannot write itself: numpy scalars and arrays as numbers and lists, anything else (a path, a
    set) as its `str`."""
    if hasattr(o, "tolist") and hasattr(o, "dtype"):  # a numpy scalar or array
        return o.tolist()
    return str(o)


def _record_list(path: str) -> tuple[list | None, str | None]:
    """(the records of `path`, a JSON list of them; [] where the file does not exist, None with why it cannot be
    appended to)."""
    if not os.path.exists(path):
        return [], None
    try:
        with open(path) as fh:
            old = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{path} cannot be appended to: not a JSON list of records ({e})"
    if not isinstance(old, list):
        return None, f"{path} cannot be appended to: it holds a JSON {type(old).__name__}, not a list of records"
    return old, None


def write_jsonl(sink: IO[str] | None, record: dict) -> None:
    """One record as a line of JSON to an open `sink` (None: nothing), flushed: a stream of records a crash leaves
    whole up to the last line (`write_record` writes a file's one record or list)."""
    if sink is not None:
        sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        sink.flush()


def write_record(path: str | None, record: dict, *, append: bool = False) -> None:
    """Write a script's JSON record to `path` (creating its folder) and say so; nothing when `path` is None. Numpy
    values are written as numbers, anything else JSON cannot hold as its `str`. `append`: the file holds a JSON list
    of records (a missing file: an empty one), and `record` is added to its end (`ValueError` for a file that is not
    such a list: `check_out_flag(append=True)` finds that before a run)."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    out: Any = record
    if append:
        old, problem = _record_list(path)
        if problem:
            raise ValueError(problem)
        out = [*old, record]
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1, default=_json_default)
    print(f"wrote {path}")


def out_path_problem(path: str, folder: bool = False, append: bool = False) -> str | None:
    """Why a script could not write its output at `path` (a file, or with `folder` a folder it makes; `append`: a
    file that `write_record(append=True)` adds to), or None: checked before a run, so that a bad path does not fail
    after the work. Nothing is created."""
    if not folder and (os.path.isdir(path) or path.endswith(os.sep)):
        return f"{path} is a folder: give a file path in it"
    if folder and os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a file: give a folder path"
    probe = os.path.abspath(path if folder else os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(probe):  # the nearest folder that exists: it must let us make the rest
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{path}: {probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{path}: {probe} is not writable"
    if append:
        return _record_list(path)[1]
    return None


def check_out_flag(name: str, folder: bool = False, append: bool = False) -> None:
    """Have absl check the output path in flag `name` when it parses the flags (`out_path_problem`): a usage error
    before the script starts its work."""
    from absl import flags

    def check(value: str | None) -> bool:
        problem = value and out_path_problem(value, folder, append)
        if problem:
            raise flags.ValidationError(problem)
        return True

    flags.register_validator(name, check)


def read_jsonl(path: str, flag: str, parse: Callable[[Any, int, int], Any], error: type[Exception]) -> list:
    """Every non-empty line of the JSONL file `path` (the value of `flag`), decoded and passed to
    `parse(obj, line number, index)` (index: the non-empty lines before it), whose ValueError marks the line bad.
    All bad lines are reported together in one `error`, each by its number (the first 10 shown); an unreadable file
    or one without a line is an `error` too."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read {flag} {path}: {e}") from e
    items, errors = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        try:
            items.append(parse(obj, lineno, len(items) + len(errors)))
        except ValueError as e:
            errors.append(f"{path}:{lineno}: {e}")
    if errors:
        shown = errors[:10] + ([f"... and {len(errors) - 10} more bad lines"] if len(errors) > 10 else [])
        raise error(f"{len(errors)} bad line(s) in {flag} (line 1 is the first line):\n  " + "\n  ".join(shown))
    if not items:
        raise error(f"{flag} {path} has no prompts")
    return items


def load_experiment_model(name: str, *, dtype: str = "float32", quant: str | None = None):
    """`"tiny"` (a random 2-layer Llama for quick runs) or anything `models.load_model` accepts, loaded with `dtype`
    and `quant` (both ignored for "tiny"; quant "none" is None). That includes "preset:NAME[@FORMAT]", a real
    architecture with random weights and no tokenizer (`models.presets`; docs/api.md, "Presets"). A file or
    directory named "tiny" is loaded as a model, as `load_model` lets an existing path win over a name."""
    from models import ModelConfig, init_random_weights, load_model
    from models.loader import Model

    if name == "tiny" and not os.path.exists(name):
        cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)
        return Model(config=cfg, params=init_random_weights(cfg), tokenizer=None, source="tiny")
    return load_model(name, dtype=dtype, quant=None if quant == "none" else quant)


# Seeded prompt material shared by the speculative-decoding benchmark and the matmul quality check.
TEXTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold; fortune favours the bold, and practice makes perfect.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n",
    "Photosynthesis converts light energy into chemical energy. Plants take in carbon dioxide and water and, using "
    "sunlight, produce glucose and oxygen. The process happens in the chloroplasts.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
]
COPY_TASKS = ["Repeat the following text exactly:\n\n{}", "Rewrite the following, fixing any typos:\n\n{}",
              "Quote this passage and then explain it briefly:\n\n{}"]
CHAT = ["What are three tips for learning a new language?", "Write a short poem about autumn.",
        "Explain how a rainbow forms.", "What should I pack for a weekend hiking trip?",
        "Tell me a fun fact about octopuses.", "How do I make a good cup of tea?",
        "Describe the city of Paris in a few sentences.", "Why is the sky blue?"]


WORKLOADS = ("copy", "chat")  # the names `workload` takes (for the scripts' flag checks)


def workload(name: str, n: int, seed: int) -> list[str]:
    """`n` seeded prompts of a speculative-decoding workload: "copy" (rewrite or quote one of `TEXTS`) or "chat".
    Another name is a ValueError (it had run as "chat", under the other name)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    rng = random.Random(f"{name}:{seed}")
    if name == "copy":
        return [rng.choice(COPY_TASKS).format(rng.choice(TEXTS)) for _ in range(n)]
    return [rng.choice(CHAT) for _ in range(n)]


def chat_prompt(tok, text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def price_steps(target, ks: list[int], prompts: list[str], max_new: int) -> dict:
    """Median wall time of a plain decode step and of a verification step of k + 1 tokens, per k, at batch 1 in the
    generator (n-gram drafts; greedy; the first step of each job, its prefill, left out; each generator warmed up and
    the prompts run twice, the first pass discarded). `experiments.studies.feature_draft_study` and
    `experiments.ngram_bound` price steps with it."""
    import numpy as np

    from paged import DynamicGenerator, Job, SamplingSettings

    tok = target.tokenizer
    out = {}
    for k in ks:
        gen = DynamicGenerator(target, max_batch_size=1, max_seq_len=min(1024, target.config.max_position_embeddings),
                               use_ngram_draft=True, num_draft_tokens=k)
        gen.warmup()
        plain, verify = [], []
        for rep in range(2):  # the first pass warms the caches and is discarded
            for i, p in enumerate(prompts):
                gen.enqueue(Job(tok.encode(chat_prompt(tok, p), encode_special_tokens=True), max_new,
                                gen_settings=SamplingSettings.greedy(), seed=i, stop_conditions=[tok.eos_token_id]))
                first = True
                while gen.num_remaining_jobs():
                    before = gen.metrics()["verification_rows"]
                    t0 = time.perf_counter()
                    gen.iterate()
                    dt = time.perf_counter() - t0
                    if not first and rep:
                        (verify if gen.metrics()["verification_rows"] > before else plain).append(dt)
                    first = False
        out[k] = {"plain_ms": 1e3 * float(np.median(plain)) if plain else None,
                  "verify_ms": 1e3 * float(np.median(verify)) if verify else None,
                  "plain_steps": len(plain), "verify_steps": len(verify)}
        print(f"k={k}: plain step {out[k]['plain_ms']} ms ({len(plain)}), verification {out[k]['verify_ms']} ms "
              f"({len(verify)})", flush=True)
    return out


def int_list_flag(name: str, minimum: int = 1) -> list[int]:
    """The comma-separated integers of absl list flag `--name`, each >= `minimum`; else app.UsageError naming the
    flag (a bare int() had raised a ValueError traceback)."""
    from absl import app, flags

    values = flags.FLAGS[name].value or []
    try:
        out = [int(v) for v in values]
    except ValueError:
        out = []
    if not out or min(out) < minimum:
        raise app.UsageError(f"--{name} takes a comma-separated list of integers >= {minimum}, got "
                             f"{','.join(values)!r}")
    return out


def check_chat_model_flags(why: str) -> None:
    """--model must be one with a tokenizer (not "tiny" or a preset) and --quant a known mode, for scripts that run
    chat prompts (`why` says so in the message): app.UsageError naming the flag, before anything loads."""
    from absl import app, flags

    model = flags.FLAGS.model
    if model == "tiny" or model.startswith("preset:"):
        raise app.UsageError(f"--model {model}: {why}, so it needs a model with a tokenizer (the embedded name, an HF "
                             "dir or a .gguf), not a random one without")
    check_quant_flag("quant")


def check_quant_flag(name: str) -> None:
    """Flag `--name` must be a load-time weight mode ("none", or one of `models.weights.QUANT_MODES`): app.UsageError
    naming it, before anything loads."""
    from absl import app, flags

    from models.weights import QUANT_MODES

    quants = ("none", *(q for q in QUANT_MODES if q))
    value = flags.FLAGS[name].value
    if value not in quants:
        raise app.UsageError(f"--{name}={value} is not one of: {', '.join(quants)}")


@contextlib.contextmanager
def model_flag(name: str, value: Any):
    """Load a model inside: a `models.ModelError` (an unknown or broken source) becomes an app.UsageError naming
    flag `--name` (it had been a traceback in each script)."""
    from absl import app

    from models import ModelError

    try:
        yield
    except ModelError as e:
        raise app.UsageError(f"--{name} {value}: {e}") from e
