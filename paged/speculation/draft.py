"""`DraftModel`: a draft model's engine for speculative decoding, mirroring the target's paged cache.

The draft engine is an ordinary `paged.device.engine.Engine` built with the target's `EngineConfig` (same page size,
number of pages, batch and chunk limits), so the page ids the target's page pool hands out index the draft's cache
too: the tokens the target writes reach the draft's cache in the same pages ("mirrored"), so prefix sharing, the
prompt cache, cancel and eviction need nothing more: a page is valid, shared, cached or free in both caches at once.
The draft may lag the target by the tokens it has not been fed yet; it tracks, per job, how many of the job's tokens
have KV in its cache, and feeds the missing ones before drafting: one or two after a verification step (the bonus
token, and the last draft when every draft was accepted), any number as a catch-up chunk otherwise. Prefill chunks
are mirrored in their step (a prompt's pages may be shared); a decode row that does not draft in a step (the
adaptive gate closed it, it has no room for drafts, or its job never drafts) is not: its tokens are fed as a
catch-up chunk when the job next drafts, or in the step whose token fills their page, whichever comes first, and a
page that a full acceptance completed gets its last draft's KV in the job's next step. So a page is whole in the
draft cache by the step after the prompt cache may first share it (the catch-up chunks run before that step's
prefill chunks), but for the last token of a page a job completed in the step it finished; and a step that verifies
nothing runs no draft forward over its decode rows but those chunks.

Where a step allows it (`DraftModel.ahead`: every row drafting, no penalty history, room in the pages), the next
step's burst is dispatched right after the target's verification, from its results on the device, and runs while
the host takes in the step; the next `propose` uses it if its rows are those, each where the verification left it,
and drops it otherwise (docs/speculative.md, "How a step works").

The draft samples its drafts with the job's seed salted (`DRAFT_SEED_SALT`), so its draws are independent of the
target's, except when `coupled` (sample-then-match acceptance): it then draws with the target's own keys, so at
each position the draft and the target add the same Gumbel noise to their log-probabilities, and a draft whose
distribution is close to the target's draws the target's token (Gumbel-max coupling): matching then accepts far
more than the independent draws' sum p q, every draft where q = p. `greedy` (ExLlamaV2's sample-then-match): the
draft proposes its argmax (after the row's penalties and bias) at every position instead of sampling.

Validation (`InvalidConfigError`): the draft must share the target's tokenizer (the bytes of every token both
tokenizers and both models have). Its vocabulary size may differ (padded differently past the tokenizer, as
Qwen2.5-7B's 152064 ids and 0.5B's 151936) when both have a tokenizer: the draft's logits are then matched to the
target's ids (`models.draft.matched_vocab`: -inf past its own vocabulary, the ids past the target's dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from models.draft import matched_vocab
from models.errors import InvalidLoadOptionError
from paged.device.batch import RowInput
from paged.device.config import Drafting
from paged.device.engine import Engine
from paged.errors import InvalidConfigError
from paged.speculation.rows import DRAFT_SEED_SALT, Proposal, verification_row


def check_draft_model(target_model: Any, draft_model: Any, target_tokenizer: Any = None) -> None:
    """Raise `InvalidConfigError` unless `draft_model` can draft for `target_model`: the same token bytes for every
    id both tokenizers and both models have (a draft without a tokenizer is trusted when its vocabulary size is the
    model's). The sizes may differ, as vocabularies padded differently past one tokenizer do (Qwen2.5-7B's 152064
    ids and 0.5B's 151936; a GGUF tokenizer lists the padding as tokens of its own), since the draft is then
    `models.draft.matched_vocab` to the model's ids, which keeps speculative decoding lossless."""
    tv, dv = target_model.config.vocab_size, getattr(getattr(draft_model, "config", None), "vocab_size", None)
    if dv is None or not hasattr(draft_model, "params"):
        raise InvalidConfigError(f"draft_model must be a loaded models.Model, got {type(draft_model).__name__}")
    ta = target_tokenizer if target_tokenizer is not None else getattr(target_model, "tokenizer", None)
    tb = getattr(draft_model, "tokenizer", None)
    if ta is None or tb is None:
        if tv != dv:
            raise InvalidConfigError(f"draft_model has a vocabulary of {dv} ids but the model has {tv}; a draft "
                                     "whose vocabulary differs needs both models' tokenizers to show they share one "
                                     "(load both with their tokenizers, or use a draft with the same vocabulary)")
        return
    if ta is tb:
        return
    shared = min(getattr(ta, "vocab_size", tv), getattr(tb, "vocab_size", dv), tv, dv)
    for i in range(shared):  # (past a tokenizer or a model's vocabulary: padding, with no text to compare)
        if ta.token_bytes(i) != tb.token_bytes(i):
            raise InvalidConfigError(f"draft_model's tokenizer differs from the model's (token {i}: "
                                     f"{tb.token_bytes(i)!r} vs {ta.token_bytes(i)!r}); speculative decoding needs "
                                     "the same tokenizer")


class DraftModel:
    """The draft side of `paged.speculation.speculator.Speculator` for a draft model (a
    `paged.speculation.drafter.Drafter`: its drafts cost a forward, so the adaptive gate decides first)."""

    gate_first = True

    def __init__(self, target: Any, model: Any, num_draft_tokens: int, tokenizer: Any = None,
                 coupled: bool = False, greedy: bool = False):
        check_draft_model(target.model, model, tokenizer)
        try:
            model = matched_vocab(model, int(target.model.config.vocab_size))  # (itself when the sizes match)
        except InvalidLoadOptionError as e:  # (a reduced head with no id the model has)
            raise InvalidConfigError(f"draft_model: {e}") from None
        seq, positions = target.config.max_seq_len, model.config.max_position_embeddings
        if positions is not None and seq > positions:
            raise InvalidConfigError(f"draft_model: max_seq_len={seq} exceeds the draft model's "
                                     f"max_position_embeddings={positions} (the draft mirrors every sequence); lower "
                                     "max_seq_len or use a draft model with more positions")
        self.k = num_draft_tokens
        self.coupled = coupled  # draw with the target's keys (see the module docstring)
        self.greedy = greedy  # propose the argmax instead of a draw
        if not target.fed_rows:
            raise InvalidConfigError("a draft model's target verifies drafts read on the device: build it with "
                                     "Verification(fed_drafts=True) (SpeculationConfig.verification())")
        # the draft engine: the target's sizes, no adapters, no verification; it proposes k drafts per row, padded to
        # the rows of the target's verification steps (`propose`)
        try:
            self.engine = Engine(model, dataclasses.replace(target.config, max_loras=0, verification=None,
                                                            drafting=Drafting(num_draft_tokens,
                                                                              pad_rows=target.fed_rows)))
        except InvalidConfigError as e:  # (its mesh is the target's: say which model a message about "the model" is)
            raise InvalidConfigError(f"draft_model: {e}") from None
        self.kv: dict[Hashable, int] = {}  # per job: tokens with KV in the draft cache (a prefix)
        self.pipeline = True  # dispatch the next step's burst ahead where the step allows (`ahead`)
        self._can_ahead: tuple | None = None  # the last burst's rows, when `ahead` may follow it
        self._ahead: tuple | None = None  # a burst dispatched ahead: (keys, slots, sampled rows, q, drafts)
        self._next: dict[Hashable, tuple[int, int]] = {}  # per job after a verification: (position, token) of its row
        self.ahead_bursts = [0, 0]  # bursts dispatched ahead, and of them used by the next step

    def warmup(self, progress: bool = False) -> int:
        return self.engine.warmup(progress=progress)

    def release(self, key: Hashable) -> None:
        self.kv.pop(key, None)
        self._next.pop(key, None)

    def _mirror(self, items: list[tuple[Hashable, RowInput]]) -> None:
        """Run the forward of `items` on the draft engine (K/V only: no sampler, no wait for the device), in as few
        calls as the buckets allow, each job's rows in order; then each job's KV reaches the end of its last row."""
        cfg = self.engine.config
        groups: list[list[tuple[Hashable, RowInput]]] = []
        for key, row in items:
            g = groups[-1] if groups else None
            fits = g is not None and len(g) < cfg.max_batch_size and all(k != key for k, _ in g) and (
                row.is_decode or sum(not r.is_decode for _, r in g) < cfg.max_prefill_rows)
            if fits:
                g.append((key, row))
            else:
                groups.append([(key, row)])
        for g in groups:
            self.engine.run_forward([r for _, r in g])  # KV only: the draft's samples here are unused
            for key, r in g:
                self.kv[key] = r.start_pos + len(r.tokens)

    def propose(self, target: Any, specs: Sequence[Any], want: list[int], host: bool = True) -> Proposal:
        """`Drafter.propose`: `_propose`'s drafts (see there), every row of evidence class 0."""
        drafts, q, want, on_device = self._propose(target, specs, want, host)
        return Proposal(want=want, drafts=drafts, classes=[0] * len(specs), draft_logprobs=q, on_device=on_device)

    def stats(self) -> dict:
        return {"draft_bursts_ahead": self.ahead_bursts[0], "draft_bursts_ahead_used": self.ahead_bursts[1]}

    def step_cost(self, target: Any) -> float:
        """A draft step over a target step: the weight bytes each step reads (a reduced head's draft reads its small
        head, not the embedding table it gathers from)."""
        return self.engine.model.params.step_read_bytes() / max(target.model.params.step_read_bytes(), 1)

    def _propose(self, target: Any, specs: Sequence[Any], want: list[int], host: bool = True
                 ) -> tuple[list[list[int]] | None, jax.Array | None, list[int], jax.Array | None]:
        """Feed the draft what it lacks (the step's prefill chunks, and the catch-up chunks of the module docstring),
        then draft `self.k` tokens for every row with `want[i] > 0` in one jitted
        call laid out like the target's verification batch (a row whose token before its own has no KV in the draft
        cache yet feeds it in the same forward: `Engine.draft(catch_up=)`). Returns (drafts per row, on the host:
        None unless `host`, and then nothing waits for the burst; the draft distributions [S', k, V] by target batch
        row, the drafts to verify per row, the drafts on the device [R, k] by target batch row for
        `target.run(draft_tokens=)`)."""
        ahead, self._ahead, self._can_ahead = self._ahead, None, None
        if ahead is not None and self.pipeline and not host:
            got = self._take_ahead(ahead, target, specs, want)
            if got is not None:
                return got
        catch_up_chunks: list[tuple[Hashable, RowInput]] = []
        prefill: list[tuple[Hashable, RowInput]] = []
        chunk = self.engine.config.max_chunk_size
        page = self.engine.config.page_size
        offsets = [0] * len(specs)
        for i, (s, n) in enumerate(zip(specs, want)):
            row = s.row
            if not n and not (row.is_decode and row.sample):  # a prefill chunk: mirrored now (its pages may be shared)
                prefill.append((s.key, row))
                continue
            # what the draft holds of the job (a job first seen here: its prefix came mirrored); a rewind since
            # moved the job back below what it held; `_mirror` moves the record on as the chunks run
            have = self.kv[s.key] = min(self.kv.get(s.key, row.start_pos), row.start_pos)
            # the pages before the row's are fed whole (a job admitted now may share them; one that a full
            # acceptance completed lacks its last draft's KV)
            page_start = row.start_pos - row.start_pos % page
            if n:  # a drafting row: up to the token before its own (the burst feeds that one and its own)
                upto = max(row.start_pos - 1, page_start)
            elif (row.start_pos + 1) % page == 0:  # a decode row that does not draft waits, unless its token fills
                upto = row.start_pos + 1  # its page (which the prompt cache may then share): fed up to that token
            else:
                upto = page_start
            while have < upto:
                end = min(upto, have + chunk)
                catch_up_chunks.append((s.key, RowInput(tokens=list(s.sequence[have:end]), start_pos=have,
                                                        pages=row.pages, sample=False)))
                have = end
            offsets[i] = row.start_pos - have
        # catch-up chunks first: a job admitted in this step may share the pages they complete
        mirror = catch_up_chunks + prefill
        if mirror:
            self._mirror(mirror)
        drafting = [i for i, n in enumerate(want) if n]
        if not drafting:
            return [[] for _ in specs], None, want, None
        placeholder = [verification_row(s, [0] * n) if n else s.row for s, n in zip(specs, want)]
        _, sampled, slots = target.verify_plan(placeholder)
        drows, catch_up = [], []
        for i in drafting:
            s = specs[i]
            row = s.row
            sampling = dict(row.sampling or {})
            if not self.coupled:
                sampling["seed"] = (int(sampling.get("seed", 0)) ^ DRAFT_SEED_SALT) & 0xFFFFFFFF
            if self.greedy:
                sampling["temperature"] = 0.0
            drows.append(RowInput(tokens=list(row.tokens), start_pos=row.start_pos, pages=row.pages,
                                  sampling=sampling, history=row.history, bias=row.bias, mask=row.mask,
                                  dry_breakers=row.dry_breakers, xtc_exempt=row.xtc_exempt))
            # the token before the row's is missing too: fed first, in the same forward
            catch_up.append(int(s.sequence[row.start_pos - 1]) if offsets[i] else -1)
        tokens, q, on_device = self.engine.draft(drows, [slots[i] for i in drafting], sampled, catch_up, host=host)
        # The next step's burst may be dispatched ahead when every row of this one drafts with its drafts on the
        # device, has no penalty history (which would follow the verified tokens) and holds pages for all the burst
        # may write: up to 2k positions past its token (k accepted, the target's token, k - 1 drafts' KV).
        if self.pipeline and not host and not mirror and len(drafting) == len(specs) and self._room_ahead(specs):
            self._can_ahead = ([specs[i].key for i in drafting], [slots[i] for i in drafting], sampled)
        if tokens is None:
            return None, q, want, on_device
        drafts: list[list[int]] = [[] for _ in specs]
        for j, i in enumerate(drafting):
            drafts[i] = [int(t) for t in tokens[j]]
        return drafts, q, want, on_device

    def accepted(self, spec: Any, item: Any, num_drafts: int) -> None:
        """Record what the draft cache holds of the job after the step (see the module docstring)."""
        if not num_drafts:
            return
        # The burst fed the row's token (after its catch-up token, if any) and its drafts d_1 .. d_(k-1), not d_k:
        # the accepted ones have valid KV.
        self.kv[spec.key] = spec.row.start_pos + 1 + min(item.num_accepted, self.k - 1)
        self._next[spec.key] = (spec.row.start_pos + 1 + item.num_accepted, int(item.tokens[-1]))

    def ahead(self, results: Any) -> None:
        """Dispatch the next step's burst for this step's rows now, before the host has seen `results` (the
        verification's device results; `Engine.draft_ahead`), where `propose` allowed it: the burst then runs while
        the host takes in this step and lays out the next. `propose` uses it if the next step has exactly these rows,
        each continuing where the verification left it (no job finished, rewound or joined); otherwise it is
        dropped: it only wrote KV past what the draft cache is known to hold."""
        can, self._can_ahead = self._can_ahead, None
        if can is None or not self.pipeline or results.num_accepted is None:
            return
        q, on_device = self.engine.draft_ahead(results.token, results.num_accepted)
        self._ahead = (*can, q, on_device)
        self.ahead_bursts[0] += 1

    def drop_ahead(self) -> None:
        """Forget a burst dispatched ahead (and the step it could follow): the step it went ahead from failed, so the
        jobs are not where that burst assumed (`paged.speculation.spec_step.SpeculativeStep.run`)."""
        self._ahead = self._can_ahead = None

    def _take_ahead(self, ahead: tuple, target: Any, specs: Sequence[Any], want: list[int]
                    ) -> tuple[None, jax.Array, list[int], jax.Array] | None:
        """`propose`'s answer from a burst dispatched ahead (`ahead`), or None when this step's rows are not the
        ones it drafted for, each at the token and position the verification left it."""
        keys, slots, sampled, q, on_device = ahead
        if len(specs) != len(keys) or not all(want) or any(s.key is not k for s, k in zip(specs, keys)):
            return None
        for s in specs:
            nxt = self._next.get(s.key)
            if nxt is None or nxt != (s.row.start_pos, int(s.row.tokens[0])):
                return None
        placeholder = [verification_row(s, [0] * n) for s, n in zip(specs, want)]
        _, now_sampled, now_slots = target.verify_plan(placeholder)
        if now_sampled != sampled or list(now_slots) != list(slots):
            return None
        for s in specs:  # the burst fed the row's token (and the token before it where the cache lacked it)
            self.kv[s.key] = s.row.start_pos + 1
        self.engine.advance_burst(slots, [s.row.start_pos for s in specs], [int(s.row.tokens[0]) for s in specs])
        self.ahead_bursts[1] += 1
        self._can_ahead = (keys, slots, sampled) if self._room_ahead(specs) else None
        return None, q, want, on_device

    def _room_ahead(self, specs: Sequence[Any]) -> bool:
        """Whether a burst may go ahead for these rows: none has a penalty history (which would follow the verified
        tokens) and each holds pages for all the burst may write, up to 2k positions past its token."""
        ps = self.engine.config.page_size
        return all(not len(s.row.history) and len(s.row.pages) * ps > s.row.start_pos + 2 * self.k for s in specs)
