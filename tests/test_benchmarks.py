"""Every benchmark command of benchmarks/README.md runs, in a quick form,
so that none can rot.  The figures are not checked: they are measured on a
shared machine and belong beside the reference system's in docs/benchmarks.md, not
in a test.  What is checked is that each command finishes and prints both
systems.  The TFRA reference venv comes from benchmarks/setup-tfra.sh
(scripts/test.sh builds it and sets TFRA_PYTHON), the Horovod interpreter
from scripts/test.sh (TFDE_HOROVOD_PYTHON)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# scripts/test.sh runs these one per core at once: no figure is checked.
pytestmark = pytest.mark.bench


def _needed(variable: str, what: str) -> str:
    path = os.environ.get(variable, "")
    if not path or not Path(path).exists():
        pytest.fail(f"${variable} does not name {what} ({path!r}); scripts/test.sh builds it and sets it")
    return path


def _bench(*args, timeout=900) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _written(out: str) -> Path:
    match = re.search(r"written: (\S+\.json)", out)
    assert match, out[-2000:]
    return ROOT / match.group(1)


def test_the_whole_run_quick_and_its_markdown_tables():
    _needed("TFRA_PYTHON", "the TFRA venv's python")
    out = _bench("benchmarks.run", "--quick")
    assert "reference: TFRA 0.8.1" in out, out[:2000]
    for part in (
        "find_batch4096_zipf",
        "call_floor_batch4096_identity",
        "redis op",
        "two-tower training",
        "TFRA tf-keras",
        "tfde Keras 3",
        "floor: frozen dense tables",
    ):
        assert part in out, (part, out[-3000:])
    tables = _bench("benchmarks.markdown", str(_written(out)))
    assert tables.count("|") > 20, tables


def test_e2e_on_redis_first_with_a_frequency_policy_on_both_sides():
    """The floor run goes with the first backend; with Redis first it used
    to crash clearing the tables of the layers it had swapped out.  Both
    sides' tables get a FrequencyRestrictPolicy (TFRA's side builds them
    the same way on every backend)."""
    _needed("TFRA_PYTHON", "the TFRA venv's python")
    out = _bench(
        "benchmarks.e2e_bench",
        "--backends",
        "redis",
        "--redis-interactions",
        "10000",
        "--epochs",
        "1",
        "--rounds",
        "1",
        "--policy",
        "frequency",
    )
    assert "floor: frozen dense tables" in out, out[-2000:]
    assert "restrict policy on both sides' tables: frequency" in out, out[-2000:]
    for side in ("TFRA tf-keras", "tfde tf-keras", "tfde Keras 3"):
        assert re.search(rf"{side}\s+[\d,]+\s+0\.\d+", out), (side, out[-2000:])


def test_checkpoint_bench_beside_tfra():
    _needed("TFRA_PYTHON", "the TFRA venv's python")
    out = _bench("benchmarks.checkpoint_bench", "--n", "20000")
    assert re.search(r"save s\s+[\d.]+\s+[\d.]+", out), out[-2000:]


@pytest.mark.parametrize("backend", ["cuckoo", "redis"])
def test_policy_bench(backend):
    out = _bench("benchmarks.policy_bench", "--vocab", "20000", "--steps", "5", "--rounds", "1", "--backend", backend)
    assert f"training step on {backend}" in out, out[-2000:]
    assert "frequency" in out and "timestamp" in out and "frequency, Python path" in out, out[-2000:]


def test_distributed_bench_quick_with_both_engines():
    horovod = _needed("TFDE_HOROVOD_PYTHON", "the Horovod environment's python")
    out = _bench("benchmarks.distributed_bench", "--quick", "--horovod-python", horovod, timeout=1200)
    for run in ("2 workers MWMS", "2 workers Horovod"):
        assert run in out, (run, out[-2000:])
    # What the rows counted cover: all a shared Redis store holds, worker 0's shard of sharded tables.
    assert re.search(r"2 workers MWMS +shared Redis .* [\d,]+ \(all workers: a shared store\)", out), out[-2000:]
    assert re.search(r"2 workers Horovod +sharded cuckoo .* [\d,]+ \(worker 0's shard\)", out), out[-2000:]


def test_semi_sync_bench_quick_and_again_from_its_results():
    out = _bench("benchmarks.semi_sync_bench", "--quick", timeout=1200)
    for layout in ("cuckoo", "cuckoo-copies", "cuckoo-local-slots", "redis"):
        for k in (1, 4):
            assert re.search(rf"two-tower {layout:<9}\s+{k}\s+[\d,]+", out), (layout, k, out[-2000:])
    # The ceiling of any k: two processes alone on the same cores, beside exact training.
    assert re.search(r"two-tower: two processes alone, no exchange .*: [\d,]+ examples/s = [\d.]+x", out), out[-2000:]
    again = _bench("benchmarks.semi_sync_bench", "--from", str(_written(out)))
    assert again.strip().splitlines()[-6:] == out.split("written:")[0].strip().splitlines()[-6:]


def test_dlrm_bench_table_of_several_rounds():
    # The median of two rounds' collective op counts [10, 10] was 10.0, which
    # the table's integer column refused after a 36-minute run: counts stay ints.
    import argparse

    from benchmarks import dlrm_bench

    one = {"steps": 43, "ms_per_step": 100.0, "examples_per_s": 80000.0, "loss": 0.5, "auc": 0.86}
    one.update(collective_ops_in_step=10, exchange_calls_per_step=4.0, plan=None)
    median = dlrm_bench.median_of([one, {**one, "ms_per_step": 120.0, "collective_ops_in_step": 12}])
    assert median["ms_per_step"] == 110.0 and median["collective_ops_in_step"] == 10
    assert median["rounds"] == 2
    run = ("tfde DistributedEmbedding", "tfde", "collection", ("auto", None), 2, "mwms", "python", "tf-keras")
    args = argparse.Namespace(
        features=26, max_cardinality=10**6, dim=16, batch_size=4096, examples=1000, skip=5, rounds=2
    )
    info = {"cpu": "cpu", "cores": 2, "git": "abc", "tf": "2.21"}
    text = dlrm_bench.table([{**median, "run": run}], info, args)
    assert "| 2 MWMS | tfde DistributedEmbedding | auto | 110.0 | 80,000 | 4.0 | – | – | 10 | 0.8600 |" in text


def test_dlrm_bench_quick_beside_tfra():
    """Every side of the many-feature benchmark: the floor, TFRA alone and
    under Horovod (HvdAllToAllEmbedding), tfde's layers alone, under MWMS
    and under Horovod."""
    tfra = _needed("TFRA_PYTHON", "the TFRA venv's python")
    horovod = _needed("TFDE_HOROVOD_PYTHON", "the Horovod environment's python")
    out = _bench(
        "benchmarks.dlrm_bench", "--quick", "--horovod-python", horovod, "--tfra-horovod-python", tfra, timeout=1200
    )
    for row in (
        "| 1 | floor: frozen dense tables |",
        "| 1 | TFRA per-feature Embedding |",
        "| 2 MWMS | tfde DistributedEmbedding | auto |",
        "| 2 Horovod | tfde DistributedEmbedding | round_robin, column slices of 8 |",
        "| 2 Horovod | TFRA HvdAllToAllEmbedding |",
    ):
        assert row in out, (row, out[-3000:])
    assert re.search(r"\| 2 MWMS \| tfde DistributedEmbedding \| auto \| [\d.]+ \| [\d,]+ \| 4\.0 \|", out), out[-3000:]
