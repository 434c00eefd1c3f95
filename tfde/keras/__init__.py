"""Keras integration: layers over tfde Variables (Keras 3 or tf-keras)."""

from tfde.keras import layers

__all__ = ["layers"]
