"""Translation of TFRA's arguments into tfde's, shared by the modules of
tfde.compat.tfra.  Each function takes TFRA's spelling and returns tfde's,
or raises tfde.ConfigError naming the argument, what tfde does instead and
the fix (docs/migrating-from-tfra.md lists every one)."""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf

from tfde.errors import ConfigError
from tfde.tables.base import TableCreator, int_arg
from tfde.tables.cuckoo import CuckooTableCreator

GUIDE = "docs/migrating-from-tfra.md"


def refuse_unknown(where: str, kwargs: dict, accepted) -> None:
    """ConfigError naming every keyword of `kwargs`: `where` takes none of
    them (TFRA options tfde has no counterpart for, or typos)."""
    if kwargs:
        raise ConfigError(
            f"{where} got keyword argument(s) {sorted(kwargs)} that tfde does not take; accepted: "
            f"{', '.join(accepted)} (see {GUIDE})"
        )


def require(where: str, name: str, value, wanted, why: str) -> None:
    """ConfigError unless `value` is `wanted` (a TFRA option whose other
    values ask for something tfde does not do)."""
    if value is not wanted and value != wanted:
        raise ConfigError(f"{where}: {name}={value!r} is not supported: {why}. Drop {name}= (see {GUIDE})")


def check_devices(where: str, devices) -> None:
    """TFRA's `devices` (None, a device string or a list of them): every
    one must be a CPU, where tfde's tables live; placing nothing is a no-op."""
    if devices is None:
        return
    listed = [devices] if isinstance(devices, str) else devices
    if not isinstance(listed, (list, tuple)) or not listed:
        raise ConfigError(
            f"{where}: devices must be a device string or a non-empty list of them, e.g. ['CPU'], got {devices!r}"
        )
    for device in listed:
        try:
            kind = tf.DeviceSpec.from_string(device).device_type if isinstance(device, str) else "?"
        except ValueError:
            kind = "?"
        if kind == "?":
            raise ConfigError(
                f"{where}: devices entry {device!r} is not a device string; expected e.g. 'CPU' or '/CPU:0'"
            )
        if kind is not None and kind.upper() != "CPU":
            raise ConfigError(
                f"{where}: devices={devices!r} asks for a {kind.upper()} table, but tfde's tables live "
                "in this process on the CPU; pass devices=['CPU'] or drop devices= (see "
                f"{GUIDE})"
            )


def check_strategy(where: str, strategy) -> None:
    """TFRA's `distribute_strategy`: tfde uses the strategy in scope when a
    layer is made, so a given one must be that strategy."""
    if strategy is None:
        return
    current = tf.distribute.get_strategy()
    if strategy is not current:
        in_scope = (
            f"the strategy in scope is {type(current).__name__}"
            if tf.distribute.has_strategy()
            else "no strategy is in scope"
        )
        raise ConfigError(
            f"{where}: distribute_strategy={type(strategy).__name__} is not the strategy in scope "
            f"({in_scope}); tfde uses the strategy in scope when the layer is made: build the layer "
            "inside `with strategy.scope():` (then distribute_strategy= may be dropped)"
        )


def init_capacity(where: str, value) -> int:
    rows = int_arg(value)
    if rows is None or rows < 0:
        raise ConfigError(f"{where}: init_capacity must be an int >= 0 (rows to presize), got {value!r}")
    return rows


def table_creator(where: str, kv_creator, capacity: int) -> TableCreator:
    """The tfde TableCreator for TFRA's `kv_creator` (None: the cuckoo
    table) and `init_capacity`: a cuckoo table is presized for that many
    rows (CuckooTableCreator(expected_rows=)); other stores take no size."""
    if kv_creator is None:
        return CuckooTableCreator(expected_rows=capacity)
    if not isinstance(kv_creator, TableCreator):
        raise ConfigError(
            f"{where}: kv_creator must be de.CuckooHashTableCreator(...), de.RedisTableCreator(...) or "
            f"a tfde TableCreator, got {type(kv_creator).__name__}"
        )
    if isinstance(kv_creator, CuckooTableCreator) and capacity:
        if kv_creator.expected_rows not in (0, capacity):
            raise ConfigError(
                f"{where}: init_capacity={capacity} and the kv_creator's expected_rows="
                f"{kv_creator.expected_rows} disagree; give the size once"
            )
        return dataclasses.replace(kv_creator, expected_rows=capacity)
    return kv_creator


def variable_kwargs(
    where: str,
    *,
    devices,
    partitioner,
    initializer,
    trainable,
    checkpoint,
    init_size,
    kv_creator,
    restrict_policy,
    bp_v2,
) -> dict:
    """tfde.Variable keyword arguments for the table options TFRA's Variable,
    get_variable and Embedding layers share."""
    check_devices(where, devices)
    require(
        where,
        "partitioner",
        partitioner,
        None,
        "tfde routes keys to its tables by its stable hash (docs/formats.md, 'The stable key hash'); "
        "num_shards= sets how many",
    )
    require(where, "checkpoint", checkpoint, True, "tfde always saves a table with the model or Variable")
    require(
        where,
        "bp_v2",
        bp_v2,
        False,
        "tfde's training steps are synchronous and write each key once per step, so there is no race between "
        "workers to add deltas for",
    )
    return {
        "initializer": initializer,
        "trainable": trainable,
        "restrict_policy": restrict_policy,
        "table_creator": table_creator(where, kv_creator, init_capacity(where, init_size)),
    }


def fspath(where: str, name: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{where}: {name} must be a path (str), got {type(value).__name__}")
    return os.fspath(value)
