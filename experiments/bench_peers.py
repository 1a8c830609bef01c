"""The same workloads through this framework, llama.cpp (`llama-cpp-python`, same GGUF file) and HF transformers,
in one run, with the ratios. Peers that are not installed are skipped (never a CI dependency).

    python -m experiments.bench_peers --json_out experiments/results/peers_cpu.json
    python -m experiments.bench_peers --engines ours,transformers --batch_sizes 16,64 --quant keep

Workloads (greedy, end-of-text ignored so every sequence decodes exactly `--decode_tokens` tokens):
  single   one sequence with a `--prompt_len`-token prompt: decode tokens/s after the first token;
  prefill  one `--prefill_len`-token prompt: prompt tokens/s until its first token;
  batch B  B sequences with distinct `--prompt_len`-token prompts decoding together: aggregate decode tokens/s,
           timed from the moment every sequence has its first token (prefill excluded) to the last token.
For this framework the decode rows also carry `weights_gb_s`: the weight bytes one forward step reads
(`Weights.step_read_bytes`) x the steps of the decode phase / its seconds -- how close decode runs to memory speed.
llama.cpp reads the same GGUF tensors per step, so its figure is ours x its tokens/s over ours.
Every engine runs each workload once untimed first (our compilation, their warm-up) and gets `--threads` threads,
each engine in a process of its own (`--isolate`, the default): in one process the engines' thread pools (XLA's,
OpenMP's) shared two cores, and llama.cpp's single-stream decode measured 37 instead of 123 tok/s after ours.
Figures are only meaningful on an idle machine; the load average is recorded before and after.

llama-cpp-python builds llama.cpp from source on install (~10 minutes on 2 cores):
`CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python`. On a CPU with AMX whose kernel or hypervisor does not
grant the tile state (the 2026-11-26 host), its AMX matmul crashes; build it without AMX (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import check_out_flag, write_record

FLAGS = flags.FLAGS
engine_flags.define()  # --model (ours; a .gguf is also given to the peers), --quant, --page_size, --cache_dtype, ...
flags.DEFINE_list("engines", ["ours", "llama.cpp", "transformers"], "engines to run (skipped when not installed)")
flags.DEFINE_list("workloads", ["single", "prefill", "batch"], "workloads")
flags.DEFINE_list("batch_sizes", ["16", "64"], "sequences for the batch workload")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens per sequence (single, batch)")
flags.DEFINE_integer("prefill_len", 512, "prompt tokens of the prefill workload")
flags.DEFINE_integer("decode_tokens", 64, "tokens decoded per sequence")
flags.DEFINE_integer("threads", 2, "CPU threads for every engine")
flags.DEFINE_bool("isolate", True, "run each engine in a fresh process (no thread pool of one engine near another's)")
if "json_out" not in FLAGS:  # other experiment scripts define it too (same meaning)
    flags.DEFINE_string("json_out", None, "write the record here")
    check_out_flag("json_out")


def prompts(tokenizer, n: int, length: int, salt: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly `length` token ids, from ordinary text (no special tokens)."""
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near "
             "the old harbour and count ships").split()
    out = []
    for i in range(n):
        text = " ".join(words[(i * 7 + salt + j) % len(words)] + (str(i) if j == 0 else "") for j in range(length))
        ids = tokenizer.encode(text)
        while len(ids) < length:
            ids = ids + ids
        out.append(ids[:length])
    return out


# ----------------------------------------------------------------------------------------------------- ours
class Ours:
    name = "ours"

    def __init__(self):
        self.model = engine_flags.load_model()
        self.gens = {}
        self.weight_bytes = self.model.params.step_read_bytes()  # per forward step (Weights.step_read_bytes)
        self.decode_steps = 0  # forward steps of the last run's decode phase

    def _gen(self, batch: int, max_len: int):
        from paged import DynamicGenerator

        key = (batch, max_len)
        if key not in self.gens:
            ps = FLAGS.page_size
            config = dataclasses.replace(engine_flags.engine_config(batch), max_batch_size=batch, num_pages=None,
                                         max_chunk_size=512, max_seq_len=-(-max_len // ps) * ps)
            self.gens[key] = DynamicGenerator(self.model, config=config)
        return self.gens[key]

    def run(self, seqs: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(seconds until every sequence has its first token, seconds for the rest of the decode)."""
        from paged import Job, SamplingSettings

        gen = self._gen(len(seqs), max(len(s) for s in seqs) + new_tokens)
        gen.pool.reset_cache()  # no prefix hits across repetitions
        t0 = time.perf_counter()
        gen.enqueue([Job(s, new_tokens, gen_settings=SamplingSettings.greedy()) for s in seqs])
        while gen.pending or any(j.new_tokens == 0 for j in gen.active):
            gen.iterate()
        t1, steps = time.perf_counter(), gen.steps
        while gen.num_remaining_jobs():
            gen.iterate()
        self.decode_steps = gen.steps - steps
        return t1 - t0, time.perf_counter() - t1


# ------------------------------------------------------------------------------------------------ llama.cpp
class LlamaCpp:
    name = "llama.cpp"

    def __init__(self):
        import llama_cpp
        import numpy as np

        self.lib, self.np = llama_cpp, np
        # llama.cpp logs every load and context to stderr; keep the callback referenced while the library lives
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(self._quiet, None)
        self.path = gguf_path()
        self.ctx = None
        self.key = None

    def _context(self, batch: int, max_len: int):
        lc = self.lib
        if self.key == (batch, max_len):
            return self.ctx
        if self.ctx is not None:
            lc.llama_free(self.ctx)
        if not hasattr(self, "model"):
            mp = lc.llama_model_default_params()
            self.model = lc.llama_model_load_from_file(self.path.encode(), mp)
            self.vocab = lc.llama_model_get_vocab(self.model)
            self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        cp = lc.llama_context_default_params()
        cp.n_ctx = batch * max_len + 64
        cp.n_batch = max(512, batch * max_len)
        cp.n_ubatch = 512
        cp.n_seq_max = batch
        cp.n_threads = cp.n_threads_batch = FLAGS.threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.key = (batch, max_len)
        return self.ctx

    def _clear(self, ctx):
        lc = self.lib
        if hasattr(lc, "llama_memory_clear"):
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        else:
            lc.llama_kv_self_clear(ctx)

    def _decode(self, ctx, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, want_logits); returns the greedy token for each item that wants logits."""
        lc, np = self.lib, self.np
        b = lc.llama_batch_init(len(items), 0, 1)
        try:
            b.n_tokens = len(items)
            for i, (tok, pos, seq, want) in enumerate(items):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
                b.seq_id[i][0] = seq
            if lc.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            out = []
            for i, item in enumerate(items):
                if item[3]:
                    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                    out.append(int(logits.argmax()))
            return out
        finally:
            lc.llama_batch_free(b)

    def run(self, seqs: list[list[int]], new_tokens: int) -> tuple[float, float]:
        ctx = self._context(len(seqs), max(len(s) for s in seqs) + new_tokens)
        self._clear(ctx)
        t0 = time.perf_counter()
        last = []
        for s, ids in enumerate(seqs):  # one prompt per decode call, like our one-prefill-row steps
            last += self._decode(ctx, [(t, p, s, p == len(ids) - 1) for p, t in enumerate(ids)])
        t1 = time.perf_counter()
        for k in range(1, new_tokens):
            last = self._decode(ctx, [(t, len(seqs[s]) + k - 1, s, True) for s, t in enumerate(last)])
        return t1 - t0, time.perf_counter() - t1


# --------------------------------------------------------------------------------------------- transformers
class Transformers:
    name = "transformers"

    def __init__(self):
        import torch
        import transformers

        torch.set_num_threads(FLAGS.threads)
        path = gguf_path()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()

    def run(self, seqs: list[list[int]], new_tokens: int) -> tuple[float, float]:
        torch = self.torch
        from transformers import DynamicCache

        ids = torch.tensor(seqs)  # equal lengths: no padding needed
        cache = DynamicCache()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            for _ in range(1, new_tokens):
                out = self.model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return t1 - t0, time.perf_counter() - t1


ENGINES = {"ours": (Ours, "jax"), "llama.cpp": (LlamaCpp, "llama_cpp"), "transformers": (Transformers, "transformers")}


def measure(engine, tokenizer, workload: str, batch: int = 1) -> dict:
    n = FLAGS.decode_tokens
    if workload == "prefill":
        seqs = prompts(tokenizer, 1, FLAGS.prefill_len)
        engine.run(seqs, 1)
        t_pre, _ = engine.run(seqs, 1)
        return dict(workload="prefill", tokens_per_s=FLAGS.prefill_len / t_pre, seconds=t_pre)
    seqs = prompts(tokenizer, batch, FLAGS.prompt_len, salt=batch)
    engine.run(seqs, n)
    t_pre, t_dec = engine.run(seqs, n)
    name = "single" if workload == "single" else f"batch {batch}"
    rec = dict(workload=name, tokens_per_s=batch * (n - 1) / t_dec, seconds=t_dec, prefill_seconds=t_pre)
    if getattr(engine, "weight_bytes", None):  # gpt-fast's figure: weight bytes one step reads x steps / seconds
        rec["weights_gb_s"] = engine.weight_bytes * engine.decode_steps / t_dec / 1e9
    return rec


def gguf_path() -> str:
    """The GGUF file the peers load: --model when it is one, else the embedded SmolLM2."""
    if FLAGS.model.endswith(".gguf"):
        return FLAGS.model
    from models.embedded import embedded_gguf_path

    return embedded_gguf_path()


def _run_isolated(name: str) -> tuple[str, list[dict]]:
    """One engine's workloads in a fresh process: the flags given here (relative paths in them resolve as here: the
    child runs in this directory, the repository on its PYTHONPATH), `--engines name`; its result lines and
    warnings pass through."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "engine.json")
        flags_given = {id(FLAGS[f]): FLAGS[f] for f in FLAGS if FLAGS[f].present}.values()  # short names too
        given = [f.serialize() for f in flags_given if f.name not in ("engines", "isolate", "json_out")]
        cmd = [sys.executable, "-m", "experiments.bench_peers", *given, f"--engines={name}", "--noisolate",
               f"--json_out={out}"]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        for line in proc.stdout.splitlines():
            if line.startswith(name):
                print(line, flush=True)
            elif line.startswith("warning:"):
                print(f"[{name}] {line}", flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{name}'s process failed (exit {proc.returncode}); run it alone: "
                               f"python -m experiments.bench_peers --engines {name}")
        with open(out) as f:
            rec = json.load(f)
    return rec["versions"][name], rec["results"][name]


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"warning: load average {load_before[0]:.2f}; peer ratios are only valid on an idle machine")
    from models.embedded import EMBEDDED_NAMES
    from models.gguf_reader import read_gguf_metadata
    from models.tokenizer import Tokenizer

    unknown = [e for e in FLAGS.engines if e not in ENGINES]
    if unknown:
        raise app.UsageError(f"--engines: unknown engine {unknown[0]!r}; choose from {sorted(ENGINES)}")
    if FLAGS.model.lower() not in EMBEDDED_NAMES and not FLAGS.model.endswith(".gguf"):
        raise app.UsageError(f"--model {FLAGS.model}: the peers need a GGUF file; give a .gguf path or the embedded "
                             "smollm2-135m")
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf_path()))  # the same prompt ids for everyone
    results: dict[str, list[dict]] = {}
    versions = {}
    for name in FLAGS.engines:
        cls, module = ENGINES[name]
        if importlib.util.find_spec(module) is None:
            print(f"[{name}: not installed ({module}), skipped]")
            continue
        if FLAGS.isolate and len(FLAGS.engines) > 1:
            versions[name], results[name] = _run_isolated(name)
            continue
        engine = cls()
        versions[name] = getattr(__import__(module), "__version__", "?")
        rows = []
        for w in FLAGS.workloads:
            for b in ([int(x) for x in FLAGS.batch_sizes] if w == "batch" else [1]):
                rec = measure(engine, tokenizer, w, b)
                rows.append(rec)
                bw = f"  weights read at {rec['weights_gb_s']:.1f} GB/s" if "weights_gb_s" in rec else ""
                print(f"{name:13s} {rec['workload']:10s} {rec['tokens_per_s']:8.1f} tok/s{bw}", flush=True)
        results[name] = rows
        del engine
    table = []
    if "ours" in results:
        for i, rec in enumerate(results["ours"]):
            row = dict(workload=rec["workload"], ours=rec["tokens_per_s"])
            for peer in results:
                if peer != "ours":
                    row[peer] = results[peer][i]["tokens_per_s"]
                    row[f"ours/{peer}"] = rec["tokens_per_s"] / results[peer][i]["tokens_per_s"]
            table.append(row)
        print("\nworkload    " + "  ".join(f"{k:>16s}" for k in table[0] if k != "workload"))
        for row in table:
            print(f"{row['workload']:10s}  " + "  ".join(f"{v:16.2f}" for k, v in row.items() if k != "workload"))
    if FLAGS.json_out:
        import jax

        from experiments.lib.serving.env import matmul_auto

        names = ("engines", "workloads", "batch_sizes", "prompt_len", "prefill_len", "decode_tokens", "threads",
                 "isolate", "model", "quant", "cache_dtype", "page_size", "decode_steps", "cpu_dispatch")
        write_record(FLAGS.json_out, dict(
            flags={k: FLAGS[k].value for k in names}, git_sha=_git_sha(), machine=platform.machine(),
            cpus=os.cpu_count(), matmul_auto=matmul_auto(), cpu=platform.processor(), jax=jax.__version__,
            versions=versions, load_avg_before=load_before, load_avg_after=os.getloadavg(), results=results,
            table=table))


if __name__ == "__main__":
    app.run(main)
