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


# ------------------------------------------------------------------------------------------- rooms inside packages
# Inside a package the same rule holds between its rooms (docs/architecture.md, "Rooms inside `paged/`"): a module
# imports only modules of its own room or of the rooms below, and no package has an import cycle among its modules
# (function-local imports count: an import placed in a function to dodge a cycle is the cycle still). Package faces
# (`__init__.py` re-exports) are left out of the cycle check, as a re-export is not coupling.
PAGED_ROOMS: list[tuple[str, tuple[str, ...]]] = [  # bottom to top; a name ending in "." is a whole subpackage
    ("floor", ("paged.errors", "paged.validate", "paged.clock")),
    ("device", ("paged.device.",)),
    ("requests", ("paged.settings", "paged.filters", "paged.embeddings", "paged.job", "paged.token_sets",
                  "paged.streaming")),
    ("policies", ("paged.policies.",)),
    ("speculation", ("paged.speculation.",)),
    ("host", ("paged.host.",)),
    ("server", ("paged.server.",)),
    ("sim", ("paged.sim", "paged.testing")),
    ("face", ("paged", "paged.compat")),
]


def module_name(file: Path, root: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(package: str, root: Path = ROOT, faces: bool = True) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (anywhere in it). `from pkg import sub` counts as importing
    the submodule where `sub` is one, else the package. `faces=False` leaves `__init__.py` modules out."""
    files = {module_name(f, root): f for f in sorted((root / package).rglob("*.py"))
             if faces or f.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for mod, file in files.items():
        deps = set()
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        from_lines = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        found = imports_of(file, root)
        by_line = {i.line: i.module for i in found}
        for imp in found:  # imports and import_module() calls
            if imp.line not in from_lines and imp.module.split(".")[0] == package:
                deps.add(imp.module)
        for node in ast.walk(tree):  # `from pkg import sub` imports the submodule pkg.sub, else pkg's names
            if isinstance(node, ast.ImportFrom):
                base = by_line[node.lineno]
                if base.split(".")[0] == package:
                    subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files}
                    deps |= subs if len(subs) == len(node.names) else subs | {base}
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def room_of(module: str, rooms=PAGED_ROOMS) -> int | None:
    for i, (_, members) in enumerate(rooms):
        if any(module.startswith(m) or module == m[:-1] if m.endswith(".") else module == m for m in members):
            return i
    return None


def room_violations(root: Path = ROOT, rooms=PAGED_ROOMS) -> list[str]:
    bad = []
    for mod, deps in module_graph("paged", root).items():
        mine = room_of(mod, rooms)
        if mine is None:
            bad.append(f"{mod} is in no room of PAGED_ROOMS: place it")
            continue
        for d in sorted(deps):
            theirs = room_of(d, rooms)
            if theirs is not None and theirs > mine:
                bad.append(f"{mod} ({rooms[mine][0]}) imports {d} ({rooms[theirs][0]}, a room above it)")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycle_inside_a_package(package):
    cycles = import_cycles(module_graph(package, faces=False))
    assert not cycles, "import cycles (a module should import only from below it):\n  " + "\n  ".join(
        " <-> ".join(c) for c in cycles)


def test_paged_rooms_import_only_the_rooms_below():
    bad = room_violations()
    assert not bad, "room order broken:\n  " + "\n  ".join(bad)


def test_paged_has_no_folder_of_more_than_15_modules():
    for folder in [ROOT / "paged", *[p.parent for p in (ROOT / "paged").glob("*/__init__.py")]]:
        modules = [f for f in folder.glob("*.py") if f.name != "__init__.py"]
        assert len(modules) <= 15, f"{folder.relative_to(ROOT)} holds {len(modules)} modules: group them in rooms"


def test_the_room_and_cycle_checks_catch_what_they_are_for(tmp_path):
    root = _tree(tmp_path, {
        "paged/__init__.py": "from paged.host.gen import G\n",
        "paged/errors.py": "",
        "paged/device/__init__.py": "",
        "paged/device/step.py": "from paged.device import engine\n",
        "paged/device/engine.py": """\
            def f():
                from paged.device.step import g  # lazy: still a cycle
                from paged.host.other import H  # a room above
            """,
        "paged/host/__init__.py": "",
        "paged/host/other.py": "",
        "paged/host/gen.py": "from paged.device.engine import f\nfrom paged import errors\n",
        "paged/stray.py": "",
    })
    graph = module_graph("paged", root, faces=False)
    assert graph["paged.host.gen"] == {"paged.device.engine", "paged.errors"}
    assert import_cycles(graph) == [["paged.device.engine", "paged.device.step"]]
    assert room_violations(root) == [
        "paged.device.engine (device) imports paged.host.other (host, a room above it)",
        "paged.stray is in no room of PAGED_ROOMS: place it",
    ]
