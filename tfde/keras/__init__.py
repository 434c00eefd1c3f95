"""Keras integration: layers over tfde Variables (Keras 3 or tf-keras)."""

from tfde.keras import callbacks, layers

__all__ = ["callbacks", "layers"]
