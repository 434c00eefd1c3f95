"""tf.train.Checkpoint support: tfde Variables are saved by a registered
checkpoint saver (tf.saved_model.experimental's register_checkpoint_saver)
that streams every table in bounded chunks (tfde/saving/format.py) into the
checkpoint TensorFlow writes, and restores them, slots included, even into a
Variable whose optimizer has not created its slots yet.

So `tf.train.Checkpoint(model=model, optimizer=opt).save(...)`,
tf.train.CheckpointManager, tf-keras `save_weights` (TF format) and Keras
callbacks built on them save rows, optimizer slots and policy state with the
dense weights, atomically as TensorFlow writes checkpoints (a temporary
directory merged at the end; the `checkpoint` state file last).

Saving and restoring run eagerly (they export tables chunk by chunk).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.saved_model.registration import registration

from tfde.errors import CheckpointError
from tfde.saving import format as fmt
from tfde.saving import state

SAVER_NAME = "tfde.Variable"  # package "tfde", name "Variable": recorded in every checkpoint

# Set by CheckpointManager.restore: for the bundle it reads, every writer's
# bundle, so that each Variable reads all shards of a distributed checkpoint.
# Kept after restore() returns: Variables built later are restored then
# (TensorFlow's deferred restoration) and need the same sources.
_sources: Dict[str, List[Tuple[str, str]]] = {}


def restore_sources(prefix: str, sources: Sequence[Tuple[str, str]]) -> None:
    _sources[prefix] = list(sources)


def _eager_path(tensor, what: str) -> str:
    if not tf.executing_eagerly():
        raise CheckpointError(
            f"tfde Variables are {what} eagerly (their tables stream to disk chunk by chunk), but this {what} "
            "runs inside a tf.function or a SavedModel export; save with tf.train.Checkpoint / model.save / "
            "save_weights from eager code, and export for serving with tfde.export_for_serving")
    return tensor.numpy().decode() if hasattr(tensor, "numpy") else str(tensor)


def _save(trackables, file_prefix):
    prefix = _eager_path(file_prefix, "saved")
    # file_prefix is "<checkpoint prefix>-tfde.Variable"; the chunk bundles go
    # to TensorFlow's temporary directory of this checkpoint, which the merge
    # empties and removes (and which a crash leaves behind harmlessly).
    root = prefix[:-len("-" + SAVER_NAME)] if prefix.endswith("-" + SAVER_NAME) else prefix
    next_prefix = state.prefix_counter(f"{root}_temp/tfde")
    prefixes = []
    for object_name, var in sorted(trackables.items()):
        writer = fmt.BundleWriter(fmt.base_name(object_name), next_prefix)
        state.save_variable(var, writer)
        prefixes.extend(writer.prefixes)
    return prefixes


def _restore(trackables, merged_prefix):
    prefix = _eager_path(merged_prefix, "restored")
    sources = _sources.get(prefix) or [(prefix, prefix)]
    for object_name, var in sorted(trackables.items()):
        base = fmt.base_name(object_name)
        state.restore_variable(var, [fmt.BundleReader(p, base, where) for p, where in sources])


def _is_variable(obj) -> bool:
    from tfde.variable import Variable

    return isinstance(obj, Variable)


def register() -> None:
    """Registers the saver (once; tfde's import does it)."""
    try:
        registration.register_checkpoint_saver(package="tfde", name="Variable", predicate=_is_variable,
                                               save_fn=_save, restore_fn=_restore)
    except ValueError:  # already registered (module reloaded)
        pass
