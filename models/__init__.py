"""Llama-family models in functional JAX: configs, weight pytrees, forward, loaders, tokenizers."""

from models.config import ModelConfig, RopeScaling
from models.errors import (
    MissingWeightError,
    ModelError,
    ModelFileNotFoundError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    WeightShapeError,
)
from models.loader import Model, load_model
from models.weights import LayerWeights, Weights, init_random_weights

__all__ = [
    "LayerWeights", "MissingWeightError", "Model", "ModelConfig", "ModelError", "ModelFileNotFoundError",
    "RopeScaling", "TokenizerError", "UnsupportedArchitectureError", "UnsupportedTensorTypeError",
    "WeightShapeError", "Weights", "init_random_weights", "load_model",
]
