"""`Speculator`: the host side of speculative decoding, which the generator calls each step (its drafter, a
`paged.speculation.drafter.Drafter`: a draft model, `paged.speculation.draft.DraftModel`, or prompt lookup,
`paged.speculation.drafter.NgramDrafter`; verification on the device: `paged.device.verify`). Call sequence for
the generator, each `iterate()`:

    rows, owners, failed = scheduler.plan(active)                      # as now
    plan = speculator.plan([SpecRow(key=job, row=row, sequence=job.sequence,
                                    max_drafts=<room: 0 for prefill rows, else min(k, tokens the job may still
                                               emit - 1, slots left in its reserved pages past kv + 1)>,
                                    bias_at=<lambda j: the row bias for the token at output position
                                             new_tokens + j (stop-token bans before min_new_tokens, banned-string
                                             bans at that sequence index)>,
                                    penalty_window=<SamplingSettings.history_window(max_penalty_range)>,
                                    host_drafts=<the job has a grammar filter>)
                            for row, job in zip(rows, owners)])        # runs the draft model (mirror + propose)
    out = engine.run(plan.rows, return_top_k=..., return_logits=..., draft_logprobs=plan.draft_logprobs,
                     draft_tokens=plan.draft_tokens)                   # (a draft model's: see `SpecPlan`)
    for row_result in speculator.accept(plan, out):                    # one `Accepted` per row, in order
        advance the job's KV by `row_result.kv_advance` (1 + accepted drafts for a verification row: the KV of
        rejected drafts is dropped by not counting it), then feed `row_result.tokens` one by one through the
        usual per-token path (stop tokens / strings, banned-string rewinds, max_new_tokens), with
        `row_result.logprobs[i]`, `top_ids[i]`, `top_logprobs[i]`, `logits[i]` for token i; stop at the first
        token that ends the job or rewinds it (the later ones were conditioned on it); add
        `num_drafted` / `num_accepted` to the job's counters.
    speculator.release(job)     when a job finishes, fails or is cancelled (its per-job drafter state)
    speculator.stats()          totals and the per-position acceptance histogram

`plan` with no row able to speculate returns the scheduler's rows untouched and `draft_logprobs=None`, so
`engine.run` takes its ordinary path (and with a draft model, the draft still sees the step's rows: its cache
mirrors the target's). The generator must not use decode bursts (`decode_steps > 1`) while speculating.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from paged.errors import InvalidConfigError
from paged.speculation.config import SpeculationConfig
from paged.speculation.draft import DraftModel
from paged.speculation.draft_gate import DraftGate
from paged.speculation.drafter import Drafter, check_target, make_drafter
from paged.speculation.rows import (
    Accepted,
    SpecPlan,
    SpecRow,
    verification_row,
)


class Speculator:
    """Drafts tokens for the decoding rows of each step and turns the verification results into accepted tokens.

    `target`: the generator's `paged.device.engine.Engine`, built for this speculation's verification
    (`EngineConfig(verification=config.verification())`: its verification buckets, fixed at construction).
    `config` (`paged.speculation.config.SpeculationConfig`, validated there) says how:
    its drafter is a draft model (`draft_model`, a `models.Model` sharing the target's tokenizer, its vocabulary
    size the same or padded differently; its engine gets the target's config, so the same page ids index both
    caches) or prompt lookup (`max_ngram`; with
    `ngram_corpus`, a table drafting where prompt lookup's match is short). `acceptance`: how sampled rows accept
    drafts, "rejection" (lossless rejection sampling), "match" (sample, then match, see `accept_drafts`; a draft
    model's draws coupled to the target's) or "exllamav2" (sample, then match, a draft model drafting greedily);
    greedy rows accept the drafts equal to the target's argmax either way. `adaptive`: a step verifies only where its
    drafts are expected to pay for the verification (`paged.speculation.draft_gate`, with `draft_token_cost` its rho;
    None: the backend's measured default); else every step with drafts verifies (ExLlamaV2's behaviour).
    """

    def __init__(self, target: Any, config: SpeculationConfig, drafter: Drafter):
        check_target(target, config)
        if not isinstance(drafter, Drafter):
            raise InvalidConfigError(f"Speculator: drafter must implement paged.speculation.drafter.Drafter, got "
                                     f"{type(drafter).__name__}")
        k = config.num_draft_tokens
        self.config = config
        self.target = target
        self.acceptance = config.acceptance
        self.k = k
        self.drafter = drafter
        # the draft model's own handle (its engine, the bursts dispatched ahead), None for other drafters
        self.draft = drafter if isinstance(drafter, DraftModel) else None
        self.gate = None
        if config.adaptive:
            self.gate = DraftGate(k, config.draft_token_cost, draft_step_cost=drafter.step_cost(target))
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0  # verification rows run
        self.emitted = 0  # tokens they emitted (accepted drafts and the target's token after them; `unemitted`)
        self.accepted_at = np.zeros(k, np.int64)  # rows whose draft j was accepted
        self.corpus_drafted = 0  # drafts the n-gram corpus proposed (evidence class < 0), verified
        self.corpus_accepted = 0

    @classmethod
    def of(cls, target: Any, *, draft_model: Any = None, tokenizer: Any = None, **settings: Any) -> Speculator:
        """A speculator from the generator's keyword arguments (`use_ngram_draft`, `num_draft_tokens`, `max_ngram`,
        `adaptive`, `draft_token_cost`, `acceptance`, `ngram_corpus`: `SpeculationConfig.of`), for scripts and
        tests that drive an engine without a generator."""
        config = SpeculationConfig.of(draft_model=draft_model, **settings)
        if config is None:
            raise InvalidConfigError("Speculator needs a drafter: draft_model= or use_ngram_draft=True")
        return cls(target, config, make_drafter(config, target, draft_model=draft_model, tokenizer=tokenizer))

    @property
    def corpus(self) -> Any:
        """The n-gram drafter's corpus table (None: none, or another drafter)."""
        return getattr(self.drafter, "corpus", None)

    # ------------------------------------------------------------------ per job
    def release(self, key: Hashable) -> None:
        """Forget a job (finished, failed or cancelled)."""
        if self.gate is not None:
            self.gate.release(key)
        self.drafter.release(key)

    def warmup(self, progress: bool = False) -> int:
        """Compile the drafter's variants (the target's verification buckets come with its own warmup)."""
        return self.drafter.warmup(progress)

    def stats(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_draft_tokens": self.accepted,
                "rejected_draft_tokens": self.drafted - self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": self.emitted / self.rounds if self.rounds else 0.0,
                "accepted_at_position": self.accepted_at.tolist(), "draft_bursts_ahead": 0,
                "draft_bursts_ahead_used": 0, **self.drafter.stats(),
                "corpus_drafted_tokens": self.corpus_drafted, "corpus_accepted_draft_tokens": self.corpus_accepted,
                **({} if self.gate is None else self.gate.stats())}

    # ------------------------------------------------------------------ per step
    def _plain(self, specs: Sequence[SpecRow]) -> SpecPlan:
        return SpecPlan(rows=[s.row for s in specs], draft_logprobs=None, inputs=list(specs),
                        num_drafts=[0] * len(specs))

    def plan(self, specs: Sequence[SpecRow]) -> SpecPlan:
        """Draft for every decode row with `max_drafts > 0` and lay the step's rows out for verification (see the
        module docstring for the call sequence). The adaptive gate decides before drafting where drafts cost a
        forward (`Drafter.gate_first`), else after, from the drafts' evidence."""
        want = [min(self.k, s.max_drafts) if (s.row.is_decode and s.row.sample) else 0 for s in specs]
        sampling_rows = sum(bool(s.row.sample) for s in specs)
        first = self.drafter.gate_first
        if first and self.gate is not None and not self.gate.decide([(s.key, 0, n) for s, n in zip(specs, want)],
                                                                    sampling_rows):
            want = [0] * len(specs)  # a drafter with a cache still sees the step's rows (it follows the target's)
        # A draft model's drafts stay on the device (the target's forward writes them into the rows' token slots)
        # unless a row needs them on the host before the step: its penalty history or its grammar masks follow them.
        host = any(s.host_drafts or s.penalty_window or len(s.row.history) for s, n in zip(specs, want) if n)
        p = self.drafter.propose(self.target, specs, want, host)
        if not any(p.want) or (not first and self.gate is not None and not self.gate.decide(
                [(s.key, c, n) for s, c, n in zip(specs, p.classes, p.want)], sampling_rows)):
            return self._plain(specs)
        drafts = p.drafts if p.drafts is not None else [[0] * n for n in p.want]  # (placeholders: on the device)
        vrows = [verification_row(s, d[:n]) if n else s.row for s, d, n in zip(specs, drafts, p.want)]
        return SpecPlan(rows=vrows, draft_logprobs=p.draft_logprobs, inputs=list(specs), num_drafts=list(p.want),
                        classes=p.classes, draft_tokens=p.on_device)

    def unemitted(self, item: Accepted, emitted: int) -> tuple[int, int]:
        """A row whose job ended after `emitted` of its tokens, all accepted drafts (a stop token among them): the
        drafts past that point, accepted or not, are taken out of the statistics (drafted, accepted, by position,
        the corpus's; the tokens the rows emitted), which count what the job's output used. Returns the (drafted,
        accepted) drafts taken out."""
        drafted, accepted = item.num_drafted - emitted, item.num_accepted - emitted
        if accepted < 0:  # (it ended on the target's own token, after every accepted draft: all of it counts)
            return 0, 0
        self.drafted -= drafted
        self.accepted -= accepted
        self.emitted -= accepted + 1  # (its row's own token, after the drafts, was not emitted either)
        self.accepted_at[emitted : item.num_accepted] -= 1
        if item.corpus:
            self.corpus_drafted -= drafted
            self.corpus_accepted -= accepted
        return drafted, accepted

    def accept(self, plan: SpecPlan, out: Any) -> list[Accepted]:
        """One `Accepted` per row of the plan, in order; updates the drafters' state and the statistics."""
        res: list[Accepted] = []
        per_pos = out.num_accepted is not None
        for i, (row, spec, m) in enumerate(zip(plan.rows, plan.inputs, plan.num_drafts)):
            pick = (lambda a, i=i: a[i]) if not per_pos else (lambda a, i=i: a[i][0])
            if m:
                a = int(out.num_accepted[i])
                n = a + 1
                toks = [int(t) for t in out.token[i, :n]]
                corpus = plan.classes is not None and plan.classes[i] < 0  # (ngram_corpus.corpus_class)
                item = Accepted(tokens=toks, logprobs=np.asarray(out.logprob[i, :n]), top_ids=out.top_ids[i, :n],
                                top_logprobs=out.top_logprobs[i, :n],
                                logits=None if out.logits is None else out.logits[i, :n], kv_advance=1 + a,
                                num_drafted=m, num_accepted=a, corpus=corpus)
                self.drafted += m
                self.accepted += a
                self.emitted += n
                self.rounds += 1
                self.accepted_at[:a] += 1
                if corpus:
                    self.corpus_drafted += m
                    self.corpus_accepted += a
                if self.gate is not None:
                    self.gate.record(spec.key, plan.classes[i], m, a)
            elif row.sample:
                item = Accepted(tokens=[int(pick(out.token))], logprobs=np.asarray([pick(out.logprob)]),
                                top_ids=pick(out.top_ids)[None], top_logprobs=pick(out.top_logprobs)[None],
                                logits=None if out.logits is None else pick(out.logits)[None],
                                kv_advance=len(row.tokens))
            else:
                item = Accepted(tokens=[], logprobs=np.zeros(0, np.float32), top_ids=np.zeros((0, 0), np.int32),
                                top_logprobs=np.zeros((0, 0), np.float32), logits=None, kv_advance=len(row.tokens))
            self.drafter.accepted(spec, item, m)
            res.append(item)
        return res
