"""Throwaway Redis deployments on loopback for the tests: a 3-master cluster,
a master watched by a sentinel, and the same two with a replica, each
started once per test session on free ports and stopped at exit.  Traffic stays on 127.0.0.1."""

import atexit
import shutil
import socket
import subprocess
import tempfile
import time

import redis

_procs = []
_cache = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid."""
    for _ in range(1000):
        p = free_port()
        if p < 55000:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                pass
    raise RuntimeError("no free port pair for a Redis cluster node")


def _server(*args, cwd=None):
    proc = subprocess.Popen(
        [shutil.which("redis-server"), *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _procs.append(proc)
    return proc


class _PortTaken(Exception):
    """The server exited before it answered: another process bound its port
    between free_port() and the server's own bind."""


def _wait(predicate, what, timeout_s=20.0, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise _PortTaken(what)
        try:
            if predicate() and (proc is None or proc.poll() is None):
                return
        except (redis.ConnectionError, redis.ResponseError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")


def _on_a_free_port(start, pick=None, attempts=5):
    """start(port) -> the server's process, waited for with _wait(proc=):
    a port another process took first is given up for a new one."""
    for _ in range(attempts):
        port = (pick or free_port)()
        try:
            start(port)
            return port
        except _PortTaken:
            continue
    raise RuntimeError(f"no redis-server could bind a free port in {attempts} attempts")


def standalone(extra=()):
    """A fresh standalone server; returns its port."""

    def start(port):
        proc = _server("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra)
        _wait(lambda: redis.Redis(port=port, password=_password(extra)).ping(), f"redis-server on {port}", proc=proc)

    return _on_a_free_port(start)


class Restartable:
    """A standalone server that can be killed (-9) and started again on the
    same port: with its data (persist: every change goes to its append-only
    file) or empty."""

    def __init__(self, persist: bool = True):
        self.dir = tempfile.mkdtemp(prefix="tfde-aof-")
        self.persist = persist  # False: it comes back empty
        self.proc = None
        self.port = _on_a_free_port(self._start_on)

    def _start_on(self, port):
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        self.proc = _server("--port", str(port), "--bind", "127.0.0.1", "--save", "", *aof, "--dir", self.dir)
        _wait(lambda: redis.Redis(port=port).ping(), f"redis-server on {port}", proc=self.proc)

    def start(self):
        """Again, on its port (the data comes back from the append-only file)."""
        self._start_on(self.port)

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


def _password(extra):
    extra = list(extra)
    return extra[extra.index("--requirepass") + 1] if "--requirepass" in extra else None


def _cluster_node(work: str) -> int:
    """Port of a new cluster-enabled server (no slots yet) keeping its node
    file in `work`."""

    def start(p):
        proc = _server(
            "--port",
            str(p),
            "--bind",
            "127.0.0.1",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"nodes-{p}.conf",
            "--save",
            "",
            "--appendonly",
            "no",
            cwd=work,
        )
        _wait(lambda: redis.Redis(port=p).ping(), f"cluster node {p}", proc=proc)

    return _on_a_free_port(start, pick=cluster_port)


def _create_cluster(ports, replicas: int) -> None:
    """Makes the cluster nodes on `ports` one cluster (`replicas` per
    master), once every slot is served."""
    subprocess.run(
        [shutil.which("redis-cli"), "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
         "--cluster-replicas", str(replicas), "--cluster-yes"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    _wait(lambda: all(_cluster_ok(p) for p in ports), "cluster_state:ok")


def _master_of(port: int, key: str) -> int:
    """Port of the master serving `key`'s slot, as the node on `port` says."""
    slot = redis.Redis(port=port).execute_command("CLUSTER KEYSLOT", key)
    for entry in redis.Redis(port=port).execute_command("CLUSTER SLOTS"):
        if entry[0] <= slot <= entry[1]:
            return int(entry[2][1])
    raise RuntimeError(f"no master serves slot {slot}")


def cluster():
    """Ports of a 3-master cluster (no replicas), slots all assigned."""
    if "cluster" not in _cache:
        work = tempfile.mkdtemp(prefix="tfde-cluster-")

        ports = [_cluster_node(work) for _ in range(3)]
        _create_cluster(ports, 0)
        _cache["cluster"] = ports
    return _cache["cluster"]


def _cluster_ok(port) -> bool:
    info = redis.Redis(port=port).execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        return info.get("cluster_state") == "ok"
    return b"cluster_state:ok" in info


def _sentinel(name: str, master: int, ready, settings: str = "") -> int:
    """Port of a new sentinel watching the server on `master` as `name`
    (quorum 1, plus `settings` lines for it), once ready(sentinel client)."""

    def start(port):
        conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
        conf.write(f"port {port}\nbind 127.0.0.1\nsentinel monitor {name} 127.0.0.1 {master} 1\n{settings}")
        conf.close()
        proc = _server(conf.name, "--sentinel")
        _wait(lambda: ready(redis.Redis(port=port)), f"sentinel on {port} watching {name}", proc=proc)

    return _on_a_free_port(start)


def _replica_up(name: str, replica: int):
    """A ready() for _sentinel: the sentinel reports `replica` up and in sync."""
    return lambda client: any(
        int(r["port"]) == replica and r["flags"] == "slave" and r["master-link-status"] == "ok"
        for r in client.sentinel_slaves(name)
    )


def sentinel():
    """(sentinel port, master port) with the master monitored as 'master'."""
    if "sentinel" not in _cache:
        master = standalone()
        port = _sentinel(
            "master",
            master,
            lambda client: client.execute_command("SENTINEL get-master-addr-by-name master"),
            "sentinel down-after-milliseconds master 2000\n",
        )
        _cache["sentinel"] = (port, master)
    return _cache["sentinel"]


def replica_of(master_port: int, extra=()) -> int:
    """Port of a new replica of the server on master_port, once its link is
    up.  It accepts writes of its own too (replica-read-only no), so a test
    can plant a row only the replica holds and tell which server answered."""

    def start(port):
        proc = _server(
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--replicaof",
            "127.0.0.1",
            str(master_port),
            "--replica-read-only",
            "no",
            "--dir",
            tempfile.mkdtemp(prefix="tfde-replica-"),  # where the replica loads its master's snapshot
            *extra,
        )
        _wait(
            lambda: redis.Redis(port=port).info("replication").get("master_link_status") == "up",
            f"replica on {port} of {master_port}",
            proc=proc,
        )

    return _on_a_free_port(start)


def sentinel_with_replica():
    """(sentinel port, master port, replica port): a master with one replica,
    watched as 'replicated' by a sentinel that reports the replica up."""
    if "sentinel_with_replica" not in _cache:
        master = standalone()
        replica = replica_of(master)
        port = _sentinel("replicated", master, _replica_up("replicated", replica))
        _cache["sentinel_with_replica"] = (port, master, replica)
    return _cache["sentinel_with_replica"]


def cluster_with_replica():
    """(master port, replica port): a cluster of one master holding every
    slot and one replica of it (redis-cli --cluster create wants 3 masters;
    this is built by hand: ADDSLOTSRANGE, MEET, REPLICATE)."""
    if "cluster_with_replica" not in _cache:
        work = tempfile.mkdtemp(prefix="tfde-cluster-replica-")
        master, replica = _cluster_node(work), _cluster_node(work)
        admin, follower = redis.Redis(port=master), redis.Redis(port=replica)
        admin.execute_command("CLUSTER ADDSLOTSRANGE 0 16383")
        follower.execute_command("CLUSTER MEET", "127.0.0.1", master)
        master_id = admin.execute_command("CLUSTER MYID")
        master_id = master_id.decode() if isinstance(master_id, bytes) else master_id

        nodes = lambda: follower.execute_command("CLUSTER NODES")  # noqa: E731
        _wait(lambda: master_id in str(nodes()), f"cluster node {replica} to meet {master}")
        follower.execute_command("CLUSTER REPLICATE", master_id)
        _wait(
            lambda: follower.info("replication").get("master_link_status") == "up",
            f"cluster replica {replica} of {master}",
        )
        _wait(lambda: _cluster_ok(master) and _cluster_ok(replica), "cluster_state:ok")
        # The master learns of its replica by gossip: CLUSTER SLOTS lists it then.
        _wait(
            lambda: str(replica) in str(admin.execute_command("CLUSTER SLOTS")),
            f"CLUSTER SLOTS of {master} to list replica {replica}",
        )
        _cache["cluster_with_replica"] = (master, replica)
    return _cache["cluster_with_replica"]


class FailoverGroup:
    """A master, its replica and a sentinel that fails over quickly
    (down-after-milliseconds 1000), for tests that kill the master: each
    group is the test's own.  Attributes: sentinel, master, replica (ports)."""

    def __init__(self):
        self.master_proc = None

        def start_master(port):
            self.master_proc = _server("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
            _wait(lambda: redis.Redis(port=port).ping(), f"redis-server on {port}", proc=self.master_proc)

        self.master = _on_a_free_port(start_master)
        self.replica = replica_of(self.master)

        self.sentinel = _sentinel(
            "group",
            self.master,
            _replica_up("group", self.replica),
            "sentinel down-after-milliseconds group 1000\nsentinel failover-timeout group 5000\n",
        )

    def kill_master(self) -> None:
        """kill -9 the master, once the replica holds everything it wrote."""
        assert redis.Redis(port=self.master).execute_command("WAIT", 1, 5000) == 1
        self.master_proc.kill()
        self.master_proc.wait(timeout=10)

    def promoted(self) -> bool:
        """Whether the sentinel now names the replica as the master."""
        found = redis.Redis(port=self.sentinel).sentinel_get_master_addr_by_name("group")
        return found is not None and int(found[1]) == self.replica


class FailoverCluster:
    """3 masters, each with one replica, that fail over quickly
    (cluster-node-timeout 1000), for tests that kill a master: each is the
    test's own.  Attributes: ports (all six), procs (port -> process)."""

    def __init__(self):
        work = tempfile.mkdtemp(prefix="tfde-failover-cluster-")
        self.procs = {}

        def start(p):
            proc = _server(
                "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{p}.conf", "--cluster-node-timeout", "1000",
                "--save", "", "--appendonly", "no", cwd=work,
            )  # fmt: skip
            _wait(lambda: redis.Redis(port=p).ping(), f"cluster node {p}", proc=proc)
            self.procs[p] = proc

        self.ports = [_on_a_free_port(start, pick=cluster_port) for _ in range(6)]
        _create_cluster(self.ports, 1)
        _wait(lambda: len(self._replicas()) == 3, "every master's replica")

    def _replicas(self):
        return [r for r in redis.Redis(port=self.ports[0]).execute_command("CLUSTER SLOTS") if len(r) > 3]

    def master_of(self, key: str) -> int:
        """Port of the master serving `key`'s slot."""
        return _master_of(self.ports[0], key)

    def kill(self, port: int) -> None:
        """kill -9 the master on `port`, once its replica holds everything it wrote."""
        assert redis.Redis(port=port).execute_command("WAIT", 1, 5000) == 1
        self.procs[port].kill()
        self.procs[port].wait(timeout=10)


class MigratingCluster:
    """3 masters (redis-cli's least), no replicas, the test's own: for tests
    that move a slot from one master to another by hand, as `redis-cli --cluster reshard`
    does, holding the migration open as long as they like.  Attributes:
    ports."""

    def __init__(self):
        work = tempfile.mkdtemp(prefix="tfde-migrating-cluster-")
        self.ports = [_cluster_node(work) for _ in range(3)]
        _create_cluster(self.ports, 0)

    def _node(self, port: int):
        return redis.Redis(port=port)

    def _id(self, port: int) -> str:
        return self._node(port).execute_command("CLUSTER MYID").decode()

    def master_of(self, key: str) -> int:
        return _master_of(self.ports[0], key)

    def begin(self, key: str) -> tuple:
        """Opens the migration of `key`'s slot to another master (IMPORTING
        on it, MIGRATING here); returns (slot, source port, target port)."""
        slot = self._node(self.ports[0]).execute_command("CLUSTER KEYSLOT", key)
        source = self.master_of(key)
        target = next(p for p in self.ports if p != source)
        self._node(target).execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self._id(source))
        self._node(source).execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self._id(target))
        return slot, source, target

    def keys_in(self, port: int, slot: int) -> list:
        return sorted(self._node(port).execute_command("CLUSTER GETKEYSINSLOT", slot, 100000))

    def move(self, slot: int, source: int, target: int, keys) -> None:
        """MIGRATE `keys` (of `slot`) from source to target in one call."""
        self._node(source).execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)

    def finish(self, slot: int, target: int) -> None:
        """Hands the slot to `target` on every master, ending the migration."""
        for port in [target] + [p for p in self.ports if p != target]:
            self._node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", self._id(target))

    def asking_calls(self, port: int) -> int:
        """How many ASKING commands the server on `port` has served."""
        stats = self._node(port).info("commandstats")
        return int(stats.get("cmdstat_asking", {}).get("calls", 0))


def forget(name: str) -> None:
    """A test stopped a server of deployment `name` (its helper's name): the
    next call of the helper starts a new one."""
    _cache.pop(name, None)


@atexit.register
def _stop_all():
    for proc in _procs:
        proc.terminate()
    for proc in _procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
