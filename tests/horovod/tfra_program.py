"""A TFRA user's Horovod program, as TFRA users write it, with only its
imports changed to tfde.compat.tfra: a tfrs two-tower model whose towers
start with HvdAllToAllEmbedding (int64 keys, cuckoo tables made by a
creator with a FileSystemSaver, a FrequencyRestrictPolicy, devices=['CPU']),
a FactorizedTopK metric over candidates mapped through the item tower,
Horovod's broadcast callback, DEHvdModelCheckpoint into a directory per
rank and TensorBoard.  For tests/horovod/test_compat_tfra_horovod.py.

  horovodrun -np N -H localhost:N --gloo python tfra_program.py OUT train
  horovodrun -np N -H localhost:N --gloo python tfra_program.py OUT restore

`train` trains two epochs (each rank on its shard of the data) and writes
OUT-train-wR.npz: the rows, optimizer slots and policy counts this rank
stores, the dense weights and the optimizer's step.  `restore` builds the
same model, restores the latest checkpoint of its rank's directory and
writes OUT-restore-wR.npz without training.  Working directory: where model_dir_R go."""

import sys
from pathlib import Path

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

import tfde
from tfde.compat.tfra import dynamic_embedding as de

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from distributed_check import dump  # noqa: E402  (the writer of what distributed_check.load reads)

hvd.init()
OUT, PHASE = sys.argv[1], sys.argv[2]
RANK, SIZE = hvd.rank(), hvd.size()
USERS, ITEMS, EXAMPLES = 100, 400, 1024

cuckoo_creator = de.CuckooHashTableCreator(saver=de.FileSystemSaver(proc_size=SIZE, proc_rank=RANK))


def datasets():
    # Each user watches mostly their own few movies, some Zipf-popular ones:
    # a pattern two epochs learn (random pairs leave the loss at chance,
    # where an epoch's mean can rise by noise alone).
    rng = np.random.default_rng(7)
    users = rng.integers(0, USERS, EXAMPLES)
    own = rng.permutation(ITEMS)[2 * users + rng.integers(0, 2, EXAMPLES)]  # 2 movies a user, none shared
    items = np.where(rng.random(EXAMPLES) < 0.8, own, rng.zipf(1.4, EXAMPLES) % ITEMS)
    ratings = tf.data.Dataset.from_tensor_slices({"user_id": users, "movie_id": items})
    train = ratings.shard(SIZE, RANK).batch(EXAMPLES // SIZE // 8)  # 8 steps an epoch on every rank
    candidates = tf.data.Dataset.from_tensor_slices(np.arange(ITEMS, dtype=np.int64)).batch(128)
    return train, candidates


def tower(name):
    return tf.keras.Sequential(
        [
            de.keras.layers.HvdAllToAllEmbedding(
                embedding_size=16,
                key_dtype=tf.int64,
                value_dtype=tf.float32,
                initializer=tf.random_uniform_initializer(),
                init_capacity=1000,
                restrict_policy=de.FrequencyRestrictPolicy,
                name=name,
                devices=["CPU"],
                kv_creator=cuckoo_creator,
            ),
            tf.keras.layers.Dense(16, activation="gelu"),
            tf.keras.layers.Dense(8),
            tf.keras.layers.Lambda(lambda x: tf.math.l2_normalize(x, axis=1)),
        ],
        name=f"{name}-tower",
    )


class TwoTowerModel(tfrs.Model):
    def __init__(self, user_model, item_model, task):
        super().__init__()
        self.user_model, self.item_model, self.task = user_model, item_model, task

    def compute_loss(self, features, training=False):
        return self.task(self.user_model(features["user_id"]), self.item_model(features["movie_id"]))


def build(candidates):
    user_model, item_model = tower("user-embedding"), tower("movie-embedding")
    task = tfrs.tasks.Retrieval(metrics=tfrs.metrics.FactorizedTopK(candidates.map(item_model)))
    model = TwoTowerModel(user_model, item_model, task)
    model.compile(optimizer=de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)))
    return model


def write(model, history=None):
    out = {"dense/step": np.array(int(model.optimizer.iterations))}
    for tower_model in (model.user_model, model.item_model):
        layer = tower_model.layers[0]
        out[f"{layer.name}/keys"], out[f"{layer.name}/rows"] = dump(layer.params)
        for name, slot in layer.params.slots.items():  # the optimizer's slots and the policy's state
            out[f"{layer.name}/{name}/keys"], out[f"{layer.name}/{name}/rows"] = dump(slot)
        for i, weight in enumerate(tower_model.layers[1].get_weights() + tower_model.layers[2].get_weights()):
            out[f"dense/{tower_model.name}/{i}"] = weight
    if history is not None:
        out["loss"] = np.array(history.history["loss"])  # this rank's own: not compared between ranks
    np.savez(f"{OUT}-{PHASE}-w{RANK}.npz", **out)


train, candidates = datasets()
model = build(candidates)
model_dir = f"model_dir_{RANK}"
if PHASE == "train":
    callbacks = [
        tf.keras.callbacks.TensorBoard(log_dir=model_dir),
        de.keras.callbacks.DEHvdBroadcastGlobalVariablesCallback(root_rank=0),
        de.keras.callbacks.DEHvdModelCheckpoint(
            filepath=model_dir + "/weights_epoch{epoch:03d}_loss{loss:.4f}",
            options=tf.saved_model.SaveOptions(namespace_whitelist=["TFRA"]),
        ),
    ]
    history = model.fit(train, epochs=2, callbacks=callbacks, verbose=2)
    write(model, history)
else:
    restored = tfde.CheckpointManager(model_dir, model=model, optimizer=model.optimizer).restore()
    batch = next(iter(train))  # the towers' dense layers are made (and take their restored values) on a first call
    model.user_model(batch["user_id"]), model.item_model(batch["movie_id"])
    print(f"rank {RANK}: restored {restored}", flush=True)
    write(model)
