"""What a benchmark record says about where it ran: git state, device, CPU, versions, load average."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LOAD_WARN = 0.5


def git_info(root: str = REPO_ROOT) -> dict:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")  # the instruction sets the CPU kernels may use


def cpu_isa() -> list[str]:
    """Which of ISA_FLAGS this CPU has (from /proc/cpuinfo; [] where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in ISA_FLAGS if x in have]
    except OSError:
        pass
    return []


def host_setup() -> dict:
    """The host keys of a step-time fit's setup (paged.sim.HOST_SETUP and the rest): CPU model, its instruction
    sets, the GPU (None on the CPU), the JAX backend and the usable cores."""
    import jax

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    gpu = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else None
    return {"cpu": cpu_model(), "isa": cpu_isa(), "gpu": gpu, "backend": jax.default_backend(), "cpus": usable}


def device_info() -> dict:
    import jax

    from paged.device.cpu_runtime import runtime_info

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "device_kind": jax.devices()[0].device_kind, "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_usable": usable, "machine": platform.machine(), "platform": platform.platform(),
            "matmul_auto": matmul_auto(), **runtime_info()}


def matmul_auto() -> str:
    """What `matmul_impl="auto"` runs here, for the results JSON."""
    import jax

    from pallas_kernels import native, registry
    from pallas_kernels.tuned_tables import gemv_max_rows

    if registry.on_gpu():
        device = jax.devices()[0].device_kind
        limits = ", ".join(f"{k} <= {gemv_max_rows(device, k)}" for k in ("q4_1", "q4_0", "int8"))
        return f"pallas_gemv for rows {limits}, pallas above, each where it fits the matrix, else xla"
    why = native.unavailable_reason()
    if why is not None:
        return f"xla (native unavailable: {why})"
    isa = native.resolved_isa()
    rows = ", ".join(f"{k} {'any' if v is None else f'<= {v}'}" for k, v in native.NATIVE_MAX_ROWS[isa].items())
    above = "" if all(v is None for v in native.NATIVE_MAX_ROWS[isa].values()) else "; xla above"
    return f"native ({isa}, {native.threads()} threads, {native.prefetch_hint()} prefetch) for rows {rows}{above}"


def versions() -> dict:
    import jax
    import jaxlib
    import numpy

    return {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "numpy": numpy.__version__}


def load_average(warn_label: str | None = None, threshold: float = LOAD_WARN) -> list[float]:
    """os.getloadavg(); with `warn_label`, warns on stderr when the 1-minute load exceeds `threshold`."""
    try:
        la = list(os.getloadavg())
    except OSError:
        return []
    if warn_label is not None and la and la[0] > threshold:
        print(f"WARNING: 1-minute load average {la[0]:.2f} > {threshold} {warn_label}: the machine is busy, "
              "timings are noisy", file=sys.stderr)
    return la


def narrow_path_tokens(model, eng) -> int:
    """Token slots up to which the engine's quantized matmuls take the native CPU kernel and wider steps another
    path (`auto` on a CPU with the kernel built; the smallest limit over the model's weight kinds); 0 when there is
    no such second path: no native kernel, or one that takes every row count (VNNI: `native.max_rows` is None)."""
    import jax

    from pallas_kernels import native
    from pallas_kernels.dequant_matmul import native_fits
    from pallas_kernels.quant_format import QuantizedArray

    if jax.default_backend() != "cpu" or eng.config.matmul_impl != "auto" or not native.available():
        return 0
    weights = [w for w in jax.tree_util.tree_leaves(model.params.layers, is_leaf=lambda x: isinstance(
        x, QuantizedArray)) if isinstance(w, QuantizedArray) and native_fits(1, w)]
    limits = [native.max_rows(w.kind) for w in weights]
    if not limits or all(limit is None for limit in limits):
        return 0
    return min(limit for limit in limits if limit is not None)
