"""Loading Keras model files that hold tfde layers.

``keras.models.load_model`` finds tfde's layers and optimizers only once
tfde is imported (importing registers them with Keras), and Keras never
imports a module named in a file itself (Keras 3 imports only its own
packages): so a program that loads a model must ``import tfde`` first.
Without it Keras 3 reports "Could not locate class 'Embedding'" inside a
"could not be deserialized properly" error whose config shows
``'module': 'tfde.keras.layers'``, and tf-keras takes the layer for its
own Embedding and fails with ``KeyError: 'input_dim'``; tfde cannot run
code before it is imported to say more (docs/saving.md, "Loading Keras files").

A ``.keras`` file records the Keras that wrote it (metadata.json,
"keras_version"): Keras 3 and tf-keras (2.x) cannot read each other's model
configs (a Keras 3 InputLayer has "batch_shape", a tf-keras optimizer
"is_legacy_optimizer", ...).  tfde.keras.load_model checks that first and
names the Keras to load it with.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Optional

import tensorflow as tf

from tfde.errors import CheckpointError
from tfde.flavour import flavour_fix, keras_flavour_name, running_keras_major


def saved_keras_version(filepath) -> Optional[str]:
    """The "keras_version" a ``.keras`` file was written by, or None when
    the path is not such a file (a SavedModel directory, an .h5 file)."""
    path = os.fspath(filepath)
    if not (os.path.isfile(path) and zipfile.is_zipfile(path)):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            meta = json.loads(archive.read("metadata.json"))
    except (KeyError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"{path} is not a Keras model file (no readable metadata.json: {e}); save it "
            "with model.save(path) to a path ending in .keras"
        ) from None
    version = meta.get("keras_version")
    return str(version) if version is not None else None


def check_saved_by_this_keras(filepath) -> None:
    """Raises CheckpointError when the ``.keras`` file `filepath` was
    written by the other Keras (Keras 3 vs tf-keras) than this process
    runs, naming both and how to load it."""
    version = saved_keras_version(filepath)
    if version is None:
        return
    try:
        saved = int(version.split(".")[0])
    except ValueError:
        return
    running = running_keras_major()
    if (saved >= 3) != (running >= 3):
        raise CheckpointError(
            f"{os.fspath(filepath)} was saved by {keras_flavour_name(saved)} (keras_version {version}), but this "
            f"process runs {keras_flavour_name(running)}, which cannot read its model config; {flavour_fix(saved)}"
        )


def load_model(filepath, custom_objects=None, compile: bool = True, **kwargs):
    """``tf.keras.models.load_model`` for models with tfde layers, after
    checking that a ``.keras`` file was written by the Keras this process
    runs (CheckpointError naming the Keras that wrote it otherwise).  tfde's
    layers and optimizers are registered already (tfde is imported).

    Example:
      >>> model = tfde.keras.load_model("model.keras")  # doctest: +SKIP
    """
    check_saved_by_this_keras(filepath)
    return tf.keras.models.load_model(filepath, custom_objects=custom_objects, compile=compile, **kwargs)
