"""The named step-time fits (`paged.sim.StepTimeModel` JSON files) the simulator prices steps with: one folder,
`experiments/data/step_time/`, one file per hardware + model + setup, e.g. `cpu_epyc_smollm2_q4.json`. A fit's name
is its file's stem; `--step_time_model` takes a name or a path."""

from __future__ import annotations

import os

FITS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "step_time")
DEFAULT_FIT = "cpu_epyc_smollm2_q4"  # the 2-core AMD EPYC host, SmolLM2-135M's Q4_1 GGUF, the default engine flags


def available() -> list[str]:
    """The names of the fits in FITS_DIR."""
    if not os.path.isdir(FITS_DIR):
        return []
    return sorted(f.removesuffix(".json") for f in os.listdir(FITS_DIR) if f.endswith(".json"))


def fit_path(name_or_path: str) -> str:
    """The file of a fit: a name in FITS_DIR, or a path (anything with a separator or a .json suffix). A name that
    is not there raises ValueError listing the names that are."""
    if os.sep in name_or_path or "/" in name_or_path or name_or_path.endswith(".json"):
        return name_or_path
    path = os.path.join(FITS_DIR, name_or_path + ".json")
    if not os.path.exists(path):
        raise ValueError(f"no step-time fit named {name_or_path!r} in {os.path.relpath(FITS_DIR)}; the named fits: "
                         f"{', '.join(available()) or 'none'} (or give a path to a JSON fit)")
    return path
