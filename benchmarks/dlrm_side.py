"""One run of the DLRM benchmark (benchmarks/dlrm_bench.py): one process, or
one worker of a job (TF_CONFIG for MultiWorkerMirroredStrategy, horovodrun
for Horovod).  It runs in tfde's environment or in TFRA's: every system
trains the same network (tfde/demo/dlrm_net.py, plain Keras, loaded by path
so that TFRA's environment needs no tfde) on the same data (one .npz) with
the same input pipeline, optimizer, step timing and AUC; only the embedding
layers differ:

  tfde   tfde.demo.dlrm.DLRM: one DistributedEmbedding ("collection", with a
         placement plan) or one tfde Embedding per feature ("per-feature")
  floor  frozen dense Keras Embedding tables over ids mapped to 0..n-1 in
         advance: the same network with the embedding work taken out
  tfra   one TFRA de.keras.layers.Embedding per feature (one process) or
         HvdAllToAllEmbedding (Horovod; devices=["CPU"], TFRA #365/#401)

  python benchmarks/dlrm_side.py CONFIG.json

CONFIG: system, engine (null, "mwms", "horovod"), layers, placement,
column_slice_threshold, data (.npz), features, batch_size (per worker),
dim, learning_rate, seed, steps (per worker; null: one epoch of its share),
skip (warm-up steps left out of the timing), out (where worker 0 writes
its JSON figures).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    """tfde/demo/<name>.py as a module of its own (it imports neither tfde
    nor anything of this repository, so TFRA's environment can load it)."""
    spec = importlib.util.spec_from_file_location(f"dlrm_bench_{name}", ROOT / "tfde" / "demo" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


clicks = _load("clicks")
net = _load("dlrm_net")


class Single:
    """The engine of one process."""

    kind, rank, size = None, 0, 1

    def scope(self):
        return tf.distribute.get_strategy().scope()

    def optimizer(self, opt):
        return opt

    def dataset(self, make):
        return make()

    def callbacks(self):
        return []

    def reader(self, fn):
        return fn


class TfraHorovod(Single):
    """TFRA's synchronous Horovod training: HvdAllToAllEmbedding layers and
    de.DynamicEmbeddingOptimizer(..., synchronous=True), which all-reduces
    the dense gradients with Horovod."""

    kind = "horovod"

    def __init__(self):
        import horovod.tensorflow as hvd

        hvd.init()
        self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()

    def callbacks(self):
        from tensorflow_recommenders_addons import dynamic_embedding as de

        return [de.keras.callbacks.DEHvdBroadcastGlobalVariablesCallback(root_rank=0)]


def floor_ids(data: dict, features: list) -> dict:
    """The floor's inputs: each feature's ids mapped to 0..n-1 (over train
    and held-out examples), and n per feature."""
    train, test, sizes = [], [], []
    for j in range(len(features)):
        both = np.concatenate([data["train_cats"][:, j], data["test_cats"][:, j]])
        _, idx = np.unique(both, return_inverse=True)
        sizes.append(int(idx.max()) + 1)
        train.append(idx[: len(data["train_cats"])])
        test.append(idx[len(data["train_cats"]) :])
    return {"train_cats": np.stack(train, 1), "test_cats": np.stack(test, 1), "sizes": sizes}


def build(cfg: dict, data: dict, engine, features: list):
    """(model, plan text or None) of cfg's system, compiled."""
    seed, dim, lr = cfg["seed"], cfg["dim"], cfg["learning_rate"]
    init = tf.keras.initializers.RandomNormal(stddev=0.05, seed=seed)
    loss = tf.keras.losses.BinaryCrossentropy(from_logits=True)
    system = cfg["system"]
    if system == "tfde":
        import tfde
        from tfde.demo.dlrm import DLRM

        with engine.scope():
            model = DLRM(
                [int(c) for c in data["cardinalities"][: len(features)]],
                embedding_dim=dim,
                layers=cfg["layers"],
                placement=cfg["placement"],
                column_slice_threshold=cfg.get("column_slice_threshold"),
                seed=seed,
                features=features,
            )
            opt = engine.optimizer(tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(lr)))
            model.compile(optimizer=opt, loss=loss)
        return model, (str(model.embedding.plan) if cfg["layers"] == "collection" else None)
    if system == "floor":

        class Floor(net.DLRMNet):
            def __init__(self, sizes):
                super().__init__(features, dim, seed)
                self.tables = [
                    tf.keras.layers.Embedding(n, dim, embeddings_initializer=init, trainable=False, name=name)
                    for n, name in zip(sizes, features)
                ]

            def sparse_vectors(self, f, training=None):
                return [t(f[name]) for t, name in zip(self.tables, features)]

        model = Floor(data["floor_sizes"])
        model.compile(optimizer=tf.keras.optimizers.Adam(lr), loss=loss)
        return model, None
    if system == "tfra":
        from tensorflow_recommenders_addons import dynamic_embedding as de

        class Tfra(net.DLRMNet):
            def __init__(self):
                super().__init__(features, dim, seed)
                if engine.kind == "horovod":
                    make = de.keras.layers.HvdAllToAllEmbedding
                    extra = {"devices": ["CPU"], "mpi_size": engine.size}
                else:
                    make, extra = de.keras.layers.Embedding, {"devices": ["/CPU:0"]}
                # embedding_size by name: HvdAllToAllEmbedding takes with_unique first.
                kw = {"key_dtype": tf.int64, "initializer": init, **extra}
                self.tables = [make(embedding_size=dim, name=name, **kw) for name in features]

            def sparse_vectors(self, f, training=None):
                return [t(f[name]) for t, name in zip(self.tables, features)]

        model = Tfra()
        sync = {"synchronous": True} if engine.kind == "horovod" else {}
        model.compile(optimizer=de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(lr), **sync), loss=loss)
        return model, None
    raise SystemExit(f"unknown system {system!r}: expected tfde, floor or tfra")


_COLLECTIVE_OP = re.compile(r"^(Collective|Horovod|Nccl)")


def collective_ops(model) -> int | None:
    """Collective ops (tf.distribute's, Horovod's) in the traced training
    step, nested functions included; None where it cannot be read."""
    fn = getattr(model, "train_function", None)
    concrete = []
    for candidate in (fn, getattr(fn, "__wrapped__", None), getattr(fn, "_fn", None)):
        lister = getattr(candidate, "_list_all_concrete_functions", None)
        if lister is not None:
            concrete = lister()
            break
    if not concrete:
        return None
    graph_def = concrete[0].graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(1 for n in nodes if _COLLECTIVE_OP.match(n.op))


def run(cfg: dict) -> dict:
    system, kind = cfg["system"], cfg.get("engine")
    if system == "tfde":
        import tfde
        from tfde.demo.engines import Engine

        if kind is not None:
            tfde.exchange.enable_stats()
        engine = Engine(kind)
    elif kind == "horovod":
        engine = TfraHorovod()
    elif kind is None:
        engine = Single()
    else:
        raise SystemExit(f"{system} runs on one process or under Horovod, not {kind!r}")
    data = dict(np.load(cfg["data"]))
    features = clicks.CATEGORICAL[: cfg["features"]]
    if system == "floor":
        mapped = floor_ids(data, features)
        data.update(train_cats=mapped["train_cats"], test_cats=mapped["test_cats"], floor_sizes=mapped["sizes"])
    tf.keras.utils.set_random_seed(cfg["seed"])
    model, plan = build(cfg, data, engine, features)

    batch = cfg["batch_size"]
    shard = [a[engine.rank :: engine.size] for a in (data["train_dense"], data["train_cats"], data["train_labels"])]
    steps = min(len(shard[2]) // batch, cfg.get("steps") or 1 << 30)
    steps = min(steps, len(data["train_labels"]) // engine.size // batch)  # the same on every worker
    ds = engine.dataset(lambda: net.dataset(*shard, batch, cfg["seed"], features).repeat())
    times = []
    stamp = tf.keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: times.append(time.perf_counter()))
    start = time.perf_counter()
    history = model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[stamp] + engine.callbacks())
    fit_seconds = time.perf_counter() - start
    step_ms = 1000.0 * np.diff(times[cfg["skip"] :])
    out = {
        "steps": steps,
        "ms_per_step": float(np.median(step_ms)),
        "examples_per_s": batch * engine.size / (float(np.median(step_ms)) / 1000.0),
        "loss": float(history.history["loss"][-1]),
        "collective_ops_in_step": collective_ops(model),
        "plan": plan,
    }
    if system == "tfde":
        import tfde

        stats = tfde.exchange.stats()
        if stats is not None:
            s = stats.read()
            out.update(
                exchange_calls_per_step=s["calls"] / steps,
                exchange_kib_per_step=s["bytes"] / steps / 1024,
                exchange_ms_per_step=1000.0 * s["seconds"] / steps,
                fit_ms_per_step=1000.0 * fit_seconds / steps,
            )
    score = engine.reader(lambda f: model(f, training=False))
    scores = []
    for s in range(0, len(data["test_labels"]), 8192):
        f = net.feature_dict(data["test_dense"][s : s + 8192], data["test_cats"][s : s + 8192], features)
        scores.append(np.asarray(score({k: tf.constant(v) for k, v in f.items()})))
    out["auc"] = clicks.auc(data["test_labels"], np.concatenate(scores))
    if engine.rank == 0:
        Path(cfg["out"]).write_text(json.dumps(out))
    return out


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    run(json.loads(Path(sys.argv[1]).read_text()))
