"""Semi-synchronous training against exact training: 2 MWMS workers of the
two-tower demo and of the DLRM demo, a sync every k in {1, 4, 16, 64} steps
(k = 1 is exact training), on sharded cuckoo tables (fetching each key
from its owner; with copies of the tables on every worker: "cuckoo-copies",
--sync-replicate; and the copies keeping each worker's optimizer slots:
"cuckoo-local-slots", --sync-replicate --sync-local-slots) and on a shared
Redis store (docs/semi-sync.md).

Each run is `tfde train --workers 2 --sync-every K --exchange-stats` (tf-keras
model.fit) on the same synthetic data for the same number of epochs, so every
k sees the same examples.  Reported per run: examples/s (all workers; the
median epoch, so the first epoch's tracing is left out when there are 3;
an epoch's time includes the sync at its end),
payload KiB and ms per step inside tfde's collectives (the dense weights'
average at a sync included; waiting for the other worker too), and held-out
quality: recall@100 (two-tower) or AUC (DLRM), with the ratio to k = 1.
Beside them, the ceiling of any k on this host: two `tfde train` processes
alone at once, each on half the data (what one worker trains), with no
exchange at all ("two processes alone").

  python -m benchmarks.semi_sync_bench                 # 28 runs, about 38 minutes on 2 cores
  python -m benchmarks.semi_sync_bench --quick         # small data, k in {1, 4}: what CI runs
  python -m benchmarks.semi_sync_bench --plot docs/images/semi-sync-tradeoff.png   # also draws (matplotlib)
  python -m benchmarks.semi_sync_bench --from benchmarks/results/semi-sync-*.json --plot out.png  # a run again

Two workers on a 2-core machine share the cores: the exchange's waiting
time is what semi-synchronous training saves, and the figures show how much
of a step it is here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from benchmarks.distributed_bench import parse

HERE = Path(__file__).resolve().parent
COPIES = ("cuckoo-copies", "cuckoo-local-slots")  # layouts with copies (the same program as cuckoo at k = 1)
MODELS = {
    # model: (flags, quality key, quality name)
    "two-tower": (["--interactions", "{size}", "--users", "{users}", "--items", "{items}"], "recall", "recall@100"),
    "dlrm": (["--model", "dlrm", "--examples", "{size}"], "auc", "AUC"),
}


def run(
    model: str, layout: str, every: int, size: int, epochs: int, port: int, tmp: str, users=20_000, items=5_000
) -> dict:
    flags, _, _ = MODELS[model]
    cmd = [sys.executable, "-m", "tfde", "train", "--keras", "tf-keras", "--epochs", str(epochs)]
    cmd += [f.format(size=size, users=users, items=items) for f in flags]
    cmd += ["--workers", "2", "--engine", "mwms", "--exchange-stats", "--sync-every", str(every)]
    tag = None
    if layout in COPIES:
        cmd += ["--sync-replicate"] + (["--sync-local-slots"] if layout == "cuckoo-local-slots" else [])
    if layout == "redis":
        tag = f"semi-bench-{uuid.uuid4().hex[:8]}"
        cfg = Path(tmp) / f"{tag}.json"
        cfg.write_text(json.dumps({"redis_host_port": port, "model_tag_runtime": tag, "storage_slice": 2}))
        cmd += ["--backend", "redis", "--redis-config", str(cfg)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, env=env, timeout=3600)
    finally:
        if tag is not None:
            import redis

            client = redis.Redis(port=port)
            stale = list(client.scan_iter(match=f"{tag}:*"))
            if stale:
                client.delete(*stale)
    # `tfde train` exits with 1 when the model does not beat its baseline
    # (most-popular items, or the dense features alone): a figure here.
    below_baseline = "did not beat" in proc.stdout + proc.stderr
    if proc.returncode != 0 and not (proc.returncode == 1 and below_baseline):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    out = parse(proc.stdout)
    out["beat_baseline"] = not below_baseline
    m = re.search(r"held-out AUC: ([\d.]+)", proc.stdout)
    if m:
        out["auc"] = float(m.group(1))
    return out


def alone(model: str, size: int, epochs: int, users=20_000, items=5_000) -> dict:
    """Two single-process trainings at once, each on half the data: what
    the two workers do between syncs with no exchange and no sync at all,
    on the same cores.  Their examples/s, summed, bound any k's."""
    flags, _, _ = MODELS[model]
    cmd = [sys.executable, "-m", "tfde", "train", "--keras", "tf-keras", "--epochs", str(epochs)]
    cmd += [f.format(size=size // 2, users=users, items=items) for f in flags]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent, env=env)
        for _ in range(2)
    ]
    rates = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        figures = parse(out)
        if proc.returncode not in (0, 1) or "examples_per_s" not in figures:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-2000:]}\n{err[-3000:]}")
        rates.append(figures["examples_per_s"])
    return {"examples_per_s": sum(rates), "each": rates}


def exact_run(results: list, model: str):
    """The model's exact training (sharded cuckoo, k = 1) among `results`, or None."""
    return next((r for r in results if r["model"] == model and r["layout"] == "cuckoo" and r["every"] == 1), None)


def ceiling_lines(results: list, bounds: dict) -> list:
    """One line per model: the two processes alone against exact training."""
    lines = []
    for model, b in bounds.items():
        exact = exact_run(results, model)
        ratio = f" = {b['examples_per_s'] / exact['examples_per_s']:.2f}x sharded cuckoo k=1" if exact else ""
        lines.append(
            f"{model}: two processes alone, no exchange (the ceiling of any k here): "
            f"{b['examples_per_s']:,.0f} examples/s{ratio}"
        )
    return lines


def table(results: list) -> str:
    lines = [
        f"{'model':<10}{'layout':<20}{'k':>4}{'examples/s':>12}{'× k=1':>7}{'KiB/step':>10}{'exchange ms':>12}"
        f"{'step ms':>9}{'quality':>19}{'× k=1':>7}"
    ]
    base = {(r["model"], r["layout"]): r for r in results if r["every"] == 1}
    for r in results:
        b = base.get((r["model"], r["layout"]))
        _, key, name = MODELS[r["model"]]
        speed = f"{r['examples_per_s'] / b['examples_per_s']:.2f}" if b else "-"
        quality = f"{r[key] / b[key]:.3f}" if b and key in r and key in b else "-"
        lines.append(
            f"{r['model']:<10}{r['layout']:<20}{r['every']:>4}{r.get('examples_per_s', 0):>12,.0f}{speed:>7}"
            f"{r.get('kib_per_step', 0):>10,.0f}{r.get('exchange_ms', 0):>12.1f}{r.get('step_ms', 0):>9.1f}"
            f"{name + ' ' + format(r.get(key, 0), '.4f'):>19}{quality:>7}"
        )
    return "\n".join(lines)


def plot(results: list, path: str, info: dict, bounds=None) -> None:
    """Examples/s and quality against k, per model and layout (a PNG); with
    `bounds`, each model's two processes alone as a dashed line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib: pip install matplotlib ({e})") from e
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for (model, layout), marker in zip(
        sorted({(r["model"], r["layout"]) for r in results}), ["o", "s", "^", "D", "v", "P", "X", "*"]
    ):
        runs = sorted((r for r in results if r["model"] == model and r["layout"] == layout), key=lambda r: r["every"])
        _, key, name = MODELS[model]
        base = runs[0]
        ks = [r["every"] for r in runs]
        label = f"{model}, {layout}"
        axes[0].plot(ks, [r["examples_per_s"] / base["examples_per_s"] for r in runs], marker=marker, label=label)
        axes[1].plot(ks, [r[key] / base[key] for r in runs], marker=marker, label=f"{label} ({name})")
    for model, b in (bounds or {}).items():
        exact = exact_run(results, model)
        if exact:
            ceiling = b["examples_per_s"] / exact["examples_per_s"]
            axes[0].axhline(ceiling, linestyle="--", color="grey", linewidth=1)
            axes[0].annotate(f"{model}: two processes alone", (1, ceiling), fontsize=7, color="grey", va="bottom")
    ticks = sorted({r["every"] for r in results})
    for ax, title in zip(axes, ["examples/s relative to k = 1 (exact)", "held-out quality relative to k = 1"]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(k) for k in ticks])
        ax.set_xlabel("k: steps between syncs")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"2 MWMS workers, {info['cpu']}, {info['cores']} cores, tfde git {info['git']}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", default="1,4,16,64", help="the values of k, comma-separated (1 is the baseline)")
    p.add_argument("--models", default="two-tower,dlrm")
    p.add_argument("--layouts", default="cuckoo,cuckoo-copies,cuckoo-local-slots,redis")
    p.add_argument("--interactions", type=int, default=200_000, help="two-tower data")
    p.add_argument("--examples", type=int, default=200_000, help="DLRM data")
    p.add_argument("--epochs", type=int, default=3, help="two-tower epochs")
    p.add_argument("--dlrm-epochs", type=int, default=3)
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--plot", help="also draw the trade-off curves into this PNG (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="two-tower, small data, 1 epoch, k in {1, 4}: ~2 minutes")
    p.add_argument("--no-alone", action="store_true", help="leave out the two processes alone (the ceiling)")
    p.add_argument("--from", dest="source", help="print (and --plot) the results JSON of an earlier run; runs nothing")
    args = p.parse_args(argv)
    if args.source:
        saved = json.loads(Path(args.source).read_text())
        print(table(saved["runs"]))
        print("\n".join(ceiling_lines(saved["runs"], saved.get("alone", {}))))
        if args.plot:
            plot(saved["runs"], args.plot, saved["machine"], saved.get("alone"))
            print(f"plot: {args.plot}")
        return 0
    if args.quick:
        args.every, args.models, args.interactions, args.epochs = "1,4", "two-tower", 40_000, 1
    everies = [int(k) for k in args.every.split(",")]
    if 1 not in everies or any(k < 1 for k in everies):
        p.error("--every must list k = 1 (the baseline) and values >= 1")
    from benchmarks.table_bench import machine, write_results

    info = machine()
    results, bounds = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            size = args.interactions if model == "two-tower" else args.examples
            epochs = args.epochs if model == "two-tower" else args.dlrm_epochs
            vocab = (2_000, 1_000) if args.quick else (20_000, 5_000)
            if not args.no_alone:
                bounds[model] = alone(model, size, epochs, *vocab)
                print(f"  {model}, two processes alone: {bounds[model]}", flush=True)
            for layout in args.layouts.split(","):
                for every in sorted(everies):
                    exact = exact_run(results, model)
                    if layout in COPIES and every == 1 and exact:
                        # The same program: replicate changes nothing at k = 1.
                        r = {k: v for k, v in exact.items() if k not in ("model", "layout", "every")}
                    else:
                        r = run(model, layout, every, size, epochs, args.port, tmp, *vocab)
                    results.append({"model": model, "layout": layout, "every": every, **r})
                    print(f"  {model}, {layout}, k={every}: {r}", flush=True)
    print(
        f"\nmachine: {info['cpu']}, {info['cores']} cores; tfde git {info['git']}; 2 MWMS workers, tf-keras model.fit, "
        f"two-tower: {args.interactions:,} interactions ({'2K users, 1K' if args.quick else '20K users, 5K'} items), "
        f"{args.epochs} epoch(s), 1024 examples per worker and step; "
        f"DLRM: {args.examples:,} examples, {args.dlrm_epochs} epoch(s), 4096 per worker and step"
    )
    print(table(results))
    print("\n".join(ceiling_lines(results, bounds)))
    path = write_results("semi-sync", {"machine": info, "args": vars(args), "runs": results, "alone": bounds})
    print(f"\nwritten: {path.relative_to(HERE.parent)}")
    if args.plot:
        plot(results, args.plot, info, bounds)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
