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

import json
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.checkpoint import graph_view
from tensorflow.python.saved_model.registration import registration
from tensorflow.python.trackable import python_state, trackable_utils

from tfde import semi_sync
from tfde.errors import CheckpointError
from tfde.optimizer_rules import rule_for
from tfde.saving import format as fmt
from tfde.saving import state
from tfde.variable import Variable

SAVER_NAME = "tfde.Variable"  # package "tfde", name "Variable": recorded in every checkpoint

# Set by CheckpointManager.restore: for the bundle it reads, every writer's
# bundle, so that each Variable reads all shards of a distributed checkpoint.
# Kept after restore() returns: Variables built later are restored then
# (TensorFlow's deferred restoration) and need the same sources.
_sources: Dict[str, List[Tuple[str, str]]] = {}
# Restores refused by an OptimizerSlots record, by TensorFlow's restore id
# (Trackable._update_uid: the restore that last reached an object).
# TensorFlow keeps a refused restore's pending (deferred) restorations of
# objects not built yet; a tfde Variable built later skips them (it stays
# as it is, as the refusal said).
_refused: Dict[int, CheckpointError] = {}


def restore_sources(prefix: str, sources: Sequence[Tuple[str, str]]) -> None:
    _sources[prefix] = list(sources)


def check_before_read(checkpoint, prefix: str) -> None:
    """Raises CheckpointError when a tfde Variable that `checkpoint` reaches
    (built already) has other keys, dim or dtype than the checkpoint at
    `prefix` saved for it, before TensorFlow restores anything.  Variables
    are found where the checkpoint's object graph puts them, as its saver
    names them; one the checkpoint does not hold there is left to the
    restore itself."""
    sources = _sources.get(prefix) or [(prefix, prefix)]
    _, paths = graph_view.ObjectGraphView(checkpoint).breadth_first_traversal()
    for obj, path in paths.items():
        if isinstance(obj, Variable):
            base = fmt.base_name(trackable_utils.object_path_to_string(path))
            state.check_compatible(obj, [fmt.BundleReader(p, base, where) for p, where in sources])


def _eager_path(tensor, what: str) -> str:
    if not tf.executing_eagerly():
        raise CheckpointError(
            f"tfde Variables are {what} eagerly (their tables stream to disk chunk by chunk), but this was called "
            "inside a tf.function or a SavedModel export; save with tf.train.Checkpoint / model.save / "
            "save_weights from eager code, and export for serving with tfde.export_for_serving"
        )
    return tensor.numpy().decode() if hasattr(tensor, "numpy") else str(tensor)


def _save(trackables, file_prefix):
    prefix = _eager_path(file_prefix, "saved")
    semi_sync.before_export("a checkpoint save")
    # file_prefix is "<checkpoint prefix>-tfde.Variable"; the chunk bundles go
    # to TensorFlow's temporary directory of this checkpoint, which the merge
    # empties and removes (and which a crash leaves behind harmlessly).
    root = prefix[: -len("-" + SAVER_NAME)] if prefix.endswith("-" + SAVER_NAME) else prefix
    next_prefix = state.prefix_counter(f"{root}_temp/tfde")
    prefixes = []
    for object_name, var in sorted(trackables.items()):
        writer = fmt.BundleWriter(fmt.base_name(object_name), next_prefix)
        state.save_variable(var, writer)
        prefixes.extend(writer.prefixes)
    return prefixes


def _restore(trackables, merged_prefix):
    trackables = {name: var for name, var in trackables.items() if getattr(var, "_update_uid", None) not in _refused}
    prefix = _eager_path(merged_prefix, "restored")
    sources = _sources.get(prefix) or [(prefix, prefix)]

    def readers(object_name):
        return [fmt.BundleReader(p, fmt.base_name(object_name), where) for p, where in sources]

    for object_name, var in sorted(trackables.items()):  # a mismatch in any of them: no table changes
        state.check_compatible(var, readers(object_name))
    for object_name, var in sorted(trackables.items()):
        state.restore_variable(var, readers(object_name))


OPTIMIZER_SLOTS = "tfde_slots"  # the checkpoint name of an optimizer's OptimizerSlots


class OptimizerSlots(python_state.PythonState):
    """Which slots a tfde-wrapped optimizer keeps for the rows of tfde
    Variables (Adam: m, v; SGD with momentum: momentum), saved with the
    optimizer in TF checkpoints (tf.train.Checkpoint, tfde.CheckpointManager).

    A restore of a checkpoint written by an optimizer that kept other slots
    is refused: the rows' state would be another optimizer's (Adam's m read
    as momentum), and so would its hyperparameters.  tfde.CheckpointManager
    checks before it restores anything (check_optimizers).  Through
    tf.train.Checkpoint, TensorFlow restores Python state before any tensor
    and any tfde Variable of the same restore, so the refusal comes before
    those change; tfde Variables built later skip the refused restore (but
    TensorFlow may still restore its own variables built later: Keras layers
    of a model not built yet).  Checkpoints written before tfde recorded the
    slots have no record and are not checked."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)  # the optimizer owns this record

    def _slots(self) -> Tuple[str, List[str]]:
        opt = self._optimizer()
        rule = rule_for(opt)
        return type(opt).__name__, sorted(name for name, _ in rule.slots(opt))

    def serialize(self) -> bytes:
        optimizer, slots = self._slots()
        return json.dumps({"format": 1, "optimizer": optimizer, "slots": slots}).encode()

    def mismatch(self, saved_value, where: str) -> Optional[CheckpointError]:
        """The error refusing a checkpoint whose record is `saved_value`, or
        None when its slots are this optimizer's."""
        raw = saved_value.numpy() if hasattr(saved_value, "numpy") else saved_value
        try:
            saved = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            saved_optimizer, saved_slots = str(saved["optimizer"]), sorted(map(str, saved["slots"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return CheckpointError(
                f"{where}: the record of the optimizer's tfde slots is unreadable ({e}); the file is corrupted"
            )
        optimizer, slots = self._slots()
        if saved_slots == slots:
            return None

        def names(s):
            return ", ".join(s) if s else "none"

        return CheckpointError(
            f"{where}: the checkpoint's optimizer ({saved_optimizer}) keeps the slots [{names(saved_slots)}] for "
            f"tfde rows, but the optimizer restoring it ({optimizer}) keeps [{names(slots)}]: its state would be "
            "the wrong optimizer's. Restore into a model compiled with the optimizer the checkpoint was written "
            f"with ({saved_optimizer} with the same options). Nothing was restored"
        )

    def deserialize(self, string_value) -> None:
        error = self.mismatch(string_value, "the checkpoint")
        if error is not None:
            uid = getattr(self, "_update_uid", None)  # TensorFlow's id of this restore
            if uid is not None:
                _refused[uid] = error
            raise error


def check_optimizers(root, prefix: str, where: str) -> None:
    """Raises the CheckpointError of the first tfde-wrapped optimizer under
    `root` (a tf.train.Checkpoint) whose slots differ from those recorded
    with it in the checkpoint at `prefix`, before anything is restored.
    Objects are matched to the checkpoint's by their path of names, as
    TensorFlow matches them."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    reader = tf.train.load_checkpoint(prefix)
    if not reader.has_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"):
        return
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    queue, seen = [(0, root)], set()
    while queue:
        node_id, obj = queue.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        node = graph.nodes[node_id]
        if isinstance(obj, OptimizerSlots):
            keys = [a.checkpoint_key for a in node.attributes if a.name == python_state.PYTHON_STATE]
            error = obj.mismatch(reader.get_tensor(keys[0]), where) if keys else None
            if error is not None:
                raise error
            continue
        if not node.children:
            continue
        try:
            children = obj._trackable_children()
        except Exception:  # noqa: BLE001 - an object that cannot list them now: TensorFlow's restore will
            continue
        for ref in node.children:
            child = children.get(ref.local_name)
            if child is not None:
                queue.append((ref.node_id, child))


def optimizer_slots(optimizer) -> OptimizerSlots:
    """The OptimizerSlots record of `optimizer` (made once, kept on it)."""
    record = optimizer.__dict__.get("_tfde_slots_record")
    if record is None:
        record = OptimizerSlots(optimizer)
        object.__setattr__(optimizer, "_tfde_slots_record", record)  # not a Keras-tracked attribute
    return record


def _is_variable(obj) -> bool:
    return isinstance(obj, Variable)


def register() -> None:
    """Registers the saver (once; tfde's import does it)."""
    try:
        registration.register_checkpoint_saver(
            package="tfde", name="Variable", predicate=_is_variable, save_fn=_save, restore_fn=_restore
        )
    except ValueError:  # already registered (module reloaded)
        pass
