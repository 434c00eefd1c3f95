"""A tfrs two-tower retrieval model on MovieLens trained by several CPU
processes under Horovod, each storing its share of every embedding table in
in-process cuckoo tables, with checkpoints a restarted job resumes from.

  tfde make-data movielens        # synthetic MovieLens CSVs (or MovieLens's own ratings.csv + movies.csv)
  horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_two_tower.py movielens checkpoints
  # the same command again resumes from the latest checkpoint in checkpoints/

The data directory is the first argument, else $TFDE_EXAMPLE_DATA, else
./movielens; checkpoints go to the second (default ./checkpoints), one
directory for every worker: each writes its own files there, and a
checkpoint restores into any number of workers.  Horovod builds against TF <=
2.16 (docs/distributed.md, "Horovod", says how to install it).

What it shows: int64 keys (user and movie ids) on each worker's own tables,
ids and rows travelling to their owners through Horovod's all-to-all;
hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(...)) in that order;
Horovod's broadcast callback; tfde's ModelCheckpoint (rows, optimizer
slots, policy state and dense weights; atomic); a tfrs FactorizedTopK metric
over every movie, averaged over the workers at the end.
"""

import os

# Horovod's Keras support and TensorFlow Recommenders need tf-keras; the
# choice is made when TensorFlow is imported.
os.environ["TF_USE_LEGACY_KERAS"] = "1"

import argparse  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402
import movielens  # noqa: E402  (examples/movielens.py)
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402

import tfde  # noqa: E402
import tfde.distributed.horovod  # noqa: E402

SEED = 2023


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", help="directory with ratings.csv and movies.csv")
    parser.add_argument("checkpoints", nargs="?", default="checkpoints", help="checkpoint directory (shared)")
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


def tower(name):
    """ids [batch] int64 -> [batch, 32] float32, unit length.  The table
    creator is tfde's default: this worker's cuckoo tables."""
    return tf.keras.Sequential(
        [
            tfde.keras.layers.Embedding(
                64,
                key_dtype=tf.int64,
                initializer=tf.random_uniform_initializer(-0.05, 0.05),
                restrict_policy=tfde.FrequencyRestrictPolicy,
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
        movies = self.movie_tower(features["movie_id"])
        # Horovod's convention: each worker's loss is the mean over its own
        # batch, and the gradients are averaged over the workers (tfde does
        # it for tfrs.Model's train_step), which makes them those of the mean
        # over the global batch.  The task's loss has reduction NONE so that
        # the mean is taken here, not tfrs's default SUM.
        return tf.reduce_mean(self.task(users, movies))


def main():
    args = parse_args()
    data_dir = movielens.data_dir(args.data)
    tfde.distributed.horovod.init()  # hvd.init(), and tfde's all-to-all exchange
    rank, size = hvd.rank(), hvd.size()
    say = lambda *a: print(f"[rank {rank}/{size}]", *a, flush=True)  # noqa: E731
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {size} workers")
    local_batch = args.batch_size // size

    ratings = movielens.load(data_dir)
    train, validation = movielens.split(ratings, seed=SEED)
    say(
        f"{data_dir}: {len(train['movie_id']):,} training and {len(validation['movie_id']):,} validation ratings, "
        f"{len(ratings['all_movie_ids']):,} movies"
    )

    def share(part):
        # Every worker must take the same number of steps (every lookup is a
        # collective): each gets exactly len // size examples.
        n = len(part["movie_id"]) // size
        ds = tf.data.Dataset.from_tensor_slices({"user_id": part["user_id"], "movie_id": part["movie_id"]})
        return ds.take(n * size).shard(size, rank)

    train_ds = share(train).shuffle(len(train["movie_id"]), seed=SEED + rank).batch(local_batch, drop_remainder=True)
    if args.steps:
        train_ds = train_ds.repeat()
    validation_ds = share(validation).batch(local_batch)
    movies = tf.data.Dataset.from_tensor_slices(ratings["all_movie_ids"])

    user_tower, movie_tower = tower("user"), tower("movie")
    model = TwoTower(
        user_tower,
        movie_tower,
        tfrs.tasks.Retrieval(
            loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
            metrics=tfrs.metrics.FactorizedTopK(movies.batch(128).map(movie_tower), ks=sorted({1, 10, args.k})),
        ),
    )
    model.compile(
        optimizer=hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(args.learning_rate)))
    )

    checkpoint = tfde.keras.callbacks.ModelCheckpoint(args.checkpoints, restore=True)
    restrict = tfde.keras.callbacks.RestrictCallback(max_size=args.max_rows, num_reserved=args.max_rows * 9 // 10)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), checkpoint, restrict]
    model.fit(
        train_ds, epochs=args.epochs, steps_per_epoch=args.steps, callbacks=callbacks, verbose=2 if rank == 0 else 0
    )
    if checkpoint.restored_from:
        say(f"resumed from {checkpoint.restored_from}")
    else:
        say(f"no checkpoint in {args.checkpoints} at the start: trained from scratch")
    say(
        f"optimizer steps: {int(model.optimizer.iterations.numpy())}; latest checkpoint: "
        f"{checkpoint.manager.latest_checkpoint}"
    )
    sizes = {
        layer.name: tfde.policy.global_size(layer.params) for layer in (user_tower.layers[0], movie_tower.layers[0])
    }
    say(f"rows stored (all workers): {sizes}; {restrict.restrictor.removed:,} keys removed here by the restrict policy")
    result = model.evaluate(validation_ds, return_dict=True, verbose=0)
    top_k = result[f"factorized_top_k/top_{args.k}_categorical_accuracy"]
    # Each worker evaluated its own share, all of one size: their mean is the metric of the whole validation set.
    mean = float(hvd.allreduce(tf.constant(top_k, tf.float64), name="top_k_accuracy"))
    say(f"validation top-{args.k} categorical accuracy: {mean:.4f} (this worker's share: {top_k:.4f})")


if __name__ == "__main__":
    main()
