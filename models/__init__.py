"""Llama-family models in functional JAX: configs, weight pytrees, forward, loaders, tokenizers."""

from models.config import ModelConfig, RopeScaling
from models.errors import (
    CorruptFileError,
    InvalidLoadOptionError,
    InvalidPromptError,
    InvalidPromptTypeError,
    MissingWeightError,
    ModelConfigError,
    ModelError,
    ModelFileNotFoundError,
    ModelLoadError,
    TokenizerError,
    TokenizerLoadError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    WeightShapeError,
)
from models.loader import Model, load_model, preset_model
from models.presets import PRESETS, WEIGHT_FORMATS, parameter_count, preset_config, random_weights, weight_bytes
from models.weights import LayerWeights, Weights, init_random_weights

__all__ = [
    "PRESETS", "WEIGHT_FORMATS", "CorruptFileError", "InvalidLoadOptionError", "InvalidPromptError",
    "InvalidPromptTypeError", "LayerWeights", "MissingWeightError", "Model", "ModelConfig", "ModelConfigError",
    "ModelError", "ModelFileNotFoundError", "ModelLoadError", "RopeScaling", "TokenizerError", "TokenizerLoadError",
    "UnsupportedArchitectureError", "UnsupportedTensorTypeError", "WeightShapeError", "Weights",
    "init_random_weights", "load_model", "parameter_count", "preset_config", "preset_model", "random_weights",
    "weight_bytes",
]
