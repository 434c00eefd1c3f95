"""The Redis backend's configuration: TFRA's ``redis.config`` JSON, unchanged.

Every field keeps TFRA's name; units are in the table below (and docs/redis.md, 'The JSON config').
Unknown fields warn; a wrong type or value raises ConfigError naming the
field and the expected form.  Passwords never appear in repr() or errors.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import warnings
from typing import Tuple, Union

from tfde._defaults import REDIS_RETRY_DEADLINE_MS
from tfde.errors import ConfigError

ENV_VAR = "TFDE_REDIS_CONFIG"  # names a config file when no path or dict is given
# Timeouts in milliseconds; each must be 1..MAX_TIMEOUT_MS (the native client
# passes them to poll() and SO_RCVTIMEO as a C int).
TIMEOUT_FIELDS = (
    "redis_connect_timeout",
    "redis_socket_timeout",
    "redis_sentinel_connect_timeout",
    "redis_sentinel_socket_timeout",
)
MAX_TIMEOUT_MS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class RedisTableConfig:
    """Connection and layout of Redis-backed tables (all fields as in TFRA).

    redis_connection_mode: 0 cluster, 1 sentinel, 2 standalone.
    redis_master_name: sentinel master name (mode 1).
    redis_host_ip / redis_host_port: servers (lists of equal length; a port
      may be given as one int).
    redis_user / redis_password / redis_db: auth and database number.
    redis_read_access_slave: read from replicas (mode 0/1).
    redis_connect_keep_alive: TCP keep-alive.
    redis_connect_timeout / redis_socket_timeout: milliseconds, 1 to
      MAX_TIMEOUT_MS.  0 is refused, not read as "no timeout": redis-py and
      tfde's native client would each give it another meaning (a blocking
      call that never returns, or a timeout on every call), and a lost server
      must surface as an error, so tfde has no unbounded wait.
    redis_conn_pool_size: connections per server (>= 1).
    redis_wait_timeout: milliseconds to wait for a pooled connection (>= 0).
    redis_connection_lifetime: minutes a connection may live (TFRA's unit, >= 0).
    redis_sentinel_user / _password / _connect_timeout / _socket_timeout:
      the same for sentinels (timeouts in milliseconds, 1 to MAX_TIMEOUT_MS).
    storage_slice: buckets (Redis hashes) per table; storage_slice_import
      the bucket count of the tables named by model_tag_import.
    using_hash_storage_slice: TFRA's bucket choice flag; tfde always routes
      by its stable hash (docs/formats.md, 'The stable key hash'), so this is accepted and ignored.
    keys_sending_size: keys per pipelined command chunk.
    using_md5_prefix_name: prefix hash names with an md5 of the model tag.
    redis_hash_tags_hypodispersion: TFRA flag, accepted and ignored.
    model_tag_import / redis_hash_tags_import: tables to import from on open.
    model_tag_runtime / redis_hash_tags_runtime: this run's prefix and one
      hash tag per bucket ("{1}", ...), so a bucket lands on a chosen slot.
    expire_model_tag_in_seconds: TTL set on a table's hashes on close.
    table_store_mode: 0 rows in TF checkpoints, 1 files in model_lib_abs_dir,
      2 Redis is the source of truth.
    model_lib_abs_dir: directory for table_store_mode 1.
    recreate_if_missing (tfde's own, default false): what to do when a
      server no longer holds a table that was opened (its meta key
      ``{prefix}:{name}:meta`` is gone: the server restarted without
      persistence, or was flushed).  false: raise BackendError naming the
      server and the table, since its rows are lost; true: write the meta key
      again (with a warning) and carry on, every key reading its initial row.
    redis_retry_deadline_ms (tfde's own, default 60000): how long a call that
      keeps failing transiently (a lost connection, a timeout, a "not now"
      reply such as LOADING or MASTERDOWN) is retried, in milliseconds of
      backoff waited in all (50 ms doubling, at most 1 s between attempts;
      each attempt's own connect and socket timeouts come on top).  Every
      retry finds the master (sentinels) or the slot map (cluster) again, so
      the default rides out a failover under Sentinel's and Cluster's default
      timeouts.  0: one attempt, no retries.
    redis_write_replicas (tfde's own, default 0): each write of the native
      ops (a training step's rows and slots, accum, remove, clear) ends on
      every master with ``WAIT redis_write_replicas
      redis_write_replicas_timeout_ms``, so a step counts as written only
      once that many replicas hold it; fewer acknowledgements are retried
      (the writes are safe to resend) within redis_retry_deadline_ms, then
      raise BackendUnavailableError saying how many replicas answered.  0:
      no WAIT (Redis's asynchronous replication: a failover may lose the
      last writes).
    redis_write_replicas_timeout_ms (tfde's own, default 1000): how long
      each WAIT waits, 1 to MAX_TIMEOUT_MS.
    """

    redis_connection_mode: int = 2
    redis_master_name: str = "master"
    redis_host_ip: Tuple[str, ...] = ("127.0.0.1",)
    redis_host_port: Tuple[int, ...] = (6379,)
    redis_user: str = "default"
    redis_password: str = dataclasses.field(default="", repr=False)
    redis_db: int = 0
    redis_read_access_slave: bool = False
    redis_connect_keep_alive: bool = False
    redis_connect_timeout: int = 1000
    redis_socket_timeout: int = 1000
    redis_conn_pool_size: int = 20
    redis_wait_timeout: int = 100000000
    redis_connection_lifetime: int = 100
    redis_sentinel_user: str = "default"
    redis_sentinel_password: str = dataclasses.field(default="", repr=False)
    redis_sentinel_connect_timeout: int = 1000
    redis_sentinel_socket_timeout: int = 1000
    storage_slice_import: int = 1
    storage_slice: int = 1
    using_hash_storage_slice: bool = False
    keys_sending_size: int = 1024
    using_md5_prefix_name: bool = False
    redis_hash_tags_hypodispersion: bool = True
    model_tag_import: str = "test"
    redis_hash_tags_import: Tuple[str, ...] = ()
    model_tag_runtime: str = "test"
    redis_hash_tags_runtime: Tuple[str, ...] = ()
    expire_model_tag_in_seconds: int = 604800
    table_store_mode: int = 2
    model_lib_abs_dir: str = "/tmp/"
    recreate_if_missing: bool = False
    redis_retry_deadline_ms: int = REDIS_RETRY_DEADLINE_MS
    redis_write_replicas: int = 0
    redis_write_replicas_timeout_ms: int = 1000

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        if self.redis_connection_mode not in (0, 1, 2):
            raise ConfigError(
                f"redis_connection_mode must be 0 (cluster), 1 (sentinel) or 2 (standalone), "
                f"got {self.redis_connection_mode}"
            )
        if not self.redis_host_ip:
            raise ConfigError('redis_host_ip is empty; expected at least one host, e.g. ["127.0.0.1"]')
        if len(self.redis_host_port) == 1 and len(self.redis_host_ip) > 1:
            object.__setattr__(self, "redis_host_port", self.redis_host_port * len(self.redis_host_ip))
        if len(self.redis_host_port) != len(self.redis_host_ip):
            raise ConfigError(
                f"redis_host_port has {len(self.redis_host_port)} entries for "
                f"{len(self.redis_host_ip)} hosts in redis_host_ip; give one port per host or a "
                "single port for all"
            )
        for port in self.redis_host_port:
            if not 1 <= port <= 65535:
                raise ConfigError(f"redis_host_port {port} is out of range; expected 1..65535")
        for name in ("storage_slice", "storage_slice_import", "keys_sending_size", "redis_conn_pool_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        # 0 keeps its TFRA meaning in these (database 0; never expire; no
        # limit on fields tfde does not use); only negatives are refused.
        for name in ("redis_db", "expire_model_tag_in_seconds", "redis_wait_timeout", "redis_connection_lifetime"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in TIMEOUT_FIELDS:
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(
                    f"{name} must be a timeout of at least 1 millisecond, got {value}; tfde has no "
                    '"no timeout" (a lost server must surface as an error): give the milliseconds '
                    f'to wait, e.g. "{name}": 1000'
                )
            if value > MAX_TIMEOUT_MS:
                raise ConfigError(f"{name} {value} is too large; expected at most {MAX_TIMEOUT_MS} milliseconds")
        if not 0 <= self.redis_retry_deadline_ms <= MAX_TIMEOUT_MS:
            raise ConfigError(
                f"redis_retry_deadline_ms must be 0 (no retries) to {MAX_TIMEOUT_MS} milliseconds of waiting "
                f"between retries, got {self.redis_retry_deadline_ms}"
            )
        if not 0 <= self.redis_write_replicas <= 1000:
            raise ConfigError(
                f"redis_write_replicas must be 0 (no WAIT) to 1000 replicas, got {self.redis_write_replicas}"
            )
        if not 1 <= self.redis_write_replicas_timeout_ms <= MAX_TIMEOUT_MS:
            raise ConfigError(
                f"redis_write_replicas_timeout_ms must be 1 to {MAX_TIMEOUT_MS} milliseconds, got "
                f"{self.redis_write_replicas_timeout_ms} (WAIT's 0, wait forever, is not offered: a lost replica "
                "must surface as an error)"
            )
        if self.storage_slice > 4096:
            raise ConfigError(f"storage_slice {self.storage_slice} is too large; expected at most 4096 buckets")
        for tags_name, slices in (
            ("redis_hash_tags_runtime", self.storage_slice),
            ("redis_hash_tags_import", self.storage_slice_import),
        ):
            tags = getattr(self, tags_name)
            if tags and len(tags) != slices:
                raise ConfigError(
                    f"{tags_name} has {len(tags)} tags for {slices} buckets; expected one tag per "
                    f"bucket, e.g. {[f'{{{i}}}' for i in range(slices)]}"
                )
            for tag in tags:
                if not (tag.startswith("{") and tag.endswith("}") and len(tag) > 2):
                    raise ConfigError(
                        f'{tags_name} entry {tag!r} is not a Redis hash tag; expected the form "{{name}}"'
                    )
            twice = sorted(t for t, n in collections.Counter(tags).items() if n > 1)
            if twice:  # two buckets would share one Redis hash: every key counted and exported twice
                raise ConfigError(
                    f"{tags_name} names {twice} for more than one bucket; expected a different tag per bucket "
                    f"(each bucket is its own Redis hash), e.g. {[f'{{{i}}}' for i in range(slices)]}"
                )
        if self.table_store_mode not in (0, 1, 2):
            raise ConfigError(f"table_store_mode must be 0, 1 or 2, got {self.table_store_mode}")
        if not self.model_tag_runtime:
            raise ConfigError("model_tag_runtime is empty; expected the prefix of this run's tables")

    # ------------------------------------------------------------ loading

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "RedisTableConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of redis_* fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(f"{source}: unknown Redis config field(s) {unknown} ignored", stacklevel=2)
        values = {}
        for k, v in data.items():
            if k not in known:
                continue
            if k in ("redis_host_ip", "redis_host_port", "redis_hash_tags_import", "redis_hash_tags_runtime"):
                v = tuple(v) if isinstance(v, list) else (v,) if isinstance(v, (int, str)) else v
            values[k] = v
        return cls(**values)

    @classmethod
    def from_path(cls, path: str) -> "RedisTableConfig":
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(
                f"Redis config file {path!r} does not exist; pass the path of a JSON file like configs/redis.json"
            ) from None
        except OSError as e:
            raise ConfigError(f"Redis config file {path!r} cannot be read: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            hint = " (JSON has no comments: remove // or # lines)" if ("//" in text or "#" in text) else ""
            raise ConfigError(
                f"Redis config file {path!r} is not valid JSON at line {e.lineno} column {e.colno}: {e.msg}{hint}"
            ) from None
        return cls.from_dict(data, source=path)

    @classmethod
    def from_env(cls, var: str = ENV_VAR) -> "RedisTableConfig":
        path = os.environ.get(var)
        if not path:
            raise ConfigError(f"environment variable {var} is not set; set it to the path of a Redis JSON config")
        return cls.from_path(path)

    @classmethod
    def load(cls, spec: Union["RedisTableConfig", dict, str, None] = None) -> "RedisTableConfig":
        """From a RedisTableConfig, a dict, a path, or (None) $TFDE_REDIS_CONFIG."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            return cls.from_dict(spec)
        if isinstance(spec, (str, os.PathLike)):
            return cls.from_path(os.fspath(spec))
        if spec is None:
            return cls.from_env()
        raise ConfigError(f"a Redis config must be a path, a dict or a RedisTableConfig, got {type(spec).__name__}")

    def hash_tags(self) -> Tuple[str, ...]:
        """The hash tags of this run's buckets (one per storage slice)."""
        return self.redis_hash_tags_runtime or default_hash_tags(self.storage_slice)

    def import_hash_tags(self, storage_slice: int) -> Tuple[str, ...]:
        """The hash tags of the buckets to import from (model_tag_import),
        which hold `storage_slice` buckets."""
        return self.redis_hash_tags_import or default_hash_tags(storage_slice)

    def key_prefix(self, model_tag: str) -> str:
        """The prefix of every Redis key of the tables under `model_tag`
        (model_tag_runtime or model_tag_import): the tag itself, or its md5
        with using_md5_prefix_name."""
        return hashlib.md5(model_tag.encode()).hexdigest() if self.using_md5_prefix_name else model_tag

    def describe_servers(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in zip(self.redis_host_ip, self.redis_host_port))


def default_hash_tags(storage_slice: int) -> Tuple[str, ...]:
    """ "{0}", "{1}", ...: one Redis Cluster hash tag per bucket."""
    return tuple(f"{{{i}}}" for i in range(storage_slice))


def _check_type(name: str, value, annotation) -> None:
    expected = {"int": int, "str": str, "bool": bool}
    ann = str(annotation)
    if ann.startswith("Tuple[str") or ann.startswith("Tuple[int"):
        inner = str if "str" in ann else int
        if not isinstance(value, tuple) or not all(isinstance(v, inner) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{name} must be a list of {inner.__name__}s, got {value!r}")
        return
    want = expected[ann]
    ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
    if want is bool and isinstance(value, int) and value in (0, 1):
        ok = True
    if not ok:
        shown = "<hidden>" if "password" in name else repr(value)
        raise ConfigError(f"{name} must be a{'n' if want is int else ''} {want.__name__}, got {shown}")
