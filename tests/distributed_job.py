"""One worker of a small synchronous training job, for tests/test_distributed.py.

  python tests/distributed_job.py CONFIG.json WORKER_INDEX

CONFIG: {"workers": N, "ports": [...], "engine": "fit" | "loop", "optimizer": "sgd" | "adam",
         "layout": "cuckoo" | "redis", "redis": {...config...} or null, "steps": T,
         "global_batch": G, "out": "prefix",
         optional: "restore_dir" (restore its latest checkpoint before training),
         "save_dir" (save a checkpoint there after training; "{rank}" in either is the worker's index),
         "restrict", "admission" ("counter" | "probability", or {layer name: kind}), "track_changes" (both
         layers), "policies": {"user_emb": "frequency" | "timestamp", "item_emb": ...} (a restrict policy per
         layer, never applied: its state is checked),
         "model": "keras" (default: Keras's train_step) | "tfrs" (a tfrs.Model: its train_step calls
         tape.gradient and apply_gradients) | "custom_step" (a Keras train_step of our own doing the same),
         "hvd_wrap": false (the tfde optimizer without hvd.DistributedOptimizer),
         "plain_optimizer": true (a Keras optimizer not wrapped by tfde: must fail naming the wrapper),
         "tfdata_read": true (after training, every worker reads rows in tf.data functions) or "unequal"
         (worker 1 runs one read more),
         "eager_read": true (after training, every worker reads rows eagerly outside strategy.run),
         "topk_metric": true (model "tfrs": a FactorizedTopK metric over candidates.map(item tower)),
         "model": "many" (one tfde.keras.layers.DistributedEmbedding over four features: user, item, an
         item history sharing the item table, a category in a table of its own; "placement" and
         "column_slice_threshold" go to the layer; worker 0 writes the layer's plan to OUT-plan.json;
         "plans": [[placement, threshold], ...] trains one such model per plan in turn, each writing
         OUT-planI-*),
         "sync_every": k (semi-synchronous training, tfde.keras.callbacks.PeriodicSync or, in the custom loop,
         tfde.semi_sync.PeriodicSync; each worker writes what it pushed at each sync to OUT-pushed-wW.npz and
         worker 0 the initial rows of every key to OUT-init.npz; with "replicate": true each worker writes its
         working copies after the last sync to OUT-copies-wW.npz), "sync_slots": "local" (PeriodicSync's slots),
         "learning_rate": Adam's (default 0.01),
         "value_dtype": "float16" (the two Embedding layers' rows and slots), ...}

The data are fixed: T global batches of G examples (string user id, int64
item id, label), the same for every run; the custom loop adds a short last
batch split unevenly.  Worker w of N trains on its slice of each global
batch, so N workers see exactly the examples one worker sees with the whole
batch.  With N > 1 the job runs under
MultiWorkerMirroredStrategy (TF_CONFIG on loopback); with N == 1 under no
strategy.  At the end each worker writes OUT-wW.npz: the rows and optimizer
slots it stores (its shard; for the Redis layout worker 0 writes the shared
tables) and the dense weights.
"""

import json
import os
import signal
import sys

import numpy as np

cfg = json.load(open(sys.argv[1]))
N, T, G = cfg["workers"], cfg["steps"], cfg["global_batch"]
if cfg["engine"] == "hvd":  # launched by horovodrun: the rank comes from Horovod
    import tfde.distributed.horovod as tfde_hvd

    if cfg.get("bare_hvd_init"):  # the mistake tfde must catch: Horovod without tfde's exchange
        import horovod.tensorflow as hvd

        hvd.init()
    else:
        hvd = tfde_hvd.init()
    import horovod.tensorflow.keras as hvd_keras

    index = hvd.rank()
    assert hvd.size() == N, (hvd.size(), N)
else:
    index = int(sys.argv[2])
    if N > 1:
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"localhost:{p}" for p in cfg["ports"]]},
                "task": {"type": "worker", "index": index},
            }
        )

import tensorflow as tf  # noqa: E402

import tfde  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distributed_check import dump  # noqa: E402  (the writer of what distributed_check.load reads)

from benchmarks.dlrm_side import collective_ops  # noqa: E402

rng = np.random.default_rng(7)
# Global batch sizes: T of G; the custom loop adds a short, unevenly split
# last batch (worker 0 gets 3 more examples than worker 1).
sizes = [G] * T + ([G // 2 + 3] if cfg["engine"] == "loop" else [])
total = sum(sizes)
# Skewed ids, so that batches share keys across workers and some steps give a
# worker no key that is new to the table.
all_users = np.array([f"u{int(i)}" for i in rng.zipf(1.3, size=total) % 97])
all_items = (rng.zipf(1.2, size=total) % 211).astype(np.int64) * 1_000_003
all_labels = rng.random(total).astype(np.float32)
# Model "many": each example's three previous items (its history, in the item
# table) and a category with a table of its own.
all_hist = np.stack([np.roll(all_items, k) for k in (1, 2, 3)], 1)
all_cats = (all_items // 1_000_003) % 13 + 5
# The second half of the last global batch repeats keys of the first step, so
# with 2 workers worker 1 sees no new key in the last step (the same data for
# any number of workers).
last = np.array_split(np.arange(total - sizes[-1], total), 2)[-1]
all_users[last], all_items[last] = all_users[: len(last)], all_items[: len(last)]
parts, start = [], 0
for size in sizes:  # this worker's slice of each global batch
    part = np.array_split(np.arange(start, start + size), N)[index]
    parts.append(part)
    start += size
mine = np.concatenate(parts)
users, items, labels = all_users[mine], all_items[mine], all_labels[mine]
hist, cats = all_hist[mine], all_cats[mine]
part_starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
part_sizes = np.array([len(p) for p in parts], np.int64)

if N > 1 and cfg["engine"] != "hvd":
    # A collective that waits longer than timeout_s fails instead of hanging.
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=cfg.get("timeout_s"))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
else:
    strategy = tf.distribute.get_strategy()
creator = None
if cfg["layout"] == "redis":
    creator = tfde.RedisTableCreator(cfg["redis"])


MANY = cfg.get("model") == "many"


def make_many(model):
    """Model "many": every feature in one DistributedEmbedding layer."""
    init = tf.keras.initializers.RandomNormal(stddev=0.3, seed=1)
    user = tfde.TableConfig("user", 8, key_dtype=tf.string, initializer=init, table_creator=creator, expected_rows=97)
    item = tfde.TableConfig("item", 8, initializer=init, table_creator=creator, expected_rows=211)
    cat = tfde.TableConfig("cat", 8, initializer=init, table_creator=creator, expected_rows=13)
    features = {
        "user": tfde.FeatureConfig(user),
        "item": tfde.FeatureConfig(item),
        "hist": tfde.FeatureConfig(item, combiner="sum"),
        "cat": tfde.FeatureConfig(cat),
    }
    model.emb = tfde.keras.layers.DistributedEmbedding(
        features,
        placement=cfg.get("placement", "auto"),
        column_slice_threshold=cfg.get("column_slice_threshold"),
        name="emb",
    )
    model.dense = tf.keras.layers.Dense(4, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2), name="dense")


def make_filter(filters, admission, name):
    kind = admission.get(name) if isinstance(admission, dict) else admission
    return filters[kind]() if kind else None


def make_layers(model):
    """The job's layers, as attributes of `model` (a Keras or tfrs Model)."""
    if MANY:
        return make_many(model)
    emb = dict(initializer=tf.keras.initializers.RandomNormal(stddev=0.3, seed=1), table_creator=creator)
    if cfg.get("restrict"):
        emb["restrict_policy"] = tfde.FrequencyRestrictPolicy
    if cfg.get("track_changes"):
        emb["track_changes"] = True
    if cfg.get("value_dtype"):  # the tables' rows and slots, e.g. "float16"
        emb["value_dtype"] = cfg["value_dtype"]
    policies = {"frequency": tfde.FrequencyRestrictPolicy, "timestamp": tfde.TimestampRestrictPolicy}
    policy = {name: policies[kind] for name, kind in cfg.get("policies", {}).items()}
    filters = {
        "counter": lambda: tfde.CounterFilter(2),
        "probability": lambda: tfde.ProbabilityFilter(0.5, seed=3),
    }
    admission = cfg.get("admission")  # one kind for both layers, or {layer name: kind}
    for name in ("user_emb", "item_emb"):
        if name in policy:
            emb["restrict_policy"] = policy[name]
        layer = tfde.keras.layers.Embedding(
            8,
            key_dtype=tf.string if name == "user_emb" else tf.int64,
            name=name,
            admission_filter=make_filter(filters, admission, name),
            **emb,
        )
        setattr(model, name, layer)
    model.dense = tf.keras.layers.Dense(4, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2), name="dense")


def forward(model, features, training):
    if MANY:
        out = model.emb(features, training=training)
        return tf.reduce_sum(model.dense(tf.concat([out[n] for n in ("user", "item", "hist", "cat")], 1)), axis=1)
    u = model.user_emb(features["user"], training=training)
    i = model.item_emb(features["item"], training=training)
    return tf.reduce_sum(model.dense(tf.concat([u, i], axis=1)), axis=1)


class Model(tf.keras.Model):
    def __init__(self):
        super().__init__()
        make_layers(self)

    def call(self, features, training=None):
        return forward(self, features, training)


MULTI_WORKER_STRATEGY = N > 1 and cfg["engine"] != "hvd"


def mean_loss(pred, y):
    """The loss of this worker's examples: their mean under Horovod (which
    averages gradients) and alone; under MultiWorkerMirroredStrategy (which
    sums them) divided by the global batch instead."""
    per_example = tf.square(pred - y)
    return tf.nn.compute_average_loss(per_example) if MULTI_WORKER_STRATEGY else tf.reduce_mean(per_example)


class CustomStepModel(Model):
    """A train_step of its own: tape.gradient, then apply_gradients (not minimize)."""

    def train_step(self, data):
        features, y = data
        with tf.GradientTape() as tape:
            loss = mean_loss(self(features, training=True), y)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def build():
    kind = cfg.get("model", "keras")
    if kind == "many":  # Keras's train_step, or with "custom_step": tape.gradient, then apply_gradients
        return CustomStepModel() if cfg.get("custom_step") else Model()
    if kind == "custom_step":
        return CustomStepModel()
    if kind == "tfrs":
        import tensorflow_recommenders as tfrs

        class TfrsModel(tfrs.Model):
            """tfrs.Model.train_step: tape.gradient, then optimizer.apply_gradients."""

            def __init__(self):
                super().__init__()
                make_layers(self)
                if cfg.get("topk_metric"):  # as the TFRA programs write it: the item tower mapped over candidates
                    candidates = tf.data.Dataset.from_tensor_slices(np.unique(all_items)).batch(16)
                    self.topk = tfrs.metrics.FactorizedTopK(candidates=candidates.map(self.item_emb), ks=(1, 5, 10))

            def call(self, features, training=None):
                return forward(self, features, training)

            def compute_loss(self, inputs, training=False):
                features, y = inputs
                if cfg.get("topk_metric"):  # as tfrs.tasks.Retrieval updates its metric
                    self.topk.update_state(self.user_emb(features["user"]), self.item_emb(features["item"]))
                return mean_loss(forward(self, features, training), y)

        return TfrsModel()
    return Model()


def compile_model(model, opt):
    if cfg.get("model", "keras") in ("keras", "many"):
        model.compile(optimizer=opt, loss="mse")
    else:
        model.compile(optimizer=opt)


def restrict_callbacks():
    """Frequency restriction to cfg["restrict"] keys every 2 steps, when asked
    for; semi-synchronous training (with what it pushes recorded) when asked for."""
    out = []
    if cfg.get("restrict"):
        out.append(tfde.keras.callbacks.RestrictCallback(every_n_steps=2, num_reserved=cfg["restrict"]))
    if cfg.get("sync_every"):
        periodic = tfde.keras.callbacks.PeriodicSync(
            cfg["sync_every"], replicate=cfg.get("replicate", False), slots=cfg.get("sync_slots", "merged")
        )
        out += [PushRecorder(lambda: periodic.sync, lambda step: step - periodic._last >= periodic.every), periodic]
    return out


HISTORY = []  # model.fit's History (engine "fit" with several workers)
SYNC = []  # [this run's tfde.semi_sync.PeriodicSync] (semi-synchronous training; the callback drops its own at the end)
PUSHED = []  # [(table name, keys, deltas)] of every sync of this worker (semi-synchronous training)
KERNELS = []  # the dense layer's kernel before each sync (its length: the syncs recorded so far)
LOCAL_STEP = []  # model.fit's traced step during local steps: its collective ops (tf.distribute's, Horovod's)
MODEL_DENSE = []  # the model's dense layer


def table_names() -> dict:
    """{id(Variable): its name in the job's files} of every layer's rows,
    optimizer slots and admission counts ("LAYER", "LAYER/SLOT",
    "LAYER/admission")."""
    names = {}
    for layer in model_layers:
        names[id(layer.params)] = layer.name
        for slot_name, slot in layer.params.slots.items():
            names[id(slot)] = f"{layer.name}/{slot_name}"
        counts = getattr(layer.params.admission_filter, "counts", None)
        if counts is not None:
            names[id(counts)] = f"{layer.name}/admission"
    return names


def record_pending(sync):
    """Appends what `sync` (tfde.semi_sync.PeriodicSync) is about to push to
    PUSHED, and the dense kernel to KERNELS."""
    KERNELS.append(np.asarray(MODEL_DENSE[0].get_weights()[0]))
    names = table_names()
    for var, keys, deltas, values in sync.pending():
        keys = keys.astype("S") if keys.dtype == object else keys
        PUSHED.append((names[id(var)], keys, deltas, values, np.full(len(keys), len(KERNELS))))


def dump_copies(sync):
    """Writes OUT-copies-wW.npz: this worker's working copies (replicate)
    of every layer's rows and optimizer slots after the last sync: the
    rows are the stores', the slots too, or with "sync_slots": "local" this
    worker's own."""
    names = table_names()
    copies = {}
    for entry in sync._entries:
        for t in entry.tables:
            if id(t.var) not in names:  # policy state, change labels
                continue
            keys, rows, _ = t.rows.export_chunk(0, 2**62)
            keys = keys.numpy()
            copies[f"{names[id(t.var)]}/keys"] = keys.astype("S") if keys.dtype == object else keys
            copies[f"{names[id(t.var)]}/rows"] = rows.numpy()
    np.savez(f"{cfg['out']}-copies-w{index}.npz", **copies)


class PushRecorder(tf.keras.callbacks.Callback):
    """Records what the PeriodicSync callback after it pushes at each sync."""

    def __init__(self, sync_of, due):
        super().__init__()
        self.sync_of, self.due = sync_of, due

    def on_train_batch_end(self, batch, logs=None):
        if self.sync_of() is not None:
            SYNC[:] = [self.sync_of()]
        if self.sync_of() is not None and self.due(int(self.model.optimizer.iterations.numpy())):
            record_pending(self.sync_of())

    def on_epoch_end(self, epoch, logs=None):  # the PeriodicSync callback syncs at each epoch's end
        if self.sync_of() is not None:
            record_pending(self.sync_of())
            LOCAL_STEP.append(collective_ops(self.model))

    def on_train_end(self, logs=None):  # its last sync, if the epoch's end left anything
        if self.sync_of() is not None and self.sync_of()._dirty():
            record_pending(self.sync_of())


def optimizer():
    if cfg.get("plain_optimizer"):  # the mistake tfde must name: no tfde.DynamicEmbeddingOptimizer
        opt = tf.keras.optimizers.Adam(0.01)
        return hvd_keras.DistributedOptimizer(opt) if cfg["engine"] == "hvd" else opt
    if cfg["optimizer"] == "adam":
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(cfg.get("learning_rate", 0.01)))
    else:
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.05))
    return hvd_keras.DistributedOptimizer(opt) if cfg["engine"] == "hvd" and cfg.get("hvd_wrap", True) else opt


def features_of(start, count):
    """This worker's features of examples [start, start + count) (tensors or numbers)."""
    out = {"user": tf.constant(users)[start : start + count], "item": tf.constant(items)[start : start + count]}
    if MANY:
        out["hist"] = tf.constant(hist)[start : start + count]
        out["cat"] = tf.constant(cats)[start : start + count]
    return out


def dataset(ctx=None):
    y = tf.constant(labels)
    ds = (
        tf.data.Dataset.from_tensor_slices((part_starts, part_sizes))
        .repeat(cfg.get("repeat", 1))
        .map(lambda s, n: (features_of(s, n), y[s : s + n]))
    )
    if cfg["engine"] == "fit" and N > 1 and cfg.get("sync_every", 1) > 1:
        # Endless, so that tf.distribute's iterator does not ask every worker
        # at each step whether it still has data (a collective in the step
        # that local steps would keep); fit takes the same T batches.
        ds = ds.repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options)


def train_and_save():
    """Builds the model, trains it and writes this worker's OUT-wW.npz (and,
    for model "many", the plan)."""
    global model_layers
    with strategy.scope():
        model = build()
        opt = optimizer()
    model_layers = [] if MANY else [model.user_emb, model.item_emb]
    MODEL_DENSE[:] = [model.dense]
    if cfg.get("sync_every") and index == 0:  # the initial rows of every key (nothing is stored yet)
        init = {}
        for layer, ids in ((model.user_emb, np.unique(all_users)), (model.item_emb, np.unique(all_items))):
            init[f"{layer.name}/keys"] = ids.astype("S") if ids.dtype.kind == "U" else ids
            init[f"{layer.name}/rows"] = layer.params._find(tf.constant(ids))[0].numpy()
        np.savez(f"{cfg['out']}-init.npz", **init)

    def checkpoints(directory):
        """tfde.saving.CheckpointManager of the job: every worker writes its own files."""
        return tfde.saving.CheckpointManager(
            directory, model=model, optimizer=opt, strategy=strategy if N > 1 and cfg["engine"] != "hvd" else None
        )

    def restore_if_asked():
        if cfg.get("restore_dir"):
            assert checkpoints(cfg["restore_dir"].format(rank=index)).restore(), "no checkpoint to restore"

    if cfg["engine"] != "loop":  # tf-keras restores into what model.fit builds later
        restore_if_asked()

    if cfg["engine"] == "hvd":
        # Each worker's loss is the mean over its examples; Horovod averages
        # gradients, so equal shares make the global mean.
        compile_model(model, opt)

        def maybe_die(number, logs):
            if index == cfg.get("die_worker") and number == cfg.get("die_after_step"):
                os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-training

        model.fit(
            dataset(),
            epochs=1,
            verbose=0,
            callbacks=[
                hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                tf.keras.callbacks.LambdaCallback(on_train_batch_end=maybe_die),
            ]
            + restrict_callbacks(),
        )
    elif cfg["engine"] == "fit":
        with strategy.scope():
            compile_model(model, opt)
        if N > 1 and os.environ.get("TF_USE_LEGACY_KERAS") == "1":
            data = tf.keras.utils.experimental.DatasetCreator(lambda ctx: dataset(ctx))
            HISTORY.append(model.fit(data, epochs=1, steps_per_epoch=T, verbose=0, callbacks=restrict_callbacks()))
            # The PeriodicSync callback gave the model back its own step and log reduction.
            assert "train_step" not in model.__dict__ and model.distribute_reduction_method == "auto"
        elif N > 1:  # Keras 3 has no DatasetCreator
            model.fit(
                strategy.distribute_datasets_from_function(dataset),
                epochs=1,
                steps_per_epoch=T,
                verbose=0,
                callbacks=restrict_callbacks(),
            )
        else:
            model.fit(dataset(), epochs=1, verbose=0, callbacks=restrict_callbacks())
    else:
        # Custom loop: create the model's and the optimizer's variables under the
        # strategy's scope before the first step, as Keras 3 needs.
        with strategy.scope():
            model(features_of(0, 1))
            opt.build(model.trainable_variables)
        restore_if_asked()  # Keras 3 restores only into a built model

        @tf.function
        def step(batch):
            def replica_step(features, y):
                # The mean over the global batch, whatever this worker's share of it.
                ctx = tf.distribute.get_replica_context()
                global_size = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.shape(y)[0], tf.float32))
                with tf.GradientTape() as tape:
                    pred = model(features, training=True)
                    loss = tf.reduce_sum(tf.square(pred - y)) / global_size
                variables = model.trainable_variables
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

            strategy.run(replica_step, args=batch)

        data = strategy.distribute_datasets_from_function(dataset) if N > 1 else dataset()
        periodic = None
        if cfg.get("sync_every"):
            dense = [v for v in model.trainable_variables if not tfde.variable.is_step_buffer(v)]
            periodic = tfde.semi_sync.PeriodicSync(
                cfg["sync_every"],
                [layer.params for layer in model_layers],
                opt,
                dense,
                strategy=strategy,
                replicate=cfg.get("replicate", False),
                slots=cfg.get("sync_slots", "merged"),
            )
            SYNC[:] = [periodic]
            periodic.start()
        auto = (
            tfde.AutoRestrictor(  # not with model "many"
                [model.user_emb.params, model.item_emb.params], every_n_steps=2, num_reserved=cfg["restrict"]
            )
            if cfg.get("restrict")
            else None
        )
        for number, batch in enumerate(data):
            step(batch)
            if periodic is not None:
                if periodic.steps + 1 >= periodic.every:
                    record_pending(periodic)
                periodic.after_step()
            if auto is not None:
                auto.after_step(number + 1)
            print(f"worker {index} finished step {number}", flush=True)
            if index == cfg.get("die_worker") and number == cfg.get("die_after_step"):
                os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-training

    if cfg["engine"] == "loop" and periodic is not None:
        record_pending(periodic)
        periodic.stop()
    if cfg.get("sync_every"):
        pushed = {}
        for name, keys, deltas, values, sync_number in PUSHED:
            pushed.setdefault(name, []).append((keys, deltas, values, sync_number))
        np.savez(
            f"{cfg['out']}-pushed-w{index}.npz",
            **{f"{n}/keys": np.concatenate([p[0] for p in v]) for n, v in pushed.items()},
            **{f"{n}/deltas": np.concatenate([p[1] for p in v]) for n, v in pushed.items()},
            **{f"{n}/values": np.concatenate([p[2] for p in v]) for n, v in pushed.items()},
            **{f"{n}/sync": np.concatenate([p[3] for p in v]) for n, v in pushed.items()},
            kernels=np.stack(KERNELS) if KERNELS else np.zeros([0]),
        )
    if cfg.get("replicate") and SYNC:
        dump_copies(SYNC[0])
    eager_read = None
    if cfg.get("eager_read"):
        # Every worker reads item rows eagerly, outside strategy.run.
        eager_ids = np.unique(all_items)[:60]
        eager_read = model.item_emb(tf.constant(eager_ids)).numpy()
    tfdata_read = None
    if cfg.get("tfdata_read"):
        # A tf.data function reads item rows (as a tfrs FactorizedTopK metric over
        # mapped candidates does), every worker the same batches: straight from
        # a shared store; through the strategy's collectives with each worker's
        # own tables under MultiWorkerMirroredStrategy (compared with the owners'
        # rows by the test, like the dense weights between workers).
        tfde.exchange.barrier(strategy if N > 1 and cfg["engine"] != "hvd" else None)
        tfdata_ids = np.unique(all_items)[:60]
        read = tf.data.Dataset.from_tensor_slices(tfdata_ids).batch(16).map(lambda x: model.item_emb(x, training=True))
        tfdata_read = np.concatenate([r.numpy() for r in read])
        if cfg["layout"] != "cuckoo":
            np.testing.assert_array_equal(tfdata_read, model.item_emb.params._find(tf.constant(tfdata_ids))[0].numpy())
        # String keys, in a parallel map: the same rows as an eager read (which
        # goes through strategy.run).
        user_ids = np.unique(all_users)[:40]
        read = tf.data.Dataset.from_tensor_slices(user_ids).batch(8).map(model.user_emb, num_parallel_calls=4)
        if cfg.get("tfdata_read") == "unequal" and index == 1:  # one worker runs the read once more
            read = read.concatenate(read.take(1))
        user_rows = np.concatenate([r.numpy() for r in read])
        np.testing.assert_array_equal(user_rows, model.user_emb(tf.constant(user_ids)).numpy())
        print(f"worker {index}: tf.data read of {len(tfdata_ids)} rows", flush=True)
    if cfg.get("save_dir"):
        checkpoints(cfg["save_dir"].format(rank=index)).save()
    # Every worker's last writes are done before worker 0 reads the shared tables.
    tfde.exchange.barrier(strategy if N > 1 and cfg["engine"] != "hvd" else None)
    out = {}
    if cfg["layout"] == "cuckoo" or index == 0:  # a shared store: worker 0 writes its tables
        for layer in model.emb.table_layers if MANY else (model.user_emb, model.item_emb):
            var = layer.params
            out[f"{layer.name}/keys"], out[f"{layer.name}/rows"] = dump(var)
            for name, slot in var.slots.items():
                out[f"{layer.name}/{name}/keys"], out[f"{layer.name}/{name}/rows"] = dump(slot)
            counts = getattr(var.admission_filter, "counts", None)
            if counts is not None and cfg.get("sync_every"):  # a CounterFilter's counts (the semi-sync checks)
                out[f"{layer.name}/admission/keys"], out[f"{layer.name}/admission/rows"] = dump(counts)
    out["dense/kernel"], out["dense/bias"] = (np.asarray(w) for w in model.dense.get_weights())
    if HISTORY and cfg.get("sync_every", 1) > 1:  # the epochs' logs: the same on every worker, as exact training's
        for name, values in HISTORY[-1].history.items():
            out[f"dense/logs/{name}"] = np.array(values)
    if LOCAL_STEP and cfg.get("sync_every", 1) > 1:
        out["dense/local-step-collectives"] = np.array(LOCAL_STEP)
    if eager_read is not None:  # compared between workers like the dense weights (distributed_check.load)
        out["dense/eager_ids"], out["dense/eager_rows"] = eager_ids, eager_read
    if tfdata_read is not None:
        out["dense/tfdata_ids"], out["dense/tfdata_rows"] = tfdata_ids, tfdata_read
    if cfg.get("topk_metric"):  # accumulated over all steps; aggregated over the workers
        out["dense/topk"] = np.array([float(r) for r in model.topk.result()])
    np.savez(f"{cfg['out']}-w{index}.npz", **out)
    if MANY and index == 0:  # where the plan put each table slice: its layer name -> worker, or -1 for rows
        plan = {
            layer.name: layer.params.placement.worker % N if hasattr(layer.params.placement, "worker") else -1
            for layer in model.emb.table_layers
        }
        json.dump({"plan": plan, "text": str(model.emb.plan)}, open(f"{cfg['out']}-plan.json", "w"))
    print(f"worker {index} done", flush=True)


# Model "many" with "plans": [[placement, column_slice_threshold], ...]: one
# model per plan in turn, in the same processes (one job start for every
# plan), each writing OUT-planI-wW.npz and OUT-planI-plan.json.
if MANY and cfg.get("plans"):
    prefix = cfg["out"]
    for number, (placement, threshold) in enumerate(cfg["plans"]):
        cfg.update(placement=placement, column_slice_threshold=threshold, out=f"{prefix}-plan{number}")
        train_and_save()
else:
    train_and_save()
