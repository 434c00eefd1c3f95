"""The commands of `tfde` (the parser and the process set-up are in
tfde_cli.py, outside the package, so that they run before TensorFlow is
imported; docs/install.md)."""

from __future__ import annotations

import os
import sys
import time

import tfde_cli


def _launch(args, argv) -> int:
    """`tfde train --workers N`: starts N workers of the same command."""
    from tfde.distributed.launch import run_local

    worker_argv = _without(argv, "--workers") + ["--as-worker"]
    env = dict(os.environ)
    if args.keras != "tf-keras":
        print(
            "--workers trains with tf-keras: Keras 3's model.fit fails under MultiWorkerMirroredStrategy and "
            "Horovod supports tf-keras only (docs/distributed.md)"
        )
        worker_argv += ["--keras", "tf-keras"]
    return run_local(worker_argv, args.workers, args.engine, env=env)


def _without(argv, flag):
    """argv minus `flag` and its value (as `--flag V` or `--flag=V`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _train(args) -> int:
    if args.sync_local_slots and not args.sync_replicate:
        print(
            "tfde train: --sync-local-slots keeps the slots in the copies of --sync-replicate; add it", file=sys.stderr
        )
        return 2
    if args.keras == "tf-keras" and os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        # `import tfde` has chosen tf.keras already: start again with tf-keras.
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "tfde_cli", *args.argv])
    if args.workers > 1 and not args.as_worker:
        return _launch(args, args.argv)
    from tfde.demo import data as demo_data
    from tfde.demo.engines import Engine
    from tfde.demo.two_tower import train

    engine = Engine(args.engine if args.as_worker else None)
    if args.exchange_stats:
        import tfde

        tfde.exchange.enable_stats()
    say = print if engine.chief else (lambda *a, **k: None)

    creator = None
    if args.backend == "redis":
        import tfde

        creator = tfde.RedisTableCreator(args.redis_config)
        say(
            f"backend: Redis at {creator.config.describe_servers()}, model tag "
            f"{creator.config.model_tag_runtime!r} (rows already stored under it are reused)"
        )
    if args.model == "dlrm":
        return _train_dlrm(args, engine, creator, say)
    args.epochs = 2 if args.epochs is None else args.epochs
    args.batch_size = args.batch_size or 1024
    args.dim = args.dim or 64
    args.learning_rate = 0.01 if args.learning_rate is None else args.learning_rate
    t = time.perf_counter()
    if args.data:
        data = demo_data.movielens_csv(args.data, seed=args.seed)
        source = args.data
    else:
        data = demo_data.synthetic(args.interactions, args.users, args.items, seed=args.seed)
        source = f"synthetic ({args.interactions:,} interactions, {args.users:,} users, {args.items:,} items)"
    say(
        f"workers: {engine.size} ({args.engine}), {args.batch_size} examples per worker and step"
        if engine.size > 1
        else "workers: 1"
    )
    say(
        f"data: {source}: {data.num_train:,} train / {len(data.test_items):,} held out, "
        f"loaded in {time.perf_counter() - t:.1f}s"
    )
    result = train(
        data,
        epochs=args.epochs,
        batch_size=args.batch_size,
        embedding_dim=args.dim,
        learning_rate=args.learning_rate,
        optimizer=args.optimizer,
        seed=args.seed,
        table_creator=creator,
        policy=args.policy,
        max_rows=args.max_rows,
        min_count=args.min_count,
        verbose=1 if sys.stdout.isatty() or args.progress else 2,
        k=args.k,
        engine=engine,
        sync_every=args.sync_every,
        sync_replicate=args.sync_replicate,
        sync_slots="local" if args.sync_local_slots else "merged",
    )
    k = args.k
    if not engine.chief:
        return 0 if result[f"recall@{k}"] > result[f"most_popular_recall@{k}"] else 1
    _print_exchange(result["exchange"])
    print(f"rows stored{result['rows_of']}: {result['user_rows']:,} users, {result['item_rows']:,} items")
    print(
        f"final loss {result['loss']:.4f}, {result['examples_per_s']:,.0f} examples/s"
        + (" (all workers)" if engine.size > 1 else "")
    )
    print(
        f"held-out recall@{k}: {result[f'recall@{k}']:.4f}  "
        f"(most-popular baseline: {result[f'most_popular_recall@{k}']:.4f})"
    )
    if result[f"recall@{k}"] <= result[f"most_popular_recall@{k}"]:
        print("the model did not beat the most-popular baseline", file=sys.stderr)
        return 1
    return 0


def _train_dlrm(args, engine, creator, say) -> int:
    """`tfde train --model dlrm`: the click model on the synthetic log or a Criteo TSV file."""
    from tfde.demo import clicks
    from tfde.demo.dlrm import train

    epochs = 1 if args.epochs is None else args.epochs
    batch_size = args.batch_size or 4096
    if not 1 <= args.features <= len(clicks.CATEGORICAL):
        print(f"tfde train: --features must be 1..{len(clicks.CATEGORICAL)}, got {args.features}", file=sys.stderr)
        return 2
    t = time.perf_counter()
    if args.data:
        data = clicks.criteo_tsv(args.data, max_examples=args.examples)
        source = f"{args.data} (Criteo TSV, string keys)"
    else:
        data = clicks.synthetic(args.examples, args.max_cardinality, seed=args.seed)
        source = f"synthetic Criteo-like log ({args.examples:,} examples, cardinalities 10..{args.max_cardinality:,})"
    say(
        f"workers: {engine.size} ({args.engine}), {batch_size} examples per worker and step"
        if engine.size > 1
        else "workers: 1"
    )
    say(
        f"data: {source}: {data.num_train:,} train / {len(data.test_labels):,} held out, "
        f"click rate {data.train_labels.mean():.3f}, made in {time.perf_counter() - t:.1f}s"
    )
    result = train(
        data,
        epochs=epochs,
        batch_size=batch_size,
        embedding_dim=args.dim or 16,
        learning_rate=0.002 if args.learning_rate is None else args.learning_rate,
        optimizer=args.optimizer,
        seed=args.seed,
        table_creator=creator,
        layers=args.layers,
        placement=args.placement,
        verbose=1 if sys.stdout.isatty() or args.progress else 2,
        engine=engine,
        features=clicks.CATEGORICAL[: args.features],
        sync_every=args.sync_every,
        sync_replicate=args.sync_replicate,
        sync_slots="local" if args.sync_local_slots else "merged",
    )
    better = result["auc"] > result["dense_baseline_auc"]
    if not engine.chief:
        return 0 if better else 1
    if result["plan"]:
        print(result["plan"])
    _print_exchange(result["exchange"])
    sizes = result["table_sizes"]
    print(
        f"rows stored{result['rows_of']}: {sum(sizes.values()):,} in {len(sizes)} tables ("
        + ", ".join(f"{n} {c:,}" for n, c in sizes.items())
        + ")"
    )
    print(
        f"final loss {result['loss']:.4f}, {result['examples_per_s']:,.0f} examples/s"
        + (" (all workers)" if engine.size > 1 else "")
        + f", {result['ms_per_step']:.1f} ms/step"
    )
    print(
        f"held-out AUC: {result['auc']:.4f}  (logistic regression on the dense features: "
        f"{result['dense_baseline_auc']:.4f})"
    )
    if not better:
        print("the model did not beat the dense-feature baseline", file=sys.stderr)
        return 1
    return 0


def _print_exchange(ex) -> None:
    if ex and ex["steps"]:
        steps = ex["steps"]
        print(
            f"exchange (worker 0): {ex['bytes'] / steps / 1024:,.1f} KiB/step handed to collectives, "
            f"{1000 * ex['seconds'] / steps:.1f} ms/step in them of {1000 * ex['fit_seconds'] / steps:.1f} ms/step, "
            f"{ex['calls'] / steps:.1f} collectives/step"
        )


def _make_data(args) -> int:
    from tfde.demo.data import write_movielens_csv

    try:
        paths = write_movielens_csv(
            args.directory, num_ratings=args.ratings, num_users=args.users, num_movies=args.movies, seed=args.seed
        )
    except ValueError as e:
        print(f"tfde make-data: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.ratings:,} ratings of {args.users:,} users and {args.movies:,} movies (seed {args.seed}): "
        + ", ".join(paths)
    )
    return 0


def _build(args) -> int:
    from tfde import _native

    path = _native.build(force=args.force, verbose=True)
    _native.load()
    print(f"tfde ops ready: {path}")
    return 0


def run(args) -> int:
    """Runs the command tfde_cli parsed (`args`, with args.argv the words)."""
    return {"train": _train, "make-data": _make_data, "build": _build}[args.command](args)


def main(argv=None) -> int:
    """`tfde ...` from Python (tfde_cli.main; the command line, without the
    start-up speed of the `tfde` script: tfde is imported already)."""
    return tfde_cli.main(argv)
