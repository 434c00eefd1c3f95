"""The `tfde` command.

  tfde train [--data ratings.csv] [--epochs N] ...   train the demo two-tower model
  tfde build [--force]                               compile the op library now (for images)
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _train(args) -> int:
    if args.keras == "tf-keras":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    from tfde.demo import data as demo_data
    from tfde.demo.two_tower import train

    creator = None
    if args.backend == "redis":
        import tfde

        creator = tfde.RedisTableCreator(args.redis_config)
        print(f"backend: Redis at {creator.config.describe_servers()}, model tag "
              f"{creator.config.model_tag_runtime!r} (rows already stored under it are reused)")
    t = time.perf_counter()
    if args.data:
        data = demo_data.movielens_csv(args.data, seed=args.seed)
        source = args.data
    else:
        data = demo_data.synthetic(args.interactions, args.users, args.items, seed=args.seed)
        source = f"synthetic ({args.interactions:,} interactions, {args.users:,} users, {args.items:,} items)"
    print(f"data: {source}: {data.num_train:,} train / {len(data.test_items):,} held out, "
          f"loaded in {time.perf_counter() - t:.1f}s")
    result = train(data, epochs=args.epochs, batch_size=args.batch_size, embedding_dim=args.dim,
                   learning_rate=args.learning_rate, optimizer=args.optimizer, seed=args.seed, table_creator=creator,
                   policy=args.policy, max_rows=args.max_rows, min_count=args.min_count,
                   verbose=1 if sys.stdout.isatty() or args.progress else 2, k=args.k)
    k = args.k
    print(f"rows stored: {result['user_rows']:,} users, {result['item_rows']:,} items")
    print(f"final loss {result['loss']:.4f}, {result['examples_per_s']:,.0f} examples/s")
    print(f"held-out recall@{k}: {result[f'recall@{k}']:.4f}  "
          f"(most-popular baseline: {result[f'most_popular_recall@{k}']:.4f})")
    if result[f"recall@{k}"] <= result[f"most_popular_recall@{k}"]:
        print("the model did not beat the most-popular baseline", file=sys.stderr)
        return 1
    return 0


def _build(args) -> int:
    from tfde import _native

    path = _native.build(force=args.force, verbose=True)
    _native.load()
    print(f"tfde ops ready: {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tfde", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the demo two-tower model")
    t.add_argument("--data", help="MovieLens ratings CSV (userId,movieId,rating,timestamp); default: synthetic")
    t.add_argument("--interactions", type=int, default=1_000_000)
    t.add_argument("--users", type=int, default=50_000)
    t.add_argument("--items", type=int, default=20_000)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--batch-size", type=int, default=1024)
    t.add_argument("--dim", type=int, default=64, help="embedding dim")
    t.add_argument("--learning-rate", type=float, default=0.01)
    t.add_argument("--optimizer", default="adam", help="adam, adagrad, sgd, rmsprop, adamw or ftrl")
    t.add_argument("--k", type=int, default=100, help="recall@k")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--keras", choices=["keras3", "tf-keras"], default="keras3")
    t.add_argument("--backend", choices=["cuckoo", "redis"], default="cuckoo", help="where the tables live")
    t.add_argument("--policy", choices=["frequency", "timestamp"], help="restrict policy of the tables")
    t.add_argument("--max-rows", type=int, help="keep each table at most this many rows (restricted after "
                                                "every batch; implies --policy frequency if none is given)")
    t.add_argument("--min-count", type=int, help="admit a key only in the step it is seen for the "
                                                 "min-count-th time (tfde.CounterFilter)")
    t.add_argument("--redis-config", help="Redis JSON config (TFRA format) for --backend redis; "
                                          "default: the file named by $TFDE_REDIS_CONFIG")
    t.add_argument("--progress", action="store_true", help="progress bar even when stdout is not a terminal")
    t.set_defaults(fn=_train)
    b = sub.add_parser("build", help="compile the native op library for the installed TensorFlow")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=_build)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
