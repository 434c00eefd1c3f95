"""The DLRM demo: a click-through-rate model with 26 sparse features trained
with model.fit on tfde tables (`tfde train --model dlrm`; docs/demo.md).

Bottom MLP over the 13 dense features (log1p of the counts) -> a vector of
the embedding width; the 26 categorical features -> one
tfde.keras.layers.DistributedEmbedding (a TableConfig per feature, placed by
the layer's plan) or, with layers="per-feature", one tfde Embedding layer
each (what the benchmark compares); DLRM's dot interaction of the 27
vectors; top MLP -> the click logit.  Evaluation: held-out AUC beside a
logistic regression on the dense features alone.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

import tfde
from tfde.demo.clicks import CATEGORICAL, Clicks, auc, dense_baseline_auc
from tfde.demo.dlrm_net import DLRMNet, dataset, feature_dict
from tfde.demo.engines import Engine
from tfde.demo.two_tower import ExamplesPerSecond, make_optimizer, whose_rows


class DLRM(DLRMNet):
    """The network of tfde/demo/dlrm_net.py with tfde tables: one
    DistributedEmbedding over a TableConfig per feature ("collection"), or
    one tfde Embedding layer per feature ("per-feature")."""

    def __init__(
        self,
        cardinalities,
        key_dtype=tf.int64,
        embedding_dim: int = 16,
        table_creator=None,
        layers: str = "collection",
        placement: str = "auto",
        seed: int = 0,
        features=CATEGORICAL,
        column_slice_threshold=None,
        **kwargs,
    ):
        super().__init__(features, embedding_dim, seed, **kwargs)
        init = tf.keras.initializers.RandomNormal(stddev=0.05, seed=seed)
        self.layers_kind = layers
        if layers == "collection":
            configs = {
                name: tfde.FeatureConfig(
                    tfde.TableConfig(
                        name,
                        embedding_dim,
                        key_dtype=key_dtype,
                        initializer=init,
                        expected_rows=card,
                        table_creator=table_creator,
                    )
                )
                for name, card in zip(self.feature_names, cardinalities)
            }
            self.embedding = tfde.keras.layers.DistributedEmbedding(
                configs, placement=placement, column_slice_threshold=column_slice_threshold, name="sparse"
            )
        elif layers == "per-feature":
            self.tables = [
                tfde.keras.layers.Embedding(
                    embedding_dim, key_dtype=key_dtype, initializer=init, table_creator=table_creator, name=name
                )
                for name in self.feature_names
            ]
        else:
            raise tfde.ConfigError(f"layers must be 'collection' or 'per-feature', got {layers!r}")

    def sparse_vectors(self, features, training=None):
        if self.layers_kind == "collection":
            out = self.embedding({name: features[name] for name in self.feature_names}, training=training)
            return [out[name] for name in self.feature_names]
        return [layer(features[name], training=training) for layer, name in zip(self.tables, self.feature_names)]

    def first_table(self):
        """The first table's variable (they all live in one kind of store)."""
        if self.layers_kind == "collection":
            return next(iter(self.embedding.variables_by_table.values()))[0]
        return self.tables[0].params

    def table_sizes(self) -> dict:
        """Rows stored per table (with several workers: whose_rows says which)."""
        if self.layers_kind == "collection":
            return {name: int(sum(int(v.size()) for v in vs)) for name, vs in self.embedding.variables_by_table.items()}
        return {layer.name: int(layer.params.size()) for layer in self.tables}


def train(
    data: Clicks,
    epochs: int = 1,
    batch_size: int = 4096,
    embedding_dim: int = 16,
    learning_rate: float = 0.001,
    optimizer: str = "adam",
    seed: int = 0,
    table_creator=None,
    layers: str = "collection",
    placement: str = "auto",
    verbose: int = 1,
    engine=None,
    features=CATEGORICAL,
    sync_every: int = 1,
    sync_replicate: bool = False,
    sync_slots: str = "merged",
) -> dict:
    """Trains the DLRM demo; returns figures (loss, examples/s, AUCs, table
    sizes).  With several workers (engine) each trains on its share of the
    data with batch_size examples per step.  features: the categorical
    features the model uses (a prefix of CATEGORICAL).  sync_every:
    semi-synchronous training with a sync every that many steps
    (tfde.keras.callbacks.PeriodicSync; docs/semi-sync.md); 1: exact.
    sync_replicate: its replicate option (copies of the sharded tables), and
    sync_slots its slots option ("local": optimizer slots per worker)."""
    features = list(features)
    if features != CATEGORICAL[: len(features)]:
        raise tfde.ConfigError(f"features must be the first N of {CATEGORICAL}, got {features}")
    engine = engine or Engine(None)
    engine.steps_per_epoch(data.num_train, batch_size)  # refuses data with no full batch, before any table exists
    if not engine.chief:
        verbose = 0
    tf.keras.utils.set_random_seed(seed)
    key_dtype = tf.string if data.string_keys else tf.int64
    with engine.scope():
        model = DLRM(
            data.cardinalities[: len(features)],
            key_dtype=key_dtype,
            embedding_dim=embedding_dim,
            table_creator=table_creator,
            layers=layers,
            placement=placement,
            seed=seed,
            features=features,
        )
        model.compile(
            optimizer=engine.optimizer(make_optimizer(optimizer, learning_rate)),
            loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
        )
    rate = ExamplesPerSecond(batch_size * engine.size, verbose=bool(verbose))
    callbacks = engine.callbacks()
    if sync_every > 1:
        callbacks.append(tfde.keras.callbacks.PeriodicSync(sync_every, replicate=sync_replicate, slots=sync_slots))
    callbacks.append(rate)  # last: an epoch's time includes its end's sync
    if engine.size == 1:
        ds = dataset(data.train_dense, data.train_cats, data.train_labels, batch_size, seed, names=features)
        steps = None
    else:
        dense, cats, labels = (engine.shard(a) for a in (data.train_dense, data.train_cats, data.train_labels))
        ds = engine.dataset(lambda: dataset(dense, cats, labels, batch_size, seed, names=features).repeat())
        steps = engine.steps_per_epoch(data.num_train, batch_size)
    fit_start = time.perf_counter()
    history = model.fit(ds, epochs=epochs, verbose=verbose, callbacks=callbacks, steps_per_epoch=steps)
    fit_seconds = time.perf_counter() - fit_start
    exchanged = tfde.exchange.stats().read() if tfde.exchange.stats() is not None else None
    num_steps = epochs * (steps or data.num_train // batch_size)
    scores = predict(model, data, engine)
    return {
        "loss": float(history.history["loss"][-1]),
        "examples_per_s": float(np.median(rate.rates)),
        "ms_per_step": 1000.0 * batch_size * engine.size / float(np.median(rate.rates)),  # at the median epoch's rate
        "auc": auc(data.test_labels, scores),
        "dense_baseline_auc": dense_baseline_auc(data, seed),
        "table_sizes": model.table_sizes(),
        "rows_of": whose_rows(engine, model.first_table()),
        "plan": str(model.embedding.plan) if layers == "collection" else None,
        "workers": engine.size,
        "exchange": None if exchanged is None else {"steps": num_steps, "fit_seconds": fit_seconds, **exchanged},
        "model": model,
    }


def predict(model, data: Clicks, engine, block: int = 8192) -> np.ndarray:
    """Scores of the held-out examples (every worker scores them all: reads
    reach every worker's rows through engine.reader)."""
    score = engine.reader(lambda f: model(f, training=False))
    out = []
    for s in range(0, len(data.test_labels), block):
        f = feature_dict(data.test_dense[s : s + block], data.test_cats[s : s + block], model.feature_names)
        out.append(np.asarray(score({k: tf.constant(v) for k, v in f.items()})))
    return np.concatenate(out)
