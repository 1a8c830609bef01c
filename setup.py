"""The native CPU kernels (`pallas_kernels/cpu/quant_matmul.cc`, `pallas_kernels/cpu/paged_attention.cc`,
`pallas_kernels/cpu/greedy_final.cc`: one library), built by setuptools with the package.

Everything else about the package is in pyproject.toml. The kernels are optional: without a C++ compiler or
jaxlib's XLA FFI headers the build prints why and the package installs without them; `pallas_kernels.native` then
reports the reason and the matmul and attention fall back to the XLA path (docs/kernels.md, "The native CPU
kernel" and "The native CPU paged attention").
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dir() -> str | None:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return path if os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")) else None


class OptionalBuildExt(build_ext):
    """Builds the kernel where it can; says why not (and goes on) where it cannot."""

    def build_extensions(self):
        include = _ffi_include_dir()
        if include is None:
            self._skip("jaxlib's XLA FFI headers were not found in the build environment")
            return
        for ext in self.extensions:
            ext.include_dirs.append(include)
        try:
            super().build_extensions()
        except Exception as e:  # noqa: BLE001 (no compiler, ...: the XLA path stays)
            self._skip(f"{type(e).__name__}: {e}")

    def _skip(self, why: str) -> None:
        print(f"warning: the native CPU kernels (matmul, paged attention) were not built ({why}); the XLA path is "
              "used instead", file=sys.stderr)


native = Extension(
    "pallas_kernels._native_quant_matmul",
    sources=["pallas_kernels/cpu/quant_matmul.cc", "pallas_kernels/cpu/paged_attention.cc",
             "pallas_kernels/cpu/greedy_final.cc"],
    depends=["pallas_kernels/cpu/quant_matmul_body.inc", "pallas_kernels/cpu/fork_join.h",
             "pallas_kernels/cpu/vec_exp.h"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17"],
    optional=True,
)

setup(ext_modules=[native], cmdclass={"build_ext": OptionalBuildExt})
