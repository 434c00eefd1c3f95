"""tfde.export_for_serving: a SavedModel that answers lookups only.

The exported model reads its embedding rows from *serving tables*: one
native cuckoo table per tfde Variable, filled with the Variable's rows at
export time and saved inside the SavedModel (rows="embedded"); or, with
rows="store", Variables on Redis keep reading their Redis tables live through
the native TfdeRedisFind op (tfde/tables/redis_table.py, RedisServingTable).  Missing keys
read the Variable's initial value (the trained model answers the same);
nothing is ever written by serving calls.  The SavedModel loads in a plain
TensorFlow process that has loaded tfde's op library
(``tf.load_op_library(path)``; ``tfde build`` prints the path) — tfde itself
need not be importable there.

Besides the serving signature, the SavedModel carries three functions per
Variable (`i` as in the JSON list ``tfde_variables()`` returns):
``tfde_lookup_<i>(keys)`` (rows, as the Variable's lookup), and
``tfde_upsert_<i>(keys, rows)`` / ``tfde_remove_<i>(keys)``, with which a
serving process applies incremental exports (tfde.saving.export_changes) to
the loaded tables without reloading.  Incremental exports carry embedding
rows only; dense weights change with every step and come with a full export.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import tensorflow as tf

from tfde import semi_sync
from tfde.errors import CheckpointError, ConfigError
from tfde.saving import format as fmt
from tfde.saving.manager import write_atomic
from tfde.saving.state import prefix_counter
from tfde.tables.cuckoo import SavedByValueCuckooTable
from tfde.variable import Variable, is_step_buffer, model_variables

SERVING_INFO = "tfde_serving.json"  # in the SavedModel's assets.extra/


def _input_signature(model, input_signature):
    if input_signature is not None:
        return list(input_signature) if isinstance(input_signature, (list, tuple)) else [input_signature]
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ConfigError(
            "the model has no recorded inputs (a subclassed model); pass input_signature=, e.g. "
            "[tf.TensorSpec([None], tf.int64, name='user_id')] or a dict of TensorSpecs"
        )
    specs = [
        tf.TensorSpec(tuple(i.shape), tf.as_dtype(i.dtype), name=getattr(i, "name", None) and str(i.name).split(":")[0])
        for i in inputs
    ]
    return [specs] if len(specs) > 1 else specs


def _dense_weights(model) -> list:
    # A Keras model's weights; a tf.Module's variables.
    weights = model.weights if hasattr(model, "weights") else model.variables
    return [w for w in weights if not is_step_buffer(w)]


def _lookup(var):
    @tf.function(input_signature=[tf.TensorSpec([None], var.key_dtype, name="keys")])
    def lookup(keys):
        return var.lookup(keys)

    return lookup


def _writers(table, var):
    """tf.functions saved with the model: apply an incremental export."""

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], var.key_dtype, name="keys"),
            tf.TensorSpec([None, var.dim], var.value_dtype, name="rows"),
        ]
    )
    def upsert(keys, rows):
        with tf.control_dependencies([table.insert(keys, rows)]):
            return tf.size(keys, out_type=tf.int64)

    @tf.function(input_signature=[tf.TensorSpec([None], var.key_dtype, name="keys")])
    def remove(keys):
        return table.remove(keys)

    return upsert, remove


def export_for_serving(
    model: Any, path: str, input_signature: Optional[Union[tf.TensorSpec, Sequence[Any]]] = None, rows: str = "embedded"
) -> Dict:
    """Writes a SavedModel at `path` whose ``serving_default`` signature runs
    ``model(inputs, training=False)`` with lookups only.

    Args:
      model: a Keras model (Keras 3 or tf-keras) or a callable tf.Module
        using tfde Variables.
      path: directory to write.
      input_signature: TensorSpecs of the inputs (a list, or one structure);
        default: the model's recorded inputs (functional/Sequential models).
      rows: "embedded" (copy every row into the SavedModel: for stores that
        fit in the serving process's memory) or "store" (Variables on Redis
        keep reading their Redis tables through the native TfdeRedisFind op,
        passwords from $TFDE_REDIS_PASSWORD; other Variables are embedded).

    Returns a summary: {"variables": [{"name", "rows", "dim", "source", ...}], "path"}.
    """
    if rows not in ("embedded", "store"):
        raise ConfigError(
            f"rows must be 'embedded' (rows copied into the SavedModel) or 'store' (Redis tables "
            f"read live), got {rows!r}"
        )
    variables = model_variables(model)
    if not variables:
        raise ConfigError(f"{type(model).__name__} uses no tfde Variable; export it with tf.saved_model.save")
    semi_sync.before_export("a serving export")
    signature = _input_signature(model, input_signature)
    module = tf.Module()
    sources, embedded, info = [], [], []
    with tf.init_scope():
        for i, var in enumerate(variables):
            entry = {
                "index": i,
                "name": var.name,
                "dim": var.dim,
                "key_dtype": var.key_dtype.name,
                "value_dtype": var.value_dtype.name,
            }
            views = [t.serving_view() for t in var.tables] if rows == "store" else []
            if views and all(v is not None for v in views):
                sources.append(views)
                entry["source"] = "store"
                entry["tables"] = [t.name for t in var.tables]
            else:
                table = SavedByValueCuckooTable(f"serving/{var.name}", var.key_dtype, var.value_dtype, var.dim)
                count = 0
                for keys, values in var.export():
                    table.insert(keys, values)
                    count += int(tf.size(keys))
                sources.append([table])
                embedded.append(table)
                entry.update(source="embedded", rows=count)
            info.append(entry)
    module.tables = embedded
    module.dense = _dense_weights(model)

    with contextlib.ExitStack() as stack:
        for var, tables in zip(variables, sources):
            stack.enter_context(var.serving_from(tables))

        if len(signature) == 1:
            serve = tf.function(lambda x: model(x, training=False), input_signature=signature)
        else:
            serve = tf.function(lambda *xs: model(list(xs), training=False), input_signature=signature)
        concrete = serve.get_concrete_function()
        # Plain lookups too (e.g. a retrieval service reading item vectors).
        for i, var in enumerate(variables):
            setattr(module, f"tfde_lookup_{i}", _lookup(var).get_concrete_function())
    # The concrete function (traced while the Variables read the serving
    # tables), not `serve` itself, which a save could trace again.
    module.serve = concrete
    for i, (var, tables) in enumerate(zip(variables, sources)):
        if isinstance(tables[0], SavedByValueCuckooTable):  # store-backed Variables change in their store
            upsert, remove = _writers(tables[0], var)
            setattr(module, f"tfde_upsert_{i}", upsert)
            setattr(module, f"tfde_remove_{i}", remove)
    text = json.dumps(info)
    module.tfde_variables = tf.function(lambda: tf.constant(text), input_signature=[])
    tf.saved_model.save(module, path, signatures={"serving_default": concrete})
    extra = os.path.join(path, "assets.extra")
    os.makedirs(extra, exist_ok=True)
    with open(os.path.join(extra, SERVING_INFO), "w") as f:
        json.dump({"format": 1, "variables": info}, f, indent=1)
    return {"path": path, "variables": info}


# ---------------------------------------------------------------- incremental


def _variables_of(model_or_variables) -> list:
    if isinstance(model_or_variables, Variable):
        return [model_or_variables]
    if isinstance(model_or_variables, (list, tuple)):
        return list(model_or_variables)
    return model_variables(model_or_variables)


def export_changes(model_or_variables: Any, since: int, path: str) -> Dict:
    """Writes the rows written after step `since` and the keys removed since
    then, for every Variable of a model (created with track_changes=True),
    as a TF bundle at prefix `path` plus `path`.json (a summary).

    Apply it to a serving copy with apply_changes; the Variables keep their
    order (export_for_serving's `tfde_variables` order).  Layout: streams
    ``rows`` ([n, dim] rows) and ``evicted`` ([n, 1] removal labels) under
    ``_tfde/changes/<i>`` (tfde/saving/format.py)."""
    variables = _variables_of(model_or_variables)
    untracked = [v.name for v in variables if v.changes is None]
    if untracked:
        raise ConfigError(
            f"Variables {untracked} do not track changes; create them (or their layers) with "
            "track_changes=True to export increments"
        )
    semi_sync.before_export("an export of changes")
    next_prefix = prefix_counter(f"{path}_temp/part")
    prefixes, summary, until = [], [], int(since)
    for i, var in enumerate(variables):
        writer = fmt.BundleWriter(f"_tfde/changes/{i}", next_prefix)
        meta = fmt.VariableMeta(
            var.name,
            var.key_dtype.name,
            {
                "rows": fmt.StreamMeta(var.dim, var.value_dtype.name, None),
                "evicted": fmt.StreamMeta(1, "float64", None),
            },
        )
        parts = [
            ("rows", var.changes.changed(since)),
            ("evicted", ((k, tf.zeros([tf.size(k), 1], tf.float64)) for k in var.changes.removed(since))),
        ]
        for stream, chunks in parts:
            fmt.write_stream(writer, stream, meta.streams[stream], chunks)
        writer.finish(meta)
        prefixes.extend(writer.prefixes)
        until = max(until, int(var.changes.clock.numpy()))
        summary.append(
            {
                "index": i,
                "name": var.name,
                "changed": meta.streams["rows"].rows,
                "removed": meta.streams["evicted"].rows,
            }
        )
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=tf.stack(prefixes), destination_prefix=path, delete_old_dirs=True)
    info = {"format": fmt.FORMAT_VERSION, "since": int(since), "until": until, "variables": summary}
    write_atomic(f"{path}.json", json.dumps(info, indent=1))
    return info


def read_changes(path: str) -> Iterator[Tuple[int, str, Iterator, Iterator]]:
    """Yields (variable index, name, upserts, removals) from export_changes'
    files: upserts iterates (keys, rows), removals iterates keys."""
    if not os.path.exists(f"{path}.json"):
        raise CheckpointError(f"{path}.json is missing: not a complete incremental export")
    with open(f"{path}.json") as f:
        info = json.load(f)
    for entry in info["variables"]:
        reader = fmt.BundleReader(path, f"_tfde/changes/{entry['index']}", where=path)
        meta = reader.meta()
        if meta is None:
            raise CheckpointError(f"{path}: no changes for Variable {entry['name']!r}; the file is incomplete")
        key_dtype = tf.as_dtype(meta.key_dtype)
        rows_dtype = tf.as_dtype(meta.streams["rows"].value_dtype)
        yield (
            entry["index"],
            entry["name"],
            fmt.read_stream(reader, "rows", meta, key_dtype, rows_dtype),
            (k for k, _ in fmt.read_stream(reader, "evicted", meta, key_dtype, tf.float64)),
        )


def apply_changes(serving: Any, path: str) -> Dict[str, int]:
    """Applies an incremental export to a loaded serving SavedModel
    (tf.saved_model.load of export_for_serving's output); returns rows
    written and keys removed per Variable name."""
    entries = json.loads(serving.tfde_variables().numpy().decode())
    names = [v["name"] for v in entries]
    done = {}
    for index, name, upserts, removals in read_changes(path):
        if index >= len(names) or names[index] != name:
            raise CheckpointError(
                f"{path} holds changes of Variable {name!r} at position {index}, but the serving "
                f"model's Variables are {names}; export changes from the model it serves"
            )
        if entries[index].get("source") == "store":  # read live from its store: nothing to apply
            done[name] = 0
            continue
        written = removed = 0
        for keys, rows in upserts:
            written += int(getattr(serving, f"tfde_upsert_{index}")(keys, rows))
        for keys in removals:
            removed += int(getattr(serving, f"tfde_remove_{index}")(keys))
        done[name] = written + removed
    return done
