"""Kernel registries: implementations of a kernel family by name, so a kernel written outside the project plugs in
without editing it.

Each family (`ATTENTION` for paged attention, `MATMUL` for the dequantizing matmul) maps names to implementations.
The built-ins ("reference", "xla", "pallas") are registered the same way a researcher registers a variant:

    from pallas_kernels.registry import ATTENTION
    ATTENTION.register("my_attention", my_attention)           # then attn_impl="my_attention"

or, without any registration call, by import path wherever an implementation name is accepted (the engine config,
the generator, every experiment's `--attn_impl` / `--matmul_impl`):

    attn_impl="my_package.kernels:my_attention"

`"auto"` is not an implementation but a choice made per backend (the family's `auto` rule). Every implementation
must follow its family's contract (the docstrings of `pallas_kernels.paged_attention` and
`pallas_kernels.dequant_matmul`, and `docs/kernels.md`); `register` checks it on a small case, by tracing only
(`jax.eval_shape`, nothing is compiled), so a wrong signature or output shape fails there with a message that says
what to change instead of deep inside the engine's jit trace. Correctness is the conformance suite's business
(`pallas_kernels.testing`, `pytest --pyargs pallas_kernels.conformance --kernel=...`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any


class KernelError(ValueError):
    """Base of the registry's errors (a ValueError, so callers validating settings catch it as one)."""


class UnknownKernelError(KernelError):
    """An implementation name that is neither registered nor an importable `module:function` path."""


class KernelContractError(KernelError):
    """An implementation whose signature or output does not follow its family's contract."""


@dataclasses.dataclass(frozen=True)
class KernelImpl:
    """One registered implementation.

    name: what it is registered under (a plain name or the `module:function` path it was imported from);
    fn: the function, called with the family's contract arguments;
    stacked_cache (attention only): the function takes the engine's stacked cache `[L, KH, N, page_size, D]` and an
        int32 `layer=` and reads that layer itself; otherwise the dispatcher slices the layer out first;
    builtin: one of the project's own implementations;
    tuning_type: the frozen dataclass its `tuning=` argument takes (what `--attn_tuning block_q=16` is parsed
        into); from `register(tuning_type=...)` or the function's `tuning_type` attribute.
    tolerance: for an implementation that is approximate by design (e.g. one that quantizes activations to int8),
        the error relative to the output's largest magnitude that the conformance suite and the benchmark's check
        accept, instead of the family's float tolerance; from `register(tolerance=...)` or the function's
        `tolerance` attribute. None: exact up to float rounding.
    """

    name: str
    fn: Callable[..., Any]
    family: str
    stacked_cache: bool = False
    builtin: bool = False
    tuning_type: type | None = None
    tolerance: float | None = None


def checked_call(impl: KernelImpl, args: tuple, kwargs: dict[str, Any], shape: tuple[int, ...], dtype: Any,
                 inputs: str) -> Any:
    """`impl.fn(*args, **kwargs)` for a user's implementation, as the engine traces it: an exception it raises, or
    an output other than `shape` / `dtype`, becomes a `KernelContractError` naming the implementation and the
    `inputs` (its shapes, in words); it had surfaced as a bare TypeError or IndexError deep in a failed step."""
    try:
        out = impl.fn(*args, **kwargs)
    except KernelError:
        raise
    except Exception as e:
        raise KernelContractError(f"{impl.family}: {impl.name!r} ({_where(impl.fn)}) raised {type(e).__name__}: {e} "
                                  f"(called with {inputs})") from e
    got_shape, got_dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if got_shape is None or tuple(got_shape) != tuple(shape) or got_dtype != dtype:
        raise KernelContractError(f"{impl.family}: {impl.name!r} ({_where(impl.fn)}) returned "
                                  f"{_describe(out)}; the contract is {tuple(shape)} {dtype} (called with {inputs})")
    return out


def _describe(out: Any) -> str:
    shape = getattr(out, "shape", None)
    return f"{tuple(shape)} {getattr(out, 'dtype', None)}" if shape is not None else f"a {type(out).__name__}"


@dataclasses.dataclass(frozen=True)
class Tuned:
    """An implementation name (or path) with the tuning to run it with: hashable, so it travels as the `attn_impl` /
    `matmul_impl` static argument of the engine's jitted step; the dispatchers unpack it."""

    impl: str
    tuning: Any

    def __str__(self) -> str:
        return f"{self.impl}[{self.tuning}]"


def with_tuning(impl: str, tuning: Any) -> str | Tuned:
    """`impl` itself when there is no tuning (so untuned programs keep their compile keys), else `Tuned`."""
    return impl if tuning is None else Tuned(impl, tuning)


def split_tuning(spec: Any) -> tuple[Any, Any]:
    """(implementation spec, tuning or None) of a name, path, `KernelImpl` or `Tuned`."""
    return (spec.impl, spec.tuning) if isinstance(spec, Tuned) else (spec, None)


class KernelRegistry:
    """Implementations of one kernel family, by name.

    family: the family's name (used in messages); required / optional: the keyword arguments the contract passes
    (besides the positional ones, `positional` of them); check: `check(impl)` runs the contract on a small case and
    raises `KernelContractError` (the family's kernel module sets it, `set_contract`); auto: backend name ->
    implementation name for "auto".
    """

    def __init__(self, family: str, *, positional: int, required: tuple[str, ...], optional: tuple[str, ...],
                 auto: Callable[[], str], check: Callable[[KernelImpl], None] | None = None):
        self.family = family
        self.positional = positional
        self.required = required
        self.optional = optional
        self._check = check
        self._auto = auto
        self._impls: dict[str, KernelImpl] = {}
        self._lock = threading.Lock()

    def set_contract(self, check: Callable[[KernelImpl], None]) -> None:
        """The contract check of the family (called once by its kernel module, before it registers built-ins)."""
        self._check = check

    # ------------------------------------------------------------------ registration
    def register(self, name: str, fn: Callable[..., Any], *, stacked_cache: bool = False, check: bool = True,
                 replace: bool = False, builtin: bool = False, tuning_type: type | None = None,
                 tolerance: float | None = None) -> KernelImpl:
        """Register `fn` under `name`; returns the entry. `check=True` runs the contract check (tracing only).
        Raises `KernelError` if the name is taken (unless `replace`), `KernelContractError` if `fn` breaks the
        contract."""
        if not isinstance(name, str) or not name or name == "auto":
            raise KernelError(f"{self.family}: an implementation name must be a non-empty string other than 'auto', "
                              f"got {name!r}")
        if not callable(fn):
            raise KernelContractError(f"{self.family}: {name!r} must be a function, got {type(fn).__name__}")
        tuning_type = tuning_type if tuning_type is not None else getattr(fn, "tuning_type", None)
        if tuning_type is not None and not (isinstance(tuning_type, type) and dataclasses.is_dataclass(tuning_type)
                                            and tuning_type.__dataclass_params__.frozen):
            # (an instance, or a dataclass that is not frozen, had passed: an unhashable tuning then failed every
            # step, its engine config unhashable)
            raise KernelContractError(f"{self.family}: {name!r}: tuning_type must be a frozen dataclass class "
                                      f"(@dataclasses.dataclass(frozen=True)), got {tuning_type!r}")
        tolerance = tolerance if tolerance is not None else getattr(fn, "tolerance", None)
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                      or not 0 < tolerance < 1):
            raise KernelContractError(f"{self.family}: {name!r}: tolerance must be a number in (0, 1), got "
                                      f"{tolerance!r}")
        impl = KernelImpl(name=name, fn=fn, family=self.family, stacked_cache=bool(stacked_cache), builtin=builtin,
                          tuning_type=tuning_type, tolerance=None if tolerance is None else float(tolerance))
        with self._lock:
            old = self._impls.get(name)
            if old is not None and not replace and old.fn is not fn:
                raise KernelError(f"{self.family}: {name!r} is already registered ({_where(old.fn)}); pick another "
                                  "name or pass replace=True")
        if old is not None and old.builtin:  # a built-in's name stays a built-in's (never removable)
            impl = dataclasses.replace(impl, builtin=True)
        self.check_signature(impl)
        if check:
            if self._check is None:
                raise KernelError(f"{self.family}: its contract is not loaded; import pallas_kernels (the package "
                                  "loads the kernel modules) before registering")
            self._check(impl)
        with self._lock:
            self._impls[name] = impl
        return impl

    def unregister(self, name: str) -> None:
        """Remove a registered implementation (built-ins cannot be removed)."""
        with self._lock:
            impl = self._impls.get(name)
            if impl is None:
                raise UnknownKernelError(f"{self.family}: {name!r} is not registered")
            if impl.builtin:
                raise KernelError(f"{self.family}: {name!r} is a built-in implementation and cannot be removed")
            del self._impls[name]

    def check_signature(self, impl: KernelImpl) -> None:
        """`KernelContractError` unless `impl.fn` accepts the contract's call: `positional` arguments and the
        required and optional keywords (plus `layer` for a stacked-cache attention)."""
        try:
            sig = inspect.signature(impl.fn)
        except (TypeError, ValueError):
            return  # builtins without a signature: the traced check decides
        params = sig.parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            kw_ok = lambda name: True  # noqa: E731
        else:
            kw_names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                            inspect.Parameter.POSITIONAL_OR_KEYWORD)}
            kw_ok = kw_names.__contains__
        keywords = self.required + self.optional + (("layer",) if impl.stacked_cache else ())
        missing = [k for k in keywords if not kw_ok(k)]
        try:
            sig.bind(*range(self.positional), **{k: None for k in keywords if kw_ok(k)})
        except TypeError as e:
            missing_msg = f"; it lacks the keyword(s) {missing}" if missing else ""
            raise KernelContractError(
                f"{self.family}: {impl.name!r} ({_where(impl.fn)}) cannot be called as the contract calls it: "
                f"{self.positional} positional arguments and the keywords {list(keywords)} ({e}){missing_msg}. "
                f"See docs/kernels.md for the signature") from None
        if missing:
            raise KernelContractError(
                f"{self.family}: {impl.name!r} ({_where(impl.fn)}) does not accept the keyword(s) {missing}; the "
                f"contract passes {list(keywords)} (add them, or **kwargs). See docs/kernels.md")

    # ------------------------------------------------------------------ lookup
    def names(self) -> tuple[str, ...]:
        """The registered names, built-ins first, plus "auto"."""
        with self._lock:
            impls = list(self._impls.values())
        return ("auto", *[i.name for i in impls if i.builtin], *sorted(i.name for i in impls if not i.builtin))

    def resolve_name(self, spec: str) -> str:
        """The implementation name `spec` stands for on this backend ("auto" resolved)."""
        return self._auto() if spec == "auto" else spec

    def get(self, spec: str | KernelImpl) -> KernelImpl:
        """The implementation for a name, "auto", or a `module:function` import path (imported and registered
        under that path on first use). Raises `UnknownKernelError` / `KernelContractError`."""
        if isinstance(spec, KernelImpl):
            return spec
        if isinstance(spec, Tuned):
            spec = spec.impl
        if not isinstance(spec, str):
            raise UnknownKernelError(f"{self.family}: an implementation is given by name or 'module:function' path, "
                                     f"got {type(spec).__name__}")
        name = self.resolve_name(spec)
        with self._lock:
            impl = self._impls.get(name)
        if impl is not None:
            return impl
        if ":" not in name:
            raise UnknownKernelError(f"{self.family}: unknown implementation {spec!r}; registered: "
                                     f"{', '.join(self.names())}, or give an import path 'module:function'")
        return self._import(name)

    def validate(self, spec: Any) -> str:
        """`spec` if it names an implementation (importing a path), else a `KernelError` saying why not."""
        self.get(spec)
        return spec

    def _import(self, path: str) -> KernelImpl:
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise UnknownKernelError(f"{self.family}: {path!r} is not a 'module:function' path")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 (any import failure is the user's module's)
            raise UnknownKernelError(f"{self.family}: cannot import module {module_name!r} for {path!r}: "
                                     f"{type(e).__name__}: {e} (is it on PYTHONPATH?)") from e
        with self._lock:  # importing may have registered it under its path
            impl = self._impls.get(path)
        if impl is not None:
            return impl
        obj = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise UnknownKernelError(f"{self.family}: module {module_name!r} has no attribute {attr!r} "
                                         f"(from {path!r})")
            obj = getattr(obj, part)
        if isinstance(obj, KernelImpl):
            return self.register(path, obj.fn, stacked_cache=obj.stacked_cache, tuning_type=obj.tuning_type)
        return self.register(path, obj, stacked_cache=bool(getattr(obj, "stacked_cache", False)))

    # ------------------------------------------------------------------ tuning
    def parse_tuning(self, spec: str | KernelImpl, value: Any) -> Any:
        """The tuning object for implementation `spec` from `value`: None or "" (its default), an instance, a dict,
        a JSON file path, or "name=value,name=value" (`--attn_tuning block_q=16,pages_per_block=4`). Values are
        converted to the dataclass fields' types. Raises `KernelError` saying what to change."""
        impl = self.get(spec)
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        t = impl.tuning_type
        if t is None:
            raise KernelError(f"{self.family}: {impl.name!r} takes no tuning (it has no tuning_type); drop the "
                              "tuning setting or register the implementation with tuning_type=")
        if isinstance(value, t):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.endswith(".json") or text.startswith("{"):
                import json
                import os

                if not text.startswith("{") and not os.path.isfile(text):
                    raise KernelError(f"{self.family}: the tuning file {text!r} does not exist (or is no file)")
                try:
                    value = json.loads(open(text).read() if os.path.isfile(text) else text)
                except (OSError, ValueError) as e:
                    raise KernelError(f"{self.family}: cannot read the tuning {text!r}: {e}") from None
            else:
                value = {}
                for part in text.split(","):
                    key, eq, raw = part.partition("=")
                    if not eq or not key.strip():
                        raise KernelError(f"{self.family}: tuning {text!r}: expected name=value pairs separated by "
                                          f"commas (fields of {t.__name__}: {_field_names(t)})")
                    if key.strip() in value:
                        raise KernelError(f"{self.family}: tuning {text!r} sets {key.strip()} twice")
                    value[key.strip()] = raw.strip()
        if not isinstance(value, dict):
            raise KernelError(f"{self.family}: a tuning is a {t.__name__}, a dict, a JSON file or 'name=value,...'; "
                              f"got {type(value).__name__}")
        import typing

        hints = typing.get_type_hints(t)
        known = {f.name for f in dataclasses.fields(t)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise KernelError(f"{self.family}: {t.__name__} has no field(s) {unknown}; fields: {_field_names(t)}")
        kwargs = {}
        for key, raw in value.items():
            kwargs[key] = self._tuning_value(key, raw, hints.get(key))
        try:
            return t(**kwargs)
        except (TypeError, ValueError) as e:
            raise KernelError(f"{self.family}: invalid tuning for {impl.name!r}: {e}") from None


    def _tuning_value(self, key: str, raw: Any, kind: Any) -> Any:
        """`raw` (a string from "name=value", or a JSON value) as a value of the field's type `kind`: int, float,
        bool, or one of them | None. A bool is no int, and a float no int (4.5 had been taken for a block size)."""
        import types
        import typing

        optional = typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)
        base = next((a for a in typing.get_args(kind) if a is not type(None)), None) if optional else kind
        if base not in (int, float, bool):
            return raw  # (a field of another type: the dataclass decides)
        if raw is None or (optional and isinstance(raw, str) and raw.lower() in ("none", "null")):
            if optional:
                return None
            raise KernelError(f"{self.family}: tuning field {key} must be {_a(base)}, got None")
        try:
            if isinstance(raw, str):
                raw = ({"true": True, "1": True, "false": False, "0": False}[raw.lower()] if base is bool
                       else base(raw))
        except (ValueError, KeyError):
            raise KernelError(f"{self.family}: tuning field {key}={raw!r} is not {_a(base)}") from None
        ok = (isinstance(raw, bool) if base is bool else
              (isinstance(raw, (int, float)) and not isinstance(raw, bool)) if base is float else
              (isinstance(raw, int) and not isinstance(raw, bool)))
        if not ok:
            raise KernelError(f"{self.family}: tuning field {key} must be {_a(base)}, got {raw!r}")
        return float(raw) if base is float else raw


def _a(kind: type) -> str:
    return f"an {kind.__name__}" if kind is int else f"a {kind.__name__}"


def _field_names(t: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(t))


def _where(fn: Callable) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    return f"{mod}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU: the one test of "auto" and of the kernels' native-GPU rules (tests
    patch it to take the GPU branches on the CPU)."""
    import jax

    return jax.default_backend() == "gpu"


def _default_backend_auto() -> str:
    return "pallas" if on_gpu() else "xla"


# The families. Their contracts and built-ins are registered by the kernel modules (`paged_attention`,
# `dequant_matmul`), which the package imports (`pallas_kernels/__init__.py`): this module imports none of them.
ATTENTION = KernelRegistry(
    "paged_attention", positional=7,
    required=("sm_scale",),
    optional=("sliding_window", "soft_cap", "k_scales", "v_scales", "layout", "tuning"),
    auto=_default_backend_auto,
)
MATMUL = KernelRegistry(
    "dequant_matmul", positional=2, required=(), optional=("tuning",),
    auto=_default_backend_auto,
)


def attention_registry() -> KernelRegistry:
    return ATTENTION


def matmul_registry() -> KernelRegistry:
    return MATMUL


__all__ = [
    "ATTENTION",
    "MATMUL",
    "KernelContractError",
    "KernelError",
    "KernelImpl",
    "KernelRegistry",
    "Tuned",
    "UnknownKernelError",
    "attention_registry",
    "matmul_registry",
    "split_tuning",
    "with_tuning",
]
