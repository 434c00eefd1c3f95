"""Start N workers of one command on this machine.

  run_local(["train", "--epochs", "1"], workers=2, engine="mwms")

engine "mwms": N processes of `python -m tfde_cli ...`, each with a TF_CONFIG for
MultiWorkerMirroredStrategy on free loopback ports (worker 0 is the chief and
prints; the others log to files).  engine "horovod": `horovodrun -np N -H
localhost:N --gloo python -m tfde_cli ...`.  Either way the exit status is the
first failure's, and when one worker fails the others are stopped rather than
left waiting for it.  On several machines, start the same command yourself on
each with TF_CONFIG listing every worker, or with horovodrun -H host1:1,host2:1
(see docs/distributed.md, 'Launching').
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

ENGINES = ("mwms", "horovod")
POLL_S = 0.5


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(ports: List[int], index: int) -> str:
    return json.dumps(
        {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
    )


def run_local(
    argv: List[str], workers: int, engine: str = "mwms", env=None, program: Optional[List[str]] = None
) -> int:
    """Runs `python -m tfde_cli *argv` as `workers` processes; returns the exit status.
    program: what each worker runs instead of `python -m tfde_cli` (e.g. [python, script.py]; a
    benchmark's worker in another environment), argv coming after it."""
    program = list(program) if program else [sys.executable, "-m", "tfde_cli"]
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    env = dict(os.environ if env is None else env)
    if engine == "horovod":
        horovodrun = shutil.which("horovodrun", path=os.path.dirname(program[0])) or shutil.which("horovodrun")
        if horovodrun is None:
            raise FileNotFoundError(
                "horovodrun not found: install Horovod in this environment (HOROVOD_WITH_TENSORFLOW=1 "
                "HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 pip install --no-build-isolation horovod==0.28.1; it "
                "builds against TF <= 2.16) or use --engine mwms"
            )
        cmd = [
            horovodrun,
            "-np",
            str(workers),
            "-H",
            f"localhost:{workers}",
            "--gloo",
            *program,
            *argv,
        ]
        return subprocess.call(cmd, env=env)
    ports = free_ports(workers)
    logs = tempfile.mkdtemp(prefix="tfde-workers-")
    procs = []
    for i in range(workers):
        out = None if i == 0 else open(os.path.join(logs, f"worker-{i}.log"), "w")
        procs.append(
            subprocess.Popen(
                [*program, *argv],
                env={**env, "TF_CONFIG": tf_config(ports, i)},
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
            )
        )
    if workers > 1:
        print(
            f"started {workers} workers (MultiWorkerMirroredStrategy on ports {ports}); logs of workers "
            f"1..{workers - 1}: {logs}",
            flush=True,
        )
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                print(
                    f"worker {i} exited with status {code}; stopping the others (log: "
                    f"{'stdout' if i == 0 else os.path.join(logs, f'worker-{i}.log')})",
                    file=sys.stderr,
                )
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
