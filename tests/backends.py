"""The one registry of table backends the tests run on.

  BACKENDS[name]() -> a made backend: .creator (a tfde TableCreator),
  .create(name, key_dtype, value_dtype, dim), .cleanup() (deletes what it
  stored), .data_ports (the Redis servers that hold its data)

Names: "cuckoo" (native, in process), "reference" (a dict: the executable
spec, the oracle of tests/test_tables.py), "redis" (the standalone server
scripts/test.sh starts on 6379), "redis-cluster" and "redis-sentinel"
(started by tests/redis_servers.py).  Redis backends keep their tables under
a model tag of their own, so runs and tests never meet.  Subsets for the
suites: TABLE_BACKENDS (every store the table suite checks against the
reference), VARIABLE_BACKENDS (what Variable-level tests run on)."""

import uuid

import redis
import redis_servers

import tfde
from tfde.tables import CuckooTableCreator, ReferenceTableCreator

REDIS_PORT = 6379  # the standalone server scripts/test.sh makes sure of


class Plain:
    """An in-process backend: nothing to clean up."""

    data_ports = ()

    def __init__(self, creator):
        self.creator = creator

    def create(self, *args):
        return self.creator.create(*args)

    def cleanup(self):
        pass


class FreshRedis:
    """A RedisTableCreator whose tables live under a model tag of their own.
    mode: 2 the standalone server on 6379, 0 a 3-master cluster, 1 a
    sentinel-watched master."""

    def __init__(self, mode=2, **config):
        self.tag = f"tfde-test-{uuid.uuid4().hex[:12]}"
        cfg = {
            "model_tag_runtime": self.tag,
            "storage_slice": 3,
            "keys_sending_size": 7,
            "redis_connection_mode": mode,
            **config,
        }
        if mode == 2:
            cfg["redis_host_port"] = REDIS_PORT
            self.data_ports = [REDIS_PORT]
        elif mode == 0:
            self.data_ports = redis_servers.cluster()
            cfg.update(redis_host_ip=["127.0.0.1"] * 3, redis_host_port=self.data_ports)
        else:
            sentinel_port, master_port = redis_servers.sentinel()
            self.data_ports = [master_port]
            cfg.update(redis_host_port=sentinel_port, redis_master_name="master")
        self.creator = tfde.RedisTableCreator(cfg)

    def create(self, *args):
        return self.creator.create(*args)

    def cleanup(self):
        for port in self.data_ports:
            client = redis.Redis(port=port)
            for key in list(client.scan_iter(match=f"{self.tag}:*")):
                client.delete(key)  # one by one: a cluster node refuses keys of several slots in one DEL


BACKENDS = {
    "cuckoo": lambda: Plain(CuckooTableCreator()),
    "reference": lambda: Plain(ReferenceTableCreator()),
    "redis": FreshRedis,
    "redis-cluster": lambda: FreshRedis(mode=0),
    "redis-sentinel": lambda: FreshRedis(mode=1),
}
TABLE_BACKENDS = ("cuckoo", "redis", "redis-cluster", "redis-sentinel")
VARIABLE_BACKENDS = ("cuckoo", "reference", "redis")
