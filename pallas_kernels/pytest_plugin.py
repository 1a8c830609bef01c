"""pytest plugin of the kernel conformance suite (registered through the `pytest11` entry point, so it is active
wherever the project is installed; otherwise pass `-p pallas_kernels.pytest_plugin`).

Options:
    --kernel=NAME_OR_PATH      implementation(s) to check, repeatable or comma-separated: a registered name or a
                               `module:function` path (default: the built-ins "xla" and "pallas")
    --kernel-family=FAMILY     attention, matmul, or auto (default: from the function's signature)
    --kernel-level=LEVEL       quick (every feature once) or full (the whole case space)
    --kernel-tuning=TUNING     the implementation's tuning, as `--attn_tuning` takes it ("block_q=8,..." or JSON)

    python -m pytest --pyargs pallas_kernels.conformance --kernel=my_module:my_attention
"""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("kernels", "kernel conformance suite (pallas_kernels.conformance)")
    group.addoption("--kernel", action="append", default=[],
                    help="implementation to check: a registered name or module:function (repeatable)")
    group.addoption("--kernel-family", default="auto", choices=("auto", "attention", "matmul"),
                    help="the kernel family of --kernel (default: inferred from its signature)")
    group.addoption("--kernel-level", default="quick", choices=("quick", "full"), help="case space to run")
    group.addoption("--kernel-tuning", default=None, help="tuning passed to the implementation")


def kernels_under_test(config) -> list[tuple[str, str]]:
    """(family, implementation) pairs the options ask for."""
    from pallas_kernels.registry import attention_registry, matmul_registry

    names = [n.strip() for opt in config.getoption("kernel") for n in opt.split(",") if n.strip()]
    family = config.getoption("kernel_family")
    if not names:
        fams = ("attention", "matmul") if family == "auto" else (family,)
        return [(f, n) for f in fams for n in ("xla", "pallas")]
    out = []
    for name in names:
        fam = family
        if fam == "auto":
            fam = infer_family(name, attention_registry(), matmul_registry())
        out.append((fam, name))
    return out


def infer_family(name: str, attention, matmul) -> str:
    """attention if `name` is registered there or its function takes 7 positional arguments; else matmul."""
    import importlib
    import inspect

    for fam, reg in (("attention", attention), ("matmul", matmul)):
        if name in reg.names():
            return fam
    module, _, attr = name.partition(":")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    fn = getattr(fn, "fn", fn)
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return "attention" if len(positional) >= 7 else "matmul"
