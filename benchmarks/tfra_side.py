"""The reference side of the benchmarks: TFRA 0.8.1, run with the interpreter
of its own venv (benchmarks/setup-tfra.sh; TF 2.16.2, tf-keras).

  TF_USE_LEGACY_KERAS=1 $TFRA_PYTHON benchmarks/tfra_side.py table N DIM BATCH
  TF_USE_LEGACY_KERAS=1 $TFRA_PYTHON benchmarks/tfra_side.py memory N DIM
  TF_USE_LEGACY_KERAS=1 $TFRA_PYTHON benchmarks/tfra_side.py e2e DATA.npz CONFIG.json
  TF_USE_LEGACY_KERAS=1 $TFRA_PYTHON benchmarks/tfra_side.py checkpoint save|restore N DIM DIR

Every mode prints one JSON line.  Inputs, timing and the op sequence come from
benchmarks/common.py, the same code tfde's side runs; this file only maps each
op onto TFRA's API (its fastest public path for each op).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow_recommenders_addons import dynamic_embedding as de  # noqa: E402


class TfraTable(common.TableAdapter):
    def __init__(self, n, dim, batch):
        self.var = de.get_variable(
            "bench",
            key_dtype=tf.int64,
            value_dtype=tf.float32,
            dim=dim,
            initializer=0.0,
            devices=["/CPU:0"],
            init_size=n,
        )
        self.table = self.var.tables[0]
        self.exists = tf.ones([n], tf.bool)
        self.batch = batch

    def upsert(self, keys, vals):
        self.var.upsert(keys, vals)

    def find(self, keys):
        self.var.lookup(keys).numpy()

    def accum(self, keys, deltas):
        # The table's own accum (Variable.accum first computes new - old in Python ops).
        self.table.accum(keys, deltas, self.exists[: keys.shape[0]])

    def remove(self, keys):
        self.var.remove(keys)

    def export_rows(self):
        keys, _ = self.var.export()
        return int(keys.shape[0])

    def batch_find_fn(self):
        return tf.function(lambda k: self.var.lookup(k))

    def batch_upsert_fn(self):
        @tf.function
        def upsert(k, v):
            self.var.upsert(k, v)

        return upsert


def table(n, dim, batch):
    out = common.table_ops(tf, TfraTable(n, dim, batch), common.table_inputs(n, dim, batch))
    return {"system": "tfra-0.8.1", "tf": tf.__version__, **out}


def memory(n, dim):
    var = de.get_variable(
        "mem", key_dtype=tf.int64, value_dtype=tf.float32, dim=dim, initializer=0.0, devices=["/CPU:0"]
    )
    return {"rss_bytes_per_row": common.memory_probe(tf, var.upsert, n, dim)}


def checkpoint(phase, n, dim, directory):
    def make(name):
        return de.get_variable(
            name, key_dtype=tf.int64, value_dtype=tf.float32, dim=dim, initializer=0.0, devices=["/CPU:0"]
        )

    return common.checkpoint_probe(
        tf, make, lambda v, k, r: v.upsert(k, r), lambda v: v.size(), phase, n, dim, directory
    )


# ---------------------------------------------------------------- end to end


class TwoTower(tf.keras.Model):
    """benchmarks/e2e_bench.py's model, layer for layer, on TFRA's embedding layer."""

    def __init__(self, cfg, creator):
        super().__init__()
        init = tf.keras.initializers.RandomNormal(stddev=0.1, seed=cfg["seed"])
        kw = {"kv_creator": creator} if creator is not None else {}
        if cfg.get("policy") == "frequency":
            kw["restrict_policy"] = de.FrequencyRestrictPolicy
        self.user_embedding = de.keras.layers.Embedding(
            cfg["embedding_dim"], key_dtype=tf.string, initializer=init, name="user-embedding", devices=["/CPU:0"], **kw
        )
        self.item_embedding = de.keras.layers.Embedding(
            cfg["embedding_dim"], key_dtype=tf.int64, initializer=init, name="item-embedding", devices=["/CPU:0"], **kw
        )
        dense_init = tf.keras.initializers.GlorotUniform(seed=cfg["seed"])
        self.user_dense = tf.keras.layers.Dense(cfg["output_dim"], kernel_initializer=dense_init)
        self.item_dense = tf.keras.layers.Dense(cfg["output_dim"], kernel_initializer=dense_init)
        self.temperature = cfg["temperature"]

    def user_vectors(self, users):
        return tf.math.l2_normalize(self.user_dense(self.user_embedding(users)), axis=-1)

    def item_vectors(self, items):
        return tf.math.l2_normalize(self.item_dense(self.item_embedding(items)), axis=-1)

    def call(self, features):
        u, i = self.user_vectors(features["user"]), self.item_vectors(features["item"])
        return tf.matmul(u, i, transpose_b=True) / self.temperature - features["item_logq"][None, :]


def e2e(data_path, config_path):
    cfg = json.load(open(config_path))
    data = np.load(data_path, allow_pickle=False)
    tf.keras.utils.set_random_seed(cfg["seed"])
    creator = None
    if cfg.get("redis_config"):
        creator = de.RedisTableCreator(de.RedisTableConfig(redis_config_abs_dir=cfg["redis_config"]))
    model = TwoTower(cfg, creator)
    model.compile(
        optimizer=de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(cfg["learning_rate"])),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    out = {
        "system": "tfra-0.8.1",
        "tf": tf.__version__,
        "keras": "tf-keras " + __import__("tf_keras").__version__,
        **common.fit_and_evaluate(
            tf, model, cfg, data, data["train_users"], data["train_items"], data["test_users"], data["all_items"]
        ),
    }
    if creator is not None:
        for layer in (model.user_embedding, model.item_embedding):
            layer.params.clear()
    return out


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "table":
        result = table(*(int(a) for a in args))
    elif mode == "memory":
        result = memory(*(int(a) for a in args))
    elif mode == "checkpoint":
        result = checkpoint(args[0], int(args[1]), int(args[2]), args[3])
    elif mode == "e2e":
        result = e2e(*args)
    else:
        raise SystemExit(f"unknown mode {mode!r}: expected table, memory, checkpoint or e2e")
    print(json.dumps(result))
