"""A program written for TensorFlow Recommenders Addons (TFRA), run on tfde
through tfde.compat.tfra: a tfrs two-tower retrieval model on MovieLens in one
process, its tables in-process cuckoo hash tables.

  tfde make-data movielens        # synthetic MovieLens CSVs (or MovieLens's own ratings.csv + movies.csv)
  python examples/tfra_two_tower.py movielens

The data directory is the first argument, else $TFDE_EXAMPLE_DATA, else
./movielens.

Only the two TFRA import lines differ from the TFRA program
(`import tensorflow_recommenders_addons as tfra` and
`from tensorflow_recommenders_addons import dynamic_embedding as de`): the
layers take TFRA's arguments (kv_creator, init_capacity, devices,
restrict_policy) and the restriction is TFRA's, `layer.params.restrict(...)`.
What each TFRA name becomes, and what behaves differently (a lookup never
inserts a key, for one): docs/migrating-from-tfra.md.
"""

import os

# TensorFlow Recommenders needs tf-keras; the choice is made when TensorFlow is imported.
os.environ["TF_USE_LEGACY_KERAS"] = "1"

import argparse  # noqa: E402

import movielens  # noqa: E402  (examples/movielens.py)
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402

import tfde.compat.tfra as tfra  # noqa: E402
from tfde.compat.tfra import dynamic_embedding as de  # noqa: E402

SEED = 2023


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", help="directory with ratings.csv and movies.csv")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, help="training steps per epoch (default: the whole training set)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument(
        "--max-rows",
        type=int,
        default=100_000,
        help="after each epoch, trim a table that holds more than this many keys to 90%% of it",
    )
    parser.add_argument("--k", type=int, default=100, help="the top-k metric printed at the end")
    return parser.parse_args()


def tower(name, key_dtype, capacity):
    """ids [batch] of key_dtype -> [batch, 32] float32, unit length."""
    return tf.keras.Sequential(
        [
            de.keras.layers.Embedding(
                embedding_size=64,
                key_dtype=key_dtype,
                initializer=tf.random_uniform_initializer(-0.05, 0.05),
                init_capacity=capacity,
                restrict_policy=de.FrequencyRestrictPolicy,
                devices=["CPU"],
                kv_creator=tfra.dynamic_embedding.CuckooHashTableCreator(saver=de.FileSystemSaver()),
                name=f"{name}-embedding",
            ),
            tf.keras.layers.Dense(64, activation="gelu"),
            tf.keras.layers.Dense(32),
            tf.keras.layers.Lambda(lambda x: tf.math.l2_normalize(x, axis=1)),
        ],
        name=f"{name}_tower",
    )


class TwoTower(tfrs.Model):
    def __init__(self, user_tower, movie_tower, task):
        super().__init__()
        self.user_tower, self.movie_tower, self.task = user_tower, movie_tower, task

    def compute_loss(self, features, training=False):
        # One process: the loss is the mean over the batch.
        per_example = self.task(self.user_tower(features["user_id"]), self.movie_tower(features["movie_title"]))
        return tf.reduce_mean(per_example)


class Restrict(tf.keras.callbacks.Callback):
    """TFRA's way to bound a table: Variable.restrict after every epoch keeps
    the `num_reserved` keys its policy ranks highest once the table holds
    more than `trigger`."""

    def __init__(self, layers, max_rows):
        super().__init__()
        self.layers, self.max_rows, self.removed = layers, max_rows, 0

    def on_epoch_end(self, epoch, logs=None):
        for layer in self.layers:
            self.removed += layer.params.restrict(num_reserved=self.max_rows * 9 // 10, trigger=self.max_rows)


def main():
    args = parse_args()
    data_dir = movielens.data_dir(args.data)
    ratings = movielens.load(data_dir)
    train, validation = movielens.split(ratings, seed=SEED)
    print(
        f"{data_dir}: {len(train['movie_id']):,} training and {len(validation['movie_id']):,} validation "
        f"ratings, {len(ratings['all_movie_ids']):,} movies",
        flush=True,
    )

    def examples(part):
        return tf.data.Dataset.from_tensor_slices({"user_id": part["user_id"], "movie_title": part["movie_title"]})

    train_ds = examples(train).shuffle(len(train["movie_id"]), seed=SEED).batch(args.batch_size)
    if args.steps:
        train_ds = train_ds.repeat()
    validation_ds = examples(validation).batch(args.batch_size)
    movies = tf.data.Dataset.from_tensor_slices(ratings["all_movie_titles"])

    num_users = len(set(ratings["user_id"].tolist()))
    user_tower = tower("user", tf.int64, num_users)
    movie_tower = tower("movie", tf.string, len(ratings["all_movie_ids"]))
    model = TwoTower(
        user_tower,
        movie_tower,
        tfrs.tasks.Retrieval(
            loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
            metrics=tfrs.metrics.FactorizedTopK(movies.batch(128).map(movie_tower), ks=sorted({1, 10, args.k})),
        ),
    )
    model.compile(optimizer=de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(args.learning_rate)))

    embeddings = [user_tower.layers[0], movie_tower.layers[0]]
    restrict = Restrict(embeddings, args.max_rows)
    model.fit(train_ds, epochs=args.epochs, steps_per_epoch=args.steps, callbacks=[restrict], verbose=2)
    sizes = {layer.name: int(layer.params.size()) for layer in embeddings}
    print(f"rows stored: {sizes}; {restrict.removed:,} keys removed by the restrict policy")
    result = model.evaluate(validation_ds, return_dict=True, verbose=0)
    print(f"optimizer steps: {int(model.optimizer.iterations.numpy())}")
    print(
        f"validation top-{args.k} categorical accuracy: "
        f"{result[f'factorized_top_k/top_{args.k}_categorical_accuracy']:.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
