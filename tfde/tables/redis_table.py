"""Redis-backed tables (standalone, sentinel or cluster; configured by a TFRA-format JSON).

Layout (documented in docs/formats.md, 'Redis: the key/value layout', so other programs can read it):
  * a table is `storage_slice` Redis hashes ("buckets") named
    ``{model_tag_runtime}:{table name}:{hash tag}``; the hash tag of bucket b
    is ``redis_hash_tags_runtime[b]`` (default ``{b}``), so in a cluster each
    bucket lands on the slot its tag chooses;
  * a key's bucket is ``((stable_hash & 0xFFFFFFFF) * storage_slice) >> 32``
    (the low half of tfde's stable hash, so it is independent of the shard
    routing, which uses the high half);
  * a field is the key's bytes: int64 / int32 keys as 8 / 4 bytes
    little-endian, string keys as their bytes; a value is the row as raw
    little-endian bytes (dim x the value dtype's size);
  * ``{model_tag_runtime}:{table name}:meta`` holds a msgpack map
    {format, key_dtype, value_dtype, dim, storage_slice, hash}, written when
    the table is created and checked when it is opened again, and again by
    every new connection (a server restarted without persistence comes back
    without it: recreate_if_missing).

Every operation on a table's rows runs in native ops on one client
(backends/redis/): TfdeRedisFind and TfdeRedisInsert pipeline HMGET / HSET
per node in chunks of keys_sending_size keys (with redis_read_access_slave
the finds read replicas), TfdeRedisInsertGroup writes a step's row and slot
tables in MULTI / EXEC transactions (RedisTable.insert_with), TfdeRedisAccum
adds on the server through a Lua script, TfdeRedisRemove, TfdeRedisSize,
TfdeRedisClear and TfdeRedisExport (HSCAN); all retry with backoff.  redis-py
serves what runs once per table, in Python: opening (the credentials, the
meta key, the import from model_tag_import) and close's expiry.  The tables
work eagerly, in tf.function and under model.fit, in the process that
created them.  A find of n keys costs one pipelined round trip per server.

Errors (both clients alike, tfde/errors.py): transient failures are retried
with backoff, then raise BackendUnavailableError (tf.errors.UnavailableError
in graphs); refusals raise at once BackendError / CapacityError /
CredentialsError (FailedPrecondition / ResourceExhausted in graphs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time
import uuid
import warnings
from typing import Optional, Union

import msgpack
import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

from tfde import _native
from tfde._defaults import REDIS_BACKOFF_BASE_S, REDIS_BACKOFF_MAX_S
from tfde.errors import (
    REDIS_ERROR_KINDS,
    BackendError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    CredentialsError,
    ShapeError,
    from_op_error,
    redis_error_kind,
)
from tfde.hashing import route_low_np, stable_hash_np, stable_hash_py
from tfde.initializers import InitSpec
from tfde.tables.base import (
    Table,
    TableCreator,
    as_deltas,
    as_keys,
    as_rows,
    check_dtypes,
    native_missing_args,
    register_creator,
)
from tfde.tables.redis_config import RedisTableConfig

FORMAT_VERSION = 1
BACKOFF_BASE_S = REDIS_BACKOFF_BASE_S  # first retry delay in seconds; doubles each retry
BACKOFF_MAX_S = REDIS_BACKOFF_MAX_S  # longest delay between retries, seconds
# Hints of the errors below; backends/redis/ops.cc Fail says the same.
_OUT_OF_MEMORY_HINT = "free memory on the server or raise its maxmemory, then run the step again"
_CREDENTIALS_HINT = "check redis_user and redis_password in the Redis config"


def backoff_s(failures: int) -> float:
    """Seconds to wait before the next attempt after `failures` (1, 2, ...)
    failures in a row: BACKOFF_BASE_S doubling, at most BACKOFF_MAX_S."""
    return min(BACKOFF_BASE_S * 2.0 ** (failures - 1), BACKOFF_MAX_S)


def retry_waits_ms(deadline_ms: int) -> list:
    """The waits (milliseconds) between the attempts of a call that keeps
    failing transiently: backoff_s per failure, for as long as the waits add
    up to at most `deadline_ms` (redis_retry_deadline_ms).  Both clients
    follow it (backends/redis/resp_client.h Client::Pipeline)."""
    waits, total = [], 0
    while True:
        wait = round(backoff_s(len(waits) + 1) * 1000)
        if total + wait > deadline_ms:
            return waits
        waits.append(wait)
        total += wait


# Adds deltas to rows atomically on the server.  KEYS[1]: the bucket hash;
# KEYS[2]: a marker unique to this chunk of this call (same hash tag), so a
# chunk retried after a dropped connection is applied once; ARGV: the rows'
# value kind (f float32, d float64, h float16, b bfloat16) followed by the
# deltas' where it differs ("hf": float16 rows, float32 deltas), dim, marker
# TTL in seconds, then (field, delta bytes, initial row bytes) triples; a
# missing field starts from its initial row.  Sums are formed as the native
# ops form them (backends/cuckoo/ops.cc AccumOp): float32 and float64 rows in
# double precision rounded once to the rows' type, float16 and bfloat16 rows
# in float32 (float64 for float64 deltas, then to float32) and rounded to
# theirs (round to nearest even; a NaN becomes the quiet NaN of its sign).
# Unlike the native ops, which run with TensorFlow's flush of subnormal
# numbers to zero, the script keeps subnormal float32 and float64 values.
_ACCUM_LUA = r"""
if not redis.call('SET', KEYS[2], 1, 'NX', 'EX', tonumber(ARGV[3])) then return 0 end
local kind, dim = ARGV[1]:sub(1, 1), tonumber(ARGV[2])
local dkind = ARGV[1]:sub(2, 2)  -- the deltas' kind where it is not the rows'
if dkind == '' then dkind = kind end
local sizes = {f = 4, d = 8, h = 2, b = 2}
local size = sizes[kind]
local function round_even(y)
  local fl = math.floor(y)
  local r = y - fl
  if r > 0.5 or (r == 0.5 and fl % 2 == 1) then fl = fl + 1 end
  return fl
end
local function decode(s, j, k)
  local pos = j * sizes[k] + 1
  if k == 'f' then return (struct.unpack('<f', s, pos)) end
  if k == 'd' then return (struct.unpack('<d', s, pos)) end
  local h = struct.unpack('<I2', s, pos)
  if k == 'b' then return (struct.unpack('<f', struct.pack('<I4', h * 65536))) end
  local sign = (h >= 32768) and -1 or 1
  local e, m = math.floor(h / 1024) % 32, h % 1024
  if e == 0 then return sign * m * 2 ^ -24 end
  if e == 31 and m == 0 then return sign * math.huge end
  if e == 31 then  -- a NaN of the half's sign (0 / 0's sign depends on the machine)
    return (struct.unpack('<f', struct.pack('<I4', (h >= 32768) and 4290772992 or 2143289344)))
  end
  return sign * (1 + m / 1024) * 2 ^ (e - 15)
end
-- Whether NaN `x` has its sign bit set.
local function negative_nan(x)
  return struct.unpack('<I4', struct.pack('<f', x)) >= 2147483648
end
local function encode(x)
  if kind == 'f' then return struct.pack('<f', x) end
  if kind == 'd' then return struct.pack('<d', x) end
  -- A NaN becomes the quiet NaN of its sign, as the native conversions make it.
  if x ~= x then return struct.pack('<I2', (kind == 'b' and 32704 or 32256) + (negative_nan(x) and 32768 or 0)) end
  if kind == 'b' then
    local u = struct.unpack('<I4', struct.pack('<f', x))
    local lsb = math.floor(u / 65536) % 2
    return struct.pack('<I2', math.floor((u + 32767 + lsb) / 65536) % 65536)
  end
  local sign = 0
  if x < 0 or (x == 0 and 1 / x < 0) then sign = 32768; x = -x end
  if x >= 65520 then return struct.pack('<I2', sign + 31744) end
  if x < 2 ^ -14 then return struct.pack('<I2', sign + round_even(x / 2 ^ -24)) end
  local _, ex = math.frexp(x)
  local e = ex - 1
  local m = round_even((x / 2 ^ e - 1) * 1024)
  if m == 1024 then m = 0; e = e + 1 end
  if e + 15 >= 31 then return struct.pack('<I2', sign + 31744) end
  return struct.pack('<I2', sign + (e + 15) * 1024 + m)
end
if (kind == 'f' or kind == 'd') and dkind == kind then
  -- float32 and float64 rows: struct decodes and encodes a block of a row
  -- at once (the same sums and roundings as decode and encode, about three
  -- times faster than one call per number).
  for i = 4, #ARGV, 3 do
    local cur = redis.call('HGET', KEYS[1], ARGV[i]) or ARGV[i + 2]
    local delta, out = ARGV[i + 1], {}
    for s = 0, dim - 1, 200 do
      local n = math.min(200, dim - s)
      local fmt = '<' .. string.rep(kind, n)
      local a = {struct.unpack(fmt, cur, s * size + 1)}
      local b = {struct.unpack(fmt, delta, s * size + 1)}
      for j = 1, n do a[j] = a[j] + b[j] end
      out[#out + 1] = struct.pack(fmt, unpack(a, 1, n))
    end
    redis.call('HSET', KEYS[1], ARGV[i], table.concat(out))
  end
  return (#ARGV - 3) / 3
end
-- float16 and bfloat16 rows: the sum as the native ops form it, in float32
-- (float64 deltas: in float64, then to float32, as their conversion to the
-- row's type goes), then rounded to the row's type.
local round_f32 = function(x) return x end
if kind == 'h' or kind == 'b' then
  round_f32 = function(x) return (struct.unpack('<f', struct.pack('<f', x))) end
end
for i = 4, #ARGV, 3 do
  local cur = redis.call('HGET', KEYS[1], ARGV[i]) or ARGV[i + 2]
  local delta, out = ARGV[i + 1], {}
  for j = 0, dim - 1 do out[j + 1] = encode(round_f32(decode(cur, j, kind) + decode(delta, j, dkind))) end
  redis.call('HSET', KEYS[1], ARGV[i], table.concat(out))
end
return (#ARGV - 3) / 3
"""
# Removes fields and counts those that were there, once per chunk of a call:
# KEYS[1]: the bucket hash; KEYS[2]: the chunk's marker (same hash slot),
# which keeps the count, so a chunk retried after a lost reply removes nothing
# more and answers the same count; ARGV: marker TTL in seconds, then the
# fields.  A field given twice in a chunk counts once.
_NO_STEP = -1  # the step input of the native ops outside a training step


def _other_tables_attrs(tables) -> dict:
    """The attrs naming the tables a grouped write (TfdeRedisInsertGroup,
    TfdeRedisApply) writes beside its own: their dims, buckets (table-major)
    and names."""
    return {
        "other_dims": [t.dim for t in tables],
        "other_buckets": [b for t in tables for b in t._buckets],
        "other_names": [t.name for t in tables],
    }


def _step_arg(step):
    return tf.constant(_NO_STEP, tf.int64) if step is None else tf.cast(step, tf.int64)


_REMOVE_LUA = r"""
local done = redis.call('GET', KEYS[2])
if done then return tonumber(done) end
local n = 0
for i = 2, #ARGV do n = n + redis.call('HDEL', KEYS[1], ARGV[i]) end
redis.call('SET', KEYS[2], n, 'EX', tonumber(ARGV[1]))
return n
"""
ACCUM_MARKER_TTL_S = 3600  # how long a chunk's applied-once marker (accum, remove) lives
# Where processes that did not create the tables (serving, load_model) find
# the passwords, which configs and graphs never carry.
PASSWORD_ENV = "TFDE_REDIS_PASSWORD"
SENTINEL_PASSWORD_ENV = "TFDE_REDIS_SENTINEL_PASSWORD"


def _forget_kept_reads() -> None:
    """Has the native ops forget the training reads they kept (docs/redis.md,
    "A step's rows, read once"; tfde_redis_forget_reads in
    backends/redis/ops.cc, called with ctypes on the loaded op library): a
    table being opened may be one of the same name made afresh, or one that
    redis-py just filled (model_tag_import)."""
    lib = ctypes.CDLL(str(_native.loaded_path()), mode=os.RTLD_NOW | os.RTLD_NOLOAD)
    lib.tfde_redis_forget_reads.restype = None
    lib.tfde_redis_forget_reads()


def _connect(cfg: RedisTableConfig):
    """The redis-py client of a creator's tables, for the config's connection
    mode.  It talks to the master only (opening tables, the import, expiry);
    the native ops read replicas when redis_read_access_slave asks."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # tfde retries whole operations itself (RedisTable._call), so redis-py's
    # own per-command retries are switched off: one policy, documented.
    common = dict(
        retry=Retry(NoBackoff(), 0),
        username=cfg.redis_user or None,
        password=cfg.redis_password or None,
        socket_connect_timeout=cfg.redis_connect_timeout / 1000.0,
        socket_timeout=cfg.redis_socket_timeout / 1000.0,
        socket_keepalive=cfg.redis_connect_keep_alive,
    )
    servers = list(zip(cfg.redis_host_ip, cfg.redis_host_port))
    # Every new connection checks that the tables opened through it are
    # still there (_TableWatch); RedisCluster runs its own handshake first.
    watch = _TableWatch(handshake=cfg.redis_connection_mode != 0)
    common["redis_connect_func"] = watch
    client = _connect_client(cfg, common, servers)
    client._tfde_watch = watch
    return client


def _connect_client(cfg: RedisTableConfig, common: dict, servers):
    import redis

    if cfg.redis_connection_mode == 2:
        return redis.Redis(
            host=servers[0][0], port=servers[0][1], db=cfg.redis_db, max_connections=cfg.redis_conn_pool_size, **common
        )
    if cfg.redis_connection_mode == 1:
        from redis.sentinel import Sentinel

        sentinel = Sentinel(
            servers,
            sentinel_kwargs=dict(
                username=cfg.redis_sentinel_user or None,
                password=cfg.redis_sentinel_password or None,
                socket_connect_timeout=cfg.redis_sentinel_connect_timeout / 1000.0,
                socket_timeout=cfg.redis_sentinel_socket_timeout / 1000.0,
            ),
            db=cfg.redis_db,
            **common,
        )
        return sentinel.master_for(cfg.redis_master_name)
    from redis.cluster import ClusterNode, RedisCluster

    try:
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in servers],
            max_connections=cfg.redis_conn_pool_size,
            **common,
        )
    except redis.exceptions.RedisClusterException as e:
        if "not enabled" in str(e).lower():
            raise ConfigError(
                f"redis_connection_mode is 0 (cluster) but {cfg.describe_servers()} is not a cluster "
                "node; use 2 for a standalone server or 1 for sentinels"
            ) from None
        raise BackendUnavailableError(f"Redis cluster at {cfg.describe_servers()} unreachable: {e}") from None
    return client


def native_attrs(
    cfg: RedisTableConfig,
    buckets,
    table_name: str,
    credentials: str = "",
    meta_key: str = "",
    meta: bytes = b"",
    writer: str = "",
) -> dict:
    """Attrs of the native Redis ops (backends/redis/ops.cc) for a table.
    Passwords are never attrs: `credentials` names the ones registered in
    this process (RedisTableCreator); without it the ops read
    $TFDE_REDIS_PASSWORD and $TFDE_REDIS_SENTINEL_PASSWORD.

    Errors: the ops classify Redis error replies with tfde/errors.py's
    REDIS_ERROR_KINDS (one table for both clients).  `meta_key`: every new
    connection checks that it still exists (a server restarted empty, see
    _TableWatch); when cfg.recreate_if_missing is set and `meta` (the packed
    meta value) is given, the ops write it again instead.  `writer`: who
    the write counts the ops check are remembered for (backends/redis/ops.cc
    WriteCounts): one id per RedisTable, so a table dropped and created again
    under the same name starts with counts of its own."""
    env = not credentials
    recreate = bool(cfg.recreate_if_missing and meta and meta_key)
    return dict(
        buckets=list(buckets),
        table_name=table_name,
        chunk=cfg.keys_sending_size,
        mode=cfg.redis_connection_mode,
        servers=[f"{h}:{p}" for h, p in zip(cfg.redis_host_ip, cfg.redis_host_port)],
        master_name=cfg.redis_master_name,
        db=cfg.redis_db,
        user=cfg.redis_user or "",
        credentials=credentials,
        password_env=PASSWORD_ENV if env else "",
        sentinel_user=cfg.redis_sentinel_user or "",
        sentinel_password_env=SENTINEL_PASSWORD_ENV if env else "",
        connect_timeout_ms=cfg.redis_connect_timeout,
        socket_timeout_ms=cfg.redis_socket_timeout,
        retry_deadline_ms=cfg.redis_retry_deadline_ms,
        write_replicas=cfg.redis_write_replicas,
        write_replicas_timeout_ms=cfg.redis_write_replicas_timeout_ms,
        error_kinds=[f"{code}={kind}" for code, kind in sorted(REDIS_ERROR_KINDS.items())],
        meta_key=meta_key,
        meta=meta if recreate else b"",
        recreate_meta=recreate,
        writer=writer,
    )


def _beside(kind: str, bucket: str) -> str:
    """A key of tfde's own beside `bucket`, in its cluster slot and named
    outside the table's keys (backends/redis/ops.cc BesideBucket, the same
    rule)."""
    open_ = bucket.find("{")
    close = bucket.find("}", open_ + 1) if open_ >= 0 else -1
    return f"{kind}:{bucket}" if open_ >= 0 and close > open_ + 1 else f"{kind}:{{{bucket}}}"


def write_count_key(bucket: str) -> str:
    """The Redis counter that every native insert into `bucket` increments
    (backends/redis/ops.cc WriteCountKey).  A count that goes back tells
    lost writes apart from a table that is merely behind (docs/redis.md,
    "What can be lost")."""
    return _beside("tfde-writes", bucket)


def _check_count_slots(name: str, buckets) -> None:
    """In a cluster, each bucket's write count must share the bucket's slot
    (they are written in one transaction): refused, before anything is
    written, for a name that breaks the hash tag (a bucket named "a{}b{c}"
    hashes whole, its count would hash "c")."""
    from redis.crc import key_slot

    for bucket in buckets:
        if key_slot(write_count_key(bucket).encode()) != key_slot(bucket.encode()):
            raise ConfigError(
                f"Redis table {name!r}: its bucket {bucket!r} and that bucket's write count "
                f"{write_count_key(bucket)!r} would lie in different cluster slots, because the name holds an "
                "empty hash tag '{}'; rename the table (or the model tag) without '{}'"
            )


def table_lost_message(address: str, table_name: str, meta_key: str) -> str:
    """Why a table's operations fail once its server lost it; the native
    client says the same (backends/redis/resp_client.h CheckTable)."""
    return (
        f"Redis at {address} no longer holds table {table_name!r} (its meta key {meta_key!r} is gone): the "
        "server was restarted without persistence or was flushed, so the table's rows are lost; restore them "
        'from a checkpoint, or set "recreate_if_missing": true in the Redis config to start the table afresh'
    )


class _TableWatch:
    """redis-py's connect hook (redis_connect_func) for the clients of one
    RedisTableCreator.  On every new connection, after the handshake, it
    checks that each table opened through these clients still has its meta
    key, as the native client does (backends/redis/resp_client.h
    CheckTable): a server restarted without persistence, or flushed, comes
    back empty, and carrying on would train from initial rows.  A missing
    key raises BackendError (table_lost_message), or, for a table whose
    config sets recreate_if_missing, is written again with a warning.  In a
    cluster, each key is checked by the node that holds it.

    Thread-safety: called from any thread that opens a connection."""

    def __init__(self, handshake: bool):
        self._handshake = handshake  # False in a cluster: RedisCluster.on_connect ran it
        self._tables = {}  # meta key -> (table name, packed meta to rewrite, or None)
        self._lock = threading.Lock()

    def watch(self, meta_key: str, table_name: str, meta) -> None:
        with self._lock:
            self._tables[meta_key] = (table_name, meta)

    def __call__(self, conn):
        import redis

        if self._handshake:
            conn.on_connect()
        with self._lock:
            tables = list(self._tables.items())
        for key, (name, meta) in tables:
            try:
                conn.send_command(*(("SET", key, meta, "NX") if meta is not None else ("EXISTS", key)))
                found = conn.read_response()
            except redis.exceptions.AskError:  # MOVED / ASK: another cluster node holds it
                continue
            if meta is not None:
                if found:
                    warnings.warn(
                        f"Redis at {conn.host}:{conn.port} held no table {name!r} (its meta key {key!r} "
                        "was gone): recreated it empty, as recreate_if_missing asks",
                        stacklevel=2,
                    )
            elif not found:
                # Closed before raising: redis-py would otherwise keep the
                # socket and use it unchecked next time.
                conn.disconnect()
                raise BackendError(table_lost_message(f"{conn.host}:{conn.port}", name, key))


def _error_code(error) -> str:
    """The code of the Redis error reply behind a redis-py ResponseError
    ("WRONGTYPE", "OOM", ...).  redis-py strips the code of the replies it
    has a class for (and, in pipelines, puts text before it)."""
    import redis.exceptions as x

    code = getattr(error, "status_code", None)
    if code:
        return code
    for cls, code in (
        (x.OutOfMemoryError, "OOM"),
        (x.NoScriptError, "NOSCRIPT"),
        (x.ReadOnlyError, "READONLY"),
        (x.ExecAbortError, "EXECABORT"),
        (x.TryAgainError, "TRYAGAIN"),
        (getattr(x, "MasterDownError", ()), "MASTERDOWN"),
        (x.ClusterDownError, "CLUSTERDOWN"),
        (x.MovedError, "MOVED"),
        (x.AskError, "ASK"),
        (x.NoPermissionError, "NOPERM"),
    ):
        if cls and isinstance(error, cls):
            return code
    text = str(error).split(" of pipeline caused error: ", 1)[-1]
    word = text.split(" ", 1)[0]
    return word if word.isalpha() and word.isupper() else "ERR"


def _error_kind(error) -> str:
    """REDIS_ERROR_KINDS' kind of a redis-py error; "transient" for lost
    connections and timeouts (redis-py's ConnectionError, TimeoutError, and
    BusyLoadingError for LOADING)."""
    import redis.exceptions as x

    if isinstance(error, tuple(getattr(x, n) for n in ("AuthenticationError", "AuthorizationError") if hasattr(x, n))):
        return "credentials"
    if isinstance(error, x.ResponseError):
        code = _error_code(error)
        return "transient" if code in ("MOVED", "ASK") else redis_error_kind(code)
    if isinstance(error, x.DataError):
        return "refused"  # redis-py refused the arguments before sending
    return "transient"  # ConnectionError, TimeoutError, cluster discovery errors


def _no_master_detail(client, master_name: str) -> str:
    """What the sentinels behind `client` (a redis-py Sentinel master
    client) last said of `master_name`: the address they name and how they
    flag it, so that "No master found" says where the master was."""
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        try:
            state = sentinel.sentinel_master(master_name)
        except Exception:  # this sentinel is down too: ask the next
            continue
        return (
            f" (the sentinels last named {state['ip']}:{state['port']} as the master of {master_name!r}, "
            f"flagged {state['flags']}: it is down and no replica has been promoted yet)"
        )
    return f" (no sentinel answered for {master_name!r} either)"


def _check_credentials(cfg: RedisTableConfig, client) -> None:
    """Authenticates to every server the native ops talk to, the way they do
    (backends/redis/resp_client.h: ``AUTH <password>`` for user "default" or
    none, else ``AUTH <user> <password>``; nothing without a password), and
    PINGs it, so that credentials the server refuses are a CredentialsError
    (a ConfigError) naming the server, the field and the fix when a table
    opens, not an error from inside the first training step's graph.
    (redis-py alone would not notice a password the server does not have:
    ``AUTH default <password>`` succeeds there.)  Connection errors
    propagate: the caller retries them."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    def probe(host, port, user, password, user_field, password_field, connect_ms, socket_ms):
        # protocol 2: redis-py's RESP3 handshake (HELLO) would be refused
        # before AUTH on a server that needs a password.
        conn = redis.Redis(
            host=host,
            port=port,
            protocol=2,
            retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=connect_ms / 1000.0,
            socket_timeout=socket_ms / 1000.0,
        )
        where = f"Redis at {host}:{port}"
        try:
            if password:
                conn.execute_command(*(("AUTH", password) if user in ("", "default") else ("AUTH", user, password)))
            conn.ping()
        except (redis.AuthenticationError, redis.ResponseError) as e:
            text = str(e)
            if "without any password configured" in text or "no password is set" in text:
                raise CredentialsError(
                    f"{where} has no password, but {password_field} is set in the Redis config; "
                    f"remove {password_field} (or give the server a password: requirepass or an "
                    "ACL user)"
                ) from None
            if text.startswith("NOAUTH") or "Authentication required" in text:
                raise CredentialsError(
                    f"{where} requires a password, but {password_field} is empty in the Redis config; "
                    f"set {password_field} (and {user_field} for an ACL user other than "
                    '"default")'
                ) from None
            if "WRONGPASS" in text or "invalid password" in text or "invalid username-password" in text:
                raise CredentialsError(
                    f"{where} refused the credentials of user {user or 'default'!r} (WRONGPASS); "
                    f"check {user_field} and {password_field} in the Redis config"
                ) from None
            raise
        finally:
            conn.close()

    servers = list(zip(cfg.redis_host_ip, cfg.redis_host_port))
    master = (
        cfg.redis_user,
        cfg.redis_password,
        "redis_user",
        "redis_password",
        cfg.redis_connect_timeout,
        cfg.redis_socket_timeout,
    )
    if cfg.redis_connection_mode == 2:
        probe(*servers[0], *master)
    elif cfg.redis_connection_mode == 1:
        # The native client asks the sentinels in turn: each one that answers
        # must take the sentinel credentials.
        for host, port in servers:
            try:
                probe(
                    host,
                    port,
                    cfg.redis_sentinel_user,
                    cfg.redis_sentinel_password,
                    "redis_sentinel_user",
                    "redis_sentinel_password",
                    cfg.redis_sentinel_connect_timeout,
                    cfg.redis_sentinel_socket_timeout,
                )
            except (redis.ConnectionError, redis.TimeoutError):
                continue  # another sentinel may answer; the master lookup below needs one
        probe(*client.connection_pool.get_master_address(), *master)
    else:
        for node in client.get_primaries():
            probe(node.host, node.port, *master)


class RedisTable(Table, trackable_base.Trackable):
    """A table stored in Redis hashes (see the module docstring for the layout).

    Checkpoints (tfde/saving) follow table_store_mode: 0 puts every key and
    row into the checkpoint; 1 dumps them to a bundle of their own in
    model_lib_abs_dir/model_tag_runtime (one per save, named in the
    checkpoint); 2 puts nothing in: Redis is the source of truth.

    Thread-safety: every method may be called from several threads; each
    command is atomic on the server, accum is atomic per key (Lua)."""

    shared_between_workers = True  # every worker of a job reads and writes the same Redis tables

    def __init__(self, name, key_dtype, value_dtype, dim, config: RedisTableConfig, client=None, credentials: str = ""):
        self.key_dtype, self.value_dtype, self.dim = check_dtypes(key_dtype, value_dtype, dim)
        self.name = name
        self.config = config
        self._client = client if client is not None else _connect(config)
        prefix = config.key_prefix(config.model_tag_runtime)
        self._tags = config.hash_tags()
        self._buckets = [f"{prefix}:{name}:{tag}" for tag in self._tags]
        self._meta_key = f"{prefix}:{name}:meta"
        if config.redis_connection_mode == 0:
            _check_count_slots(name, self._buckets)
        self._key_width = {tf.int64: 8, tf.int32: 4}.get(self.key_dtype)
        self._ops = _native.load()  # every operation of the training path (no Python per call)
        self._attrs = native_attrs(
            config, self._buckets, name, credentials, self._meta_key, self._packed_meta(), writer=uuid.uuid4().hex
        )
        self._call("open", lambda: _check_credentials(config, self._client))
        self._open_meta()
        _forget_kept_reads()
        self._watch()
        self._keys = self._buckets + [write_count_key(b) for b in self._buckets] + [self._meta_key]
        self._call("open", lambda: [self._client.persist(k) for k in self._keys])

    def memory_bytes(self):
        """0: the rows live in Redis, not in this process."""
        return tf.constant(0, tf.int64)

    def close(self) -> None:
        """Sets the expiry of this table's hashes (expire_model_tag_in_seconds;
        0 keeps them forever, as in TFRA).  Opening the table again removes it."""
        ttl = self.config.expire_model_tag_in_seconds
        if ttl > 0:
            self._call("close", lambda: [self._client.expire(k, ttl) for k in self._keys])

    # ------------------------------------------------------------ plumbing

    def _call(self, what: str, fn):
        """Runs fn() (redis-py calls).  What Redis calls transient (a lost
        connection, a timeout, a "not now" reply such as LOADING or BUSY:
        tfde/errors.py REDIS_ERROR_KINDS) is retried with backoff, then
        raised as BackendUnavailableError; a refusal is raised at once as
        BackendError, CapacityError (OOM) or CredentialsError.  Messages
        name the server, the operation and the table, in the words of the
        native ops (backends/redis/ops.cc Fail)."""
        import redis
        import redis.sentinel

        at = f"Redis at {self.config.describe_servers()}"
        during = f"{what} of table {self.name!r}"
        deadline = self.config.redis_retry_deadline_ms
        waits = retry_waits_ms(deadline)
        for attempt in range(len(waits) + 1):
            try:
                return fn()
            except redis.RedisError as e:
                kind = _error_kind(e)
                if kind == "capacity":
                    raise CapacityError(f"{at} is out of memory during {during}: {e}; {_OUT_OF_MEMORY_HINT}") from None
                if kind == "credentials":
                    raise CredentialsError(
                        f"{at} refused the credentials of user {self.config.redis_user!r} during "
                        f"{during}: {e}; {_CREDENTIALS_HINT}"
                    ) from None
                if kind != "transient":
                    raise BackendError(f"{at} refused {during}: {e}") from None
                if attempt == len(waits):
                    if isinstance(e, redis.sentinel.MasterNotFoundError):
                        e = f"{e}{_no_master_detail(self._client, self.config.redis_master_name)}"
                    raise BackendUnavailableError(
                        f"{at} unreachable during {during} after {attempt + 1} attempts in {sum(waits)} ms of "
                        f"retries (redis_retry_deadline_ms {deadline}): {e}"
                    ) from None
                time.sleep(waits[attempt] / 1000)

    def _packed_meta(self) -> bytes:
        return msgpack.packb(self._meta(len(self._buckets)))

    def _watch(self) -> None:
        """From now on every new redis-py connection checks that this table
        is still there (_TableWatch), as the native ops' connections do."""
        watch = getattr(self._client, "_tfde_watch", None)
        if watch is not None:
            watch.watch(self._meta_key, self.name, self._packed_meta() if self.config.recreate_if_missing else None)

    def _meta(self, buckets: int) -> dict:
        return {
            "format": FORMAT_VERSION,
            "key_dtype": self.key_dtype.name,
            "value_dtype": self.value_dtype.name,
            "dim": self.dim,
            "storage_slice": buckets,
            "hash": "tfde-mix64-v1",
        }

    def _open_meta(self):
        meta = self._meta(len(self._buckets))
        exists = self._call("open", lambda: self._client.exists(self._meta_key))
        if not exists:
            self._import_from_model_tag()
        created = self._call("open", lambda: self._client.set(self._meta_key, msgpack.packb(meta), nx=True))
        if created:
            return
        stored = msgpack.unpackb(self._call("open", lambda: self._client.get(self._meta_key)))
        if stored != meta:
            raise ConfigError(
                f"Redis table {self.name!r} ({self._meta_key}) already holds {stored.get('key_dtype')} -> "
                f"{stored.get('value_dtype')}[{stored.get('dim')}] in {stored.get('storage_slice')} buckets "
                f"(format {stored.get('format')}); asked for {meta['key_dtype']} -> {meta['value_dtype']}"
                f"[{meta['dim']}] in {meta['storage_slice']} buckets. Use another model_tag_runtime or the "
                "same dtypes, dim and storage_slice."
            )

    def _import_from_model_tag(self):
        """A new runtime table starts as a copy of the same table under
        model_tag_import, when that exists: rows are re-bucketed, since the
        two may have different storage_slice."""
        cfg = self.config
        if not cfg.model_tag_import or cfg.model_tag_import == cfg.model_tag_runtime:
            return
        prefix = cfg.key_prefix(cfg.model_tag_import)
        raw_meta = self._call("import", lambda: self._client.get(f"{prefix}:{self.name}:meta"))
        if raw_meta is None:
            return
        source = msgpack.unpackb(raw_meta)
        if source != self._meta(source.get("storage_slice")):
            raise ConfigError(
                f"cannot import Redis table {self.name!r} from model tag {cfg.model_tag_import!r}: it "
                f"holds {source.get('key_dtype')} -> {source.get('value_dtype')}[{source.get('dim')}],"
                f" this table is {self.key_dtype.name} -> {self.value_dtype.name}[{self.dim}]"
            )
        tags = cfg.import_hash_tags(source["storage_slice"])
        for tag in tags:
            cursor = 0
            while True:
                cursor, page = self._call(
                    "import", lambda c=cursor, t=tag: self._client.hscan(f"{prefix}:{self.name}:{t}", c, count=1000)
                )
                if page:
                    fields = list(page)
                    keys = self._keys_from_fields(fields)
                    hashes = (
                        stable_hash_np(keys)
                        if self._key_width is not None
                        else np.array([stable_hash_py(k) for k in fields], np.uint64)
                    )
                    buckets = self._bucket_of(hashes)

                    def run(fields=fields, buckets=buckets):
                        pipe = self._client.pipeline(transaction=False)
                        for f, b in zip(fields, buckets):
                            pipe.hset(self._buckets[b], f, page[f])
                        return pipe.execute()

                    self._call("import", run)
                if cursor == 0:
                    break

    def _fields(self, keys: np.ndarray) -> list:
        if self._key_width is None:
            return [k if isinstance(k, bytes) else bytes(k) for k in keys]
        raw = keys.astype("<i8" if self._key_width == 8 else "<i4").tobytes()
        w = self._key_width
        return [raw[i : i + w] for i in range(0, len(raw), w)]

    def _keys_from_fields(self, fields: list) -> np.ndarray:
        if self._key_width is None:
            return np.array(fields, dtype=object)
        return np.frombuffer(b"".join(fields), dtype="<i8" if self._key_width == 8 else "<i4").astype(
            self.key_dtype.as_numpy_dtype
        )

    def _bucket_of(self, hashes: np.ndarray) -> np.ndarray:
        return route_low_np(hashes, len(self._buckets))

    def _plan(self, hashes):
        """(bucket, index chunk) pairs covering all keys, in batch order per bucket."""
        buckets = self._bucket_of(hashes)
        step = self.config.keys_sending_size
        for b in np.unique(buckets):
            idx = np.nonzero(buckets == b)[0]
            for s in range(0, len(idx), step):
                yield int(b), idx[s : s + step]

    # ------------------------------------------------------------ Table protocol

    def _native_call(self, what: str, fn):
        """fn() (a native op).  Eagerly, a failure is raised as the tfde
        error its message names, with the same text (tfde.errors
        from_op_error); in graphs TensorFlow raises its own class of that
        error's code (UnavailableError, FailedPreconditionError, ...: the
        tfde classes subclass them), the message starting with the tfde
        class name.  The op's message already names `what`."""
        if not tf.executing_eagerly():
            return fn()
        try:
            return fn()
        except tf.errors.OpError as e:
            raise from_op_error(e) from None

    def find(self, keys, missing):
        """Rows of `keys` and whether each was stored; missing keys get rows
        from `missing` (an InitSpec or default rows).  With
        redis_read_access_slave the reads go to a replica, which may lag the
        master's writes."""
        return self._find(keys, missing, replicas=self.config.redis_read_access_slave)

    def find_to_update(self, keys, missing, step: Optional[tf.Tensor] = None):
        """find() from the master, whatever redis_read_access_slave says: a
        training step computes its writes from these rows, and a replica's
        lagging row would silently undo the master's newer one.  `step` (the
        training step's number, Table.find_to_update): buckets a failed
        attempt of this very step wrote read as they were before it, so the
        step run again computes what its first attempt did."""
        return self._find(keys, missing, replicas=False, step=step)

    def _find(self, keys, missing, replicas: bool, step=None):
        keys = as_keys(keys, self.key_dtype, self.name)
        defaults, init = native_missing_args(missing, self)
        return self._native_call(
            "find",
            lambda: self._ops.tfde_redis_find(
                keys, defaults, _step_arg(step), dim=self.dim, read_from_replicas=replicas, **self._attrs, **init
            ),
        )

    def insert(self, keys, values):
        keys = as_keys(keys, self.key_dtype, self.name)
        values = as_rows(values, self.value_dtype, self.dim, self.name)
        return self._native_call(
            "insert", lambda: self._ops.tfde_redis_insert(keys, values, dim=self.dim, **self._attrs)
        )

    def insert_with(self, keys, values, others, step: Optional[tf.Tensor] = None) -> list:
        """Upserts `values` ([n, dim] value_dtype) under `keys` ([n]) here and,
        for each ``(table, table_values)`` of `others`, `table_values`
        ([n, table.dim] table.value_dtype) under the same keys there: a
        training step's row, slots and policy state, all-or-nothing per key
        (Table.insert_with).  Returns the write ops.

        When every table of `others` is a RedisTable of the same config, key
        dtype and hash tags (a Variable's tables of one RedisTableCreator: a
        key lies in bucket b of each, and bucket b of each is in one cluster
        slot) this is one TfdeRedisInsertGroup op: MULTI / HSET ... / EXEC per
        bucket on a cluster, one transaction for the whole call on a single
        server (backends/redis/ops.cc).  Any other mix falls back to
        Table.insert_with (one insert per table)."""
        others = list(others)
        if not others and step is None:
            return [self.insert(keys, values)]
        if not all(self._shares_transactions_with(table) for table, _ in others):
            return super().insert_with(keys, values, others, step)
        keys = as_keys(keys, self.key_dtype, self.name)
        rows = [as_rows(values, self.value_dtype, self.dim, self.name)]
        rows += [as_rows(v, table.value_dtype, table.dim, table.name) for table, v in others]
        tables = [self] + [table for table, _ in others]
        n = keys.shape[0]
        for table, r in zip(tables, rows):  # the kernel checks again when n is known only at run time
            if n is not None and r.shape[0] is not None and r.shape[0] != n:
                raise ShapeError(
                    f"rows for table {table.name!r} have shape {r.shape} for {n} keys; expected "
                    f"[{n}, {table.dim}], one row per key"
                )
        others_tables = tables[1:]
        return [
            self._native_call(
                "insert",
                lambda: self._ops.tfde_redis_insert_group(
                    keys,
                    rows[0],
                    rows[1:],
                    _step_arg(step),
                    dim=self.dim,
                    **_other_tables_attrs(others_tables),
                    **self._attrs,
                ),
            )
        ]

    def apply_step(self, keys, grads, missing, slots: list, step, hyper, state=None, **rule) -> tf.Tensor:
        """The fused step's write (tfde/step_kernels.py) of a Variable whose
        rows are here and whose optimizer slots are the RedisTables `slots`
        (each shares transactions with this one): TfdeRedisApply reads the
        rows and slots of the distinct `keys` ([n]) before the step (the
        step's kept read, the rest in one round trip), applies the rule to
        their summed gradients `grads` ([n, dim], float64 for a float64
        table, else float32: the rule's compute type, in which rows and slots
        are updated before they are rounded to the table's dtype) with the
        step's scalars `hyper` (the same dtype), and writes rows and slots as
        insert_with does, in its transactions; a key whose gradient is not
        finite is left as it is, and a missing key starts from `missing`
        (an InitSpec or rows).  `state`: None, or the restrict policy's
        (RedisTable float64[1], "add" or "set", its initial value, the
        float64 scalar the step adds or sets: tfde/policy.py fused_state),
        written in the same transactions.  `rule`: the op's rule attrs (rule,
        momentum, nesterov, amsgrad, centered, slot_init, decay).  Returns the
        number of keys written."""
        others = list(slots) + ([] if state is None else [state[0]])
        if not all(self._shares_transactions_with(t) for t in others):
            raise ConfigError(
                f"the optimizer slots and policy state of Redis table {self.name!r} must be tables of the same "
                "Redis config and hash tags (a Variable's slots made with Variable.slot are)"
            )
        keys = as_keys(keys, self.key_dtype, self.name)
        defaults, init = native_missing_args(missing, self)
        states = {"state_value": []}
        if state is not None:
            _, mode, initial, value = state
            states = {
                "state_value": [tf.cast(value, tf.float64)],
                "state_mode": [mode],
                "state_init": [float(initial)],
            }
        return self._native_call(
            "apply",
            lambda: self._ops.tfde_redis_apply(
                keys,
                grads,
                defaults,
                _step_arg(step),
                hyper,
                dim=self.dim,
                Tothers=[t.value_dtype for t in others],
                **_other_tables_attrs(others),
                **states,
                **rule,
                **init,
                **self._attrs,
            ),
        )

    def _shares_transactions_with(self, table) -> bool:
        """Whether `table` can be written in the same Redis transactions as
        this table: the same servers and credentials, key dtype and buckets'
        hash tags (so bucket b of both is on one node and cluster slot)."""
        if not (
            isinstance(table, RedisTable)
            and table is not self
            and table.config == self.config
            and table.key_dtype == self.key_dtype
            and table._tags == self._tags
        ):
            return False
        if self.config.redis_connection_mode != 0:
            return True
        from redis.crc import key_slot  # a "{" in a table name would move its buckets off their tags' slots

        return all(key_slot(a.encode()) == key_slot(b.encode()) for a, b in zip(self._buckets, table._buckets))

    def accum(self, keys, deltas, missing):
        """Adds `deltas` to the rows of `keys` on the server (a missing key
        starts from `missing`), atomically per key: TfdeRedisAccum runs
        _ACCUM_LUA once per chunk of keys of a bucket, and a chunk sent
        again by a retry is applied once (its marker key)."""
        keys = as_keys(keys, self.key_dtype, self.name)
        deltas = as_deltas(deltas, self.value_dtype, self.dim, self.name)
        if isinstance(missing, InitSpec):
            init = self._ops.tfde_init_rows(keys, Tvalue=self.value_dtype, dim=self.dim, **missing.attrs())
        else:
            init = tf.broadcast_to(
                as_rows(missing, self.value_dtype, self.dim, self.name, "defaults"), [tf.size(keys), self.dim]
            )
        return self._native_call(
            "accum",
            lambda: self._ops.tfde_redis_accum(
                keys,
                deltas,
                init,
                dim=self.dim,
                script=_ACCUM_LUA,
                marker_ttl_s=ACCUM_MARKER_TTL_S,
                **self._attrs,
            ),
        )

    def remove(self, keys):
        keys = as_keys(keys, self.key_dtype, self.name)
        return self._native_call(
            "remove",
            lambda: self._ops.tfde_redis_remove(
                keys,
                Tvalue=self.value_dtype,
                dim=self.dim,
                script=_REMOVE_LUA,
                marker_ttl_s=ACCUM_MARKER_TTL_S,
                **self._attrs,
            ),
        )

    def clear(self):
        return self._native_call(
            "clear",
            lambda: self._ops.tfde_redis_clear(
                Tkey=self.key_dtype, Tvalue=self.value_dtype, dim=self.dim, **self._attrs
            ),
        )

    def size(self):
        return self._native_call(
            "size",
            lambda: self._ops.tfde_redis_size(
                Tkey=self.key_dtype, Tvalue=self.value_dtype, dim=self.dim, **self._attrs
            ),
        )

    def export_chunk(self, cursor, max_rows):
        """At most `max_rows` (keys, rows) from `cursor` (0 starts) and the
        cursor to continue from, or -1: TfdeRedisExport walks the buckets
        with HSCAN on the master (never a replica: a checkpoint must hold
        every acknowledged write)."""
        keys, rows, nxt = self._native_call(
            "export",
            lambda: self._ops.tfde_redis_export(
                tf.cast(cursor, tf.int64),
                tf.cast(max_rows, tf.int64),
                Tkey=self.key_dtype,
                Tvalue=self.value_dtype,
                dim=self.dim,
                **self._attrs,
            ),
        )
        return keys, rows, nxt

    @property
    def files_dir(self):
        """table_store_mode 1: where checkpoints dump the rows instead
        (model_lib_abs_dir/model_tag_runtime), else None."""
        if self.config.table_store_mode != 1:
            return None
        return os.path.join(self.config.model_lib_abs_dir, self.config.model_tag_runtime)

    @property
    def in_checkpoints(self) -> bool:
        """Whether checkpoints hold this table's rows: table_store_mode 0
        (yes) or 2 (no: Redis is the source of truth)."""
        return self.config.table_store_mode != 2

    def serving_view(self) -> "RedisServingTable":
        """A read-only view for SavedModels (see RedisServingTable)."""
        return RedisServingTable(self)

    def __repr__(self):
        return (
            f"RedisTable({self.name!r}, {self.key_dtype.name} -> {self.value_dtype.name}[{self.dim}], "
            f"{self.config.describe_servers()}, buckets={len(self._buckets)})"
        )


class RedisServingTable(Table):
    """A read-only view of a RedisTable through the native TfdeRedisFind op
    (backends/redis/): no Python at lookup time, so it can live in a
    SavedModel (tfde.export_for_serving(rows="store")) and runs wherever
    tfde's op library is loaded.  Reads the master (or the standalone
    server); the graph holds servers and bucket names but never a password:
    the serving process gives them in $TFDE_REDIS_PASSWORD and
    $TFDE_REDIS_SENTINEL_PASSWORD."""

    shared_between_workers = True
    in_checkpoints = False

    def __init__(self, table: RedisTable):
        self.name, self.key_dtype, self.value_dtype, self.dim = (
            table.name,
            table.key_dtype,
            table.value_dtype,
            table.dim,
        )
        # Passwords from the environment; the table's meta key is checked on
        # every new connection, never rewritten (a read-only view).
        self._attrs = native_attrs(table.config, table._buckets, table.name, meta_key=table._meta_key)
        self._ops = _native.load()

    def find(self, keys, missing):
        keys = as_keys(keys, self.key_dtype, self.name)
        defaults, init = native_missing_args(missing, self)
        return self._ops.tfde_redis_find(keys, defaults, _step_arg(None), dim=self.dim, **self._attrs, **init)

    def _read_only(self, *args, **kwargs):
        raise ConfigError(
            f"{self.name!r} is a read-only serving view of a Redis table; write through the training job's RedisTable"
        )

    insert = accum = remove = clear = size = export_chunk = _read_only

    def memory_bytes(self):
        return tf.constant(0, tf.int64)  # the rows live in Redis

    def __repr__(self):
        return f"RedisServingTable({self.name!r}, {len(self._attrs['buckets'])} buckets)"


@register_creator
class RedisTableCreator(TableCreator):
    """Creates RedisTables from a RedisTableConfig, a dict, a JSON path, or
    (None) the path in $TFDE_REDIS_CONFIG.  Tables of one creator share a
    connection pool."""

    @classmethod
    def from_config(cls, config: dict) -> "RedisTableCreator":
        """Configs are saved without passwords (get_config); a loading
        process gives them in $TFDE_REDIS_PASSWORD and
        $TFDE_REDIS_SENTINEL_PASSWORD."""
        config = dict(config)
        for field, env in (("redis_password", PASSWORD_ENV), ("redis_sentinel_password", SENTINEL_PASSWORD_ENV)):
            if os.environ.get(env):
                config[field] = os.environ[env]
        return cls(config)

    def __init__(self, config: Union[RedisTableConfig, dict, str, None] = None) -> None:
        self.config = RedisTableConfig.load(config)
        self._client = None
        self._credentials = None
        self.tables = []

    def _register_credentials(self) -> str:
        """Hands the passwords to the native ops under a random id; "" when
        there are none.  They go through a plain C function of the loaded op
        library (tfde_redis_register_credentials in backends/redis/ops.cc),
        called with ctypes: no op runs, so no tensor, attr or graph constant
        ever holds a password, eagerly, in tf.function or in a TF1 graph."""
        cfg = self.config
        if not (cfg.redis_password or cfg.redis_sentinel_password):
            return ""
        ident = uuid.uuid4().hex.encode()
        # RTLD_NOLOAD: the copy TensorFlow already loaded (whose registry the
        # ops read), never a second one.
        lib = ctypes.CDLL(str(_native.loaded_path()), mode=os.RTLD_NOW | os.RTLD_NOLOAD)
        register = lib.tfde_redis_register_credentials
        register.argtypes = [ctypes.c_char_p, ctypes.c_size_t] * 3
        register.restype = ctypes.c_int
        password, sentinel_password = cfg.redis_password.encode(), cfg.redis_sentinel_password.encode()
        register(ident, len(ident), password, len(password), sentinel_password, len(sentinel_password))
        return ident.decode()

    def create(self, name: str, key_dtype: tf.DType, value_dtype: tf.DType, dim: int) -> RedisTable:
        if self._client is None:
            self._client = _connect(self.config)
            self._credentials = self._register_credentials()
        table = RedisTable(
            name, key_dtype, value_dtype, dim, self.config, client=self._client, credentials=self._credentials
        )
        self.tables.append(table)
        return table

    def close(self) -> None:
        """Closes every table this creator made (sets their expiry)."""
        for table in self.tables:
            table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get_config(self) -> dict:
        """The config without its passwords (they are never written out)."""
        cfg = dataclasses.asdict(self.config)
        for name in ("redis_password", "redis_sentinel_password"):
            cfg.pop(name)
        return cfg
