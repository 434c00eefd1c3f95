"""Many sparse features: the DLRM-like model (13 dense, 26 categorical
features, dim 16, Adam, tf-keras model.fit) trained with per-feature tfde
layers, with one DistributedEmbedding (every placement plan), with TFRA
0.8.1's embedding layers, and with frozen dense tables (the floor: the same
network without embedding work), on 1 and 2 workers, MultiWorkerMirroredStrategy
and Horovod, side by side in one run.

Every run is benchmarks/dlrm_side.py in fresh processes, on the same data
(the demo's synthetic Criteo-like log, written once to an .npz) with the
same network (tfde/demo/dlrm_net.py), batch (per worker), optimizer, seed
and measurement: the median step time after `--skip` warm-up steps, from
a timestamp per step; collectives and their payload per step (tfde's
exchange statistics, worker 0); the collective ops in the traced training
step (tf.distribute's and Horovod's, dense all-reduces included); held-out
AUC after the same number of examples.  The runs alternate round by
round and each figure is the median over --rounds rounds (this shared VM
drifts by tens of percent within minutes).

  python -m benchmarks.dlrm_bench                    # everything (~25 min on 2 cores)
  python -m benchmarks.dlrm_bench --quick            # small data, 8 features, one run of each kind (CI)
  python -m benchmarks.dlrm_bench --only "2 workers MWMS"

Horovod runs take an interpreter whose environment has Horovod: tfde's from
scripts/test.sh (--horovod-python), TFRA's from `WITH_HOROVOD=1 bash
benchmarks/setup-tfra.sh` (--tfra-horovod-python; TFRA's Horovod row is
left out, said so, without it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import common

HERE = Path(__file__).resolve().parent
SIDE = HERE / "dlrm_side.py"
PLANS = [("rows", None), ("round_robin", None), ("memory_balanced", None), ("auto", None), ("round_robin", 8)]


def default_horovod_python() -> str:
    found = sorted(glob.glob(str(Path.home() / ".cache/tfde/venvs/horovod-*/bin/python")))
    return found[-1] if found else ""


def default_tfra_horovod_python() -> str:
    python = Path(common.TFRA_PYTHON)
    if (
        python.exists()
        and subprocess.run([str(python), "-c", "import horovod.tensorflow"], capture_output=True).returncode == 0
    ):
        return str(python)
    other = Path.home() / ".cache/tfde-anchors/tfra-horovod/bin/python"
    return str(other) if other.exists() else ""


def plan_name(placement: str, threshold) -> str:
    return placement if threshold is None else f"{placement}, column slices of {threshold}"


def runs(args) -> list:
    """(label, system, layers, plan, workers, engine, python, keras) of every run."""
    me = sys.executable
    out = [
        ("floor: frozen dense tables", "floor", "-", None, 1, None, me, "tf-keras"),
        ("TFRA per-feature Embedding", "tfra", "per-feature", None, 1, None, common.TFRA_PYTHON, "tf-keras"),
        ("tfde per-feature layers", "tfde", "per-feature", None, 1, None, me, "tf-keras"),
        ("tfde DistributedEmbedding", "tfde", "collection", ("auto", None), 1, None, me, "tf-keras"),
        ("tfde DistributedEmbedding", "tfde", "collection", ("auto", None), 1, None, me, "keras3"),
        ("tfde per-feature layers", "tfde", "per-feature", None, 2, "mwms", me, "tf-keras"),
    ]
    out += [("tfde DistributedEmbedding", "tfde", "collection", p, 2, "mwms", me, "tf-keras") for p in PLANS]
    if args.horovod_python:
        out.append(
            ("tfde per-feature layers", "tfde", "per-feature", None, 2, "horovod", args.horovod_python, "tf-keras")
        )
        out += [
            ("tfde DistributedEmbedding", "tfde", "collection", p, 2, "horovod", args.horovod_python, "tf-keras")
            for p in PLANS
        ]
    else:
        print(
            "no Horovod environment for tfde (run scripts/test.sh once, or --horovod-python): skipped", file=sys.stderr
        )
    if args.tfra_horovod_python:
        out.append(
            (
                "TFRA HvdAllToAllEmbedding",
                "tfra",
                "per-feature",
                None,
                2,
                "horovod",
                args.tfra_horovod_python,
                "tf-keras",
            )
        )
    else:
        print(
            "no TFRA environment with Horovod (WITH_HOROVOD=1 bash benchmarks/setup-tfra.sh, or "
            "--tfra-horovod-python): TFRA's Horovod row skipped",
            file=sys.stderr,
        )
    if args.quick:  # one run of each kind: every side's code runs
        keep = (
            "1 worker | floor",
            "1 worker | TFRA",
            "1 worker | tfde per-feature",
            "1 worker | tfde DistributedEmbedding | auto",
            "2 workers MWMS | tfde DistributedEmbedding | auto",
            "2 workers Horovod | tfde DistributedEmbedding | round_robin, column slices",
            "2 workers Horovod | TFRA",
        )
        out = [r for r in out if row_name(r).startswith(keep) and "Keras 3" not in row_name(r)]
    if args.only:
        out = [r for r in out if re.search(args.only, row_name(r))]
    return out


def row_name(r) -> str:
    label, _, _, plan, workers, engine, _, keras = r
    where = "1 worker" if workers == 1 else f"{workers} workers {'MWMS' if engine == 'mwms' else 'Horovod'}"
    return (
        f"{where} | {label}" + (f" | {plan_name(*plan)}" if plan else "") + (" | Keras 3" if keras == "keras3" else "")
    )


def run_one(r, data_path: str, args, tmp: str) -> dict:
    from tfde.distributed.launch import run_local

    label, system, layers, plan, workers, engine, python, keras = r
    out = Path(tempfile.mkstemp(suffix=".json", dir=tmp)[1])
    cfg = {
        "system": system,
        "engine": engine,
        "layers": layers,
        "placement": plan[0] if plan else "auto",
        "column_slice_threshold": plan[1] if plan else None,
        "data": data_path,
        "features": args.features,
        "batch_size": args.batch_size,
        "dim": args.dim,
        "learning_rate": args.learning_rate,
        "seed": 0,
        "steps": args.steps,
        "skip": args.skip,
        "out": str(out),
    }
    config = Path(tempfile.mkstemp(suffix=".json", dir=tmp)[1])
    config.write_text(json.dumps(cfg))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(HERE.parent)}
    env["PATH"] = f"{Path(python).parent}:{env['PATH']}"
    if keras == "tf-keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    else:
        env.pop("TF_USE_LEGACY_KERAS", None)
    log = Path(tmp) / f"{out.stem}.log"
    with open(log, "w") as f:
        saved = os.dup(1), os.dup(2)
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            code = run_local([str(config)], workers, engine or "mwms", env=env, program=[python, str(SIDE)])
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    if code != 0 or not out.read_text():
        raise RuntimeError(f"{row_name(r)} failed ({code}):\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def write_data(path: Path, args) -> None:
    from tfde.demo import clicks

    d = clicks.synthetic(args.examples, args.max_cardinality, seed=0)
    np.savez(
        path,
        train_dense=d.train_dense,
        train_cats=d.train_cats,
        train_labels=d.train_labels,
        test_dense=d.test_dense,
        test_cats=d.test_cats,
        test_labels=d.test_labels,
        cardinalities=np.array(d.cardinalities),
    )


def median_of(rounds: list) -> dict:
    """Every figure's median over the rounds; counts (ints) take the lower
    median, a value one round measured, so they stay whole numbers."""
    out = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rounds if r.get(key) is not None]
            middle = statistics.median_low if isinstance(value, int) else statistics.median
            out[key] = middle(values) if values else None
    out["rounds"] = len(rounds)
    return out


def table(results: list, info: dict, args) -> str:
    lines = [
        f"Machine: {info['cpu']}, {info['cores']} cores; tfde git {info['git']} (TF {info['tf']}); reference: TFRA "
        "0.8.1 on TF 2.16.2.",
        "",
        f"DLRM-like model, {args.features} categorical features (cardinalities 10..{args.max_cardinality:,}, Zipf ids) "
        f"+ 13 dense, dim {args.dim}, Adam, batch {args.batch_size} per worker, {args.examples:,} examples; "
        f"median step after {args.skip} warm-up steps, median of {args.rounds} alternating round(s):",
        "",
        "| workers | system | plan | ms/step | examples/s | collectives/step (tfde exchange) | KiB/step | "
        "ms/step in them | collective ops in step graph | AUC |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        label, _, _, plan, workers, engine, _, keras = r["run"]
        where = "1" if workers == 1 else f"{workers} {'MWMS' if engine == 'mwms' else 'Horovod'}"
        system = label + (" (Keras 3)" if keras == "keras3" else "")

        def fmt(key, spec):
            v = r.get(key)
            return "–" if v is None else format(v, spec)

        lines.append(
            f"| {where} | {system} | {plan_name(*plan) if plan else '–'} | {fmt('ms_per_step', '.1f')} | "
            f"{fmt('examples_per_s', ',.0f')} | {fmt('exchange_calls_per_step', '.1f')} | "
            f"{fmt('exchange_kib_per_step', ',.0f')} | {fmt('exchange_ms_per_step', '.1f')} | "
            f"{fmt('collective_ops_in_step', 'd')} | {fmt('auc', '.4f')} |"
        )
    return "\n".join(lines)


def ratios(results: list) -> list:
    """The issue's targets, as ratios of this run's figures."""
    by = {row_name(r["run"]): r for r in results}

    def ms(name):
        r = by.get(name)
        return None if r is None else r["ms_per_step"]

    out = []
    pairs = [
        (
            "2 workers MWMS: DistributedEmbedding (auto) / per-feature layers (target <= 0.55)",
            "2 workers MWMS | tfde DistributedEmbedding | auto",
            "2 workers MWMS | tfde per-feature layers",
        ),
        (
            "1 worker: DistributedEmbedding / floor (target <= 1.3)",
            "1 worker | tfde DistributedEmbedding | auto",
            "1 worker | floor: frozen dense tables",
        ),
        (
            "1 worker: DistributedEmbedding / TFRA per-feature Embedding",
            "1 worker | tfde DistributedEmbedding | auto",
            "1 worker | TFRA per-feature Embedding",
        ),
        (
            "2 workers Horovod: TFRA HvdAllToAllEmbedding / DistributedEmbedding (auto) (target >= 3)",
            "2 workers Horovod | TFRA HvdAllToAllEmbedding",
            "2 workers Horovod | tfde DistributedEmbedding | auto",
        ),
    ]
    for text, a, b in pairs:
        if ms(a) is not None and ms(b) is not None:
            out.append(f"{text}: {ms(a) / ms(b):.2f}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=400_000)
    p.add_argument("--max-cardinality", type=int, default=1_000_000)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--batch-size", type=int, default=4096, help="examples per worker and step")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=0.002)
    p.add_argument("--steps", type=int, default=None, help="steps per worker (default: one epoch of its share)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", help="a regular expression: only the runs whose row matches")
    p.add_argument("--horovod-python", default=default_horovod_python())
    p.add_argument("--tfra-horovod-python", default=default_tfra_horovod_python())
    p.add_argument(
        "--quick",
        action="store_true",
        help="small data and batches, 8 features, one round, one run of each kind (what CI runs)",
    )
    args = p.parse_args(argv)
    if args.quick:
        # 8 features, not 26: every side's code still runs, each job builds its graphs in a third of the time
        args.examples, args.max_cardinality, args.features, args.batch_size, args.steps, args.skip, args.rounds = (
            20_000,
            20_000,
            8,
            512,
            8,
            2,
            1,
        )
    from benchmarks.table_bench import machine, write_results

    info = machine()
    todo = runs(args)
    rounds = {i: [] for i in range(len(todo))}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "clicks.npz"
        write_data(data, args)
        for k in range(args.rounds):
            for i, r in enumerate(todo):
                rounds[i].append(run_one(r, str(data), args, tmp))
                print(f"  round {k + 1}: {row_name(r)}: {rounds[i][-1]}", flush=True)
    results = [{**median_of(rounds[i]), "run": r} for i, r in enumerate(todo)]
    text = table(results, info, args)
    print("\n" + text + "\n")
    for line in ratios(results):
        print(line)
    path = write_results(
        "dlrm", {"machine": info, "args": vars(args), "results": results, "table": text, "ratios": ratios(results)}
    )
    print(f"\nwritten: {path.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
