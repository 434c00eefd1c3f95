"""A TensorFlow Recommenders two-tower retrieval model on MovieLens, trained
by several worker processes under tf.distribute.MultiWorkerMirroredStrategy,
its embedding tables in Redis.

  tfde make-data movielens        # synthetic MovieLens CSVs (or MovieLens's own ratings.csv + movies.csv)
  # one shell per worker; TF_CONFIG lists every worker and gives this one's index:
  TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]}, "task": {"type": "worker", "index": 0}}' \\
      python examples/mwms_two_tower.py movielens
  TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]}, "task": {"type": "worker", "index": 1}}' \\
      python examples/mwms_two_tower.py movielens

Without TF_CONFIG it trains in one process.  The data directory is the first
argument, else $TFDE_EXAMPLE_DATA, else ./movielens.

Redis: $REDIS_HOST (127.0.0.1), $REDIS_PORT (6379), $REDIS_MODEL_TAG
(tfde-example-mwms), or $REDIS_CONFIG naming a TFRA-format JSON config file
(configs/redis.json).  Redis is where the rows live, so a second run under the
same tag starts from the rows of the first: change the tag (or delete its
keys, `redis-cli --scan --pattern 'TAG:*' | xargs redis-cli del`) to start
afresh.

What it shows: string keys (user ids, movie titles) in tfde Keras layers on a
shared Redis store; a tfrs FactorizedTopK metric over every movie, written as
tfrs users write it (`movies.batch(128).map(movie_tower)`: tfde never trains
from such lookups, docs/lookups.md); a FrequencyRestrictPolicy kept in bounds
by RestrictCallback; the loss averaged over the global batch.
"""

import os

# TensorFlow Recommenders needs tf-keras; the choice is made when TensorFlow is imported.
os.environ["TF_USE_LEGACY_KERAS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402

import movielens  # noqa: E402  (examples/movielens.py)
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402

import tfde  # noqa: E402

SEED = 2023


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", help="directory with ratings.csv and movies.csv")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, help="training steps per epoch (default: the whole training set)")
    parser.add_argument("--batch-size", type=int, default=1024, help="global batch: all workers together")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument(
        "--max-rows",
        type=int,
        default=100_000,
        help="keep each table at most this many keys (90%% kept when it passes)",
    )
    parser.add_argument("--k", type=int, default=100, help="the top-k metric printed at the end")
    return parser.parse_args()


def redis_creator():
    path = os.environ.get("REDIS_CONFIG")
    if path:
        return tfde.RedisTableCreator(path)
    return tfde.RedisTableCreator(
        {
            "redis_connection_mode": 2,  # a standalone server
            "redis_host_ip": [os.environ.get("REDIS_HOST", "127.0.0.1")],
            "redis_host_port": [int(os.environ.get("REDIS_PORT", "6379"))],
            "model_tag_runtime": os.environ.get("REDIS_MODEL_TAG", "tfde-example-mwms"),
            "storage_slice": 2,
        }
    )


def tower(name, creator):
    """ids [batch] string -> [batch, 32] float32, unit length."""
    return tf.keras.Sequential(
        [
            tfde.keras.layers.Embedding(
                64,
                key_dtype=tf.string,
                initializer=tf.random_uniform_initializer(-0.05, 0.05),
                restrict_policy=tfde.FrequencyRestrictPolicy,
                table_creator=creator,
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
        users = self.user_tower(features["user_id"])
        movies = self.movie_tower(features["movie_title"])
        # The task's loss has reduction NONE: one value per example of this
        # worker's batch.  compute_average_loss divides their sum by the
        # global batch (this batch times the workers in sync), so the
        # gradients the strategy sums over the workers are those of the mean
        # loss of the global batch.  (tfrs's default, a SUM, would make the
        # step grow with the batch and the number of workers.)  The top-k
        # metric runs in training steps too, as in the programs users write;
        # `compute_metrics=not training` would skip it there, and save time.
        per_example = self.task(users, movies)
        return tf.nn.compute_average_loss(per_example)


def main():
    args = parse_args()
    data_dir = movielens.data_dir(args.data)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        # A worker that dies makes the others fail within this time instead of waiting for ever.
        communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=300)
    )
    worker = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    workers = strategy.num_replicas_in_sync
    say = lambda *a: print(f"[worker {worker}/{workers}]", *a, flush=True)  # noqa: E731

    ratings = movielens.load(data_dir)
    train, validation = movielens.split(ratings, seed=SEED)
    say(
        f"{data_dir}: {len(train['movie_id']):,} training and {len(validation['movie_id']):,} validation ratings, "
        f"{len(ratings['all_movie_ids']):,} movies"
    )

    def examples(part):
        # tfds's MovieLens gives user ids as strings: so do we.
        return tf.data.Dataset.from_tensor_slices(
            {"user_id": part["user_id"].astype(str), "movie_title": part["movie_title"]}
        )

    # Every worker reads the same files and keeps its share of every global
    # batch (DATA sharding); the seeded shuffle is the same on every worker.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train_ds = (
        examples(train)
        .shuffle(len(train["movie_id"]), seed=SEED)
        .batch(args.batch_size, drop_remainder=True)
        .with_options(options)
    )
    validation_ds = examples(validation).batch(args.batch_size).with_options(options)
    if args.steps:
        train_ds = train_ds.repeat()
    movies = tf.data.Dataset.from_tensor_slices(ratings["all_movie_titles"])

    creator = redis_creator()
    say(f"tables in Redis at {creator.config.describe_servers()}, model tag {creator.config.model_tag_runtime!r}")
    with strategy.scope():
        user_tower, movie_tower = tower("user", creator), tower("movie", creator)
        task = tfrs.tasks.Retrieval(
            loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
            metrics=tfrs.metrics.FactorizedTopK(
                candidates=movies.batch(128).map(movie_tower), ks=sorted({1, 10, args.k})
            ),
        )
        model = TwoTower(user_tower, movie_tower, task)
        model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(args.learning_rate)))

    restrict = tfde.keras.callbacks.RestrictCallback(max_size=args.max_rows, num_reserved=args.max_rows * 9 // 10)
    model.fit(
        train_ds, epochs=args.epochs, steps_per_epoch=args.steps, callbacks=[restrict], verbose=2 if worker == 0 else 0
    )
    # Each key's last write is its owner's: wait for every worker's before
    # reading the tables from the metric's tf.data function.
    tfde.exchange.barrier(strategy)
    sizes = {
        layer.name: tfde.policy.global_size(layer.params) for layer in (user_tower.layers[0], movie_tower.layers[0])
    }
    say(f"rows stored: {sizes}; {restrict.restrictor.removed:,} keys removed by the restrict policy")
    result = model.evaluate(validation_ds, return_dict=True, verbose=0)
    say(f"optimizer steps: {int(model.optimizer.iterations.numpy())}")
    say(
        f"validation top-{args.k} categorical accuracy: "
        f"{result[f'factorized_top_k/top_{args.k}_categorical_accuracy']:.4f}"
    )


if __name__ == "__main__":
    main()
