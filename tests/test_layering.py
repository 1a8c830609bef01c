"""The package layers (docs/architecture.md, "Layers"): a package imports only the project packages below it.

    experiments      may import  paged, models, pallas_kernels
    paged            may import  models, pallas_kernels
    models           may import  pallas_kernels
    pallas_kernels   may import  no project package (and, of third-party code, only jax and numpy)

Every `.py` file of each package is parsed with `ast`, and every import in it counts, wherever it sits: module level,
inside a function (lazy imports), under `if TYPE_CHECKING`, and `importlib.import_module("...")` / `__import__("...")`
calls with a literal name. Nothing is imported, so the check is fast and sees code paths no test runs.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the other project packages it may import. Change the layering here (and in docs/architecture.md).
ALLOWED: dict[str, frozenset[str]] = {
    "pallas_kernels": frozenset(),
    "models": frozenset({"pallas_kernels"}),
    "paged": frozenset({"models", "pallas_kernels"}),
    "experiments": frozenset({"paged", "models", "pallas_kernels"}),
}
# Top-level names that are project code but no layer: no package may import them.
PROJECT = frozenset(ALLOWED) | {"tests"}
# package -> the third-party top-level modules it may import (absent: any). The standard library is always allowed.
THIRD_PARTY: dict[str, frozenset[str]] = {
    "pallas_kernels": frozenset({"jax", "jaxlib", "numpy"}),
}
# Modules that are pytest suites (or plugins) shipped with a package, and may import pytest besides.
PYTEST_MODULES = frozenset({"pallas_kernels/conformance.py", "pallas_kernels/pytest_plugin.py"})


@dataclasses.dataclass(frozen=True)
class Import:
    file: Path
    line: int
    module: str  # absolute dotted name, e.g. "models.quant"

    def describe(self, root: Path) -> str:
        return f"{self.file.relative_to(root)}:{self.line} imports {self.module}"


def _package_parts(file: Path, root: Path) -> list[str]:
    """The dotted package a file's relative imports resolve against (`models/quant.py` -> ["models"])."""
    parts = list(file.relative_to(root).with_suffix("").parts)
    return parts[:-1]  # drop the module name; for `pkg/__init__.py` that is "__init__", leaving the package itself


def imports_of(file: Path, root: Path) -> list[Import]:
    """Every module `file` imports, anywhere in it, as absolute dotted names."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(file, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `.` is the file's package, each further dot one package up
                package = _package_parts(file, root)
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from pkg import sub` may import the submodule pkg.sub: the top-level package is what the layers see.
            found.append(Import(file, node.lineno, module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append(Import(file, node.lineno, node.args[0].value))
    return found


def violations(package: str, root: Path = ROOT) -> list[str]:
    """'file:line imports module (...)' for every import of `package` that breaks the layering."""
    allowed = ALLOWED[package] | {package}
    third_party = THIRD_PARTY.get(package)
    bad = []
    for file in sorted((root / package).rglob("*.py")):
        for imp in imports_of(file, root):
            top = imp.module.split(".")[0]
            if top in PROJECT and top not in allowed:
                above = "a package above it" if top in ALLOWED else "a project directory that is no layer"
                may = ", ".join(sorted(ALLOWED[package])) or "no project package"
                bad.append(f"{imp.describe(root)}: {package} must not import {top} ({above}); it may import {may}")
            elif (
                third_party is not None
                and top not in PROJECT
                and top not in sys.stdlib_module_names
                and top not in third_party
                and not (top == "pytest" and file.relative_to(root).as_posix() in PYTEST_MODULES)
            ):
                bad.append(
                    f"{imp.describe(root)}: {package} may import only the standard library and "
                    f"{', '.join(sorted(third_party))}"
                )
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_the_layers_below_it(package):
    assert (ROOT / package / "__init__.py").is_file(), f"{package} is not a package under {ROOT}"
    bad = violations(package)
    assert not bad, "layering violations:\n  " + "\n  ".join(bad)


def test_every_top_level_package_has_a_layer():
    """A new top-level package must be placed in `ALLOWED` (and docs/architecture.md) before it can be imported."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(ALLOWED), f"packages without a layer: {sorted(packages - set(ALLOWED))}"


def test_quantized_format_is_imported_from_its_home():
    """`QuantizedArray`, `check` and `dequantize` live in `pallas_kernels.quant_format`; no code imports them from
    `models.quant` (which uses them, so the names exist there, but it is not their home)."""
    format_names = {"QuantizedArray", "check", "dequantize"}
    bad = []
    for file in sorted(ROOT.rglob("*.py")):
        if not {"tests", *ALLOWED} & set(file.relative_to(ROOT).parts[:1]):
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "models.quant":
                names = format_names & {alias.name for alias in node.names}
                bad += [f"{file.relative_to(ROOT)}:{node.lineno} imports {n} from models.quant" for n in sorted(names)]
    assert not bad, "import these from pallas_kernels.quant_format:\n  " + "\n  ".join(bad)


# ----------------------------------------------------------------------------------------- the checker itself
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return tmp_path


def test_checker_flags_upward_imports_anywhere_in_a_file(tmp_path):
    root = _tree(tmp_path, {
        "pallas_kernels/__init__.py": "",
        "pallas_kernels/k.py": """\
            import numpy as np
            from jax import lax

            def f():
                from models.quant import quantize  # lazy
                return quantize

            import importlib
            importlib.import_module("paged.device.engine")
            """,
        "pallas_kernels/sub/__init__.py": "from .. import k\nfrom ..k import f\n",
        "models/__init__.py": "",
        "models/m.py": """\
            from typing import TYPE_CHECKING
            from pallas_kernels import k
            from . import other
            if TYPE_CHECKING:
                import paged.device.state
            """,
        "models/other.py": "import tests.fakes\n",
    })
    kernels = violations("pallas_kernels", root)
    assert [v.split(":")[:2] for v in kernels] == [
        ["pallas_kernels/k.py", "5 imports models.quant"],
        ["pallas_kernels/k.py", "9 imports paged.device.engine"],
    ], kernels
    assert "must not import models (a package above it); it may import no project package" in kernels[0]
    sub = root / "pallas_kernels/sub/__init__.py"
    assert [i.module for i in imports_of(sub, root)] == ["pallas_kernels", "pallas_kernels.k"]  # relative, resolved
    models = violations("models", root)
    assert [v.split(": ")[0] for v in models] == [
        "models/m.py:5 imports paged.device.state",
        "models/other.py:1 imports tests.fakes",
    ]
    assert "a project directory that is no layer" in models[1]


def test_checker_restricts_third_party_imports_of_the_kernels(tmp_path):
    root = _tree(tmp_path, {
        "pallas_kernels/__init__.py": "import dataclasses, jax.numpy, numpy\nfrom flax import struct\n",
    })
    assert violations("pallas_kernels", root) == [
        "pallas_kernels/__init__.py:2 imports flax: pallas_kernels may import only the standard library and jax, "
        "jaxlib, numpy"
    ]
