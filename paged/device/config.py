"""`EngineConfig`: the one validated configuration of the engine, its shape buckets and the generator's batching.

Every default and every range check lives here, once. `DynamicGenerator(**kwargs)` builds one from its keyword
arguments, the `Engine` and `BucketSpec` are derived from it, and the experiments' absl flags are declared from its
fields (`experiments/lib/engine_flags.py`). Fields left `None` (`num_pages`, `max_seq_len`) are model-dependent and are
filled by `resolve(model_config)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged.device.sharding import parse_mesh
from paged.errors import InvalidConfigError
from paged.validate import Checker
from pallas_kernels.registry import KernelError, attention_registry, matmul_registry

ATTN_IMPLS = attention_registry().names()  # the built-ins; anything registered, or a module:function path, also works
MATMUL_IMPLS = matmul_registry().names()

CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8")  # int8: per-token-per-head scales beside the values
DEFAULT_MAX_SEQ_LEN = 2048  # cap on the model's max positions when max_seq_len is not given
INT32_MAX = 2**31 - 1  # the largest size setting: sizes, counts and positions are int32 on the device


def _field(default: Any, help: str, role: bool = False) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "role": role})


@dataclasses.dataclass(frozen=True)
class Verification:
    """The verifying role of an engine (a speculating generator's target): `run` takes verification rows of up to
    `num_draft_tokens` drafts each (`RowInput.verify`; the buckets gain a verification bucket per plain one).
    `draft_probs`: the drafts come with the distributions they were drawn from (a draft model under rejection
    sampling; `run(draft_logprobs=)`), else they are one-hot proposals. `match`: sampled rows accept a draft where it
    equals the target's own draw (`paged.device.verify.accept_drafts`) instead of by rejection sampling.
    `fed_drafts`: every verification step reads its drafts from the device (a draft model's burst,
    `run(draft_tokens=)`). Made from a `paged.speculation.config.SpeculationConfig` (`.verification()`)."""

    num_draft_tokens: int
    draft_probs: bool = False
    match: bool = False
    fed_drafts: bool = False


@dataclasses.dataclass(frozen=True)
class Drafting:
    """The drafting role of an engine (a draft model's): `draft()` proposes `num_draft_tokens` per row, its drafts on
    the device padded to `pad_rows` rows (the target's `fed_rows`)."""

    num_draft_tokens: int
    pad_rows: int = 0


ROLES = {"verification": Verification, "drafting": Drafting}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine, cache and batching settings. Frozen and validated at construction (`InvalidConfigError`)."""

    page_size: int = _field(64, "KV-cache page size in tokens (a power of two; the JAX engine needs >= 8)")
    num_pages: int | None = _field(
        None, "KV-cache pages including the reserved null page 0 (default: max_batch_size full-length sequences + 1)")
    max_seq_len: int | None = _field(None, "longest prompt + max_new_tokens (default: min(model max positions, 2048))")
    max_batch_size: int = _field(16, "jobs (rows) per step")
    max_chunk_size: int = _field(256, "prefill tokens per step, shared by the prefill rows")
    max_prefill_rows: int = _field(1, "jobs that prefill in the same step (1 .. max_batch_size)")
    max_penalty_range: int = _field(
        1024, "most recent tokens the repetition/frequency/presence penalties and DRY can see (0 disables both)")
    decode_steps: int = _field(
        1, "decode steps per device call once every job decodes (1 = one token per iterate(); more = fewer host "
        "round trips, tokens arrive in bursts)")
    fuse_sampler: bool = _field(
        False, "run a decode-only step's forward and sampler (plain, or a speculative verification's) as one program: "
        "one dispatch per step, ~6% faster batch-1 decoding and ~10% faster verification steps on a 2-core CPU, at "
        "the price of one more sampler compile per decode bucket (~2 s each there) and its memory maps "
        "(docs/performance.md, \"One program per decode step\")")
    cache_dtype: str = _field("float32", f"KV-cache dtype: one of {CACHE_DTYPES} (int8 keeps per-token scales)")
    max_embedding_tokens: int = _field(
        1024, "rows of the device table for injected embeddings (Job(embeddings=...), multimodal input); 0: none")
    max_loras: int = _field(0, "LoRA adapters the engine holds at once (generator.load_lora; Job(lora=...)); 0: none")
    mesh: str = _field("", "device mesh, e.g. 'tp=2' (tensor parallel: the KV cache and attention split by KV head), "
                       "'dp=2' (data parallel: the step's tokens split over model replicas) or 'dp=2,tp=2' "
                       "(docs/sharding.md); '': one device")
    max_lora_rank: int = _field(16, "the largest LoRA rank r an adapter may have (the device stack's width)")
    attn_impl: str = _field("auto", f"paged attention implementation: one of {ATTN_IMPLS}, another registered "
                            "name, or a module:function import path (docs/kernels.md)")
    matmul_impl: str = _field("auto", f"quantized matmul implementation: one of {MATMUL_IMPLS}, another registered "
                              "name, or a module:function import path (docs/kernels.md)")
    attn_tuning: Any = _field(None, "tuning of the attention implementation (e.g. 'block_q=16,pages_per_block=4', a "
                              "JSON file, a dict or its tuning dataclass; None: its default)")
    matmul_tuning: Any = _field(None, "tuning of the matmul implementation (as attn_tuning; e.g. 'block_n=16')")
    # The engine's roles besides plain steps, fixed when it is built (not settings: no flag, made by the generator
    # from its speculation config).
    verification: Verification | None = _field(None, "verify drafts (a speculating generator's target)", role=True)
    drafting: Drafting | None = _field(None, "propose drafts (a draft model's engine)", role=True)

    def __post_init__(self):
        c = Checker("EngineConfig", InvalidConfigError)
        ps = c.int_("page_size", self.page_size, 1, allowed="a power of two")
        if ps & (ps - 1):
            c.fail(f"page_size must be a power of two, got {ps}")
        top = INT32_MAX  # (a larger size had passed here and failed every step)
        c.optional_int("num_pages", self.num_pages, 2, top)
        c.optional_int("max_seq_len", self.max_seq_len, 1, top)
        mb = c.int_("max_batch_size", self.max_batch_size, 1, top)
        c.int_("max_chunk_size", self.max_chunk_size, 1, top)
        c.int_("max_prefill_rows", self.max_prefill_rows, 1, mb, f"an int in [1, max_batch_size={mb}]")
        c.int_("max_penalty_range", self.max_penalty_range, 0, top)
        c.int_("decode_steps", self.decode_steps, 1, top)
        c.bool_("fuse_sampler", self.fuse_sampler)
        c.choice("cache_dtype", self.cache_dtype, CACHE_DTYPES)
        c.int_("max_embedding_tokens", self.max_embedding_tokens, 0, top)
        c.int_("max_loras", self.max_loras, 0, top)
        c.int_("max_lora_rank", self.max_lora_rank, 1, top)
        parse_mesh(self.mesh)
        for name, kind in ROLES.items():
            role = getattr(self, name)
            if isinstance(role, dict):  # (from `to_dict()`)
                role = kind(**role)
                object.__setattr__(self, name, role)
            if role is not None and not isinstance(role, kind):
                c.fail_type(name, role, f"a paged.device.config.{kind.__name__} or None")
            if role is not None:
                c.int_(f"{name}.num_draft_tokens", role.num_draft_tokens, 1)
        for name, registry in (("attn", attention_registry()), ("matmul", matmul_registry())):
            impl = getattr(self, f"{name}_impl")
            if not isinstance(impl, str):
                c.fail_type(f"{name}_impl", impl, f"a name ({', '.join(registry.names())}) or a module:function path")
            try:
                registry.get(impl)
                # normalised to the implementation's tuning dataclass (frozen, hashable: a static argument of the step)
                tuning = registry.parse_tuning(impl, getattr(self, f"{name}_tuning"))
            except KernelError as e:
                c.fail(f"{name}_impl={impl!r}: {e}")
            object.__setattr__(self, f"{name}_tuning", tuning)

    @property
    def max_pages_per_row(self) -> int:
        if self.max_seq_len is None:
            raise InvalidConfigError("EngineConfig: max_seq_len is unresolved; call resolve(model_config) first")
        return -(-self.max_seq_len // self.page_size)

    @property
    def resolved(self) -> bool:
        return self.num_pages is not None and self.max_seq_len is not None

    def resolve(self, max_position_embeddings: int | None = None) -> EngineConfig:
        """Fill the model-dependent defaults: `max_seq_len = min(max_position_embeddings, 2048)` and
        `num_pages = 1 + max_batch_size * ceil(max_seq_len / page_size)`. A `max_seq_len` beyond the model's
        positions is an error."""
        c = Checker("EngineConfig", InvalidConfigError)
        seq = self.max_seq_len
        if max_position_embeddings is not None:
            if seq is None:
                seq = min(max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
            elif seq > max_position_embeddings:
                c.fail(f"max_seq_len={seq} exceeds the model's max_position_embeddings={max_position_embeddings}")
        if seq is None:
            c.fail("max_seq_len is required when the model's max_position_embeddings is unknown")
        pages = self.num_pages
        if pages is None:
            pages = 1 + self.max_batch_size * -(-seq // self.page_size)
        return dataclasses.replace(self, max_seq_len=seq, num_pages=pages)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but an unknown keyword is an `InvalidConfigError` listing the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidConfigError(f"unknown engine setting(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_fields() -> list[dataclasses.Field]:
    """The settings of `EngineConfig` (its fields but the roles), with their defaults and help texts (for flag
    definitions and docs)."""
    return [f for f in dataclasses.fields(EngineConfig) if not f.metadata["role"]]
