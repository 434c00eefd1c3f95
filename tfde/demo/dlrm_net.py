"""The DLRM network without its embeddings, and its input pipeline
(docs/demo.md, "The DLRM click model").

Plain Keras and TensorFlow: nothing here imports tfde, so the benchmark's
reference side (benchmarks/dlrm_side.py, in TFRA's environment) builds the
very network tfde's demo trains, with only the embedding layers swapped.
A subclass says where the categorical features' vectors come from
(`sparse_vectors`); this class holds the rest: the bottom MLP over the 13
dense features (log1p of the counts) -> a vector of the embedding width,
DLRM's dot interaction of the 27 vectors (the upper triangle of their
pairwise dot products) and the top MLP -> the click logit.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


class DLRMNet(tf.keras.Model):
    """features: the names of the categorical inputs; embedding_dim: the
    width of every feature's vector; seed: of the dense layers' initializer.

    Inputs: a dict with "dense" [batch, 13] and one [batch] id tensor per
    feature; output: the click logit [batch] float32."""

    def __init__(self, features, embedding_dim: int, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.feature_names = list(features)
        dense_init = tf.keras.initializers.GlorotUniform(seed=seed)

        def mlp(widths, name, last_linear=False):
            out = []
            for i, w in enumerate(widths):
                linear = last_linear and i == len(widths) - 1
                out.append(
                    tf.keras.layers.Dense(
                        w, activation=None if linear else "relu", kernel_initializer=dense_init, name=f"{name}{i}"
                    )
                )
            return out

        self.bottom = mlp([64, embedding_dim], "bottom")
        self.top = mlp([128, 64, 1], "top", last_linear=True)
        n = len(self.feature_names) + 1
        rows, cols = np.triu_indices(n, k=1)
        self._pairs = tf.constant(rows * n + cols, tf.int32)  # the upper triangle of the [n, n] dot products

    def sparse_vectors(self, features, training=None) -> list:
        """[batch, embedding_dim] per categorical feature, in feature order."""
        raise NotImplementedError

    def call(self, features, training=None):
        x = tf.math.log1p(tf.cast(features["dense"], tf.float32))
        for layer in self.bottom:
            x = layer(x)
        vectors = tf.stack([x] + self.sparse_vectors(features, training), axis=1)  # [batch, n, dim]
        dots = tf.matmul(vectors, vectors, transpose_b=True)
        batch = tf.shape(dots)[0]
        pairs = tf.gather(tf.reshape(dots, [batch, -1]), self._pairs, axis=1)
        y = tf.concat([x, pairs], 1)
        for layer in self.top:
            y = layer(y)
        return y[:, 0]


def feature_dict(dense, cats, names) -> dict:
    """Model inputs of a block of examples: {"dense": [n, 13], name: [n]}
    (cats [n, >= len(names)]: the features' ids in `names` order)."""
    out = {"dense": dense}
    for j, name in enumerate(names):
        out[name] = cats[:, j] if cats.dtype != object else cats[:, j].astype(str)
    return out


def dataset(dense, cats, labels, batch_size: int, seed: int, names, shuffle: bool = True):
    """Batches of (features, labels).  The examples are shuffled once (numpy,
    seeded) and the order of the batches again every epoch: a batch is a
    slice of constant tensors, not 4096 elements batched one by one (which
    cost more than the training step)."""
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(labels))
        dense, cats, labels = dense[order], cats[order], labels[order]
    features = {k: tf.constant(v) for k, v in feature_dict(dense, cats, names).items()}
    y = tf.constant(labels)
    batches = tf.data.Dataset.range(len(labels) // batch_size)
    if shuffle:
        batches = batches.shuffle(len(labels) // batch_size + 1, seed=seed, reshuffle_each_iteration=True)

    def take(i):
        start = i * batch_size
        return {k: v[start : start + batch_size] for k, v in features.items()}, y[start : start + batch_size]

    return batches.map(take, num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)
