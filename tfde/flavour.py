"""Which Keras this process runs: Keras 3 (TensorFlow's default since 2.16)
or tf-keras, Keras 2 (TF_USE_LEGACY_KERAS=1, which TensorFlow Recommenders
needs), as `tf.keras` resolves it; and how to run the other one.  The layers,
the optimizer wrapper, saving and loading all ask here."""

from __future__ import annotations

import tensorflow as tf


def running_keras_major() -> int:
    """3 under Keras 3, 2 under tf-keras (TF_USE_LEGACY_KERAS=1)."""
    keras = tf.keras
    version = str(keras.version()) if hasattr(keras, "version") else getattr(keras, "__version__", "2")
    return int(version.split(".")[0])


IS_KERAS3 = running_keras_major() >= 3


def flavour_fix(saved_major: int) -> str:
    """How to run a program under the Keras of major version `saved_major`."""
    if saved_major >= 3:
        return (
            "load it under Keras 3: run without TF_USE_LEGACY_KERAS=1 (unset it before importing tensorflow and tfde)"
        )
    return (
        "load it under tf-keras: set TF_USE_LEGACY_KERAS=1 before importing tensorflow and tfde (pip install tf-keras)"
    )


def keras_flavour_name(major: int) -> str:
    return "Keras 3" if major >= 3 else "tf-keras (Keras 2)"
