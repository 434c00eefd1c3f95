"""TFRA's dynamic_embedding.keras.callbacks, mapped onto Horovod's and
tfde's callbacks."""

from __future__ import annotations

import os

import tfde
from tfde.compat.tfra import _args
from tfde.distributed import horovod
from tfde.errors import ConfigError


def DEHvdBroadcastGlobalVariablesCallback(root_rank=0, device="", local_variables=None):
    """Horovod's keras BroadcastGlobalVariablesCallback(root_rank, device,
    local_variables): dense weights and optimizer variables start equal on
    every worker.  tfde's tables need no broadcast: each key's initial row is
    a function of the key and the seed, the same on every worker."""
    horovod.import_horovod()  # Horovod missing: the ImportError names the install command
    import horovod.tensorflow.keras as hvd_keras

    return hvd_keras.callbacks.BroadcastGlobalVariablesCallback(
        root_rank, device=device, local_variables=local_variables
    )


def DEHvdModelCheckpoint(
    filepath,
    monitor="val_loss",
    verbose=0,
    save_best_only=False,
    save_weights_only=False,
    mode="auto",
    save_freq="epoch",
    options=None,
    initial_value_threshold=None,
    **kwargs,
):
    """tfde.keras.callbacks.ModelCheckpoint(os.path.dirname(filepath),
    save_freq=save_freq, max_to_keep=None): every worker writes its part of
    each checkpoint (rows, optimizer slots, policy state, dense weights and
    the optimizer) atomically, as ``ckpt-<step>`` in that directory, and every
    step's checkpoint is kept, as Keras's callback keeps every file.  A step
    saved again in the same directory (a rerun, or another program writing
    there) replaces that step's older checkpoint (docs/saving.md, "Atomic
    saves").

    The file-name part of `filepath` (``weights_epoch{epoch:03d}...``) is not
    used: restore with tfde.CheckpointManager(directory, model=...,
    optimizer=...).restore() or ModelCheckpoint(directory, restore=True).
    save_weights_only, options (SaveOptions: tfde's checkpoints are not
    SavedModels) and the monitor arguments (monitor, verbose, mode,
    initial_value_threshold, which only matter with save_best_only) are
    accepted and unused; save_best_only=True and signatures are refused.
    """
    where = "de.keras.callbacks.DEHvdModelCheckpoint"
    signatures = kwargs.pop("signatures", None)
    _args.refuse_unknown(
        where,
        kwargs,
        [
            "filepath",
            "monitor",
            "verbose",
            "save_best_only=False",
            "save_weights_only",
            "mode",
            "save_freq",
            "options",
            "initial_value_threshold",
            "signatures=None",
        ],
    )
    _args.require(
        where,
        "save_best_only",
        save_best_only,
        False,
        "tfde saves every save_freq, it does not compare a monitored value",
    )
    _args.require(
        where,
        "signatures",
        signatures,
        None,
        "tfde's checkpoints are not SavedModels; export a model for serving with tfde.export_for_serving",
    )
    directory = os.path.dirname(_args.fspath(where, "filepath", filepath)) or os.curdir
    if "{" in directory:
        raise ConfigError(
            f"{where}: the directory of filepath={filepath!r} is a template ({directory!r}); tfde writes every "
            "checkpoint of a run to one directory (as ckpt-<step>): give a plain directory, e.g. "
            "'model_dir/weights'"
        )
    return tfde.keras.callbacks.ModelCheckpoint(directory, save_freq=save_freq, max_to_keep=None)


# TFRA's `callbacks.ModelCheckpoint` is its DEHvdModelCheckpoint.
ModelCheckpoint = DEHvdModelCheckpoint
