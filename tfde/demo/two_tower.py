"""The demo: a two-tower retrieval model trained with model.fit on tfde tables.

User tower: string user id -> tfde Embedding -> Dense -> L2-normalized.
Item tower: int64 item id  -> tfde Embedding -> Dense -> L2-normalized.
Loss: in-batch softmax (each user's positive item against the other items
of the batch) with a temperature and the logQ correction: popular items
appear as in-batch negatives more often, so the log of each item's training
frequency is subtracted from its logit (Yi et al., RecSys 2019); without it
the model learns to avoid popular items.  Evaluation: recall@k of held-out
(user, item) pairs over the whole catalogue, next to recommending the k most
popular training items to everyone.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

import tfde
from tfde.demo.data import Interactions
from tfde.demo.engines import Engine


class TwoTower(tf.keras.Model):
    def __init__(
        self,
        embedding_dim: int = 64,
        output_dim: int = 32,
        temperature: float = 0.1,
        table_creator=None,
        seed: int = 0,
        restrict_policy=None,
        min_count=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        init = tf.keras.initializers.RandomNormal(stddev=0.1, seed=seed)

        def embedding(key_dtype, name):
            return tfde.keras.layers.Embedding(
                embedding_dim,
                key_dtype=key_dtype,
                initializer=init,
                table_creator=table_creator,
                restrict_policy=restrict_policy,
                name=name,
                admission_filter=tfde.CounterFilter(min_count) if min_count else None,
            )

        self.user_embedding = embedding(tf.string, "user-embedding")
        self.item_embedding = embedding(tf.int64, "item-embedding")
        dense_init = tf.keras.initializers.GlorotUniform(seed=seed)
        self.user_dense = tf.keras.layers.Dense(output_dim, kernel_initializer=dense_init, name="user-dense")
        self.item_dense = tf.keras.layers.Dense(output_dim, kernel_initializer=dense_init, name="item-dense")
        self.temperature = temperature

    def user_vectors(self, users, training=False):
        return tf.math.l2_normalize(self.user_dense(self.user_embedding(users, training=training)), axis=-1)

    def item_vectors(self, items, training=False):
        return tf.math.l2_normalize(self.item_dense(self.item_embedding(items, training=training)), axis=-1)

    def call(self, features, training=None):
        u = self.user_vectors(features["user"], training=training)
        i = self.item_vectors(features["item"], training=training)
        logits = tf.matmul(u, i, transpose_b=True) / self.temperature  # [batch, batch]
        if "item_logq" in features:
            logits -= tf.cast(features["item_logq"], logits.dtype)[None, :]
        return logits


def item_log_frequency(items: np.ndarray) -> np.ndarray:
    """log of each interaction's item frequency in `items` (the logQ term)."""
    _, inverse, counts = np.unique(items, return_inverse=True, return_counts=True)
    return np.log(counts[inverse] / len(items)).astype(np.float32)


def in_batch_dataset(users, items, batch_size: int, seed: int, shuffle: bool = True) -> tf.data.Dataset:
    ds = tf.data.Dataset.from_tensor_slices(
        {"user": users.astype(str), "item": items, "item_logq": item_log_frequency(items)}
    )
    if shuffle:
        ds = ds.shuffle(min(len(items), 200_000), seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(lambda f: (f, tf.range(tf.shape(f["item"])[0])), num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)


def recall_at_k(model: TwoTower, data: Interactions, k: int = 100, max_eval: int = 20_000, reader=None) -> float:
    """Fraction of held-out (user, item) pairs whose item is in the user's
    top-k over all items.  reader(fn) wraps the model's vector functions
    (Engine.reader: distributed reads); default: call them as they are."""
    reader = reader or (lambda fn: fn)
    user_vectors = reader(lambda ids: model.user_vectors(ids, training=False))
    item_vectors = reader(lambda ids: model.item_vectors(ids, training=False))
    items = tf.constant(data.all_items)
    item_vecs = tf.concat([item_vectors(items[i : i + 8192]) for i in range(0, len(data.all_items), 8192)], 0)
    users, targets = data.test_users[:max_eval], data.test_items[:max_eval]
    pos_of_item = {int(x): i for i, x in enumerate(data.all_items)}
    target_pos = np.array([pos_of_item[int(x)] for x in targets])
    hits = 0
    for s in range(0, len(users), 2048):
        u = user_vectors(tf.constant(users[s : s + 2048].astype(str)))
        _, top = tf.math.top_k(tf.matmul(u, item_vecs, transpose_b=True), k=min(k, len(data.all_items)))
        hits += int(np.sum(np.any(top.numpy() == target_pos[s : s + 2048, None], axis=1)))
    return hits / len(users)


def most_popular_recall(data: Interactions, k: int = 100, max_eval: int = 20_000) -> float:
    ids, counts = np.unique(data.train_items, return_counts=True)
    top = set(ids[np.argsort(-counts)[:k]].tolist())
    targets = data.test_items[:max_eval]
    return float(np.mean([int(t) in top for t in targets]))


def whose_rows(engine, var) -> str:
    """What a worker's count of `var`'s rows covers, for the summaries: in a
    job, its own tables hold its shard of the keys, while a store all
    workers share (Redis, docs/redis.md) holds every worker's."""
    if engine.size == 1:
        return ""
    return " (all workers: a shared store)" if var.shared_between_workers else " (worker 0's shard)"


class TableSizes(tf.keras.callbacks.Callback):
    """Prints the rows stored per table at the end of every epoch (with
    several workers: whose_rows says which)."""

    def __init__(self, label="table rows"):
        super().__init__()
        self.label = label

    def on_epoch_end(self, epoch, logs=None):
        sizes = {
            layer.name: int(layer.params.size()) for layer in (self.model.user_embedding, self.model.item_embedding)
        }
        print(f"{self.label}: " + ", ".join(f"{name} {n:,}" for name, n in sizes.items()))


class ExamplesPerSecond(tf.keras.callbacks.Callback):
    """Adds examples/s of each epoch to the logs and prints it.  Put it after
    every other callback: an epoch's time then includes the work they do at
    its end (PeriodicSync's sync)."""

    def __init__(self, batch_size: int, verbose: bool = True):
        super().__init__()
        self.batch_size, self.verbose = batch_size, verbose  # batch_size: examples per step, all workers
        self.rates = []

    def on_epoch_begin(self, epoch, logs=None):
        self._t, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        rate = self._steps * self.batch_size / (time.perf_counter() - self._t)
        self.rates.append(rate)
        if logs is not None:
            logs["examples_per_s"] = rate
        if self.verbose:
            print(f"epoch {epoch + 1}: {rate:,.0f} examples/s")


def make_optimizer(name: str, learning_rate: float):
    opts = {
        "adam": tf.keras.optimizers.Adam,
        "adagrad": tf.keras.optimizers.Adagrad,
        "sgd": tf.keras.optimizers.SGD,
        "rmsprop": tf.keras.optimizers.RMSprop,
        "adamw": tf.keras.optimizers.AdamW,
        "ftrl": tf.keras.optimizers.Ftrl,
    }
    if name not in opts:
        raise tfde.ConfigError(f"--optimizer must be one of {sorted(opts)}, got {name!r}")
    return tfde.DynamicEmbeddingOptimizer(opts[name](learning_rate=learning_rate))


def train(
    data: Interactions,
    epochs: int = 2,
    batch_size: int = 1024,
    embedding_dim: int = 64,
    learning_rate: float = 0.01,
    optimizer: str = "adam",
    seed: int = 0,
    table_creator=None,
    verbose: int = 1,
    k: int = 100,
    policy: str = None,
    max_rows: int = None,
    min_count: int = None,
    engine=None,
    sync_every: int = 1,
    sync_replicate: bool = False,
    sync_slots: str = "merged",
) -> dict:
    """Trains the demo model; returns figures (loss, examples/s, recalls).

    policy: None, 'frequency' or 'timestamp' (restrict policy of both tables);
    max_rows: keep each table at most this big (RestrictCallback, needs a
    policy; 'frequency' if none given); min_count: CounterFilter admission.
    engine: a tfde.demo.engines.Engine (one worker of several), or None.
    sync_every: semi-synchronous training with a sync every that many steps
    (tfde.keras.callbacks.PeriodicSync; docs/semi-sync.md); 1: exact.
    sync_replicate: its replicate option (copies of the sharded tables), and
    sync_slots its slots option ("local": optimizer slots per worker).
    With several workers each trains on its share of the data with batch_size
    examples per step; only the chief (worker 0) prints."""
    engine = engine or Engine(None)
    engine.steps_per_epoch(data.num_train, batch_size)  # refuses data with no full batch, before any table exists
    if not engine.chief:
        verbose = 0
    tf.keras.utils.set_random_seed(seed)
    if max_rows and not policy:
        policy = "frequency"
    policies = {None: None, "frequency": tfde.FrequencyRestrictPolicy, "timestamp": tfde.TimestampRestrictPolicy}
    if policy not in policies:
        raise tfde.ConfigError(f"policy must be 'frequency' or 'timestamp', got {policy!r}")
    with engine.scope():
        model = TwoTower(
            embedding_dim=embedding_dim,
            table_creator=table_creator,
            seed=seed,
            restrict_policy=policies[policy],
            min_count=min_count,
        )
        model.compile(
            optimizer=engine.optimizer(make_optimizer(optimizer, learning_rate)),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rate = ExamplesPerSecond(batch_size * engine.size, verbose=bool(verbose))
    sizes = TableSizes("table rows" + whose_rows(engine, model.user_embedding.params))
    callbacks = [sizes] + engine.callbacks() if verbose else engine.callbacks()
    if max_rows:
        # Trim to 90% when a table passes max_rows, so restriction (a scan of
        # the table) runs every few batches rather than after every batch.
        callbacks.append(
            tfde.keras.callbacks.RestrictCallback(max_size=max_rows, num_reserved=max(1, int(max_rows * 0.9)))
        )
    if sync_every > 1:
        callbacks.append(tfde.keras.callbacks.PeriodicSync(sync_every, replicate=sync_replicate, slots=sync_slots))
    callbacks.append(rate)  # last: an epoch's time includes its end's sync
    if engine.size == 1:
        ds, steps = in_batch_dataset(data.train_users, data.train_items, batch_size, seed), None
    else:  # every worker takes the same number of steps through its share, repeated
        users, items = engine.shard(data.train_users), engine.shard(data.train_items)
        ds = engine.dataset(lambda: in_batch_dataset(users, items, batch_size, seed).repeat())
        steps = engine.steps_per_epoch(data.num_train, batch_size)
    fit_start = time.perf_counter()
    history = model.fit(ds, epochs=epochs, verbose=verbose, callbacks=callbacks, steps_per_epoch=steps)
    fit_seconds = time.perf_counter() - fit_start
    exchanged = tfde.exchange.stats().read() if tfde.exchange.stats() is not None else None
    recall = recall_at_k(model, data, k, reader=engine.reader)
    baseline = most_popular_recall(data, k)
    return {
        "loss": float(history.history["loss"][-1]),
        "examples_per_s": float(np.median(rate.rates)),
        f"recall@{k}": recall,
        f"most_popular_recall@{k}": baseline,
        "user_rows": int(model.user_embedding.params.size()),
        "item_rows": int(model.item_embedding.params.size()),
        "rows_of": whose_rows(engine, model.user_embedding.params),  # which workers' rows these counts are
        "workers": engine.size,
        "chief": engine.chief,
        # With tfde.exchange.enable_stats(): this worker's exchange traffic per training step.
        "exchange": None
        if exchanged is None
        else {
            "steps": len(history.history["loss"]) * (steps or len(data.train_items) // batch_size),
            "fit_seconds": fit_seconds,
            **exchanged,
        },
        "model": model,
    }
