"""Host-side construction of a `Batch` from per-row inputs, padded to a `BatchShape` (numpy, then copied to the
device; no device computation, so nothing here compiles)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from paged.device.sampling import SamplingRows
from paged.device.state import NULL_PAGE, Batch, BatchShape


@dataclasses.dataclass
class RowInput:
    """One row of a step: `tokens` are this step's new tokens, the first at position `start_pos`; `pages` is the
    row's page list, covering at least positions `0 .. start_pos + len(tokens) - 1`."""

    tokens: Sequence[int]
    start_pos: int
    pages: Sequence[int]
    sample: bool = True
    sampling: Mapping | None = None  # keyword values for SamplingRows.make (missing: neutral/greedy)
    history: Sequence[int] = ()  # previous tokens for penalties, oldest first
    bias: Mapping[int, float] | None = None  # sparse additive logit bias (-inf bans)
    # Constrained decoding: the allowed tokens as packed bits (int32 [ceil(V/32)], token t = bit t % 32 of word
    # t // 32); None: every token. Verification rows: `position_mask[j]` for position j (None entries: all).
    mask: np.ndarray | None = None
    # The sampler's per-job token sets, packed the same way (None: empty): DRY's sequence breakers, XTC's exempt
    # tokens (`paged.token_sets`).
    dry_breakers: np.ndarray | None = None
    xtc_exempt: np.ndarray | None = None
    # Speculative verification: `tokens` are the last accepted token and then the drafts, and the row samples at
    # every position (needs a verification bucket). Position j samples the token at `start_pos + j + 1`, with the
    # penalty history `position_history[j]` (default: `history` followed by the drafts before it, cut to the
    # bucket's width) and the bias `position_bias[j]` (default, or where None: `bias`).
    verify: bool = False
    lora_slot: int = 0  # the LoRA adapter the row's tokens run through (0: none; i: slot i - 1 of the engine's stack)
    # Classifier-free guidance: the row of this job's negative prompt, in the same step (it must sample too); this
    # row samples from the guided mixture of the two (`paged.device.sampling.apply_cfg`, scale `sampling["cfg_scale"]`).
    cfg_negative: RowInput | None = dataclasses.field(default=None, compare=False, repr=False)
    position_history: Sequence[Sequence[int]] | None = None
    position_bias: Sequence[Mapping[int, float] | None] | None = None
    position_mask: Sequence[np.ndarray | None] | None = None

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1

    @property
    def is_step_row(self) -> bool:
        """A verification row or a 1-token row: what owns `verify_len` slots in a verification bucket."""
        return self.verify or len(self.tokens) == 1


@functools.lru_cache(maxsize=64)
def _zero_bias(num_rows: int, vocab_size: int) -> jax.Array:
    """A device-resident zero dense bias [S, V], shared by every batch without dense-bias rows (no copy per step)."""
    return jax.device_put(np.zeros((num_rows, vocab_size), np.float32))


@functools.lru_cache(maxsize=128)
def _const_words(num_rows: int, vocab_size: int, fill: int) -> jax.Array:
    """A device-resident packed token set [S, ceil(V/32)] of every token (fill -1) or none (0), shared by every
    batch whose rows set none (no copy per step)."""
    return jax.device_put(np.full((num_rows, mask_words(vocab_size)), fill, np.int32))


def _rare_to_device(dense, mask_rows, set_rows):
    """A batch's own dense bias and token-set rows, on the device like the shared constants (`_zero_bias`,
    `_const_words`) that stand in for them in most batches: each argument of the jitted step keeps one type, numpy
    or device array, since a switch between the two compiles the step anew."""
    if dense is None and mask_rows is None and all(r is None for r in set_rows):
        return dense, mask_rows, set_rows
    return jax.device_put((dense, mask_rows, set_rows))


def mask_words(vocab_size: int) -> int:
    """int32 words of a packed token mask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


class _Masks:
    """Packed token-set rows of one batch (one `RowInput` attribute): materialised on the first row that has one;
    the other rows hold `fill` (-1: every token, the open token mask; 0: none)."""

    def __init__(self, num_points: int, vocab_size: int | None, what: str = "a token mask", fill: int = -1):
        self.num_points, self.vocab_size, self.rows, self.what, self.fill = num_points, vocab_size, None, what, fill

    def put(self, pt: int, mask: np.ndarray | None, i: int) -> None:
        if mask is None:
            return
        if self.vocab_size is None:
            raise ValueError(f"row {i} has {self.what}, and no vocab_size was given")
        if self.rows is None:
            self.rows = np.full((self.num_points, mask_words(self.vocab_size)), self.fill, np.int32)
        self.rows[pt] = mask

    def device(self, device_rows) -> jax.Array | None:
        if self.vocab_size is None:
            return None
        return _const_words(self.num_points, self.vocab_size, self.fill) if device_rows is None else device_rows

    def fields(self, device_rows) -> dict:
        if self.vocab_size is None:
            return dict(token_mask=None, token_mask_on=None)
        return dict(token_mask=self.device(device_rows), token_mask_on=np.bool_(device_rows is not None))


class _TokenSets:
    """The DRY-breaker and XTC-exempt rows of one batch."""

    def __init__(self, num_points: int, vocab_size: int | None):
        self.dry = _Masks(num_points, vocab_size, "DRY sequence breakers", 0)
        self.xtc = _Masks(num_points, vocab_size, "XTC exempt tokens", 0)

    def put(self, pt: int, r: RowInput, i: int) -> None:
        self.dry.put(pt, r.dry_breakers, i)
        self.xtc.put(pt, r.xtc_exempt, i)

    @property
    def rows(self) -> tuple:
        return self.dry.rows, self.xtc.rows

    def fields(self, device_rows: tuple) -> dict:
        return dict(dry_breakers=self.dry.device(device_rows[0]), xtc_exempt=self.xtc.device(device_rows[1]))


def _cfg_points(rows: Sequence[RowInput], point_of: Sequence[int]) -> dict[int, int]:
    """Input row -> the sample point of its CFG negative row (`RowInput.cfg_negative`), for the rows that have one."""
    if not any(r.cfg_negative is not None for r in rows):
        return {}
    index = {id(r): i for i, r in enumerate(rows)}
    out = {}
    for i, r in enumerate(rows):
        if r.cfg_negative is not None:
            j = index.get(id(r.cfg_negative))
            if j is None or j == i:
                raise ValueError(f"row {i} is guided by a CFG negative row that is not in the step")
            out[i] = point_of[j]
    return out


class _Fill:
    """The arrays of one batch being built, and the two ways a row enters them (both builders use them): `row` puts
    a row's tokens, positions, page table and lengths in batch row `s` at token slot `t0`; `point` puts a row's
    sampler inputs (settings, CFG partner, penalty history, bias, token mask, token sets) at sample point `pt`."""

    def __init__(self, shape: BatchShape, page_size: int, vocab_size: int | None, points: int):
        s_count, t_count = shape.num_rows, shape.num_tokens
        self.shape, self.page_size, self.vocab_size, self.points = shape, page_size, vocab_size, points
        self.token_ids = np.zeros(t_count, np.int32)
        self.positions = np.zeros(t_count, np.int32)
        self.token_rows = np.full(t_count, s_count, np.int32)
        self.query_lens = np.zeros(s_count, np.int32)
        self.lora_slots = np.zeros(s_count, np.int32)
        self.kv_lens = np.zeros(s_count, np.int32)
        self.page_table = np.full((s_count, shape.pages_per_row), NULL_PAGE, np.int32)
        self.decode_tokens = np.full(shape.num_decode_rows, t_count, np.int32)
        self.last_tokens = np.zeros(s_count, np.int32)
        self.history = np.full((points, shape.history_len), -1, np.int32)
        self.bias_ids = np.full((points, shape.num_bias), -1, np.int32)
        self.bias_values = np.zeros((points, shape.num_bias), np.float32)
        self.dense: np.ndarray | None = None  # [points, V], only if some point has more bias entries than num_bias
        self.masks = _Masks(points, vocab_size)
        self.sets = _TokenSets(points, vocab_size)
        self.sampling_rows: list[Mapping] = [{} for _ in range(points)]

    def row(self, i: int, r: RowInput, s: int, t0: int) -> None:
        n, p = len(r.tokens), self.shape.pages_per_row
        self.token_ids[t0 : t0 + n] = r.tokens
        self.positions[t0 : t0 + n] = np.arange(r.start_pos, r.start_pos + n)
        self.token_rows[t0 : t0 + n] = s
        self.last_tokens[s] = t0 + n - 1
        self.query_lens[s] = n
        self.lora_slots[s] = r.lora_slot
        self.kv_lens[s] = r.start_pos + n
        need = -(-self.kv_lens[s] // self.page_size)
        if len(r.pages) < need:
            raise ValueError(f"row {i} needs {need} pages for {self.kv_lens[s]} tokens but has {len(r.pages)}")
        if need > p:
            raise ValueError(f"row {i} needs {need} pages, more than the bucket's {p}")
        self.page_table[s, : min(len(r.pages), p)] = list(r.pages)[:p]

    def point(self, pt: int, i: int, r: RowInput, cfg_partner: int | None, history: Sequence[int],
              bias: Mapping[int, float] | None, mask: Any) -> None:
        if r.sampling:
            self.sampling_rows[pt] = r.sampling
        if cfg_partner is not None:
            self.sampling_rows[pt] = {**self.sampling_rows[pt], "cfg_partner": cfg_partner}
        hl = self.shape.history_len
        if hl and len(history):
            h = list(history)[-hl:]
            self.history[pt, hl - len(h) :] = h
        if bias and len(bias) <= self.shape.num_bias:
            ids = list(bias)
            self.bias_ids[pt, : len(ids)] = ids
            self.bias_values[pt, : len(ids)] = [bias[k] for k in ids]
        elif bias:
            if self.vocab_size is None:
                raise ValueError(f"row {i} has {len(bias)} bias entries, more than the bucket's "
                                 f"{self.shape.num_bias}, and no vocab_size was given for the dense bias")
            if self.dense is None:
                self.dense = np.zeros((self.points, self.vocab_size), np.float32)
            ids = np.fromiter(bias.keys(), np.int64, len(bias))
            vals = np.fromiter(bias.values(), np.float32, len(bias))
            ok = (ids >= 0) & (ids < self.vocab_size)  # like the sparse path, which drops out-of-range ids
            self.dense[pt, ids[ok]] = vals[ok]
        self.masks.put(pt, mask, i)
        self.sets.put(pt, r, i)

    def batch(self, sample_positions: np.ndarray, **extra: Any) -> Batch:
        # The arrays stay numpy: the jitted step takes them as arguments and copies them in its own dispatch, a few
        # microseconds each, where a jax.device_put of them all took ~0.2 ms of host time per step (and jnp.asarray
        # may compile a conversion for a new shape).
        dense, mask_rows, set_rows = _rare_to_device(self.dense, self.masks.rows, self.sets.rows)
        v = self.vocab_size
        return Batch(
            token_ids=self.token_ids, positions=self.positions, token_rows=self.token_rows,
            query_lens=self.query_lens, kv_lens=self.kv_lens, page_table=self.page_table,
            decode_tokens=self.decode_tokens, last_tokens=self.last_tokens,
            sampling=SamplingRows.make(self.sampling_rows), sample_positions=sample_positions, history=self.history,
            bias_ids=self.bias_ids, bias_values=self.bias_values,
            bias_dense=None if v is None else (_zero_bias(self.points, v) if dense is None else dense),
            bias_dense_on=None if v is None else np.bool_(dense is not None),
            **self.masks.fields(mask_rows), **self.sets.fields(set_rows), lora_slots=self.lora_slots, **extra,
        )


def build_batch(rows: Sequence[RowInput], shape: BatchShape, page_size: int, vocab_size: int | None = None,
                sample_rows: int | None = None, slots: Sequence[int] | None = None) -> tuple[Batch, list[int]]:
    """Lay `rows` out in `shape`: multi-token rows in prefill windows (the longest first), single-token rows in the
    decode slots or, in a prefill layout, in the padding of the last window right after its chunk.

    The sampler inputs cover the first `sample_rows` rows (default: all), which must hold every row given. Logit
    bias: up to `shape.num_bias` entries of a row go in the sparse arrays; a row with more goes in the dense
    `[S', V]` bias, which needs `vocab_size` (without it, `Batch.bias_dense` is None and such a row is an error).
    Returns the batch and, for each input row, its row index in the batch (where its results come out).
    `slots` (decode-only buckets only): put input row i in batch row `slots[i]` instead (rows in between are
    padding), so that a draft model's batch lines up with the target's verification batch.
    """
    if shape.verify_len:
        return _build_verify_batch(rows, shape, page_size, vocab_size, sample_rows)
    if any(r.verify for r in rows):
        raise ValueError(f"verification rows need a verification bucket (verify_len > 0), got {shape}")
    lay = shape.layout
    sp, qm = lay.num_prefill_rows, lay.max_q_len
    s_count, t_count = shape.num_rows, shape.num_tokens
    s_sample = s_count if sample_rows is None else sample_rows
    pre = sorted((i for i, r in enumerate(rows) if not r.is_decode), key=lambda i: -len(rows[i].tokens))
    dec = [i for i, r in enumerate(rows) if r.is_decode]
    if len(pre) > sp or len(dec) > shape.num_decode_rows:
        raise ValueError(f"{len(pre)} prefill + {len(dec)} decode rows do not fit {shape}")
    fill = _Fill(shape, page_size, vocab_size, s_sample)
    decode_tokens = fill.decode_tokens
    slot_of = [0] * len(rows)
    start = [0] * len(rows)  # token slot of each row's first token
    for j, i in enumerate(pre):
        slot_of[i], start[i] = j, j * qm
        if len(rows[i].tokens) > qm:
            raise ValueError(f"row {i} has {len(rows[i].tokens)} tokens, more than the window of {qm}")
    # decode rows: the layout's decode slots, or the tail of the last prefill window
    first = sp * qm if lay.num_decode_rows or not sp else (sp - 1) * qm + (
        len(rows[pre[sp - 1]].tokens) if len(pre) == sp else 0)
    if dec and first + len(dec) > t_count:
        raise ValueError(f"{len(dec)} decode rows do not fit the {t_count - first} free token slots of {shape}")
    if slots is not None:
        if sp or len(slots) != len(rows) or len(set(slots)) != len(slots) or any(
                not 0 <= x < shape.num_decode_rows for x in slots) or pre:
            raise ValueError(f"slots={list(slots)} must place {len(rows)} decode rows in distinct rows of the "
                             f"decode-only {shape}")
        for i, x in enumerate(slots):
            slot_of[i], start[i] = x, x
            decode_tokens[x] = x
    else:
        for j, i in enumerate(dec):
            slot_of[i], start[i] = sp + j, first + j
            decode_tokens[j] = first + j
    if rows and max(slot_of) >= s_sample:
        raise ValueError(f"row slots up to {max(slot_of)} do not fit sample_rows={s_sample}")
    cfg = _cfg_points(rows, slot_of)
    for i, r in enumerate(rows):
        fill.row(i, r, slot_of[i], start[i])
        fill.point(slot_of[i], i, r, cfg.get(i), r.history, r.bias, r.mask)
    batch = fill.batch(fill.kv_lens[:s_sample].copy())
    return batch, slot_of


def _build_verify_batch(rows: Sequence[RowInput], shape: BatchShape, page_size: int, vocab_size: int | None,
                        sample_rows: int | None) -> tuple[Batch, list[int]]:
    """`build_batch` for a verification bucket (`shape.verify_len` W > 0; see `paged.device.state`): step rows
    (verification
    rows, 1-token rows) own W slots each, in input order: windows of a decode-only bucket, or the tail of the last
    prefill window at a stride of W; multi-token non-verification rows are prefill chunks in the windows (the
    longest first). Every row has W sample points; the sampler inputs have `sample_rows * W` rows."""
    w = shape.verify_len
    lay = shape.layout
    sp, qm = lay.num_prefill_rows, lay.max_q_len
    s_count, t_count = shape.num_rows, shape.num_tokens
    s_sample = s_count if sample_rows is None else sample_rows
    n_pts = s_sample * w
    steps = [i for i, r in enumerate(rows) if r.is_step_row]
    if shape.step_rows_in_windows:
        pre: list[int] = []
        if len(steps) != len(rows) or len(steps) > sp:
            raise ValueError(f"{len(rows)} rows ({len(steps)} step rows) do not fit the decode-only {shape}")
    else:
        pre = sorted((i for i, r in enumerate(rows) if not r.is_step_row), key=lambda i: -len(rows[i].tokens))
        if len(pre) > sp or len(steps) > shape.num_decode_rows:
            raise ValueError(f"{len(pre)} prefill + {len(steps)} step rows do not fit {shape}")
    for i, r in enumerate(rows):
        if r.verify and not 1 <= len(r.tokens) <= w:
            raise ValueError(f"verification row {i} has {len(r.tokens)} tokens; a bucket of verify_len={w} holds "
                             f"1 to {w}")
    fill = _Fill(shape, page_size, vocab_size, n_pts)
    decode_tokens = fill.decode_tokens
    sample_tokens = np.zeros((s_count, w), np.int32)
    sample_positions = np.zeros(n_pts, np.int32)
    drafts = np.full((s_sample, w - 1), -1, np.int32)
    num_drafts = np.zeros(s_sample, np.int32)
    slot_of = [0] * len(rows)
    start = [0] * len(rows)
    if shape.step_rows_in_windows:
        for j, i in enumerate(steps):
            slot_of[i], start[i] = j, j * qm
    else:
        for j, i in enumerate(pre):
            slot_of[i], start[i] = j, j * qm
            if len(rows[i].tokens) > qm:
                raise ValueError(f"row {i} has {len(rows[i].tokens)} tokens, more than the window of {qm}")
        first = (sp - 1) * qm + (len(rows[pre[sp - 1]].tokens) if len(pre) == sp else 0)
        if steps and first + len(steps) * w > t_count:
            raise ValueError(f"{len(steps)} step rows of {w} slots do not fit the {t_count - first} free token "
                             f"slots of {shape}")
        for j, i in enumerate(steps):
            slot_of[i], start[i] = sp + j, first + j * w
            decode_tokens[j] = first + j * w
    if rows and max(slot_of) >= s_sample:
        raise ValueError(f"row slots up to {max(slot_of)} do not fit sample_rows={s_sample}")

    cfg = _cfg_points(rows, [x * w for x in slot_of])
    for i in cfg:
        if rows[i].verify:
            raise ValueError(f"row {i}: a CFG row cannot be a verification row (CFG jobs are not drafted for)")

    for i, r in enumerate(rows):
        s, t0, n = slot_of[i], start[i], len(r.tokens)
        fill.row(i, r, s, t0)
        points = n if r.verify else 1
        if r.verify:
            sample_tokens[s, :n] = np.arange(t0, t0 + n)
            num_drafts[s] = n - 1
            drafts[s, : n - 1] = list(r.tokens)[1:]
        else:
            sample_tokens[s, 0] = t0 + n - 1
        for j in range(points):
            pt = s * w + j
            sample_positions[pt] = fill.kv_lens[s] - points + 1 + j
            if r.verify and r.position_history is not None:
                history = r.position_history[j]
            elif r.verify:
                history = list(r.history) + list(r.tokens)[1 : j + 1] if len(r.history) else ()
            else:
                history = r.history
            pb = r.position_bias[j] if r.verify and r.position_bias is not None else None
            mask = r.position_mask[j] if r.verify and r.position_mask is not None else r.mask
            fill.point(pt, i, r, cfg.get(i), history, r.bias if pb is None else pb, mask)
    batch = fill.batch(sample_positions, sample_tokens=sample_tokens, drafts=drafts, num_drafts=num_drafts)
    return batch, slot_of
