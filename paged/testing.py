"""A hand-checkable fake engine and a byte tokenizer, so the scheduler, policies, page pool and streaming can be
tested without a JAX forward pass (JetStream-style), and a fault injector for any generator. Importable from outside
the repository's tests:

    from paged.testing import ByteTokenizer, FakeEngine, FaultInjector, drain
    gen = DynamicGenerator(tokenizer=ByteTokenizer(), engine=FakeEngine(num_pages=32), policy="vllm")
    faults = FaultInjector(gen, step=0.1, draft=0.05, masks=0.05, seed=0)

`paged.sim.SimulatedEngine` is this engine plus a virtual clock advanced by a step-time model."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from typing import Any

import numpy as np

from paged.device.buckets import BucketSpec
from paged.device.config import EngineConfig, Verification
from paged.device.engine_api import StepOutput
from paged.errors import InvalidConfigError
from paged.speculation.config import SpeculationConfig


class ByteTokenizer:
    """Token i < 256 is the byte i; 256 = <eos> (special), 257 = <bos> (special)."""

    vocab_size = 258
    eos_token_id = 256
    bos_token_id = 257
    special_token_ids = frozenset({256, 257})
    chat_template = None

    def encode(self, text, *, add_bos=False, encode_special_tokens=False):
        return ([257] if add_bos else []) + list(text.encode())

    def decode(self, ids, *, decode_special_tokens=False):
        return b"".join(self.token_bytes(i) for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, t):
        return bytes([t]) if t < 256 else (b"<eos>" if t == 256 else b"<bos>")


def fake_logprob(token: int, pos: int) -> float:
    """The fake's log-probability of `token` sampled at sequence position `pos` (the index it takes in the job's
    sequence): -(token % 7 + 1) / 10 - pos / 1000, so every (token, position) pair reports its own value."""
    return -(token % 7 + 1) / 10 - pos / 1000


def fake_top_k(token: int, pos: int, k: int, vocab_size: int = 258) -> tuple[list[int], list[float]]:
    """The fake's top-k at that step: the sampled token and the k - 1 ids after it, each half a nat less likely."""
    return [(token + j) % vocab_size for j in range(k)], [fake_logprob(token, pos) - j / 2 for j in range(k)]


# the generator's speculation arguments -> `SpeculationConfig.of`'s
_SPECULATION_ARGS = {"draft_model": "draft_model", "use_ngram_draft": "use_ngram_draft",
                     "num_draft_tokens": "num_draft_tokens", "max_ngram": "max_ngram", "adaptive_draft": "adaptive",
                     "draft_token_cost": "draft_token_cost", "draft_acceptance": "acceptance",
                     "ngram_corpus": "ngram_corpus"}


def verification_for(**generator_kwargs: Any) -> Verification | None:
    """The role an engine needs under a generator given these keyword arguments (its speculation ones; the others are
    ignored): `SpeculationConfig.verification()` of the speculation they describe, None without a drafter. For an
    engine built outside the generator: `FakeEngine(verification=verification_for(**spec))`."""
    config = SpeculationConfig.of(**{_SPECULATION_ARGS[k]: v for k, v in generator_kwargs.items()
                                     if k in _SPECULATION_ARGS})
    return None if config is None else config.verification()


class FakeEngine:
    """next token = (last input token + 1) % vocab, or a scripted continuation: `script[first prompt token] =
    (prompt_len, tokens)` makes a job whose prompt starts with that token emit `tokens` in order. Tokens with a
    -inf bias, or outside the row's token mask, are skipped (the next id is taken). Log-probabilities and top-k come
    from `fake_logprob` and `fake_top_k` of the sampled token and its position; logits are one-hot at the sampled
    token."""

    def __init__(self, num_pages=32, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=128,
                 max_prefill_rows=1, vocab_size=258, script=None, record=True, config=None, verification=None):
        """`record=False` keeps no history (`calls`, `written`): for long simulations (a `script` needs the
        written cache). `config`: an `EngineConfig` to use instead of the size arguments. `verification`: its
        verifying role (`paged.device.config.Verification`, e.g. `SpeculationConfig.verification()` of the
        generator's speculation): verification rows of up to that many one-hot drafts, checked greedily against the
        fake's own next token (the fake is deterministic, so greedy acceptance is exact, and the same as
        sample-then-match)."""
        # implements paged.device.engine_api.EngineProtocol
        if config is None:
            config = EngineConfig(num_pages=num_pages, page_size=page_size, max_batch_size=max_batch_size,
                                  max_chunk_size=max_chunk_size, max_seq_len=max_seq_len,
                                  max_prefill_rows=max_prefill_rows, verification=verification)
        elif verification is not None:
            config = dataclasses.replace(config, verification=verification)
        if config.verification is not None and (config.verification.draft_probs or config.verification.fed_drafts):
            raise ValueError("FakeEngine verifies one-hot drafts from the host only (n-gram), not a draft model's")
        if script and not record:
            raise ValueError("FakeEngine: a script needs record=True (it reads the written cache)")
        self.config = config
        page_size, num_pages, max_seq_len = config.page_size, config.num_pages, config.max_seq_len
        self.record = record
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.spec = BucketSpec.from_config(self.config)
        self.verify_len = 0 if config.verification is None else config.verification.num_draft_tokens + 1
        self.timings = {}
        self.script = script or {}
        self.calls = []  # rows of every step
        self.bursts = []  # num_steps of every multi-step call
        self.written = {}  # (page, offset) -> token, to check what the cache would hold

    def run(self, rows, *, return_top_k=0, return_logits=False, num_steps=1, draft_logprobs=None):
        if any([getattr(r, "verify", False) for r in rows]):
            return self._run_verify(rows, return_top_k, return_logits)
        if num_steps > 1:  # like paged.device.step.decode_steps: each sampled token is fed back as the next input
            self.bursts.append(num_steps)
            outs = []
            for _ in range(num_steps):  # (the class's run: a wrapper set on the instance, e.g. an EngineProbe that
                # records calls, sees the burst once, not each of its steps too)
                outs.append(type(self).run(self, rows, return_top_k=return_top_k))
                rows = [dataclasses.replace(r, tokens=[int(t)], start_pos=r.start_pos + 1)
                        for r, t in zip(rows, outs[-1].token)]
            stack = lambda name: np.stack([getattr(o, name) for o in outs])
            return StepOutput(token=stack("token"), logprob=stack("logprob"), top_ids=stack("top_ids"),
                              top_logprobs=stack("top_logprobs"), logits=None, shape=None, seconds=0.0)
        if self.record:
            self.calls.append(rows)
        tokens, logprobs, top_ids, top_logprobs = [], [], [], []
        if not self.record and not self.script and not return_top_k:  # (a simulation's steps: `_sample`, inlined)
            vocab = self.vocab_size
            for r in rows:
                t = (r.tokens[-1] + 1) % vocab  # next_token
                if r.bias or r.mask is not None:
                    t = self._first_allowed(r, t)
                tokens.append(max(t, 0))
                logprobs.append(-math.inf if t < 0 else  # (nothing allowed: as the real sampler reports it)
                                -(t % 7 + 1) / 10 - (r.start_pos + len(r.tokens)) / 1000)  # fake_logprob
        else:
            for r in rows:
                if self.record:
                    self._write(r)
                t, lp, ids, lps = self._sample(r, return_top_k)
                tokens.append(t)
                logprobs.append(lp)
                top_ids.append(ids)
                top_logprobs.append(lps)
        n, k = len(rows), return_top_k
        logits = None
        if return_logits:
            logits = np.zeros((n, self.vocab_size), np.float32)
            logits[np.arange(n), tokens] = 1.0
        return StepOutput(
            token=np.asarray(tokens, np.int32), logprob=np.asarray(logprobs, np.float32),
            top_ids=np.asarray(top_ids, np.int32).reshape(n, k) if k else np.empty((n, 0), np.int32),
            top_logprobs=np.asarray(top_logprobs, np.float32).reshape(n, k) if k else np.empty((n, 0), np.float32),
            logits=logits, shape=None, seconds=0.0,
        )

    def _write(self, r):
        if self.record:
            for i, t in enumerate(r.tokens):
                pos = r.start_pos + i
                self.written[(r.pages[pos // self.page_size], pos % self.page_size)] = t

    def _sample(self, r, return_top_k):
        """(token, logprob, top ids, top logprobs) the fake samples after row `r`."""
        t = self.next_token(r)
        if r.bias or r.mask is not None:  # (without either, every token is allowed)
            t = self._first_allowed(r, t)
            if t < 0:  # every token banned or masked out: token 0 at -inf, as the real sampler reports it
                return 0, -math.inf, [0] * return_top_k, [-math.inf] * return_top_k
        pos = r.start_pos + len(r.tokens)  # where the sampled token goes in the sequence
        ids, lps = fake_top_k(t, pos, return_top_k, self.vocab_size) if return_top_k else ([], [])
        return t, fake_logprob(t, pos), ids, lps

    def _first_allowed(self, r, t):
        """`t`, or the first id after it (cyclically) that the row's bias does not ban and its mask allows; -1 when
        there is none."""
        bias = r.bias or {}

        def allowed(t: int) -> bool:
            return bias.get(t, 0.0) != -math.inf and (r.mask is None or (int(r.mask[t >> 5]) >> (t & 31)) & 1)

        for _ in range(self.vocab_size):
            if allowed(t):
                return t
            t = (t + 1) % self.vocab_size
        return -1

    # ------------------------------------------------------------------ speculative verification (n-gram drafts)
    def _run_verify(self, rows, return_top_k, return_logits):
        """Results per position `[n, W]` and `num_accepted [n]`, as `paged.device.engine.Engine` returns them: position
        j of a verification row is sampled from the row cut after its j-th token (with `position_bias[j]`), drafts are
        accepted while they equal those samples, and the sample at the first mismatch (or after the last draft) ends
        the row's tokens (-1 after it)."""
        w = self.verify_len
        if not w:
            raise ValueError("verification rows need a FakeEngine built with verification=")
        if self.record:
            self.calls.append(rows)
        n, k = len(rows), return_top_k
        token = np.full((n, w), -1, np.int32)
        logprob = np.zeros((n, w), np.float32)
        top_ids = np.zeros((n, w, k), np.int32)
        top_logprobs = np.zeros((n, w, k), np.float32)
        accepted = np.zeros(n, np.int32)
        for i, r in enumerate(rows):
            self._write(r)
            if not r.verify:
                t, lp, ids, lps = self._sample(r, k)
                token[i, 0], logprob[i, 0], top_ids[i, 0], top_logprobs[i, 0] = t, lp, ids, lps
                continue
            if len(r.tokens) > w:
                raise ValueError(f"a verification row of {len(r.tokens)} tokens exceeds verify_len {w}")
            drafts = list(r.tokens[1:])
            for j in range(len(r.tokens)):
                bias, mask = r.bias, r.mask
                if r.position_bias is not None and r.position_bias[j] is not None:
                    bias = r.position_bias[j]
                if r.position_mask is not None:
                    mask = r.position_mask[j]
                sub = dataclasses.replace(r, tokens=list(r.tokens[: j + 1]), verify=False, bias=bias, mask=mask)
                t, lp, ids, lps = self._sample(sub, k)
                token[i, j], logprob[i, j], top_ids[i, j], top_logprobs[i, j] = t, lp, ids, lps
                if j < len(drafts) and drafts[j] == t:
                    accepted[i] += 1
                    continue
                break
        logits = None
        if return_logits:
            logits = np.zeros((n, w, self.vocab_size), np.float32)
            for i in range(n):
                for j in range(w):
                    if token[i, j] >= 0:
                        logits[i, j, token[i, j]] = 1.0
        return StepOutput(token=token, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs, logits=logits,
                          shape=None, seconds=0.0, num_accepted=accepted)

    def next_token(self, r):
        if not self.script:
            return (r.tokens[-1] + 1) % self.vocab_size
        end = r.start_pos + len(r.tokens)  # tokens in context after this row
        ctx_first = self.written.get((r.pages[0], 0))
        if ctx_first in self.script:
            prompt_len, tokens = self.script[ctx_first]
            n_generated = end - prompt_len
            if 0 <= n_generated < len(tokens):
                return tokens[n_generated]
        return (r.tokens[-1] + 1) % self.vocab_size

    def warmup(self, progress=False, decode_steps=1):
        return 0


class ContextFakeEngine(FakeEngine):
    """A fake whose next token depends on every token of the row's context as read back from the (fake) KV cache
    through its page table: a lowercase letter, 97 + (sum of (position + 1) * token) % 26. A stale, missing or
    misplaced KV entry (wrong page after preemption, a bad prefix-cache hit) changes the output."""

    def next_token(self, r):
        ps = self.page_size
        end = r.start_pos + len(r.tokens)
        acc = 0
        for pos in range(end):
            acc += (pos + 1) * self.written[(r.pages[pos // ps], pos % ps)]
        return 97 + acc % 26


class InjectedFault(RuntimeError):
    """A fault `FaultInjector` raised."""


class FaultInjector:
    """Makes a generator's engine step, drafting and mask computation raise `InjectedFault` at seeded points, through
    the generator's `fault_hook` (the one supported way: no private method is wrapped).

    `step`, `draft`, `masks`: the probability that each call at that point raises. "step" is right before the engine
    step (plain or verification): `iterate()` raises `StepError`, no job advances. "draft" is after a speculative
    step's drafts are made (the drafter's state has moved) and before the engine step: `StepError` too. "masks" is
    each mask computation of the filtered rows: the generator retries the rows one at a time, and the jobs whose
    computation failed end alone with `eos_reason="error"` (the error names `InjectedFault`). The same `seed` and the
    same calls give the same faults. `injected[point]` counts the faults raised, `calls[point]` the calls; `remove()`
    (or leaving a `with` block) takes the hook away."""

    POINTS = ("step", "draft", "masks")

    def __init__(self, generator, *, step: float = 0.0, draft: float = 0.0, masks: float = 0.0, seed: int = 0):
        self.rates = {"step": step, "draft": draft, "masks": masks}
        for point, p in self.rates.items():
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise InvalidConfigError(f"FaultInjector: {point} must be a probability in [0, 1], got {p!r}")
        if not hasattr(generator, "fault_hook"):
            raise InvalidConfigError(f"FaultInjector: {type(generator).__name__} has no fault_hook (pass a "
                                     "paged.DynamicGenerator)")
        if generator.fault_hook is not None:
            raise InvalidConfigError("FaultInjector: the generator has a fault hook already; remove() it first")
        self.generator = generator
        self.rng = random.Random(seed)
        self.injected: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        generator.fault_hook = self

    def __call__(self, point: str) -> None:
        self.calls[point] += 1
        if self.rng.random() < self.rates.get(point, 0.0):
            self.injected[point] += 1
            raise InjectedFault(f"injected {point} fault #{self.injected[point]}")

    def remove(self) -> None:
        if self.generator.fault_hook is self:
            self.generator.fault_hook = None

    def __enter__(self) -> FaultInjector:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclasses.dataclass
class Collected:
    results: list
    texts: dict
    finals: dict


def page_refs(gen) -> dict[int, int]:
    """page -> how many live jobs hold it (a CFG job's negative prompt too): the counts `PagePool.check`
    (`expected_refs=`) holds the pool to."""
    out: dict[int, int] = {}
    for job in gen.active:
        for m in (job,) if job.cfg_partner is None else (job, job.cfg_partner):
            for p in m.pages:
                out[p] = out.get(p, 0) + 1
    return out


def drain(gen, limit=10_000):
    """Run the generator until empty; collect results, streamed text per identifier, final dicts."""
    results, texts, finals = [], {}, {}
    for _ in range(limit):
        if not gen.num_remaining_jobs():
            break
        for r in gen.iterate():
            results.append(r)
            if r["stage"] == "streaming":
                texts[r["identifier"]] = texts.get(r["identifier"], "") + r["text"]
            if r["eos"]:
                finals[r["identifier"]] = r
    else:
        raise AssertionError("generator did not finish")
    return Collected(results, texts, finals)


TINY_SHAPE = dict(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8)


def tiny_config(vocab_size: int, num_layers: int = 2, **overrides: Any):
    """The tests' tiny random Llama: hidden 32, MLP 48, 4 query and 2 KV heads of 8 (`TINY_SHAPE`), `num_layers`
    layers, `vocab_size` tokens; `overrides` are further `models.ModelConfig` fields (max_position_embeddings,
    rope_theta, tie_word_embeddings, ...). One definition instead of the same config written in every test file:
    the same config also means the same compiled programs, which the suite's compilation cache shares."""
    from models import ModelConfig

    return ModelConfig(model_type="llama", vocab_size=vocab_size, num_layers=num_layers, **{**TINY_SHAPE, **overrides})


def tiny_model(config: Any, seed: int = 0, tokenizer: Any = None, source: str = "tiny", **weights: Any):
    """A `models.loader.Model` of `config` (e.g. `tiny_config(...)`) with random weights (`init_random_weights(config,
    seed=seed, **weights)`)."""
    from models import init_random_weights
    from models.loader import Model

    return Model(config=config, params=init_random_weights(config, seed=seed, **weights), tokenizer=tokenizer,
                 source=source)


def quantized_tiny_model(tokenizer=None, seed: int = 0, scale: float = 0.05):
    """A tiny random Llama (2 layers, hidden 128, 6 query and 2 KV heads of SmolLM2's head size 64, vocabulary 258)
    whose projections and LM head are Q4_1 in groups of 32, as SmolLM2's GGUF: on the CPU they run through the native
    kernel (int8 activations), where a rounding's difference anywhere grows into whole quantization steps, so tests of
    bitwise output identity use it (`models.invariant`)."""
    from models import ModelConfig, init_random_weights, quant
    from models.loader import Model

    cfg = ModelConfig(model_type="llama", vocab_size=258, hidden_size=128, intermediate_size=96, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=64, rope_theta=10000.0, tie_word_embeddings=False)
    w = init_random_weights(cfg, seed=seed, scale=scale)

    def q4(a):  # one [in, out] matrix, or a stack [L, in, out]
        if a.ndim == 2:
            return quant.quantize(a, "q4_1", 32)
        return quant.stack([quant.quantize(a[i], "q4_1", 32) for i in range(a.shape[0])])

    layers = w.layers.replace(wqkv=q4(w.layers.wqkv), wo=q4(w.layers.wo), w_gate_up=q4(w.layers.w_gate_up),
                              w_down=q4(w.layers.w_down))
    return Model(config=cfg, params=w.replace(layers=layers, lm_head=q4(w.lm_head)), tokenizer=tokenizer,
                 source="tiny-q4_1")
