"""Throwaway Redis deployments on loopback for the tests: a 3-master cluster
and a master watched by a sentinel, each started once per test session on
free ports and stopped at exit.  Traffic stays on 127.0.0.1."""

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
    proc = subprocess.Popen([shutil.which("redis-server"), *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _procs.append(proc)
    return proc


def _wait(predicate, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.ConnectionError, redis.ResponseError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")


def standalone(extra=()):
    """A fresh standalone server; returns its port."""
    port = free_port()
    _server("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra)
    _wait(lambda: redis.Redis(port=port, password=_password(extra)).ping(), f"redis-server on {port}")
    return port


class Restartable:
    """A standalone server that writes every change to its append-only file,
    so it can be killed (-9) and started again on the same port with its data."""

    def __init__(self):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tfde-aof-")
        self.proc = None
        self.start()

    def start(self):
        self.proc = _server("--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                            "--appendfsync", "always", "--dir", self.dir)
        _wait(lambda: redis.Redis(port=self.port).ping(), f"redis-server on {self.port}")

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


def _password(extra):
    extra = list(extra)
    return extra[extra.index("--requirepass") + 1] if "--requirepass" in extra else None


def cluster():
    """Ports of a 3-master cluster (no replicas), slots all assigned."""
    if "cluster" not in _cache:
        work = tempfile.mkdtemp(prefix="tfde-cluster-")
        ports = [cluster_port() for _ in range(3)]
        for p in ports:
            _server("--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
                    f"nodes-{p}.conf", "--save", "", "--appendonly", "no", cwd=work)
        for p in ports:
            _wait(lambda p=p: redis.Redis(port=p).ping(), f"cluster node {p}")
        subprocess.run([shutil.which("redis-cli"), "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        _wait(lambda: all(_cluster_ok(p) for p in ports), "cluster_state:ok")
        _cache["cluster"] = ports
    return _cache["cluster"]


def _cluster_ok(port) -> bool:
    info = redis.Redis(port=port).execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        return info.get("cluster_state") == "ok"
    return b"cluster_state:ok" in info


def sentinel():
    """(sentinel port, master port) with the master monitored as 'master'."""
    if "sentinel" not in _cache:
        master = standalone()
        port = free_port()
        conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
        conf.write(f"port {port}\nbind 127.0.0.1\nsentinel monitor master 127.0.0.1 {master} 1\n"
                   "sentinel down-after-milliseconds master 2000\n")
        conf.close()
        _server(conf.name, "--sentinel")
        _wait(lambda: redis.Redis(port=port).execute_command("SENTINEL get-master-addr-by-name master"),
              f"sentinel on {port}")
        _cache["sentinel"] = (port, master)
    return _cache["sentinel"]


@atexit.register
def _stop_all():
    for proc in _procs:
        proc.terminate()
    for proc in _procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
