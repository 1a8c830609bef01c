"""Named exceptions raised while loading models and tokenizers.

Every message says what was wrong and what to change; callers catch the family by `ModelError`.
"""


class ModelError(Exception):
    """Base class for model, checkpoint and tokenizer errors."""


class ModelFileNotFoundError(ModelError, FileNotFoundError):
    """A checkpoint, config or tokenizer file that the source needs is missing."""


class UnsupportedArchitectureError(ModelError, ValueError):
    """The checkpoint's `model_type`, activation or rope scaling is not implemented."""


class WeightShapeError(ModelError, ValueError):
    """A tensor in the checkpoint does not have the shape the config implies."""


class MissingWeightError(ModelError, KeyError):
    """A tensor the architecture needs is absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnsupportedTensorTypeError(ModelError, ValueError):
    """A GGUF tensor uses a quantization type this project cannot read."""


class TokenizerError(ModelError, ValueError):
    """A tokenizer file is missing, malformed, or lacks what was asked of it (e.g. a chat template)."""
