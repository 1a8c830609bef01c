"""Named exceptions raised while loading models and tokenizers, and by the tokenizer on bad input.

Every message says which file (or argument) was wrong, what was wrong, and what to change; callers catch the family
by `ModelError`. Every failure of `load_model()` (and of the tokenizer constructors) is a `ModelLoadError`, whatever
the file: the underlying library's error (JSON, safetensors, sentencepiece, `tokenizers`, struct, numpy) is chained
as `__cause__`, never raised bare. The specific classes keep the built-in bases they always had (`FileNotFoundError`,
`KeyError`, `ValueError`), so older `except` clauses still work.

    ModelError
    ├── ModelLoadError (ValueError)
    │   ├── ModelFileNotFoundError (FileNotFoundError)
    │   ├── CorruptFileError
    │   ├── ModelConfigError
    │   ├── UnsupportedArchitectureError
    │   ├── WeightShapeError
    │   ├── NonFiniteWeightError
    │   ├── MissingWeightError (KeyError)
    │   ├── UnsupportedTensorTypeError
    │   ├── InvalidLoadOptionError
    │   └── TokenizerLoadError (also a TokenizerError)
    └── TokenizerError (ValueError)
        ├── TokenizerLoadError
        └── InvalidPromptError
            └── InvalidPromptTypeError (TypeError)
"""

from __future__ import annotations

import copy
from typing import NoReturn


class ModelError(Exception):
    """Base class for model, checkpoint and tokenizer errors."""


class ModelLoadError(ModelError, ValueError):
    """A model or tokenizer could not be loaded: a file is missing, corrupt, truncated or inconsistent, or a load
    option is invalid. The message names the file and the problem."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A checkpoint, config or tokenizer file that the source needs is missing."""


class CorruptFileError(ModelLoadError):
    """A file's bytes are not what its format requires: invalid JSON, a truncated or garbled safetensors or GGUF
    file, a tensor whose bytes run past the end of the file."""


class ModelConfigError(ModelLoadError):
    """config.json or GGUF metadata lacks a required key, has a value of the wrong type or range, or sizes that do
    not fit together (e.g. attention heads not a multiple of key/value heads)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's `model_type`, activation or rope scaling is not implemented."""


class WeightShapeError(ModelLoadError):
    """A tensor in the checkpoint does not have the shape (or a float dtype) the config implies."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor  # the checkpoint's name of the offending tensor, so loaders can say which file holds it


class MissingWeightError(ModelLoadError, KeyError):
    """A tensor the architecture needs is absent from the checkpoint."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class NonFiniteWeightError(ModelLoadError):
    """A tensor that must hold finite numbers (a LoRA adapter's A or B) holds NaN or infinity."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class UnsupportedTensorTypeError(ModelLoadError):
    """A GGUF tensor uses a quantization type this project cannot read."""


class InvalidLoadOptionError(ModelLoadError):
    """`load_model()` got a `dtype` or `quant` value it does not support; the message lists the allowed values."""


class TokenizerError(ModelError, ValueError):
    """A tokenizer file is missing, malformed, or lacks what was asked of it (e.g. a chat template)."""


class TokenizerLoadError(TokenizerError, ModelLoadError):
    """A tokenizer file (tokenizer.json, tokenizer.model, tokenizer_config.json, a chat template file, or a GGUF's
    tokenizer metadata) is corrupt or inconsistent."""


class InvalidPromptError(TokenizerError):
    """Text given to `Tokenizer.encode()` cannot be encoded, e.g. it holds a lone surrogate code point."""


class InvalidPromptTypeError(InvalidPromptError, TypeError):
    """`Tokenizer.encode()` was given something other than a str."""


def raise_with_source(error: ModelError, source: str) -> NoReturn:
    """Raise `error` again with its message prefixed by `source: ` (a file path), same type and attributes, chained
    from `error`; `error` itself when its message already names `source`. Call it in the `except` clause."""
    if source in str(error):
        raise error
    new = copy.copy(error)  # keeps the type and extra attributes (e.g. `tensor`) without calling __init__ again
    new.args = (f"{source}: {error}",)
    raise new from error
