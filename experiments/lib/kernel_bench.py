"""The choices of `experiments.bench_kernels` that need none of its flags: which implementations it times by default
per backend, the dense baseline per backend, and the utilisation of its points against the peaks it uses
(`experiments.lib.peaks`)."""

from __future__ import annotations

from experiments.lib.peaks import Peak, utilisation
from pallas_kernels import native, native_attention


def default_impls(backend: str, native_reason: str | None) -> list[str]:
    """The implementations a family times when none are named: on a GPU the kernel and XLA; on the CPU "native"
    (what "auto" runs there, when it is built and takes the shape: `native_reason` None) before XLA and the
    reference."""
    if backend == "gpu":
        return ["pallas", "xla"]
    return (["native"] if native_reason is None else []) + ["xla", "reference"]


def native_attention_reason(heads: str) -> str | None:
    """Why the native attention cannot run the `--heads` shape here (None: it can)."""
    return native_attention.unavailable_reason(int(heads.split("x")[2]))


def native_matmul_reason() -> str | None:
    """Why the native matmul cannot run here (None: it can)."""
    return native.unavailable_reason()


def dense_baseline_dtype(backend: str) -> str:
    """The dtype of the fastest dense matmul on `backend`, the baseline a quantized matmul must beat: bfloat16 on a
    GPU (tensor cores); float32 on the CPU, where XLA's bfloat16 dot is several times slower than its float32 one
    (and slower than the quantized kernels, which made a bfloat16 baseline flatter them)."""
    return "bfloat16" if backend == "gpu" else "float32"


def point_label(rec: dict) -> str:
    return f"{rec['op']} {rec['shape']} {rec['impl']}"


def achieved_rates(rows: list[dict]) -> dict[str, dict[str, float]]:
    """metric -> point label -> achieved rate, for the timed points (`peaks.choose_peaks`' `achieved`)."""
    timed = [r for r in rows if "gbps" in r]
    return {"bandwidth_gbps": {point_label(r): r["gbps"] for r in timed},
            "matmul_gflops": {point_label(r): r["gflops"] for r in timed}}


def apply_utilisation(rows: list[dict], used: dict[str, Peak]) -> None:
    """Every timed point's `bandwidth_frac` and `flops_frac` against the peaks `used` (`peaks.choose_peaks`)."""
    for r in rows:
        if "gbps" in r:
            r["bandwidth_frac"] = utilisation(r["gbps"], used["bandwidth_gbps"])
            r["flops_frac"] = utilisation(r["gflops"], used["matmul_gflops"])
