"""Main job: generate text with `paged.DynamicGenerator` from the embedded SmolLM2-135M-Instruct (or any supported
model): one prompt streamed live, a JSONL file of prompts run with continuous batching, or a multi-turn chat.

    python -m experiments.generate --prompt "Give me three facts about octopuses."
    python -m experiments.generate --nochat --prompt "Once upon a time" --temperature 0.8 --seed 1
    echo "Explain paged attention in one sentence." | python -m experiments.generate
    python -m experiments.generate                       # in a terminal: chat (/reset, /quit, Ctrl-D)
    python -m experiments.generate --prompts_file prompts.jsonl --output results.jsonl --max_batch_size 16
    python -m experiments.generate --model path/to/hf_dir --dtype bfloat16 --cache_dtype int8 --warmup

Modes (the first that applies):
  --prompts_file F   bulk: every line of F becomes a job, all enqueued into one generator and run with continuous
                     batching (default --max_batch_size 16); a progress bar and a summary table (prefix-cache hits,
                     TTFT mean/median/p90, decode and aggregate tokens/s) go to stderr.
  --prompt P         one job; its text streams to stdout as it is sampled, a timing line goes to stderr.
  stdin a terminal   chat REPL: type a message, the reply streams; the conversation is kept (each turn re-encodes
                     it, and the prefix cache serves the earlier turns' pages: see "cached" in the timing line).
                     /reset forgets it, /quit or Ctrl-D exits, Ctrl-C stops a reply (at the prompt: exits).
  stdin a pipe       its text is the prompt (the default prompt when it is empty).

Prompts file (JSONL), one object a line; blank lines are skipped, a bad line is reported by its number:
    {"id": "q1", "prompt": "Name three moons of Jupiter.", "max_new_tokens": 64, "seed": 7}
    {"messages": [{"role": "user", "content": "Hi!"}], "temperature": 0.7, "top_p": 0.9, "stop": ["\\n\\n"]}
  "prompt" (string) or "messages" (chat list) is required; optional: "id" (default: the line number), "system",
  "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop" (strings; replaces --stop for that line). Other
  settings come from the flags. With --seed and no per-line seed, job i (0-based) uses seed + i.

Output (--output PATH, JSONL; in bulk mode without --output the records go to stdout): one record per finished job,
in input order (chat: one per turn): id, prompt (the exact text given to the model, after the chat template),
completion, new_tokens, prompt_tokens, cached_tokens (prompt tokens served by the prefix cache), eos_reason, ttft_s
(enqueue to first token, queueing included), decode_tok_s, time_generate_s.

With --chat (default) prompts are wrapped in the model's chat template (--system adds a system message); --nochat
sends the raw text. The model's end tokens (its tokenizer's EOS, config.json's eos_token_id list) always stop a
job; --stop adds comma-separated stop strings.

Comparing kernel implementations (docs/kernels.md, step 5): --compare_to=IMPL runs the prompt(s) greedily twice,
with the implementation under test (--attn_impl, or --matmul_impl) and with IMPL, every other implementation pinned
to the same one in both runs, and reports each prompt's first divergent token with the logit margin there
(experiments/lib/compare_impls.py; --output: one record per prompt).
    python -m experiments.generate --attn_impl my_kernels:attention --compare_to xla --prompt "Write a haiku."

Constrained decoding (docs/features.md, "Filters"): --json_schema FILE, --regex PATTERN and --grammar FILE (Lark) make
every job's output follow them (given together, they intersect); such a job ends with eos_reason "end_filter" when
its output is complete (--filter_prefer_eos: as soon as the filters accept it).
    python -m experiments.generate --json_schema person.json --prompt "Describe a fictional person as JSON."
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from absl import app, flags

from experiments.lib import compare_impls, engine_flags
from experiments.lib.common import read_jsonl, write_jsonl
from paged.speculation.rows import ACCEPTANCE_RULES

FLAGS = flags.FLAGS
engine_flags.define()  # --model, --quant, cache and engine flags, --seed, --temperature, --progress, --decode_steps
DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."

# --- what to run
flags.DEFINE_string("prompt", DEFAULT_PROMPT, "the prompt (single mode; streams the reply)")
flags.DEFINE_string("prompts_file", None, "JSONL file of prompts (bulk mode; see the module docstring)")
flags.DEFINE_string("output", None, "write one JSONL record per finished job (or chat turn) here")
flags.DEFINE_string("system", None, "optional system message (chat template only)")
flags.DEFINE_bool("chat", True, "wrap prompts in the model's chat template (--nochat: raw text)")
flags.DEFINE_bool("warmup", False, "compile every step bucket before the first job (generator.warmup)")
flags.DEFINE_string("compare_to", None, "run the prompt(s) greedily with the implementation under test "
                    "(--attn_impl, or --matmul_impl) and again with this one (a name or module:function), every "
                    "other implementation pinned to the same one in both, and report the first divergent token and "
                    "the logit margin there (docs/kernels.md)")
# --- several processes (hosts): each runs this same command with its own --process_id (docs/sharding.md)
flags.DEFINE_integer("num_processes", 1, "processes in a multi-process (multi-host) run; > 1 needs --mesh over all "
                     "their devices, --coordinator_address and --prompt or --prompts_file")
flags.DEFINE_integer("process_id", 0, "this process's index in [0, --num_processes); process 0 prints and saves")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (the same in every process)")
flags.DEFINE_integer("cpu_devices_per_process", None, "CPU only: virtual devices each process gets (for trying a "
                     "multi-process mesh on one machine)")
# --- sampling (a JSONL line may override max_new_tokens, temperature, top_k, top_p, seed and stop)
flags.DEFINE_integer("max_new_tokens", 128, "tokens to generate at most")
flags.DEFINE_integer("min_new_tokens", 0, "stop tokens are banned until this many tokens are out (a stop string "
                     "still ends the job, as in ExLlamaV2)")
flags.DEFINE_integer("top_k", 50, "top-k (0 = off)")
flags.DEFINE_float("top_p", 0.8, "top-p in (0, 1] (1 = off)")
flags.DEFINE_float("min_p", 0.0, "min-p in [0, 1) (0 = off)")
flags.DEFINE_float("typical", 0.0, "locally typical sampling mass in [0, 1] (0 = off)")
flags.DEFINE_float("repetition_penalty", 1.0, ">= 1e-30, 1 = off")
flags.DEFINE_float("frequency_penalty", 0.0, "subtracted per occurrence (0 = off)")
flags.DEFINE_float("presence_penalty", 0.0, "subtracted once per present token (0 = off)")
flags.DEFINE_list("stop", [], "extra stop strings, comma-separated (the model's end tokens always stop)")
# ExLlamaV2's full sampler (docs/api.md, "The full sampler"): a flag per SamplingSettings field, its default (off)
FULL_SAMPLER_FLAGS = {
    "penalty_decay": (0, "penalties fade to neutral over this many tokens beyond their range"),
    "top_a": (0.0, "keep p >= top_a * p_max^2 (0 = off)"),
    "tfs": (0.0, "tail-free sampling in (0, 1) (0 = off)"),
    "smoothing_factor": (0.0, "quadratic sampling (0 = off)"),
    "min_temp": (0.0, "dynamic temperature: the lowest (on when --max_temp > --min_temp)"),
    "max_temp": (0.0, "dynamic temperature: the highest"),
    "temp_exponent": (1.0, "dynamic temperature: the exponent of the normalised entropy"),
    "temperature_last": (False, "apply the temperature after truncation"),
    "skew": (0.0, "skew the draw towards (< 0) or away from (> 0) the likeliest tokens (0 = off)"),
    "xtc_probability": (0.0, "XTC: how often the tokens above --xtc_threshold are excluded (0 = off)"),
    "xtc_threshold": (0.1, "XTC: the probability above which tokens are excluded"),
    "mirostat": (False, "mirostat v2 (per job): steer the surprise towards --mirostat_tau"),
    "mirostat_tau": (1.5, "mirostat: the target surprise in bits"),
    "mirostat_eta": (0.1, "mirostat: the learning rate"),
    "dry_multiplier": (0.0, "DRY: penalise continuing a repeated sequence (0 = off)"),
    "dry_base": (1.75, "DRY: the penalty grows as base^(match length - allowed length)"),
    "dry_allowed_length": (2, "DRY: repeats up to this length go unpenalised"),
    "dry_range": (0, "DRY: tokens looked back at (0 = the whole history window, --max_penalty_range)"),
    "dry_max_ngram": (20, "DRY: the longest repeat considered"),
}
for _name, (_default, _help) in FULL_SAMPLER_FLAGS.items():
    {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float}[type(_default)](
        _name, _default, _help)
# --- classifier-free guidance (docs/features.md, "Classifier-free guidance")
flags.DEFINE_string("negative_prompt", None, "CFG: every job is guided away from this prompt (formatted like the "
                    "prompt: chat template, --system); needs --cfg_scale")
flags.DEFINE_float("cfg_scale", None, "CFG: sample from s * log p(prompt) + (1 - s) * log p(negative prompt); "
                   "1 = the prompt alone, > 1 pushes away from the negative prompt")
# --- a LoRA adapter (docs/features.md, "Per-job LoRA")
flags.DEFINE_string("lora", None, "a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) "
                    "applied to every job")
# --- speculative decoding (docs/speculative.md): one drafter at most
flags.DEFINE_string("draft_model", None, "speculative decoding with a draft model: an HF directory or .gguf sharing "
                    "the model's tokenizer (e.g. experiments.distill_draft --out), or 'self:N' for the model's own "
                    "first N layers (a truncated self-draft, no training)")
flags.DEFINE_integer("num_draft_tokens", 4, "tokens drafted per job and step (with --draft_model or --ngram_draft)")
flags.DEFINE_bool("ngram_draft", False, "speculative decoding with n-gram prompt lookup (no draft model)")
flags.DEFINE_integer("max_ngram", 4, "--ngram_draft: longest suffix looked up in the prompt and output")
flags.DEFINE_string("ngram_corpus", None, "--ngram_draft: a corpus table (experiments/build_ngram_corpus.py) that "
                    "drafts where prompt lookup finds no match of 2 or more tokens")
flags.DEFINE_bool("adaptive_draft", False, "verify drafts only in steps where they are expected to pay for the "
                  "verification (per-job acceptance against a step-cost model; docs/speculative.md)")
flags.DEFINE_float("draft_token_cost", None, "--adaptive_draft: the cost model's rho, one query token over a step's "
                   "fixed cost (default: the backend's measured value)")
flags.DEFINE_enum("draft_acceptance", "rejection", list(ACCEPTANCE_RULES), "how sampled jobs accept "
                  "drafts: lossless rejection sampling, or sample-then-match (the tokens plain sampling emits per "
                  "seed) with a draft model's draws coupled to the target's, or with greedy drafts as ExLlamaV2")
# --- constrained decoding (paged/filters.py): the output of every job follows these (they intersect)
flags.DEFINE_string("json_schema", None, "a JSON-schema file: the output is one JSON value valid under it")
flags.DEFINE_string("regex", None, "the output matches this regular expression as a whole (Rust regex syntax)")
flags.DEFINE_string("grammar", None, "a Lark grammar file (start rule `start`): the output is a sentence of it")
flags.DEFINE_bool("filter_prefer_eos", False, "end a filtered job as soon as its filters accept the output")
# --- cache and engine: experiments/lib/engine_flags.py (--max_batch_size defaults to 16 in bulk mode, 1 otherwise)

LORA_NAME = "lora"  # the name --lora's adapter is loaded under
PROMPT_KEYS = ("id", "prompt", "messages", "system", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
BULK_BATCH_SIZE = 16


class PromptsFileError(app.UsageError):
    """A line of the prompts file is malformed or cannot run; the message names the file and line."""


@dataclasses.dataclass
class Request:
    """One generation request: what to say (prompt or messages) and how (settings); `text`/`ids` once encoded."""

    id: Any
    settings: Any  # paged.SamplingSettings
    max_new_tokens: int
    prompt: str | None = None
    messages: list[dict] | None = None
    system: str | None = None
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    line: int | None = None  # 1-based line in the prompts file
    text: str | None = None  # the exact text given to the model
    ids: list[int] | None = None
    negative_ids: list[int] | None = None  # CFG (--negative_prompt): the negative prompt, formatted and encoded

    @property
    def where(self) -> str:
        return f"{FLAGS.prompts_file}:{self.line}" if self.line is not None else "prompt"


# ---------------------------------------------------------------------------------------------------- flags
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def validate_flags() -> None:
    """Check flag values before loading anything; raises app.UsageError with what is wrong and what is allowed."""
    engine_flags.validate()
    if FLAGS.max_new_tokens < 1:
        raise app.UsageError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
    if not 0 <= FLAGS.min_new_tokens <= FLAGS.max_new_tokens:
        raise app.UsageError(f"--min_new_tokens must be in [0, --max_new_tokens], got {FLAGS.min_new_tokens}")
    if any(not s for s in FLAGS.stop):
        raise app.UsageError("--stop contains an empty stop string")
    if FLAGS.prompts_file is not None:
        if FLAGS["prompt"].present:
            raise app.UsageError("give either --prompt or --prompts_file, not both")
        if os.path.isdir(FLAGS.prompts_file):
            raise app.UsageError(f"--prompts_file {FLAGS.prompts_file} is a directory; give a JSONL file")
        if not os.path.isfile(FLAGS.prompts_file):
            raise app.UsageError(f"--prompts_file {FLAGS.prompts_file} does not exist")
    if FLAGS["prompt"].present and not FLAGS.prompt.strip():
        raise app.UsageError("--prompt is empty")
    if (FLAGS.negative_prompt is None) != (FLAGS.cfg_scale is None):
        raise app.UsageError("classifier-free guidance takes both --negative_prompt and --cfg_scale")
    if FLAGS.negative_prompt is not None and not FLAGS.negative_prompt.strip():
        raise app.UsageError("--negative_prompt is empty")
    if FLAGS.lora is not None and not os.path.isdir(FLAGS.lora):
        raise app.UsageError(f"--lora {FLAGS.lora} is not a directory (a PEFT adapter: adapter_config.json and "
                             "adapter_model.safetensors)")
    if FLAGS.output is not None:
        parent = os.path.dirname(os.path.abspath(FLAGS.output))
        if not os.path.isdir(parent):
            raise app.UsageError(f"--output {FLAGS.output}: directory {parent} does not exist")
        if os.path.isdir(FLAGS.output):
            raise app.UsageError(f"--output {FLAGS.output} is a directory; name the file to write")
    check_process_flags()
    check_speculation_flags()
    build_settings()  # sampling flags
    build_filters()  # a bad schema, regex or grammar is reported here, before the model loads
    compare_plan()


def compare_plan() -> compare_impls.ComparePlan | None:
    """The comparison `--compare_to` asks for (None without it); app.UsageError naming the flag when it cannot run."""
    if FLAGS.compare_to is None:
        return None
    from pallas_kernels import native, registry

    value = FLAGS.compare_to
    if FLAGS.temperature != 0:
        raise app.UsageError(f"--compare_to compares greedy decoding: drop --temperature={FLAGS.temperature}")
    if _mode() == "chat" or FLAGS.num_processes > 1:
        raise app.UsageError("--compare_to takes --prompt or --prompts_file (one process, no chat)")
    given = {"attention": FLAGS["attn_impl"].present, "matmul": FLAGS["matmul_impl"].present}
    impls = {"attention": FLAGS.attn_impl, "matmul": FLAGS.matmul_impl}
    quantizes = not registry.on_gpu() and native.unavailable_reason() is None
    try:
        return compare_impls.plan_comparison(value, impls, given, auto_matmul_quantizes=quantizes)
    except compare_impls.CompareError as e:
        raise app.UsageError(f"--compare_to={value}: {e}") from None


def check_process_flags() -> None:
    """The multi-process flags (checked before JAX starts: joining must come first)."""
    if FLAGS.num_processes < 1 or not 0 <= FLAGS.process_id < FLAGS.num_processes:
        raise app.UsageError(f"--process_id must be in [0, --num_processes={FLAGS.num_processes}), got "
                             f"{FLAGS.process_id}")
    if FLAGS.num_processes > 1:
        if not FLAGS.coordinator_address:
            raise app.UsageError("--num_processes > 1 needs --coordinator_address=HOST:PORT (process 0's)")
        if not FLAGS.mesh:
            raise app.UsageError("--num_processes > 1 needs --mesh over every process's devices (e.g. dp=2,tp=2)")
        if _mode() not in ("single", "bulk"):
            raise app.UsageError("--num_processes > 1 runs the same jobs in every process: give --prompt or "
                                 "--prompts_file (not chat or stdin)")
        if FLAGS.policy == "lpm":  # its aging reads the wall clock: the processes would schedule differently
            raise app.UsageError("--num_processes > 1 needs a policy that does not read the wall clock; lpm ages "
                                 "waiting jobs by time: use another --policy")


_ERRORS = None  # a non-main process's own stderr, kept for its errors while the rest of its output is silenced


def join_processes() -> None:
    """With --num_processes > 1: join the run (`paged.device.sharding.initialize_distributed`) before JAX is used. Every
    process then runs the same jobs; all but process 0 stay silent (no stdout, progress or --output; their errors
    still reach their own stderr, see `cli_main`)."""
    global _ERRORS
    if FLAGS.num_processes == 1:
        return
    from paged.device.sharding import initialize_distributed, is_main_process

    initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                           FLAGS.cpu_devices_per_process)
    sys.stdout.flush()
    sys.stderr.flush()
    if not is_main_process():
        _ERRORS = os.fdopen(os.dup(2), "w", encoding=sys.stderr.encoding, errors="backslashreplace")
        quiet = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):  # what the libraries print from C++ too
            os.dup2(quiet, fd)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    else:  # the collectives' C++ notices go to stderr; stdout keeps only the records and the streamed text
        sys.stdout = os.fdopen(os.dup(1), "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)
        os.dup2(2, 1)


def silence_other_processes() -> None:
    """After validation (which every process runs, so that a bad flag stops them all): only process 0 saves and
    shows progress."""
    if _ERRORS is not None:
        FLAGS.output, FLAGS.progress = None, False


def build_filters() -> list:
    """The filters the flags ask for (`--json_schema`, `--regex`, `--grammar`); app.UsageError with the grammar
    engine's message for a bad one."""
    from paged.errors import InvalidJobError
    from paged.filters import GrammarFilter, JsonSchemaFilter, RegexFilter

    out = []
    try:
        for flag, make in (("json_schema", JsonSchemaFilter), ("grammar", GrammarFilter)):
            path = getattr(FLAGS, flag)
            if path is not None:
                if not os.path.isfile(path):
                    raise app.UsageError(f"--{flag} {path} does not exist")
                try:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                except (OSError, UnicodeDecodeError) as e:
                    raise app.UsageError(f"--{flag} {path}: cannot read it as UTF-8 text ({e})") from None
                out.append(make(text))
        if FLAGS.regex is not None:
            out.append(RegexFilter(FLAGS.regex))
    except InvalidJobError as e:
        raise app.UsageError(str(e)) from None
    return out


def build_settings(**overrides: Any):
    """SamplingSettings from the sampling flags, with `overrides` (e.g. a prompts-file line's temperature) on top.
    Out-of-range values raise app.UsageError with the settings' own message."""
    from paged import InvalidSettingsError, SamplingSettings

    kw = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, min_p=FLAGS.min_p,
              typical=FLAGS.typical, repetition_penalty=FLAGS.repetition_penalty,
              frequency_penalty=FLAGS.frequency_penalty, presence_penalty=FLAGS.presence_penalty,
              cfg_scale=FLAGS.cfg_scale, **{name: getattr(FLAGS, name) for name in FULL_SAMPLER_FLAGS})
    kw.update(overrides)
    try:
        return SamplingSettings(**kw)
    except InvalidSettingsError as e:
        flagged = "" if overrides else " (check the sampling flags)"
        raise app.UsageError(f"{e}{flagged}") from e


def load_model_from_flags():
    model = engine_flags.load_model()  # (an unknown or broken --model is a usage error there)
    if model.tokenizer is None:
        raise app.UsageError(f"--model {FLAGS.model} has no tokenizer; this job needs one")
    STOP_TOKEN_IDS[:] = model.stop_token_ids
    return model


def build_generator(model, *, max_batch_size: int | None = None, uses_penalties: bool | None = None,
                    adjust: Callable[[Any], Any] | None = None):
    """A DynamicGenerator configured by the cache/engine flags. `max_batch_size` is the mode's default, used when
    --max_batch_size is not given. Without penalties the penalty-history buckets are left out (fewer compiles).
    `adjust`: EngineConfig -> the config to use instead (--compare_to's runs)."""
    from models import ModelError
    from paged import DynamicGenerator

    if uses_penalties is None:  # penalties and DRY read the token history
        settings = build_settings()
        uses_penalties = settings.uses_penalties or settings.uses_dry
    kw = engine_flags.generator_kwargs(max_batch_size or 1, max_penalty_range=1024 if uses_penalties else 0)
    if FLAGS.lora is not None:  # one slot at least, as wide as the adapter's rank
        from models.lora import read_adapter_config

        try:
            rank = read_adapter_config(FLAGS.lora).get("r")
        except ModelError as e:
            raise app.UsageError(f"--lora {FLAGS.lora}: {e}") from None
        rank = max(kw["config"].max_lora_rank, rank if isinstance(rank, int) else 0)
        kw["config"] = dataclasses.replace(kw["config"], max_loras=max(kw["config"].max_loras, 1), max_lora_rank=rank)
    try:
        if adjust is not None:
            kw["config"] = adjust(kw["config"])
        gen = DynamicGenerator(model, **kw, **speculation_kwargs(model))
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    if FLAGS.lora is not None:
        try:
            gen.load_lora(LORA_NAME, FLAGS.lora)
        except ModelError as e:
            raise app.UsageError(f"--lora {FLAGS.lora}: {e}") from None
    return gen


def check_speculation_flags() -> None:
    """The drafter flags that need no model (`validate_flags`, before it loads); app.UsageError naming the flag."""
    if FLAGS.ngram_draft and FLAGS.draft_model:
        raise app.UsageError("--draft_model and --ngram_draft: choose one drafter")
    if FLAGS.num_draft_tokens < 1 or FLAGS.max_ngram < 1:
        raise app.UsageError("--num_draft_tokens and --max_ngram must be >= 1")
    if ((FLAGS.adaptive_draft or FLAGS.draft_token_cost is not None or FLAGS.draft_acceptance != "rejection")
            and not (FLAGS.ngram_draft or FLAGS.draft_model)):
        raise app.UsageError("--adaptive_draft / --draft_token_cost / --draft_acceptance need --ngram_draft or "
                             "--draft_model")
    if FLAGS.draft_token_cost is not None and not FLAGS.adaptive_draft:
        raise app.UsageError("--draft_token_cost applies to --adaptive_draft only")
    if FLAGS.negative_prompt is not None and (FLAGS.ngram_draft or FLAGS.draft_model):  # every job uses CFG
        raise app.UsageError("--negative_prompt with a drafter: a CFG job samples each token from both prompts' "
                             "mixture, one token per step, so it never speculates; drop --draft_model / "
                             "--ngram_draft (or --negative_prompt)")
    if FLAGS.ngram_corpus and not FLAGS.ngram_draft:
        raise app.UsageError("--ngram_corpus is the n-gram drafter's table: add --ngram_draft")
    src = FLAGS.draft_model or ""
    if src.startswith("self:") and not (src[5:].isdigit() and int(src[5:]) >= 1):
        raise app.UsageError(f"--draft_model {src}: 'self:N' takes a layer count >= 1, e.g. self:4")


def check_mirostat_with_drafter(settings: Sequence[Any]) -> None:
    """app.UsageError where a drafter is given and every job (`settings`: each job's SamplingSettings) samples with
    mirostat, whose target changes after every token: none would ever speculate. (Greedy jobs ignore mirostat.)"""
    if (FLAGS.ngram_draft or FLAGS.draft_model) and settings and all(s.uses_mirostat for s in settings):
        raise app.UsageError("--mirostat with a drafter: mirostat's target changes after every token, so its jobs "
                             "never speculate; drop --draft_model / --ngram_draft (or --mirostat)")


def speculation_kwargs(model) -> dict:
    """The generator's speculative-decoding arguments from --draft_model / --ngram_draft (empty: none; the flags
    were checked by `check_speculation_flags`)."""
    extra = dict(adaptive_draft=True, draft_token_cost=FLAGS.draft_token_cost) if FLAGS.adaptive_draft else {}
    if FLAGS.draft_acceptance != "rejection":
        extra["draft_acceptance"] = FLAGS.draft_acceptance
    if FLAGS.ngram_corpus:
        from paged.speculation.ngram_corpus import NgramCorpus, NgramCorpusError

        try:
            extra["ngram_corpus"] = NgramCorpus.load(FLAGS.ngram_corpus)
        except NgramCorpusError as e:
            raise app.UsageError(f"--ngram_corpus {FLAGS.ngram_corpus}: {e}") from None
    if FLAGS.ngram_draft:
        return dict(use_ngram_draft=True, max_ngram=FLAGS.max_ngram, num_draft_tokens=FLAGS.num_draft_tokens,
                    **extra)
    if not FLAGS.draft_model:
        return {}
    from models import ModelError, load_model
    from models.draft import truncated_model

    src = FLAGS.draft_model
    try:
        if src.startswith("self:"):
            draft = truncated_model(model, int(src[5:]))  # (its range against the model's layers: ModelError)
        else:
            draft = load_model(src, dtype=FLAGS.dtype)  # its tokenizer, if it has one, must be the model's
    except ModelError as e:
        raise app.UsageError(f"--draft_model {src}: {e}") from e
    return dict(draft_model=draft, num_draft_tokens=FLAGS.num_draft_tokens, **extra)


SPEC_COUNTS = ("drafted_tokens", "accepted_draft_tokens", "verification_rows", "gated_steps")


def speculation_line(metrics: dict, since: dict | None = None) -> str | None:
    """"[speculative: ...]" with the acceptance rate and mean accepted length (and, adaptive, the steps that did not
    verify), or None where nothing was drafted or gated. `since`: earlier metrics of the same generator, whose counts
    are left out (a chat conversation after /reset)."""
    if since is not None:
        m = {k: metrics.get(k, 0) - since.get(k, 0) for k in SPEC_COUNTS}
        m["acceptance_rate"] = m["accepted_draft_tokens"] / m["drafted_tokens"] if m["drafted_tokens"] else 0.0
        rows = m["verification_rows"]

        def emitted(x: dict) -> float:  # the tokens verifications emitted (the generator's own count, as its mean)
            return x.get("mean_accepted_length", 0.0) * x.get("verification_rows", 0)

        m["mean_accepted_length"] = (emitted(metrics) - emitted(since)) / rows if rows else 0.0
        metrics = m
    gated = metrics.get("gated_steps", 0)
    if not metrics.get("drafted_tokens"):
        return f"[speculative: nothing drafted, {gated} steps not verified (adaptive)]" if gated else None
    return (f"[speculative: {metrics['accepted_draft_tokens']} / {metrics['drafted_tokens']} drafts accepted "
            f"({100 * metrics['acceptance_rate']:.1f}%), mean accepted length {metrics['mean_accepted_length']:.2f} "
            f"tokens per verification" + (f", {gated} steps not verified (adaptive)" if gated else "") + "]")


# ---------------------------------------------------------------------------------------------------- prompts
STOP_TOKEN_IDS: list[int] = []  # the loaded model's (`Model.stop_token_ids`), set by load_model_from_flags


def stop_conditions(tok, strings: Sequence[str]) -> list:
    """A job's stops: the model's end-of-reply ids (its tokenizer's EOS and config.json's eos_token_id list) and
    `strings`."""
    ids = STOP_TOKEN_IDS or [t for t in (tok.eos_token_id,) if t is not None]
    return list(ids) + list(strings)


def use_template(tok) -> bool:
    return bool(FLAGS.chat and tok.chat_template)


def format_prompt(tok, req: Request) -> str:
    """The exact text given to the model: the chat template over (system +) the prompt or messages, or the raw
    prompt with --nochat (or a model without a template)."""
    if req.messages is not None:
        if not use_template(tok):
            why = "--nochat was given" if not FLAGS.chat else "the model has no chat template"
            raise PromptsFileError(f"{req.where}: \"messages\" need the chat template, but {why}; use \"prompt\"")
        messages = list(req.messages)
        if req.system is not None:
            messages = [{"role": "system", "content": req.system}] + messages
        return tok.apply_chat_template(messages, add_generation_prompt=True)
    if not use_template(tok):
        return req.prompt
    messages = [{"role": "system", "content": req.system}] if req.system else []
    return tok.apply_chat_template(messages + [{"role": "user", "content": req.prompt}], add_generation_prompt=True)


def encode_request(tok, req: Request) -> Request:
    """Fill `req.text` and `req.ids`."""
    req.text = format_prompt(tok, req)
    req.ids = tok.encode(req.text, encode_special_tokens=use_template(tok))
    if not req.ids:
        raise PromptsFileError(f"{req.where}: the prompt encodes to no tokens")
    if FLAGS.negative_prompt is not None:  # formatted as a prompt of its own (same system message, one turn)
        neg = dataclasses.replace(req, prompt=FLAGS.negative_prompt, messages=None)
        req.negative_ids = tok.encode(format_prompt(tok, neg), encode_special_tokens=use_template(tok))
    return req


def make_job(tok, req: Request, identifier: Any = None, return_logits: bool = False):
    from paged import Job

    ids = req.ids if req.negative_ids is None else [req.ids, req.negative_ids]
    return Job(ids, req.max_new_tokens, lora=LORA_NAME if FLAGS.lora is not None else None, return_logits=return_logits,
               min_new_tokens=min(FLAGS.min_new_tokens, req.max_new_tokens),
               gen_settings=req.settings, stop_conditions=stop_conditions(tok, req.stop), seed=req.seed,
               identifier=identifier, filters=build_filters(), filter_prefer_eos=FLAGS.filter_prefer_eos)


def single_request(prompt: str, rid: Any = 1) -> Request:
    return Request(id=rid, prompt=prompt, system=FLAGS.system, settings=build_settings(),
                   max_new_tokens=FLAGS.max_new_tokens, seed=FLAGS.seed, stop=list(FLAGS.stop))


def parse_prompt_line(obj: Any, lineno: int, index: int) -> Request:
    """Validate one decoded JSONL line (`index`: 0-based job number) into a Request; raises ValueError."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(PROMPT_KEYS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError('give exactly one of "prompt" (a string) or "messages" (a chat list)')
    prompt, messages, system = obj.get("prompt"), obj.get("messages"), obj.get("system")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise ValueError('"prompt" must be a non-empty string')
    if "messages" in obj:
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f'"messages"[{i}] must be an object with string "role" and "content"')
        if system is not None and messages[0]["role"] == "system":
            raise ValueError('"system" given but "messages" already starts with a system message')
        if system is None and FLAGS.system is not None and messages[0]["role"] == "system":
            raise ValueError('--system given but "messages" already starts with a system message (drop one of them)')
    if system is not None and not isinstance(system, str):
        raise ValueError('"system" must be a string')
    rid = obj.get("id", lineno)
    if not (isinstance(rid, str) or _is_int(rid)):
        raise ValueError('"id" must be a string or an integer')
    max_new = obj.get("max_new_tokens", FLAGS.max_new_tokens)
    if not _is_int(max_new) or max_new < 1:
        raise ValueError(f'"max_new_tokens" must be an integer >= 1, got {max_new!r}')
    overrides = {}
    for key, check, kind in (("temperature", _is_number, "a number"), ("top_p", _is_number, "a number"),
                             ("top_k", _is_int, "an integer")):
        if key in obj:
            if not check(obj[key]):
                raise ValueError(f'"{key}" must be {kind}, got {obj[key]!r}')
            overrides[key] = obj[key]
    seed = obj.get("seed", None if FLAGS.seed is None else FLAGS.seed + index)
    if seed is not None and not _is_int(seed):
        raise ValueError(f'"seed" must be an integer, got {seed!r}')
    stop = obj.get("stop", list(FLAGS.stop))
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError('"stop" must be a list of non-empty strings')
    try:
        settings = build_settings(**overrides)
    except app.UsageError as e:
        raise ValueError(str(e)) from e
    return Request(id=rid, prompt=prompt, messages=messages, system=system if system is not None else FLAGS.system,
                   settings=settings, max_new_tokens=max_new, seed=seed, stop=stop, line=lineno)


def read_prompts_file(path: str) -> list[Request]:
    """Parse and validate every line of a JSONL prompts file (before the model loads). All bad lines are reported
    together in one PromptsFileError, each by its line number."""
    return read_jsonl(path, "--prompts_file", parse_prompt_line, PromptsFileError)


# ---------------------------------------------------------------------------------------------------- results
def make_record(req: Request, final: dict) -> dict:
    """The JSONL record of a finished job (its eos result)."""
    n = final["new_tokens"]
    gen_s = final["time_generate"]
    rate = (n - 1) / gen_s if n > 1 and gen_s > 0 else None
    return {
        "id": req.id, "prompt": req.text, "completion": final["full_completion"], "new_tokens": n,
        "prompt_tokens": final["prompt_tokens"], "cached_tokens": final["cached_tokens"],
        "eos_reason": final["eos_reason"], "ttft_s": round(final["time_enqueued"] + final["time_prefill"], 6),
        "decode_tok_s": None if rate is None else round(rate, 3), "time_generate_s": round(gen_s, 6),
    }


class OrderedWriter:
    """Writes records in input order as soon as every earlier one is done (a crash keeps a clean prefix)."""

    def __init__(self, sink: IO[str] | None):
        self.sink = sink
        self.ready: dict[int, dict] = {}
        self.next = 0

    def add(self, index: int, record: dict) -> None:
        self.ready[index] = record
        while self.next in self.ready:
            write_jsonl(self.sink, self.ready.pop(self.next))
            self.next += 1


def stream_job(gen, job, write: Callable[[str], Any]) -> dict:
    """Run the generator until the (enqueued) `job` finishes, passing its text to `write` as it streams; returns its
    final result. On KeyboardInterrupt the job is cancelled and the interrupt re-raised."""
    try:
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["job"] is not job or r["stage"] != "streaming":
                    continue
                if r["text"]:
                    write(r["text"])
                if r["eos"]:
                    return r
    except KeyboardInterrupt:
        gen.cancel(job)
        raise
    raise RuntimeError(f"{job!r} left the generator without a final result")


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _fmt_rate(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.1f}"


def weights_gb_s(gen, steps: int, seconds: float) -> float | None:
    """The memory bandwidth the weights took: bytes a step reads (`Weights.step_read_bytes`) x steps / seconds, in
    GB/s (as gpt-fast reports it; the KV cache and activations come on top). None without a real model."""
    params = getattr(getattr(getattr(gen, "engine", None), "model", None), "params", None)
    if params is None or not hasattr(params, "step_read_bytes") or seconds <= 0:
        return None
    return params.step_read_bytes() * steps / seconds / 1e9  # unrounded: a tiny test model reads ~1e-5 GB/s


def timing_line(record: dict, *, compiled: bool, total_s: float | None = None) -> str:
    n, cached = record["new_tokens"], record["cached_tokens"]
    parts = [f"{n} tokens, {record['eos_reason']}",
             f"prompt {record['prompt_tokens']} tokens ({cached} cached)",
             f"first token after {record['ttft_s']:.2f}s" + ("" if compiled else " (includes compilation)"),
             f"{_fmt_rate(record['decode_tok_s'])} tok/s decode" + ("" if compiled else " (includes compilation; "
                                                                   "--warmup compiles first)")]
    if record.get("weights_gb_s") is not None:
        parts.append(f"weights read at {record['weights_gb_s']:.3g} GB/s"
                     + ("" if compiled else " (includes compilation)"))
    if total_s is not None:
        parts.append(f"{total_s:.1f}s total")
    return "[" + "; ".join(parts) + "]"


# ---------------------------------------------------------------------------------------------------- modes
def run_single(gen, tok, req: Request, *, sink: IO[str] | None = None, compiled: bool = False) -> dict:
    """One job; its text streams to stdout, the timing line goes to stderr. Returns its record."""
    from paged import InvalidJobError, JobTooLargeError

    encode_request(tok, req)
    print(f"[prompt {len(req.ids)} tokens]", file=sys.stderr)
    t0 = time.perf_counter()
    steps0 = gen.steps
    job = make_job(tok, req)
    try:
        gen.enqueue(job)
    except (JobTooLargeError, InvalidJobError) as e:
        raise app.UsageError(str(e)) from e
    final = stream_job(gen, job, _stdout_write)
    print()
    record = make_record(req, final)
    record["weights_gb_s"] = weights_gb_s(gen, gen.steps - steps0, time.perf_counter() - t0)
    print(timing_line(record, compiled=compiled, total_s=time.perf_counter() - t0), file=sys.stderr)
    line = speculation_line(gen.metrics())
    if line:
        print(line, file=sys.stderr)
    write_jsonl(sink, record)
    return record


@dataclasses.dataclass
class BulkResult:
    records: list[dict]  # finished jobs, input order
    wall_s: float
    total: int  # jobs enqueued
    metrics: dict
    interrupted: bool = False


def run_bulk(gen, tok, requests: Sequence[Request], *, sink: IO[str] | None = None,
             progress: bool = True) -> BulkResult:
    """Enqueue every request into `gen` and run them with continuous batching; records are written to `sink` in
    input order as they complete. A progress bar (jobs done / total, tokens, tok/s) goes to stderr."""
    from tqdm import tqdm

    from paged import InvalidJobError, JobTooLargeError

    for r in requests:
        encode_request(tok, r)
    t0 = time.perf_counter()
    tokens0 = gen.tokens_generated
    errors = []
    for i, r in enumerate(requests):
        try:
            gen.enqueue(make_job(tok, r, identifier=i))
        except (JobTooLargeError, InvalidJobError) as e:
            errors.append(f"{r.where}: {e}")
    if errors:  # every prompt that cannot run, together (as the file's bad lines), before any job runs
        gen.clear_queue()
        shown = errors[:10] + ([f"... and {len(errors) - 10} more"] if len(errors) > 10 else [])
        raise PromptsFileError(errors[0] if len(errors) == 1 else
                               f"{len(errors)} prompts cannot run:\n  " + "\n  ".join(shown))
    records: list[dict | None] = [None] * len(requests)
    writer = OrderedWriter(sink)
    bar = tqdm(total=len(requests), unit="job", desc="generating", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    last_refresh = 0.0
    interrupted = False
    try:
        while gen.num_remaining_jobs():
            for res in gen.iterate():
                if res["eos"]:
                    i = res["identifier"]
                    records[i] = make_record(requests[i], res)
                    writer.add(i, records[i])
                    bar.update(1)
            now = time.perf_counter()
            if now - last_refresh > 0.25 or not gen.num_remaining_jobs():
                made = gen.tokens_generated - tokens0
                bar.set_postfix(tokens=made, tok_s=f"{made / max(now - t0, 1e-9):.1f}")
                last_refresh = now
    except KeyboardInterrupt:
        gen.clear_queue()
        interrupted = True
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    return BulkResult(records=[r for r in records if r is not None], wall_s=wall, total=len(requests),
                      metrics=gen.metrics(), interrupted=interrupted)


def run_chat(gen, tok, *, sink: IO[str] | None = None, read: Callable[[str], str] | None = None) -> list[dict]:
    """Multi-turn REPL. Each turn re-encodes the whole templated conversation; the generator's prefix cache serves
    the pages of the earlier turns (the timing line shows how many prompt tokens were cached). Without a chat
    template (or with --nochat) every line is an independent raw completion. Returns the turns' records."""
    from paged import InvalidJobError, JobTooLargeError
    from paged.device.engine import count_compiles

    read = read or input
    templated = use_template(tok)
    history: list[dict] = []
    since = None  # the generator's metrics at the last /reset
    records: list[dict] = []
    note = "" if templated else " (no chat template: each line is a raw completion, no history)"
    print(f"[chat with {FLAGS.model}{note}; /reset clears the conversation, /quit or Ctrl-D exits]", file=sys.stderr)
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=sys.stderr)
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        command = line.strip()
        if not command:
            continue
        if command in ("/quit", "/exit"):
            break
        if command == "/reset":
            history.clear()
            since = gen.metrics()  # the acceptance line is the conversation's
            print("[conversation cleared]", file=sys.stderr)
            continue
        user = {"role": "user", "content": command}
        while True:
            req = single_request(command, rid=len(records) + 1)
            if templated:
                req.prompt, req.messages = None, history + [user]
            encode_request(tok, req)
            try:
                job = make_job(tok, req)
                gen.enqueue(job)
                break
            except JobTooLargeError as e:
                if len(history) < 2:
                    print(f"[{e}]", file=sys.stderr)
                    job = None
                    break
                del history[:2]  # forget the oldest exchange and try again
                print("[conversation too long: dropped the oldest exchange]", file=sys.stderr)
            except InvalidJobError as e:
                print(f"[{e}]", file=sys.stderr)
                job = None
                break
        if job is None:
            continue
        programs = sum(count_compiles().values())
        try:
            final = stream_job(gen, job, _stdout_write)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            continue
        print()
        record = make_record(req, final)
        records.append(record)
        write_jsonl(sink, record)
        # (a turn may compile after the first: a longer conversation's bucket, a drafter's verification)
        print(timing_line(record, compiled=sum(count_compiles().values()) == programs), file=sys.stderr)
        line = speculation_line(gen.metrics(), since)  # (the conversation's so far)
        if line:
            print(line, file=sys.stderr)
        if templated:
            history += [user, {"role": "assistant", "content": final["full_completion"]}]
    return records


def greedy_traces(gen, tok, requests: Sequence[Request], watch: Sequence[Sequence[int]] | None = None) -> list:
    """Run every request in `gen` (logits asked for) and return one `compare_impls.Trace` per request, in order;
    `watch`: the other run's tokens per request (the logit row where this run first differs is kept)."""
    from paged import InvalidJobError, JobTooLargeError

    traces = [compare_impls.Trace(watch=None if watch is None else watch[i]) for i in range(len(requests))]
    for i, r in enumerate(requests):
        try:
            gen.enqueue(make_job(tok, r, identifier=i, return_logits=True))
        except (JobTooLargeError, InvalidJobError) as e:
            gen.clear_queue()
            raise app.UsageError(f"{r.where}: {e}") from e
    while gen.num_remaining_jobs():
        for res in gen.iterate():
            if res["stage"] != "streaming":
                continue
            trace = traces[res["identifier"]]
            trace.add(res["token_ids"], res.get("logits"))
            if res["eos"]:
                trace.text = res["full_completion"]
    return traces


def run_compare(model, tok, requests: Sequence[Request], plan: compare_impls.ComparePlan, *,
                max_batch_size: int, sink: IO[str] | None = None) -> list[dict]:
    """--compare_to: every request greedily under `plan`'s two configs (the implementation under test first, then
    the reference, each in a generator of its own), then per request the first divergent token (stdout) and a
    record (`sink`)."""
    for r in requests:
        if r.settings.temperature != 0:
            raise app.UsageError(f"{r.where}: --compare_to compares greedy decoding; drop the temperature")
        encode_request(tok, r)
    print(f"[{plan.describe()}]", file=sys.stderr)
    runs = {}
    for side, pick in (("under_test", 0), ("reference", 1)):
        t0 = time.perf_counter()
        gen = build_generator(model, max_batch_size=max_batch_size, adjust=lambda c, p=pick: plan.configs(c)[p])
        watch = [t.tokens for t in runs["under_test"]] if side == "reference" else None
        runs[side] = greedy_traces(gen, tok, requests, watch)
        impl = plan.under_test if side == "under_test" else plan.reference
        print(f"[{side.replace('_', ' ')}: {plan.family} {impl!r}, {len(requests)} prompt(s) in "
              f"{time.perf_counter() - t0:.1f}s]", file=sys.stderr)
        del gen
    piece = lambda t: tok.decode([t], decode_special_tokens=True)  # noqa: E731
    records = []
    for r, test, ref in zip(requests, runs["under_test"], runs["reference"]):
        d = compare_impls.divergence(test, ref, len(r.ids), piece)
        compared = min(len(test.tokens), len(ref.tokens)) if d is None else d["index"]
        print(f"{r.id}: {compare_impls.describe_divergence(d, compared)}")
        rec = {"id": r.id, "prompt": r.text, "family": plan.family, "under_test": plan.under_test,
               "reference": plan.reference, "pinned": {plan.other: plan.pinned, "why": plan.pinned_why},
               "identical": d is None, "divergence": d, "prompt_tokens": len(r.ids),
               "tokens_under_test": len(test.tokens), "tokens_reference": len(ref.tokens),
               "completion_under_test": test.text, "completion_reference": ref.text}
        records.append(rec)
        write_jsonl(sink, rec)
    return records


# ---------------------------------------------------------------------------------------------------- summary
def summarise(records: Sequence[dict], metrics: dict, wall_s: float, total: int | None = None,
              weight_bytes: int = 0) -> dict:
    """Aggregate figures of a bulk run (`metrics`: generator.metrics() after it; `weight_bytes`: what one step
    reads of the weights, for the bandwidth row)."""
    import numpy as np

    ttft = np.asarray([r["ttft_s"] for r in records], dtype=float)
    rates = [r["decode_tok_s"] for r in records if r["decode_tok_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in records)
    generated = sum(r["new_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    nan = float("nan")
    return {
        "jobs": len(records), "jobs_total": len(records) if total is None else total,
        "prompt_tokens": prompt, "generated_tokens": generated, "cached_tokens": cached,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "prefix_hits": metrics.get("prefix_hits", 0), "prefix_queries": metrics.get("prefix_queries", 0),
        "prefix_hit_rate": metrics.get("prefix_hit_rate", 0.0),
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else nan,
        "ttft_median_s": float(np.median(ttft)) if len(ttft) else nan,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if len(ttft) else nan,
        "decode_tok_s_mean": float(np.mean(rates)) if rates else nan,
        "output_tok_s": generated / wall_s if wall_s > 0 else nan,
        "wall_s": wall_s,
        "weights_gb_s": (weight_bytes * metrics.get("steps", 0) / wall_s / 1e9) if weight_bytes and wall_s > 0 else nan,
        "drafted_tokens": metrics.get("drafted_tokens", 0), "gated_steps": metrics.get("gated_steps", 0),
        "acceptance_rate": metrics.get("acceptance_rate", 0.0),
        "mean_accepted_length": metrics.get("mean_accepted_length", 0.0),
    }


def format_summary(s: dict, compiled: bool = True) -> str:
    """The bulk run's summary table; `compiled=False` (no --warmup) says that its times include compilation."""
    jobs = f"{s['jobs']}" if s["jobs"] == s["jobs_total"] else f"{s['jobs']} of {s['jobs_total']} (interrupted)"
    caveat = "" if compiled else " (includes compilation; --warmup compiles first)"
    # the generator's counts cover every job it admitted; the records only the finished ones
    admitted = "" if s["jobs"] == s["jobs_total"] else " (every admitted job, finished or not)"
    rows = [
        ("jobs", jobs),
        ("prompt tokens", f"{s['prompt_tokens']}"),
        ("generated tokens", f"{s['generated_tokens']}"),
        ("cached prompt tokens", f"{s['cached_tokens']} ({100 * s['cached_fraction']:.1f}% of prompt tokens)"),
        ("prefix pages hit", f"{s['prefix_hits']} / {s['prefix_queries']} "
                             f"({100 * s['prefix_hit_rate']:.1f}%){admitted}"),
        ("TTFT mean / median / p90",
         f"{s['ttft_mean_s']:.3f} / {s['ttft_median_s']:.3f} / {s['ttft_p90_s']:.3f} s{caveat}"),
        ("decode tok/s per job (mean)", f"{s['decode_tok_s_mean']:.1f}{caveat}"),
        ("output tok/s (aggregate)", f"{s['output_tok_s']:.1f}{caveat}"),
        ("weights read (steps x bytes / wall)", f"{s.get('weights_gb_s', float('nan')):.3g} GB/s{caveat}"),
        ("wall time", f"{s['wall_s']:.2f} s"),
    ]
    if s.get("drafted_tokens"):
        rows[-1:-1] = [("draft acceptance rate",
                        f"{100 * s['acceptance_rate']:.1f}% of {s['drafted_tokens']} drafts{admitted}"),
                       ("mean accepted length", f"{s['mean_accepted_length']:.2f} tokens per verification")]
    if s.get("gated_steps"):
        rows[-1:-1] = [("steps not verified (adaptive)", f"{s['gated_steps']}{admitted}")]
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([rule] + [f"{k:<{width}}  {v}" for k, v in rows] + [rule])


# ---------------------------------------------------------------------------------------------------- main
def _mode() -> str:
    if FLAGS.prompts_file is not None:
        return "bulk"
    if FLAGS["prompt"].present:
        return "single"
    if sys.stdin is not None and sys.stdin.isatty():
        return "chat"
    return "stdin"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])} (quote the prompt: --prompt \"...\")")
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)  # "no TPU" notices are noise here
    check_process_flags()
    engine_flags.apply_cpu_dispatch()  # before anything starts JAX (joining reads the process index)
    join_processes()  # before anything starts JAX
    validate_flags()
    silence_other_processes()
    mode = _mode()
    requests = read_prompts_file(FLAGS.prompts_file) if mode == "bulk" else None
    check_mirostat_with_drafter([r.settings for r in requests] if requests is not None else [build_settings()])
    prompt = FLAGS.prompt
    if mode == "stdin":
        data = sys.stdin.read() if sys.stdin is not None else ""
        prompt = data.strip() or DEFAULT_PROMPT
        mode = "single"

    t0 = time.perf_counter()
    model = load_model_from_flags()
    tok = model.tokenizer
    # (a CFG job takes two rows: its prompt and the negative prompt)
    batch = BULK_BATCH_SIZE if mode == "bulk" else (2 if FLAGS.negative_prompt is not None else 1)
    comparing = FLAGS.compare_to is not None  # (its two runs build generators of their own)
    gen = None if comparing else build_generator(model, max_batch_size=batch)
    note = "" if use_template(tok) or not FLAGS.chat else "; no chat template: raw text"
    print(f"[loaded {FLAGS.model} in {time.perf_counter() - t0:.1f}s{note}]", file=sys.stderr)
    if FLAGS.warmup and not comparing:
        t1 = time.perf_counter()
        n = gen.warmup(progress=FLAGS.progress)
        print(f"[compiled {n} step buckets in {time.perf_counter() - t1:.1f}s]", file=sys.stderr)

    sink = open(FLAGS.output, "w", encoding="utf-8") if FLAGS.output else None
    try:
        if comparing:
            run_compare(model, tok, requests or [single_request(prompt)], compare_plan(), sink=sink,
                        max_batch_size=batch)
        elif mode == "bulk":
            result = run_bulk(gen, tok, requests, sink=sink or sys.stdout, progress=FLAGS.progress)
            summary = summarise(result.records, result.metrics, result.wall_s, result.total,
                                weight_bytes=model.params.step_read_bytes())
            print(format_summary(summary, compiled=FLAGS.warmup), file=sys.stderr)
            if result.interrupted:
                raise SystemExit(130)
        elif mode == "chat":
            run_chat(gen, tok, sink=sink)
        else:
            run_single(gen, tok, single_request(prompt), sink=sink, compiled=FLAGS.warmup)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if sink is not None:
            sink.close()
            print(f"[wrote {FLAGS.output}]", file=sys.stderr)


def cli_main(argv):
    """`main` with input errors (bad flags, a bad prompts-file line) shown as one short message, not the whole
    usage text."""
    try:
        main(argv)
    except app.UsageError as e:
        print(f"error: {e}\n(python -m experiments.generate --helpshort lists the flags)", file=_ERRORS or sys.stderr,
              flush=True)
        raise SystemExit(1) from None
    except Exception:
        if _ERRORS is not None:  # a silenced process: its traceback still reaches its own stderr
            import traceback

            traceback.print_exc(file=_ERRORS)
            _ERRORS.flush()
        raise


if __name__ == "__main__":
    app.run(cli_main)
