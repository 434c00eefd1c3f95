"""End-to-end benchmark: the demo two-tower model trained by tfde and by TFRA.

Same architecture (tfde.demo.two_tower.TwoTower, rebuilt layer for layer on
TFRA's embedding layer in benchmarks/tfra_side.py), same data (the demo's
synthetic interactions, generated once and handed to both sides as one .npz),
same batch, optimizer (Adam 0.01), shuffle seed, epochs and evaluation
(held-out recall@100 over the whole catalogue, computed by the same numpy
code).  Throughput is the median examples/s over 50-step windows after the
first 20 steps (tracing and warm-up excluded); each side trains --rounds
times (3), the sides alternating, and the figures are medians over rounds.  Each side trains in a fresh
process; TFRA in its own venv under tf-keras (the only Keras it supports),
tfde under tf-keras and under Keras 3.

  python -m benchmarks.e2e_bench [--backends cuckoo,redis] [--interactions 1000000] [--epochs 2]
                                 [--policy frequency]

--policy frequency gives both sides' tables a FrequencyRestrictPolicy (as the
TFRA users' programs do); the floor has none.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

from benchmarks import common

HERE = Path(__file__).resolve().parent
TFRA_PYTHON = common.TFRA_PYTHON
MAX_EVAL = 20_000  # held-out pairs evaluated, like the demo
FLOOR = "floor: frozen dense tables"  # the same model with embedding work removed (tf-keras)


def write_data(path: Path, interactions: int, seed: int = 0) -> dict:
    from tfde.demo import data as demo_data
    from tfde.demo.two_tower import item_log_frequency

    d = demo_data.synthetic(interactions, seed=seed)
    pos = {int(x): i for i, x in enumerate(d.all_items)}
    test_items = d.test_items[:MAX_EVAL]
    # Dense indices of the same ids, for the floor run (a fixed-vocabulary model).
    user_names, user_idx = np.unique(np.concatenate([d.train_users, d.test_users]).astype(str), return_inverse=True)
    np.savez(
        path,
        train_users=d.train_users.astype(str),
        train_items=d.train_items,
        item_logq=item_log_frequency(d.train_items),
        test_users=d.test_users[:MAX_EVAL].astype(str),
        test_target_pos=np.array([pos[int(x)] for x in test_items]),
        all_items=d.all_items,
        train_user_idx=user_idx[: d.num_train],
        test_user_idx=user_idx[d.num_train :][:MAX_EVAL],
        train_item_idx=np.array([pos[int(x)] for x in d.train_items]),
        num_users=len(user_names),
    )
    ids, counts = np.unique(d.train_items, return_counts=True)
    top = set(ids[np.argsort(-counts)[:100]].tolist())
    return {
        "train": d.num_train,
        "held_out": len(test_items),
        "most_popular_recall": float(np.mean([int(t) in top for t in test_items])),
    }


def tfde_side(data_path: str, config_path: str) -> dict:
    """Trains in this process (TF_USE_LEGACY_KERAS chosen by the caller)."""
    import tensorflow as tf

    import tfde
    from tfde.demo.two_tower import TwoTower

    cfg = json.load(open(config_path))
    data = np.load(data_path, allow_pickle=False)
    tf.keras.utils.set_random_seed(cfg["seed"])
    creator = tfde.RedisTableCreator(cfg["redis_config"]) if cfg.get("redis_config") else None
    model = TwoTower(
        embedding_dim=cfg["embedding_dim"],
        output_dim=cfg["output_dim"],
        temperature=cfg["temperature"],
        table_creator=creator,
        seed=cfg["seed"],
        restrict_policy=tfde.FrequencyRestrictPolicy if cfg.get("policy") == "frequency" else None,
    )
    users, items = data["train_users"], data["train_items"]
    eval_users, eval_items = data["test_users"], data["all_items"]
    tfde_layers = (model.user_embedding, model.item_embedding)  # the floor run swaps them out
    if cfg.get("floor"):
        # The floor of any embedding library: the same model, but the ids are
        # dense indices into frozen Keras Embedding tables, so embedding
        # storage, lookup and update cost nothing beyond a gather.
        init = tf.keras.initializers.RandomNormal(stddev=0.1, seed=cfg["seed"])
        model.user_embedding = tf.keras.layers.Embedding(
            int(data["num_users"]), cfg["embedding_dim"], embeddings_initializer=init, trainable=False
        )
        model.item_embedding = tf.keras.layers.Embedding(
            len(data["all_items"]), cfg["embedding_dim"], embeddings_initializer=init, trainable=False
        )
        users, items = data["train_user_idx"], data["train_item_idx"]
        eval_users, eval_items = data["test_user_idx"], np.arange(len(data["all_items"]))
    model.compile(
        optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(cfg["learning_rate"])),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    out = {
        "system": "tfde",
        "tf": tf.__version__,
        "keras": ("tf-keras " + __import__("tf_keras").__version__)
        if legacy
        else ("Keras " + __import__("keras").__version__),
        **common.fit_and_evaluate(tf, model, cfg, data, users, items, eval_users, eval_items),
    }
    if creator is not None:  # the Redis tables of this run go (the floor run's are empty)
        for layer in tfde_layers:
            layer.params.clear()
    return out


def _json_line(cmd, env, what) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, env=env, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def redis_config(port: int, buckets: int = 2) -> dict:
    tag = f"e2e-bench-{uuid.uuid4().hex[:8]}"
    tags = [f"{{{i}}}" for i in range(buckets)]
    return {
        "redis_connection_mode": 2,
        "redis_host_ip": ["127.0.0.1"],
        "redis_host_port": [port],
        "model_tag_runtime": tag,
        "model_tag_import": tag,
        "storage_slice": buckets,
        "storage_slice_import": buckets,
        "redis_hash_tags_runtime": tags,
        "redis_hash_tags_import": tags,
        "keys_sending_size": 1024,
    }


def measure(
    backends,
    interactions: int,
    epochs: int,
    with_tfra: bool,
    port: int = 6379,
    log=print,
    redis_interactions: int = None,
    rounds: int = 1,
    policy: str = None,
) -> dict:
    """{backend: {"data": ..., "tfde tf-keras": {...}, "tfde Keras 3": {...}, "TFRA tf-keras": {...}}}.

    rounds: every side trains this many times, the sides alternating within
    a round (host drift hits all alike); examples/s and recall are medians."""
    results, infos = {}, {}
    with tempfile.TemporaryDirectory(prefix="tfde-e2e-") as tmp:
        for backend in backends:
            n = redis_interactions if backend == "redis" and redis_interactions else interactions
            data = Path(tmp) / f"data-{n}.npz"
            if n not in infos:
                infos[n] = write_data(data, n)
            res = {"data": {**infos[n], "interactions": n, "epochs": epochs}}
            legacy = {"TF_USE_LEGACY_KERAS": "1"}
            sides = [("tfde tf-keras", "tfde", legacy, False), ("tfde Keras 3", "tfde", {}, False)]
            if with_tfra:
                sides.insert(0, ("TFRA tf-keras", "tfra", legacy, False))
            if backend == backends[0]:
                sides.append((FLOOR, "tfde", legacy, True))
            runs = {label: [] for label, *_ in sides}
            for _, (label, system, extra_env, floor) in itertools.product(range(rounds), sides):
                cfg = {
                    "seed": 0,
                    "embedding_dim": 64,
                    "output_dim": 32,
                    "temperature": 0.1,
                    "learning_rate": 0.01,
                    "batch_size": 1024,
                    "epochs": epochs,
                    "shuffle_buffer": 200_000,
                    "k": 100,
                    "floor": floor,
                    "policy": None if floor else policy,
                }
                if backend == "redis":
                    rc = redis_config(port)
                    rc_path = Path(tmp) / f"{rc['model_tag_runtime']}.json"
                    rc_path.write_text(json.dumps(rc))
                    cfg["redis_config"] = str(rc_path)
                cfg_path = Path(tmp) / f"cfg-{uuid.uuid4().hex[:8]}.json"
                cfg_path.write_text(json.dumps(cfg))
                env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
                env.update(extra_env, TF_CPP_MIN_LOG_LEVEL="3")
                if system == "tfra":
                    cmd = [TFRA_PYTHON, str(HERE / "tfra_side.py"), "e2e", str(data), str(cfg_path)]
                else:
                    cmd = [sys.executable, "-m", "benchmarks.e2e_bench", "--side", str(data), str(cfg_path)]
                runs[label].append(_json_line(cmd, env, f"{label} ({backend})"))
                log(
                    f"  e2e {backend} {label}: {runs[label][-1]['examples_per_s']:,.0f} examples/s, "
                    f"recall@100 {runs[label][-1]['recall']:.4f}"
                )
            for label, done in runs.items():
                res[label] = {
                    **done[-1],
                    "rounds": done,
                    "examples_per_s": statistics.median(r["examples_per_s"] for r in done),
                    "recall": statistics.median(r["recall"] for r in done),
                }
            results[backend] = res
    return results


def report(results: dict) -> list:
    lines = [f"{'two-tower training':<30}{'examples/s':>12}{'recall@100':>12}{'x TFRA ex/s':>13}"]
    for backend, res in results.items():
        d = res["data"]
        lines.append(
            f"{backend} backend: {d['interactions']:,} interactions ({d['train']:,} train), {d['epochs']} "
            f"epoch(s), batch 1024; most-popular recall@100 {d['most_popular_recall']:.4f}"
        )
        ref = res.get("TFRA tf-keras")
        for label in ("TFRA tf-keras", "tfde tf-keras", "tfde Keras 3", FLOOR):
            if label not in res:
                continue
            r = res[label]
            ratio = f"{r['examples_per_s'] / ref['examples_per_s']:.2f}x" if ref else "-"
            lines.append(f"  {label:<28}{r['examples_per_s']:>12,.0f}{r['recall']:>12.4f}{ratio:>13}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="cuckoo,redis")
    p.add_argument("--interactions", type=int, default=1_000_000)
    p.add_argument(
        "--redis-interactions",
        type=int,
        default=300_000,
        help="interactions for the Redis backend (it is slower; same for both systems)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--port", type=int, default=6379, help="redis-server for the redis backend")
    p.add_argument("--rounds", type=int, default=3, help="alternating trainings per side; medians reported")
    p.add_argument("--no-tfra", action="store_true")
    p.add_argument("--policy", choices=["frequency"], help="a restrict policy on both sides' tables")
    p.add_argument("--side", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side:
        print(json.dumps(tfde_side(*args.side)))
        return 0
    from benchmarks.table_bench import machine, write_results

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; TF {info['tf']}, tfde git {info['git']}")
    results = measure(
        args.backends.split(","),
        args.interactions,
        args.epochs,
        not args.no_tfra,
        args.port,
        redis_interactions=args.redis_interactions,
        rounds=args.rounds,
        policy=args.policy,
    )
    if args.policy:
        print(f"restrict policy on both sides' tables: {args.policy}")
    print("\n".join(report(results)))
    path = write_results("e2e", {"machine": info, "policy": args.policy, "results": results})
    print(f"\nwritten: {path.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
