"""The generator's side of speculative decoding: which rows of a step may speculate and how far, the step itself
(`Speculator.plan` -> `engine.run` -> `Speculator.accept`), and the per-job counters. `DynamicGenerator` holds one
`SpeculativeStep` when it was given a drafter (`draft_model=` or `use_ngram_draft=True`, made into a
`paged.speculation.config.SpeculationConfig`) and none otherwise, in which case nothing here runs and the step is
exactly the non-speculative one.

A decoding job's row (one token to feed) verifies up to `max_drafts` drafts:
    min(num_draft_tokens,
        max_new_tokens - new_tokens - 1,            # the row emits up to drafts + 1 tokens: never more than asked
        len(pages) * page_size - kv_position - 1)   # the row writes KV at kv .. kv + drafts: inside its own pages
and the bias at each drafted position is the one the scheduler would give the row that samples there (stop tokens
before `min_new_tokens`, tokens banned there by banned-string rewinds, the settings' bias and bans); drafting stops
before a position where every token is banned. Prefill chunks (and the chunk that samples the first token) share
the step unchanged. The tokens of each row then go through `JobOutput.feed`, one at a time, as if they had come
from single steps (see the module docstring of `paged.speculation.speculator` for the call sequence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from paged.device.batch import RowInput
from paged.errors import InvalidConfigError
from paged.filters import compute_masks, mask_allows
from paged.speculation.config import SpeculationConfig
from paged.speculation.drafter import make_drafter
from paged.speculation.rows import Accepted, SpecRow
from paged.speculation.speculator import Speculator


class SpeculativeStep:
    """Drafts, verifies and accepts for one generator (see the module docstring).

    `scheduler` provides `sample_bias(job, index)` (the logit bias of the row that samples sequence index `index`, or
    None where every token is banned) and the engine config; `engine` must support verification rows
    (built with `EngineConfig(verification=config.verification())`), and a draft model needs the JAX
    `paged.device.engine.Engine`."""

    def __init__(self, engine: Any, scheduler: Any, config: SpeculationConfig, *, draft_model: Any = None,
                 tokenizer: Any = None):
        if draft_model is not None and not (hasattr(engine, "verify_plan") and hasattr(engine, "model")):
            raise InvalidConfigError(f"DynamicGenerator: a draft model needs the JAX paged.device.engine.Engine as the "
                                     f"target (it mirrors its cache), not {type(engine).__name__}")
        # the drafter is built from the config and handed to the speculator
        drafter = make_drafter(config, engine, draft_model=draft_model, tokenizer=tokenizer)
        self.speculator = Speculator(engine, config, drafter)
        self.k = config.num_draft_tokens
        self.scheduler = scheduler
        self.page_size = scheduler.config.page_size
        self.max_penalty_range = scheduler.config.max_penalty_range

    # ------------------------------------------------------------------ rows
    def max_drafts(self, job: Any, row: RowInput) -> int:
        if not (row.sample and len(row.tokens) == 1):
            return 0
        room = len(job.pages) * self.page_size - job.kv_position - 1
        return max(0, min(self.k, job.max_new_tokens - job.new_tokens - 1, room))

    def spec_row(self, row: RowInput, job: Any) -> SpecRow:
        m = self.max_drafts(job, row)
        if job.healing_allowed and job.new_tokens == 0:
            m = 0  # the healed first token: its mask allows only the healing candidates (and, with filters, feeds the
            # grammar only its text after the prefix): verify it alone
        if job.mirostat_mu is not None:
            m = 0  # mirostat's mu after a token depends on that token: positions cannot be verified in parallel
        if job.cfg_partner is not None or job.cfg_owner is not None:
            m = 0  # CFG: both prompts' rows take one token per step, sampled from their mixture
        if job.embeddings:
            m = 0  # prompt lookup could propose reserved ids, and a draft model has no embedding table
        base = job.kv_position + len(row.tokens)  # sequence index the row's first position samples
        biases = []
        for j in range(1, m + 1):
            b = self.scheduler.sample_bias(job, base + j)
            if b is None:  # every token banned there: draft no further
                m = j - 1
                break
            biases.append(b)
        s = job.gen_settings
        window = s.history_window(self.max_penalty_range)
        return SpecRow(key=job, row=row, sequence=job.sequence, max_drafts=m,
                       bias_at=lambda j, biases=biases: biases[j - 1], penalty_window=window,
                       host_drafts=job.filter_state is not None)

    # ------------------------------------------------------------------ the step
    def run(self, engine: Any, rows: Sequence[RowInput], owners: Sequence[Any], *, return_top_k: int,
            return_logits: bool, fault: Any = None) -> tuple[Any, list[Accepted]]:
        """Draft, run the step (verification rows where there are drafts), accept. Returns the engine's output
        and one `Accepted` per row, in order. `fault(point)` (the generator's fault hook) is called with "draft"
        once the drafts are made and with "step" right before the engine step."""
        plan = self.speculator.plan([self.spec_row(r, j) for r, j in zip(rows, owners)])
        for i, (job, n) in enumerate(zip(owners, plan.num_drafts)):
            if n and job.filter_state is not None:
                plan.rows[i] = dataclasses.replace(plan.rows[i], position_mask=_position_masks(
                    job.filter_state, plan.rows[i].mask, list(plan.rows[i].tokens[1:])))
        kw = {} if plan.draft_logprobs is None else {"draft_logprobs": plan.draft_logprobs}
        if plan.draft_tokens is not None:
            kw["draft_tokens"] = plan.draft_tokens
            kw["after_dispatch"] = self.speculator.draft.ahead  # the next step's burst, where it may go ahead
        try:
            if fault is not None:
                fault("draft")
                fault("step")
            out = engine.run(plan.rows, return_top_k=return_top_k, return_logits=return_logits, **kw)
            items = self.speculator.accept(plan, out)
        except Exception:
            if self.speculator.draft is not None:  # a burst that went ahead from this step's results is not the
                self.speculator.draft.drop_ahead()  # retry's: it drafted one verification further on
            raise
        for job, item in zip(owners, items):
            job.drafted_tokens += item.num_drafted
            job.accepted_draft_tokens += item.num_accepted
        return out, items

    # ------------------------------------------------------------------ bookkeeping
    def ended_after(self, job: Any, item: Accepted, emitted: int) -> None:
        """`job` ended after `emitted` tokens of its row's `item`, all accepted drafts: the drafts past them do not
        count, in the job's statistics or the generator's (`Speculator.unemitted`)."""
        drafted, accepted = self.speculator.unemitted(item, emitted)
        job.drafted_tokens -= drafted
        job.accepted_draft_tokens -= accepted

    def release(self, job: Any) -> None:
        """Forget the job's drafter state (finished, failed, cancelled or preempted)."""
        self.speculator.release(job)

    def warmup(self, progress: bool = False) -> int:
        return self.speculator.warmup(progress)

    def metrics(self) -> dict:
        s = self.speculator.stats()
        return {"drafted_tokens": s["drafted_tokens"], "accepted_draft_tokens": s["accepted_draft_tokens"],
                "rejected_draft_tokens": s["rejected_draft_tokens"], "acceptance_rate": s["acceptance_rate"],
                "mean_accepted_length": s["mean_accepted_length"], "verification_rows": self.speculator.rounds,
                "accepted_at_position": s["accepted_at_position"], "gated_steps": s.get("gated_steps", 0),
                "explored_steps": s.get("explored_steps", 0), "draft_bursts_ahead": s["draft_bursts_ahead"],
                "draft_bursts_ahead_used": s["draft_bursts_ahead_used"],
                "corpus_drafted_tokens": s["corpus_drafted_tokens"],
                "corpus_accepted_draft_tokens": s["corpus_accepted_draft_tokens"]}


def _position_masks(state: Any, first: Any, drafts: list[int]) -> list:
    """The token mask of each position of a verification row: position 0's (`first`, already computed), then the
    grammar's after each draft, computed by consuming the drafts and rolling back. After a draft the grammar
    rejects, later positions can never be reached (acceptance stops there); they reuse the last mask."""
    masks = [first]
    taken = 0
    try:
        for t in drafts:
            if not mask_allows(masks[-1], t) or t in state.stop_tokens:  # a stop token ends the job
                break
            state.consume(t)
            taken += 1
            masks.append(compute_masks([state])[0])
    finally:  # the grammar is back where the job is, whatever failed
        state.rollback(taken)
    return masks + [masks[-1]] * (len(drafts) + 1 - len(masks))


def empty_metrics() -> dict:
    """`SpeculativeStep.metrics()` of a generator that does not speculate."""
    return {"drafted_tokens": 0, "accepted_draft_tokens": 0, "rejected_draft_tokens": 0, "acceptance_rate": 0.0,
            "mean_accepted_length": 0.0, "verification_rows": 0, "accepted_at_position": [], "gated_steps": 0,
            "explored_steps": 0, "draft_bursts_ahead": 0, "draft_bursts_ahead_used": 0, "corpus_drafted_tokens": 0,
            "corpus_accepted_draft_tokens": 0}
