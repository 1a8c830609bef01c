"""Tensor and data parallelism with `jax.sharding`: a device mesh, logical sharding rules, where the engine's arrays
live.

`EngineConfig.mesh = "tp=N"` (tensor parallel), `"dp=M"` (data parallel) or `"dp=M,tp=N"` runs the engine's jitted
step on M x N devices of one process (GPUs, or virtual CPU devices from
`XLA_FLAGS=--xla_force_host_platform_device_count=N`). Nothing is hand-partitioned: the arrays are placed with
`NamedSharding`s and XLA's SPMD partitioner (GSPMD) splits the unchanged step, inserting the collectives its
shardings need; the cache's sharding is pinned inside the step (`constrain_cache`), so a step never gathers the
cache onto one device and the donated state comes back sharded as it went in.

Kept apart, as in jax-llm-examples: each array declares its *logical* axes once (`LOGICAL_AXES`: heads, kv_heads,
mlp, vocab, embed, layers, pages, ...), and `RULES` maps logical axes to mesh axes. With the default rules:
- the paged KV cache `[L, KH, pages, page_size, D]` (and an int8 cache's scales) is split over KV heads on `tp`;
- the attention output projection `wo` `[L, nH*D, H]` by query heads and the MLP down projection `w_down`
  `[L, F, H]` by intermediate features on `tp`; their partial products are summed across `tp` by XLA;
- the attention kernels (Pallas; any non-XLA implementation) run per device through `per_kv_head` (a `shard_map`
  over the KV-head split), since their custom calls cannot be partitioned by XLA;
- the fused projections `wqkv` `[L, H, (nH + 2 KH) D]` and `w_gate_up` `[L, H, 2F]`, the norms, the embedding and
  the LM head, quantized weights (`QuantizedArray`: their group scales follow the in-feature axis, so v1 keeps them
  whole), the page table, the sampling state and every batch input are replicated;
- a model whose KV-head (or query-head) count `tp` does not divide is an `InvalidConfigError`.

Data parallelism: the step's tokens (and with them its rows, which are laid out contiguously) are split over `dp`
(`constrain_tokens` pins the hidden states `[T, H]` to `P("dp")` at the start of the step), so each of the `dp`
replicas of the weights computes its own rows; the cache is replicated over `dp` (each replica holds every page, and
the new tokens' K/V reach every replica), so any row may use any page and the one scheduler and page pool stay as
they are. The price is memory: the cache is held `dp` times (split over `tp` within each replica). Several processes
(multi-host) are not supported (see docs/sharding.md).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged.errors import InvalidConfigError
from pallas_kernels.quant_format import QuantizedArray

MESH_AXES = ("dp", "tp")
# logical axis -> mesh axis (None: replicated)
RULES: dict[str, str | None] = {"kv_heads": "tp", "heads": "tp", "mlp": "tp", "vocab": None, "embed": None,
                                "layers": None, "pages": None, "page_slots": None, "head_dim": None, "qkv": None,
                                "gate_up": None, "tokens": "dp"}
# array (a field of Weights / LayerWeights / EngineState) -> its logical axes
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "cache.k": ("layers", "kv_heads", "pages", "page_slots", "head_dim"),
    "cache.v": ("layers", "kv_heads", "pages", "page_slots", "head_dim"),
    "cache.k_scale": ("layers", "kv_heads", "pages", "page_slots"),
    "cache.v_scale": ("layers", "kv_heads", "pages", "page_slots"),
    "layers.wqkv": ("layers", "embed", "qkv"),
    "layers.wo": ("layers", "heads", "embed"),
    "layers.w_gate_up": ("layers", "embed", "gate_up"),
    "layers.w_down": ("layers", "mlp", "embed"),
    "hidden": ("tokens", "embed"),
}
_SPEC = re.compile(r"^\s*([a-z]+)\s*=\s*(\d+)\s*$")


def parse_mesh(spec: str) -> dict[str, int]:
    """`"tp=4"` -> `{"tp": 4}`; `""` -> `{}`. `InvalidConfigError` on anything else."""
    if not isinstance(spec, str):
        raise InvalidConfigError(f"EngineConfig: mesh must be a string like 'tp=2', got {spec!r}")
    axes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _SPEC.match(part)
        if not m:
            raise InvalidConfigError(f"EngineConfig: mesh={spec!r}: {part!r} is not 'axis=size' (e.g. 'tp=2')")
        name, size = m.group(1), int(m.group(2))
        if name not in MESH_AXES:
            raise InvalidConfigError(f"EngineConfig: mesh={spec!r}: axis {name!r} is not supported; the mesh axes are "
                                     f"{MESH_AXES}")
        if name in axes or size < 1:
            raise InvalidConfigError(f"EngineConfig: mesh={spec!r}: each axis once, with a size >= 1")
        axes[name] = size
    return axes


def make_mesh(spec: str, cfg: Any) -> Mesh | None:
    """The device mesh `("dp", "tp")` of `EngineConfig.mesh` for a model of config `cfg`, or None for one device.
    Checks the device count and that `tp` divides the model's heads and intermediate size."""
    axes = parse_mesh(spec)
    dp, tp = axes.get("dp", 1), axes.get("tp", 1)
    if dp * tp == 1:
        return None
    devices = jax.devices()
    if dp * tp > len(devices):
        hint = (" (on the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
                if devices[0].platform == "cpu" else "")
        raise InvalidConfigError(f"EngineConfig: mesh={spec!r} needs {dp * tp} devices; {len(devices)} "
                                 f"available{hint}")
    for name, n, what in (("num_kv_heads", cfg.num_kv_heads, "the KV cache and the attention are split by head"),
                          ("num_heads", cfg.num_heads, "the attention output projection is split by head"),
                          ("intermediate_size", cfg.intermediate_size, "the MLP down projection is split by row")):
        if n % tp:
            raise InvalidConfigError(f"EngineConfig: mesh={spec!r}: tp={tp} must divide the model's {name}={n} "
                                     f"({what}); use a tp that divides it")
    return jax.make_mesh((dp, tp), MESH_AXES, devices=devices[: dp * tp],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def spec_of(name: str) -> P:
    """The PartitionSpec of the array `name` (a key of `LOGICAL_AXES`) under `RULES`; unknown names: replicated."""
    axes = LOGICAL_AXES.get(name)
    return P() if axes is None else P(*(RULES[a] for a in axes))


def _place(x: Any, mesh: Mesh, spec: P) -> Any:
    return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))


def _place_fields(obj: Any, prefix: str, mesh: Mesh, **placed: Any) -> Any:
    """`obj` (a flax struct dataclass) with every field not in `placed` put on the mesh by its logical axes
    (`spec_of(prefix.field)`; replicated when the field has none, and for quantized weights)."""
    for f in dataclasses.fields(obj):
        if f.name not in placed:
            x = getattr(obj, f.name)
            placed[f.name] = _place(x, mesh, P() if isinstance(x, QuantizedArray) else spec_of(f"{prefix}.{f.name}"))
    return obj.replace(**placed)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """`Weights` with every leaf placed by its logical axes (replicated where the rules say so, and for quantized
    weights)."""
    return _place_fields(params, "params", mesh, layers=_place_fields(params.layers, "layers", mesh))


def shard_state(state: Any, mesh: Mesh) -> Any:
    """`EngineState` with the cache split by KV heads and everything else replicated."""
    return _place_fields(state, "cache", mesh)


def _mesh_axes() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(mesh.axis_names)


def constrain_tokens(h: jax.Array) -> jax.Array:
    """Inside the step: split the hidden states `[T, H]` by token over `dp` (data parallel); a no-op otherwise."""
    if "dp" not in _mesh_axes():
        return h
    return jax.lax.with_sharding_constraint(h, spec_of("hidden"))


def per_kv_head(fn: Any, q: jax.Array, kc: jax.Array, vc: jax.Array, ks: Any, vs: Any, *rest: Any) -> jax.Array:
    """`fn(q, kc, vc, ks, vs, *rest)` (a paged attention implementation: q `[T, nH, D]`, the stacked cache
    `[L, KH, ...]`; `rest` the replicated batch metadata) run per device under a mesh with `tp > 1`: a `shard_map`
    hands each device its `nH / tp` query heads and its `KH / tp` KV heads of the cache (query heads are grouped by KV
    head, so the two splits line up), and the outputs are its heads. Kernels are custom calls that XLA's partitioner
    cannot split; this is how they run on the head-split cache. Without a mesh: `fn` itself."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "tp" not in mesh.axis_names or mesh.shape["tp"] == 1:
        return fn(q, kc, vc, ks, vs, *rest)
    head, cache = P(None, "tp", None), spec_of("cache.k")
    scales = [x for x in (ks, vs) if x is not None]

    def local(q, kc, vc, *more):
        s = list(more[: len(scales)])
        return fn(q, kc, vc, s.pop(0) if ks is not None else None, s.pop(0) if vs is not None else None,
                  *more[len(scales):])

    specs = (head, cache, cache, *[spec_of("cache.k_scale")] * len(scales), *[P()] * len(rest))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=head, check_vma=False)(
        q, kc, vc, *scales, *rest)


def constrain_cache(k: jax.Array, v: jax.Array, ks: Any, vs: Any) -> tuple:
    """Inside the step: pin the updated cache to its sharding when the step runs under a mesh (`jax.set_mesh`, as
    `Engine` does), so XLA neither gathers it nor returns it laid out differently; a no-op on one device."""
    if "tp" not in _mesh_axes():
        return k, v, ks, vs
    c = jax.lax.with_sharding_constraint
    return (c(k, spec_of("cache.k")), c(v, spec_of("cache.v")),
            None if ks is None else c(ks, spec_of("cache.k_scale")),
            None if vs is None else c(vs, spec_of("cache.v_scale")))
