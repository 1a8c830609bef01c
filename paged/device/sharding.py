"""Tensor and data parallelism with `jax.sharding`: a device mesh, logical sharding rules, where the engine's arrays
live.

`EngineConfig.mesh = "tp=N"` (tensor parallel), `"dp=M"` (data parallel) or `"dp=M,tp=N"` runs the engine's jitted
step on M x N devices (GPUs, or virtual CPU devices from `XLA_FLAGS=--xla_force_host_platform_device_count=N`), of
this process or of several (below). Nothing is hand-partitioned: the arrays are placed with
`NamedSharding`s and XLA's SPMD partitioner (GSPMD) splits the unchanged step, inserting the collectives its
shardings need; the cache's sharding is pinned inside the step (`constrain_cache`), so a step never gathers the
cache onto one device and the donated state comes back sharded as it went in.

Kept apart, as in jax-llm-examples: each array declares its *logical* axes once (`LOGICAL_AXES`: heads, kv_heads,
mlp, vocab, embed, layers, pages, ...), and `RULES` maps logical axes to mesh axes. With the default rules:
- the paged KV cache `[L, KH, pages, page_size, D]` (and an int8 cache's scales) is split over KV heads on `tp`;
- the fused projections `wqkv` `[L, H, (nH + 2 KH) D]` and `w_gate_up` `[L, H, 2F]` (and their biases) by columns:
  `shard_params` first regroups their columns (`models.fused`) so that device `s` of `tp` holds its own query heads,
  KV heads and intermediate features of every part, and the layer splits the outputs without an exchange;
- the attention output projection `wo` `[L, nH*D, H]` by query heads and the MLP down projection `w_down`
  `[L, F, H]` by intermediate features (rows); their partial products are summed across `tp` by XLA;
- quantized weights (`QuantizedArray`) the same way, values with their group scales: by columns always, by rows
  along whole quantization groups only (`models.fused.rows_split`; otherwise that matrix stays whole), and their
  matmuls (kernels: custom calls XLA cannot split) run per device on the shard and on its tokens
  (`models.linear.per_device`);
- the attention kernels (Pallas; any non-XLA implementation) run per device through `per_kv_head` (a `shard_map`
  over the KV-head split);
- the norms, the embedding and the LM head, the page table, the sampling state and every batch input are replicated;
- a model whose KV-head (or query-head, or intermediate) count `tp` does not divide is an `InvalidConfigError`.

Data parallelism: the step's tokens (and with them its rows, which are laid out contiguously) are split over `dp`
(`constrain_tokens` pins the hidden states `[T, H]` to `P("dp")` at the start of the step), so each of the `dp`
replicas of the weights computes its own rows; the cache is replicated over `dp` (each replica holds every page, and
the new tokens' K/V reach every replica), so any row may use any page and the one scheduler and page pool stay as
they are. The price is memory: the cache is held `dp` times (split over `tp` within each replica).

Several processes (several hosts, `initialize_distributed`): JAX's multi-controller model. Every process runs the same
program (the same generator, the same jobs, the same `iterate()` calls), the mesh spans every process's devices, and
each process feeds the same host-side inputs to the same jitted steps; results are read back replicated (`to_host`),
so every process sees every result, and the caller lets process 0 alone print or save them (`is_main_process`). The
host loop must therefore decide the same on every process: the random seeds of unseeded jobs come from one seed
broadcast by process 0 (`shared_seed`), and scheduling policies must not read the wall clock.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.fused import gate_up_parts, group_columns, qkv_parts, rows_split
from paged.errors import InvalidConfigError
from pallas_kernels.quant_format import QuantizedArray

MESH_AXES = ("dp", "tp")
# logical axis -> mesh axis (None: replicated)
RULES: dict[str, str | None] = {"kv_heads": "tp", "heads": "tp", "mlp": "tp", "vocab": None, "embed": None,
                                "layers": None, "pages": None, "page_slots": None, "head_dim": None, "qkv": "tp",
                                "gate_up": "tp", "tokens": "dp"}
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
    "layers.bqkv": ("layers", "qkv"),
    "layers.b_gate_up": ("layers", "gate_up"),
    "hidden": ("tokens", "embed"),
}
_SPEC = re.compile(r"^\s*([a-z]+)\s*=\s*([0-9]+)\s*$")  # (ASCII digits: int() reads "２" too)


def parse_mesh(spec: str) -> dict[str, int]:
    """`"tp=4"` -> `{"tp": 4}`; `""` -> `{}`. `InvalidConfigError` on anything else."""
    if not isinstance(spec, str):
        raise InvalidConfigError(f"EngineConfig: mesh must be a string like 'tp=2', got {spec!r}")
    axes: dict[str, int] = {}
    if not spec.strip():
        return axes
    for part in (p.strip() for p in spec.split(",")):
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
    if jax.process_count() > 1 and dp * tp != len(devices):
        raise InvalidConfigError(f"EngineConfig: mesh={spec!r} has {dp * tp} devices, but the {jax.process_count()} "
                                 f"processes have {len(devices)}: with several processes the mesh must span all of "
                                 "them (every process drives its own devices)")
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


def _trimmed(spec: P) -> P:
    """`spec` without trailing Nones (`P(None, "tp")` for `P(None, "tp", None)`): the form a jitted step's outputs
    carry."""
    axes = list(spec)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


def _place_quantized(qa: QuantizedArray, mesh: Mesh, spec: P) -> QuantizedArray:
    """A stacked quantized matrix `[..., in, out]` placed like the float one it stands for: split by columns, every
    leaf splits on its last axis; split by rows, values and group scales split together along whole groups
    (per-channel scales stay whole), and a matrix whose groups `tp` does not divide stays whole
    (`models.fused.rows_split`, the same rule the matmul follows)."""
    *lead, rows, cols = tuple(spec) + (None,) * (qa.values.ndim - len(spec))
    if cols is not None:
        leaf = scales = P(*lead, None, cols)
    elif rows is not None and rows_split(qa, mesh.shape[rows]):
        leaf = P(*lead, rows, None)
        scales = P() if qa.num_groups == 1 else leaf
    else:
        leaf = scales = P()
    return qa.replace(values=_place(qa.values, mesh, leaf), scales=_place(qa.scales, mesh, scales),
                      mins=_place(qa.mins, mesh, scales))


def _place_fields(obj: Any, prefix: str, mesh: Mesh, trim: bool = False, **placed: Any) -> Any:
    """`obj` (a flax struct dataclass) with every array field not in `placed` put on the mesh by its logical axes
    (`spec_of(prefix.field)`; replicated when the field has none; `trim`: written as `_trimmed`)."""
    for f in dataclasses.fields(obj):
        if f.name not in placed and f.metadata.get("pytree_node", True):
            x, spec = getattr(obj, f.name), spec_of(f"{prefix}.{f.name}")
            spec = _trimmed(spec) if trim else spec
            placed[f.name] = _place_quantized(x, mesh, spec) if isinstance(x, QuantizedArray) else _place(x, mesh,
                                                                                                        spec)
    return obj.replace(**placed)


def shard_params(params: Any, mesh: Mesh, cfg: Any) -> Any:
    """`Weights` (of a model of config `cfg`) with every leaf placed by its logical axes. With `tp > 1` the fused
    projections are first regrouped (`models.fused`) so that an even column split gives each device its own heads
    and features."""
    layers, tp = params.layers, mesh.shape["tp"]
    if tp > 1 and layers.fused_groups == 1:
        qkv, gu = qkv_parts(cfg), gate_up_parts(cfg)
        layers = layers.replace(wqkv=group_columns(layers.wqkv, qkv, tp), bqkv=group_columns(layers.bqkv, qkv, tp),
                                w_gate_up=group_columns(layers.w_gate_up, gu, tp),
                                b_gate_up=group_columns(layers.b_gate_up, gu, tp), fused_groups=tp)
    elif layers.fused_groups not in (1, tp):
        raise InvalidConfigError(f"the model's fused projections are grouped for tp={layers.fused_groups}, not for "
                                 f"this mesh's tp={tp}; load the model again")
    return _place_fields(params, "params", mesh, layers=_place_fields(layers, "layers", mesh))


def shard_state(state: Any, mesh: Mesh) -> Any:
    """`EngineState` with the cache split by KV heads and everything else replicated, its specs written as a step's
    outputs write them (`_trimmed`): the state placed here and the state a step returns are then the same argument
    to the compiled variants (else the first variant warmed up compiles again once the state has been through a
    step)."""
    return _place_fields(state, "cache", mesh, trim=True)


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


def to_host(tree: Any) -> Any:
    """`jax.device_get(tree)`, also for arrays that span other processes' devices (several processes,
    `jax.distributed`): a replicated one is read from this process's own copy, any other is gathered from every
    process (a collective: every process must make the same calls in the same order, as they do when each runs the
    same host loop)."""
    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return x.addressable_shards[0].data
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)

    return jax.device_get(jax.tree.map(get, tree))


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int,
                           local_cpu_devices: int | None = None) -> None:
    """Join a run of `num_processes` processes (one per host, or several on one machine), before anything else uses
    JAX: `jax.distributed.initialize`, with the CPU's cross-process collectives (gloo) switched on so that CPU devices
    work too. `coordinator_address` (`host:port`) is process 0's; every process passes the same one. On the CPU,
    `local_cpu_devices` gives each process that many virtual devices. Then build the generator with a `mesh` over all
    processes' devices, in every process, and run the same jobs in each (see the module docstring)."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise InvalidConfigError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise InvalidConfigError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
    if not isinstance(coordinator_address, str) or not re.fullmatch(r"\S+:\d+", coordinator_address):
        raise InvalidConfigError(f"coordinator_address must be 'host:port' (process 0's), got {coordinator_address!r}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", local_cpu_devices)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def is_main_process() -> bool:
    """True in process 0 of a multi-process run (and in a single-process one): the one that prints and saves."""
    return jax.process_index() == 0


def shared_seed(mesh: Mesh | None = None) -> int:
    """A fresh random 64-bit seed; for a generator on a `mesh` spanning several processes, the same in every process
    (process 0's, broadcast: a collective, so every process builds that generator). Without a mesh, or in one
    process, no collective and no JAX call (a generator on a fake or simulated engine does not start JAX)."""
    seed = int.from_bytes(os.urandom(8), "little")
    if mesh is None or jax.process_count() == 1:
        return seed
    from jax.experimental import multihost_utils

    halves = np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    hi, lo = (int(x) for x in multihost_utils.broadcast_one_to_all(halves))
    return (hi << 32) | lo
