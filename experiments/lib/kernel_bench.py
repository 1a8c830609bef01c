"""The choices of `experiments.bench_kernels` that need none of its flags: which implementations it times by default
per backend, the dense baseline per backend, the tunings `--sweep` tries (`sweep_grid`), and the utilisation of its
points against the peaks it uses (`experiments.lib.peaks`)."""

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


def sweep_grid(family: str, label: str, inputs, fix: dict | None = None) -> list:
    """Tunings of the built-in kernels to try for one shape; `fix` (field -> value): only those with these values.

    Attention: keys are split (split-K) only for decode rows: every row of a decode shape; in a mixed shape (a chunk
    and decode rows) the decode rows alone (`split_max_q=1`, the chunk attended whole by the first split); none in
    a prefill shape."""
    import dataclasses

    from pallas_kernels.dequant_matmul import MatmulTuning, _check_tuning
    from pallas_kernels.tuning import AttentionTuning

    def fixed(ts: list) -> list:
        return [t for t in ts if all(getattr(t, k) == v for k, v in (fix or {}).items()
                                     if k in {f.name for f in dataclasses.fields(t)})]

    out = []
    if family == "attention":
        layout = inputs["layout"]
        for bq in (1, 2, 4, 8, 16, 32):
            for ppb in (1, 2, 4, 8):
                for ks in (1, 2, 4, 8):
                    if ks == 1 or not layout.num_prefill_rows:
                        out.append(AttentionTuning(block_q=bq, pages_per_block=ppb, k_splits=ks))
                    elif layout.num_decode_rows:  # a mixed step: split the decode rows only
                        out.append(AttentionTuning(block_q=bq, pages_per_block=ppb, k_splits=ks, split_max_q=1))
        return fixed(out)
    x, qa = inputs
    for bn in [b for b in (16, 32, 64) if b == 16 or b <= x.shape[0]]:  # row blocks past n only add padding
        for bo in (32, 64, 128, 256):
            for bi in (32, 64, 128, 256):
                for si in (1, 2, 4, 8):
                    t = MatmulTuning(block_n=bn, block_out=bo, block_in=bi, split_in=si)
                    try:
                        _check_tuning(x.shape[0], qa, t, native_gpu=False)
                    except ValueError:
                        continue
                    out.append(t)
    return fixed(out)
