"""LoRA adapters in PEFT's file format: `load_lora(path, config) -> LoraAdapter`.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`, ...) and
`adapter_model.safetensors` with, per adapted projection, `...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`
`[r, in]` and `...lora_B.weight` `[out, r]`; the adapted weight is `W + scale * B @ A` with `scale = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`). This model computes `x @ W` with W stored `[in, out]`, so an adapter is
kept as `a = A.T` `[in, r]` and `b = scale * B.T` `[r, out]`, per layer and per projection among q, k, v, o, gate,
up, down (`LoraAdapter.weights`; projections the adapter leaves out are absent).

Everything is checked against the model's config before anything is used: a missing file, invalid JSON, a
`peft_type` other than "LORA", an option of the wrong type (booleans such as `use_rslora` must be JSON booleans), an
unsupported option set (`UNSUPPORTED`: `bias` other than "none", `fan_in_fan_out`, per-module `rank_pattern` /
`alpha_pattern`, DoRA, `modules_to_save`, `lora_bias`, QALoRA, `layer_replication`, `target_parameters`,
`trainable_token_indices`, ...), a target outside the seven projections, a tensor of the wrong shape, a missing or
unexpected tensor all raise a `ModelLoadError` subclass naming the file and tensor. `target_modules` may also be
PEFT's "all-linear" (the seven projections), and `exclude_modules` (names or a regex, as PEFT matches them) removes
modules from the targets.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig
from models.errors import (
    CorruptFileError,
    MissingWeightError,
    ModelConfigError,
    ModelFileNotFoundError,
    NonFiniteWeightError,
    WeightShapeError,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names -> ours, in the order of the fused matmuls (q, k, v | o | gate, up | down)
PROJECTIONS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
               "down_proj": "down"}
ALL_LINEAR = "all-linear"  # PEFT's target_modules shorthand for every linear layer but the output head
PEFT_DEFAULT_ALPHA = 8  # PEFT's LoraConfig default, for a config that leaves lora_alpha out
# PEFT LoraConfig options this module does not implement, with the value that leaves them off (a config may also
# omit them; for None / {} any empty value does): any other value is refused, never ignored
UNSUPPORTED = (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False), ("rank_pattern", {}),
               ("alpha_pattern", {}), ("modules_to_save", None), ("lora_bias", False), ("use_qalora", False),
               ("layer_replication", None), ("target_parameters", None), ("trainable_token_indices", None),
               ("alora_invocation_tokens", None), ("arrow_config", None))
# adapter_config.json options that must be JSON booleans when present
BOOLEANS = ("use_rslora", "fan_in_fan_out", "use_dora", "lora_bias", "use_qalora")
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of `cfg`'s layers."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {"q": (h, cfg.num_heads * d), "k": (h, cfg.num_kv_heads * d), "v": (h, cfg.num_kv_heads * d),
            "o": (cfg.num_heads * d, h), "gate": (h, f), "up": (h, f), "down": (f, h)}


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: `weights[(layer, projection)] = (a [in, r], b [r, out])`, the scale folded into b, float32.
    `digest` is a SHA-256 of the content (`content_digest`; the prefix cache keys pages by it, and the generator
    recomputes it when it loads an adapter, so two adapters never share a page)."""

    rank: int
    scale: float
    targets: tuple[str, ...]  # projections adapted, among PROJECTIONS' values
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    digest: bytes
    source: str = ""

    def merged_delta(self, layer: int, projection: str) -> np.ndarray | None:
        """`scale * (B @ A).T` `[in, out]`: what the adapter adds to that weight (None: it leaves it alone)."""
        w = self.weights.get((layer, projection))
        return None if w is None else w[0] @ w[1]


# ---------------------------------------------------------------------------------------------------- device side
# The layer's matmuls and the projections each one computes (the fused q|k|v and gate|up are one matmul each).
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


@struct.dataclass
class LoraStack:
    """Adapters stacked for the batched forward: `max_loras` slots of rank up to R, per layer. For each fused matmul
    g of `GROUPS` (k projections): `a[g]` `[L, slots, in, k R]` (each projection's a in its R columns) and `b[g]`
    `[L, slots, k R, out]` (block-diagonal: each projection's b in its rows and output columns), zero where a slot
    holds nothing. A token whose slot index is 0 gets no adapter; index i >= 1 reads slot i - 1 (`lora_delta`)."""

    a: dict[str, jnp.ndarray]
    b: dict[str, jnp.ndarray]

    @staticmethod
    def create(cfg: ModelConfig, slots: int, rank: int) -> LoraStack:
        shapes = projection_shapes(cfg)
        a, b = {}, {}
        for g, projs in GROUPS.items():
            fan_in = shapes[projs[0]][0]
            out = sum(shapes[p][1] for p in projs)
            a[g] = jnp.zeros((cfg.num_layers, slots, fan_in, len(projs) * rank), jnp.float32)
            b[g] = jnp.zeros((cfg.num_layers, slots, len(projs) * rank, out), jnp.float32)
        return LoraStack(a=a, b=b)

    @property
    def slots(self) -> int:
        return self.a["qkv"].shape[1]

    @property
    def rank(self) -> int:
        return self.a["o"].shape[3]


@functools.partial(jax.jit, donate_argnums=(0,))
def write_slot(stack: LoraStack, slot: jnp.ndarray, a: dict[str, jnp.ndarray], b: dict[str, jnp.ndarray]) -> LoraStack:
    """The stack with slot `slot` (an int32 scalar: one compiled variant for every slot) replaced by `a[g]` `[L, in,
    k R]` / `b[g]` `[L, k R, out]`, in place (the stack is donated)."""
    return LoraStack(a={g: x.at[:, slot].set(a[g]) for g, x in stack.a.items()},
                     b={g: x.at[:, slot].set(b[g]) for g, x in stack.b.items()})


def slot_arrays(adapter: LoraAdapter, cfg: ModelConfig, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The adapter laid out as one slot of a `LoraStack` of rank `rank` (>= adapter.rank): per group, (a `[L, in,
    k R]`, b `[L, k R, out]`) as numpy arrays."""
    shapes = projection_shapes(cfg)
    out = {}
    for g, projs in GROUPS.items():
        fan_in = shapes[projs[0]][0]
        a = np.zeros((cfg.num_layers, fan_in, len(projs) * rank), np.float32)
        b = np.zeros((cfg.num_layers, len(projs) * rank, sum(shapes[p][1] for p in projs)), np.float32)
        col = 0
        for j, p in enumerate(projs):
            width = shapes[p][1]
            for layer in range(cfg.num_layers):
                w = adapter.weights.get((layer, p))
                if w is not None:
                    a[layer, :, j * rank : j * rank + adapter.rank] = w[0]
                    b[layer, j * rank : j * rank + adapter.rank, col : col + width] = w[1]
            col += width
        out[g] = (a, b)
    return out


def lora_delta(x: jnp.ndarray, stack: LoraStack, layer: jnp.ndarray, group: str,
               token_slots: jnp.ndarray) -> jnp.ndarray:
    """f32 `[N, out]`: what the adapters add to matmul `group` of layer `layer` for tokens `x` `[N, in]` whose slot
    indices are `token_slots` `[N]` (0: none). Slot by slot, each under a `lax.cond` that skips it when no token uses
    it: `(x @ a) @ b`, selected for its own tokens after the product (a masked multiply would let a non-finite
    weight of one adapter reach every other token as 0 * inf). A step reads the weights of the adapters its tokens
    use, and a batch without adapters reads none."""
    a_all, b_all = stack.a[group], stack.b[group]  # [L, slots, in, kR], [L, slots, kR, out]
    xf = x.astype(jnp.float32)
    out = jnp.zeros((x.shape[0], b_all.shape[-1]), jnp.float32)
    for s in range(a_all.shape[1]):
        mine = token_slots == s + 1

        def add(out=out, s=s, mine=mine) -> jnp.ndarray:
            a = jax.lax.dynamic_index_in_dim(a_all, layer, 0, keepdims=False)[s]  # [in, kR]
            b = jax.lax.dynamic_index_in_dim(b_all, layer, 0, keepdims=False)[s]  # [kR, out]
            # selected after the product: a NaN or inf in this adapter never reaches another slot's rows (0 * NaN)
            return out + jnp.where(mine[:, None], (xf @ a) @ b, 0.0)

        out = jax.lax.cond(jnp.any(mine), add, lambda out=out: out)
    return out


def _fail_config(path: str, msg: str) -> ModelConfigError:
    return ModelConfigError(f"LoRA adapter {path}: {msg}")


def _block(projection: str) -> str:
    return "self_attn" if projection in ("q", "k", "v", "o") else "mlp"


def _adapted(path: str, acfg: dict, num_layers: int) -> set[tuple[int, str]]:
    """The (layer, projection) pairs the adapter's config says it adapts. `target_modules`: a list of module names,
    PEFT's regex (a string, matched in full, `re.fullmatch`, against each module's name
    `model.layers.{i}.{self_attn|mlp}.{name}`), or "all-linear" (every projection). A list or "all-linear" is
    combined with `layers_to_transform`; a regex is not (PEFT applies `layers_to_transform` to listed modules only:
    the regex alone decides). `exclude_modules` then drops modules: a regex matched in full, or a list of names each
    equal to a module's full name or to a suffix of it after a dot ("q_proj", "layers.0.self_attn.q_proj")."""
    value, only = acfg.get("target_modules"), acfg.get("layers_to_transform")
    if only is None:
        layers = set(range(num_layers))
    else:
        layers = {only} if isinstance(only, int) and not isinstance(only, bool) else only
        if not isinstance(layers, (set, list)) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                          for x in layers):
            raise _fail_config(path, f"layers_to_transform must be an int or a list of ints, got {only!r}")
        layers = set(layers)
        if not layers <= set(range(num_layers)):
            raise _fail_config(path, f"layers_to_transform {sorted(layers)} is outside the model's {num_layers} "
                               "layers")
    names = {(i, ours): f"model.layers.{i}.{_block(ours)}.{peft}"  # each module's name in PEFT's base model
             for i in range(num_layers) for peft, ours in PROJECTIONS.items()}
    if isinstance(value, str) and value.lower() == ALL_LINEAR:
        # PEFT's shorthand (a list of every linear layer but the output head; here the seven projections)
        pairs = {pair for pair in names if pair[0] in layers}
    elif isinstance(value, str):
        try:
            pattern = re.compile(value)
        except re.error as e:
            raise _fail_config(path, f"target_modules regex {value!r} is invalid ({e})") from None
        pairs = {pair for pair, full in names.items() if pattern.fullmatch(full)}
        if not pairs:
            raise _fail_config(path, f"target_modules regex {value!r} matches none of the model's "
                               f"{list(PROJECTIONS)} modules (names like model.layers.0.self_attn.q_proj)")
    else:
        if not isinstance(value, (list, tuple)) or not value:
            raise _fail_config(path, f"target_modules must be a non-empty list of module names, a regex or "
                               f"{ALL_LINEAR!r}, got {value!r}")
        for name in value:
            if not isinstance(name, str) or name not in PROJECTIONS:
                raise _fail_config(path, f"target_modules entry {name!r} is not supported; LoRA here adapts "
                                   f"{list(PROJECTIONS)}")
        pairs = {(i, PROJECTIONS[name]) for i in layers for name in value}
    exclude = acfg.get("exclude_modules")
    if exclude is None or (isinstance(exclude, (list, tuple)) and not exclude):
        return pairs
    if isinstance(exclude, str):  # a regex, matched in full, as target_modules
        try:
            skip = re.compile(exclude).fullmatch
        except re.error as e:
            raise _fail_config(path, f"exclude_modules regex {exclude!r} is invalid ({e})") from None
    elif isinstance(exclude, (list, tuple)) and all(isinstance(x, str) and x for x in exclude):
        def skip(full: str) -> bool:  # a module's full name or a suffix of it after a dot, as PEFT matches
            return any(full == x or full.endswith("." + x) for x in exclude)
    else:
        raise _fail_config(path, f"exclude_modules must be a list of module names or a regex, got {exclude!r}")
    kept = {pair for pair in pairs if not skip(names[pair])}
    if not kept:
        raise _fail_config(path, f"exclude_modules {exclude!r} excludes every module target_modules "
                           f"{value!r} selects: nothing is left to adapt")
    return kept


def content_digest(rank: int, weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]) -> bytes:
    """SHA-256 of an adapter's content (its folded `a`, `b` arrays): what the prefix cache keys its pages by."""
    h = hashlib.sha256(repr(rank).encode())
    for key in sorted(weights):
        h.update(repr(key).encode())
        for arr in weights[key]:
            arr = np.ascontiguousarray(arr, np.float32)
            h.update(repr(arr.shape).encode())
            h.update(arr.tobytes())
    return h.digest()


def _finite(arr: np.ndarray, where: str, tensor: str) -> np.ndarray:
    """`arr`, unless it holds NaN or infinity (`NonFiniteWeightError` naming `where` and `tensor`)."""
    bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
    if bad:
        raise NonFiniteWeightError(f"LoRA adapter {where}: tensor {tensor!r} holds {bad} non-finite value(s) (NaN "
                                   "or inf); an adapter's weights must be finite: fix or retrain the adapter",
                                   tensor=tensor)
    return arr


def check_adapter(adapter: LoraAdapter, config: ModelConfig) -> None:
    """`WeightShapeError` unless `adapter` (one built in code) fits a model of `config`: `rank` an int >= 1,
    `weights` a dict of `(layer, projection) -> (a, b)` pairs of real numbers (float or int arrays; not bool,
    complex, object or strings) of the shapes the rank and the model imply; `NonFiniteWeightError` for a NaN or
    infinity in one once converted to float32, the precision the engine holds it in."""
    where = adapter.source or "(in memory)"
    rank = adapter.rank
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise WeightShapeError(f"LoRA adapter {where}: rank must be an int >= 1 (the columns of each a and rows of "
                               f"each b), got {rank!r} ({type(rank).__name__})")
    if not isinstance(adapter.weights, dict):
        raise WeightShapeError(f"LoRA adapter {where}: weights must be a dict of (layer, projection) -> (a, b), "
                               f"got {type(adapter.weights).__name__}")
    shapes = projection_shapes(config)
    for key, pair in adapter.weights.items():
        if (not isinstance(key, tuple) or len(key) != 2 or isinstance(key[0], bool) or not isinstance(key[0], int)
                or not 0 <= key[0] < config.num_layers or key[1] not in shapes):
            raise WeightShapeError(f"LoRA adapter {where}: weight key {key!r} is not a "
                                   f"(layer in [0, {config.num_layers}), projection in {list(shapes)}) pair")
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise WeightShapeError(f"LoRA adapter {where}: weights[{key!r}] must be an (a, b) pair of arrays, got "
                                   f"{type(pair).__name__}" + (f" of {len(pair)}" if isinstance(pair, (tuple, list))
                                                               else ""))
        arrays = []
        for name, x in zip("ab", pair):
            tensor = f"{name} of layer {key[0]} {key[1]}"
            try:
                x = np.asarray(x)
            except ValueError as e:  # (a ragged nested list)
                raise WeightShapeError(f"LoRA adapter {where}: tensor {tensor!r} is not an array ({e})",
                                       tensor=tensor) from None
            if x.dtype.kind not in "iu" and not jnp.issubdtype(x.dtype, jnp.floating):  # (bf16: kind 'V')
                raise WeightShapeError(f"LoRA adapter {where}: tensor {tensor!r} has dtype {x.dtype}; expected real "
                                       "numbers (a float or int array; not bool, complex, object or strings)",
                                       tensor=tensor)
            with np.errstate(over="ignore"):  # (a float64 beyond float32's range becomes inf, named below)
                _finite(x.astype(np.float32), where, tensor)
            arrays.append(x)
        a, b = arrays
        fan_in, fan_out = shapes[key[1]]
        if a.shape != (fan_in, rank) or b.shape != (rank, fan_out):
            raise WeightShapeError(f"LoRA adapter {where}: layer {key[0]} {key[1]} has a "
                                   f"{list(a.shape)} and b {list(b.shape)}; rank {rank} on this model needs "
                                   f"{[fan_in, rank]} and {[rank, fan_out]}")


def read_adapter_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ModelFileNotFoundError(f"LoRA adapter {path}: {CONFIG_FILE} not found (a PEFT adapter directory holds "
                                     f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"LoRA adapter {file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _fail_config(path, f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def load_lora(path: str | os.PathLike, config: ModelConfig) -> LoraAdapter:
    """Load and check a PEFT LoRA adapter directory for a model of `config` (see the module docstring)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelFileNotFoundError(f"LoRA adapter {path}: not a directory (a PEFT adapter directory holds "
                                     f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    acfg = read_adapter_config(path)
    r, alpha = acfg.get("r"), acfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail_config(path, f"r must be an int >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _fail_config(path, f"lora_alpha must be a finite number, got {alpha!r}")
    peft_type = acfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail_config(path, f"peft_type={peft_type!r} is not supported (only LoRA adapters: "
                           "peft_type='LORA')")
    for key in BOOLEANS:
        if key in acfg and not isinstance(acfg[key], bool):
            raise _fail_config(path, f"{key} must be true or false (a JSON boolean), got {acfg[key]!r}")
    for key, neutral in UNSUPPORTED:
        value = acfg.get(key, neutral)
        off = value == neutral or (neutral in (None, {}) and value in (None, [], {}))
        if not off:
            raise _fail_config(path, f"{key}={value!r} is not supported (only plain LoRA: {key}={neutral!r} or "
                               "left out)")
    adapted = _adapted(path, acfg, config.num_layers)
    targets = tuple(p for p in PROJECTIONS.values() if any(q == p for _, q in adapted))
    scale = alpha / (math.sqrt(r) if acfg.get("use_rslora") is True else r)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ModelFileNotFoundError(f"LoRA adapter {path}: {WEIGHTS_FILE} not found")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise CorruptFileError(f"LoRA adapter {file}: cannot read it ({e})") from None
    shapes = projection_shapes(config)
    found: dict[tuple[int, str, str], np.ndarray] = {}
    named: dict[tuple[int, str, str], str] = {}  # which tensor gave each weight (two for one would be a guess)
    for name, t in tensors.items():
        m = _TENSOR.search(name)
        if m is None or m.group(2) not in PROJECTIONS:
            raise WeightShapeError(f"LoRA adapter {file}: unexpected tensor {name!r} (expected "
                                   "...layers.N.{self_attn|mlp}.{q|k|v|o|gate|up|down}_proj.lora_{A|B}.weight)",
                                   tensor=name)
        layer, proj, which = int(m.group(1)), PROJECTIONS[m.group(2)], m.group(3)
        if (layer, proj, which) in named:  # (two spellings of one tensor, or two adapters' in one file)
            raise WeightShapeError(f"LoRA adapter {file}: tensors {named[layer, proj, which]!r} and {name!r} are both "
                                   f"lora_{which} of layer {layer} {proj}; keep one (one adapter per file)",
                                   tensor=name)
        named[layer, proj, which] = name
        if (layer, proj) not in adapted:
            raise WeightShapeError(f"LoRA adapter {file}: tensor {name!r} is for layer {layer} {proj}, which "
                                   f"{CONFIG_FILE} does not adapt (target_modules, layers_to_transform)", tensor=name)
        if not jnp.issubdtype(t.dtype, jnp.floating):  # (bf16 loads as ml_dtypes' bfloat16, dtype kind 'V')
            raise WeightShapeError(f"LoRA adapter {file}: tensor {name!r} has dtype {t.dtype}; expected floats",
                                   tensor=name)
        fan_in, fan_out = shapes[proj]
        want = (r, fan_in) if which == "A" else (fan_out, r)
        if t.shape != want:
            raise WeightShapeError(f"LoRA adapter {file}: tensor {name!r} has shape {list(t.shape)}; this model "
                                   f"needs {list(want)} (r={r}, {proj} is {fan_in} -> {fan_out})", tensor=name)
        found[(layer, proj, which)] = _finite(np.asarray(t.astype(np.float32)), file, name)
    weights = {}
    for layer, proj in sorted(adapted):
        for which in "AB":
            if (layer, proj, which) not in found:
                raise MissingWeightError(f"LoRA adapter {file}: no lora_{which} tensor for layer {layer} {proj} "
                                         f"(adapted by {CONFIG_FILE})", tensor=f"layers.{layer}.{proj}")
        a, b = found[(layer, proj, "A")], found[(layer, proj, "B")]
        with np.errstate(over="ignore"):  # (an overflow is named below)
            scaled = np.float32(scale) * b.T
        weights[(layer, proj)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(
            _finite(scaled, file, f"lora_B of layer {layer} {proj} times lora_alpha / r = {scale:g}")))
    return LoraAdapter(rank=r, scale=float(scale), targets=targets, weights=weights,
                       digest=content_digest(r, weights), source=path)


def save_lora(path: str | os.PathLike, config: ModelConfig, a: dict[tuple[int, str], np.ndarray],
              b: dict[tuple[int, str], np.ndarray], *, r: int, lora_alpha: float, use_rslora: bool = False) -> None:
    """Write an adapter in PEFT's format (`a[(layer, proj)]` `[r, in]` = lora_A, `b[...]` `[out, r]` = lora_B;
    projections named q, k, v, o, gate, up, down): for tests, examples and the benchmark."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    ours = {v: k for k, v in PROJECTIONS.items()}
    targets = sorted({ours[p] for _, p in a}, key=list(PROJECTIONS).index)
    layers = sorted({layer for layer, _ in a})
    acfg = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "target_modules": targets, "use_rslora": use_rslora,
            "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    if layers != list(range(config.num_layers)):
        acfg["layers_to_transform"] = layers
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(acfg, f)
    tensors = {}
    for (layer, proj), arr in a.items():
        prefix = f"base_model.model.model.layers.{layer}.{_block(proj)}.{ours[proj]}"
        tensors[f"{prefix}.lora_A.weight"] = np.asarray(arr, np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.asarray(b[(layer, proj)], np.float32)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))


__all__ = ["GROUPS", "LoraAdapter", "LoraStack", "PROJECTIONS", "check_adapter", "content_digest", "load_lora",
           "lora_delta", "projection_shapes", "save_lora", "slot_arrays", "write_slot"]
