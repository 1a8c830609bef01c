"""pytest plugin of the kernel conformance suite (registered through the `pytest11` entry point, so it is active
wherever the project is installed; otherwise pass `-p pallas_kernels.pytest_plugin`).

Options:
    --kernel=NAME_OR_PATH      implementation(s) to check, repeatable or comma-separated: a registered name or a
                               `module:function` path (default: the built-ins "xla" and "pallas")
    --kernel-family=FAMILY     attention, matmul, or auto (default): a registered name's registry (both families
                               for a name registered in both, e.g. "native"), a path's from its function's
                               signature; a signature that fits both families or neither is a usage error
    --kernel-level=LEVEL       quick (every feature once) or full (the whole case space)
    --kernel-tuning=TUNING     the implementation's tuning, as `--attn_tuning` takes it ("block_q=8,..." or JSON)

    python -m pytest --pyargs pallas_kernels.conformance --kernel=my_module:my_attention
"""

from __future__ import annotations

import importlib
import inspect

import pytest

FAMILIES = ("attention", "matmul")


def pytest_addoption(parser):
    group = parser.getgroup("kernels", "kernel conformance suite (pallas_kernels.conformance)")
    group.addoption("--kernel", action="append", default=[],
                    help="implementation to check: a registered name or module:function (repeatable)")
    group.addoption("--kernel-family", default="auto", choices=("auto", *FAMILIES),
                    help="the kernel family of --kernel (default: inferred from its registry or signature)")
    group.addoption("--kernel-level", default="quick", choices=("quick", "full"), help="case space to run")
    group.addoption("--kernel-tuning", default=None, help="tuning passed to the implementation")


def pytest_configure(config):
    if config.getoption("kernel", None):
        kernels_under_test(config)  # a --kernel whose family cannot be told is a usage error before collection


def kernels_under_test(config) -> list[tuple[str, str]]:
    """(family, implementation) pairs the options ask for. pytest.UsageError for a `--kernel` whose family cannot
    be told with `--kernel-family=auto`."""
    from pallas_kernels.registry import attention_registry, matmul_registry

    names = [n.strip() for opt in config.getoption("kernel") for n in opt.split(",") if n.strip()]
    family = config.getoption("kernel_family")
    if not names:
        fams = FAMILIES if family == "auto" else (family,)
        return [(f, n) for f in fams for n in ("xla", "pallas")]
    out = []
    for name in names:
        fams = infer_families(name, attention_registry(), matmul_registry()) if family == "auto" else (family,)
        out.extend((f, name) for f in fams)
    return out


def infer_families(name: str, attention, matmul) -> tuple[str, ...]:
    """The families `--kernel=name` is checked in under `--kernel-family=auto`: the registries `name` is registered
    in (both for a name like "native" registered in both); for a `module:function` path, the one family
    whose positional arguments its function takes (attention 7, matmul 2; the registration test then checks the
    keywords). pytest.UsageError naming `--kernel-family` when it takes both (e.g. `fn(*args, **kwargs)`) or
    neither, or cannot be imported."""
    from pallas_kernels.registry import KernelImpl

    regs = {"attention": attention, "matmul": matmul}
    registered = tuple(f for f, reg in regs.items() if name in reg.names())
    if registered:
        return registered
    choose = "; give --kernel-family=attention or --kernel-family=matmul"
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise pytest.UsageError(f"--kernel={name}: not a registered implementation (attention: "
                                f"{', '.join(attention.names())}; matmul: {', '.join(matmul.names())}) nor a "
                                "module:function path")
    try:
        fn = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        raise pytest.UsageError(f"--kernel={name}: cannot import it ({type(e).__name__}: {e}); is its module on "
                                "PYTHONPATH?") from None
    if isinstance(fn, KernelImpl):
        return tuple(f for f, reg in regs.items() if reg.family == fn.family)
    fits = tuple(f for f, reg in regs.items() if _takes_positionals(fn, reg.positional))
    if len(fits) == 1:
        return fits
    arity = "attention takes 7 positional arguments, a matmul 2 (x, qa)"
    if fits:
        raise pytest.UsageError(f"--kernel={name}: its signature takes both 7 and 2 positional arguments, so "
                                f"--kernel-family=auto cannot tell its family ({arity}){choose}")
    raise pytest.UsageError(f"--kernel={name}: its signature takes neither 7 nor 2 positional arguments "
                            f"({arity}){choose}")


def _takes_positionals(fn, n: int) -> bool:
    """Whether `fn` can be called with `n` positional arguments (its required keyword-only ones given); a function
    without a signature takes any number."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    keywords = {p.name: None for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    try:
        sig.bind(*range(n), **keywords)
    except TypeError:
        return False
    return True
