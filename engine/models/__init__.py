from .spec import SUPPORTED_MODEL_TYPES, ModelSpec, UnsupportedModelError

__all__ = ["ModelSpec", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError"]
