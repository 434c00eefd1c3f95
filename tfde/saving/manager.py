"""CheckpointManager: checkpoints of a training job, one or many workers.

Every worker writes its own files, in parallel (no gather to one worker):
its dense weights and optimizer state through tf.train.Checkpoint, and the
rows, slots and policy state of the keys it owns (tfde/saving/state.py).
A checkpoint of N workers restores into any number M of workers: each reads
the dense state from the first writer's file and, from every writer's file,
the keys it owns now.

Layout of `directory`:

    checkpoint.json              {"format": 1, "latest": "ckpt-000000120", "checkpoints": [...]}
    ckpt-000000120/
      manifest.json              {"format": 1, "step": 120, "workers": 2, "files": {name: bytes}}
      worker-00000-of-00002.index, worker-00000-of-00002.data-*   (TF V2 bundles)
      worker-00001-of-00002.index, ...
    ckpt-000000130.partial/      a save under way, or killed: never read, removed by the next save

Workers may instead each save to a directory of their own (a path with the
rank in it, as TFRA's multi-worker programs write `model_dir_{rank}`): each then
manages its directory as above, with only its own worker file, and its
manifest names it ("writers": [rank]).  Such a part restores into the same
worker of a job of as many workers only (it owns the same keys again);
restoring into another number of workers needs the one shared directory,
which holds every worker's file.  Workers that mix the two (some sharing a
directory, some not) are refused at the first save, and so is a "shared"
directory in which the first worker does not find every worker's file
(workers on different disks).

Atomicity: checkpoint.json is the one commit point, and no directory it
names is ever written again.  Files are written into `<name>.partial/`; when
every worker is done, the first one writes the manifest, renames the
directory to `<name>` (a name checkpoint.json does not hold: a second save
of step 120 goes to `ckpt-000000120-1`), replaces checkpoint.json (temporary
file, fsync, os.replace) and only then removes the directories it no longer
names (the checkpoint the same step replaced, those beyond max_to_keep).  A
crash at any point (kill -9 included) leaves checkpoint.json naming complete
checkpoints only: the previous ones before the replace, the new one after.
Whatever a crash left behind (`.partial/` directories, checkpoint
directories checkpoint.json does not name) is removed by the next save.

Test hook: with TFDE_TEST_KILL_AT_COMMIT_POINT=k in the environment, the
process that commits kills itself (SIGKILL) at point k of the commit (0, 1,
...: before each change on disk, and once at the end), so that the tests can
show that a crash at every point leaves a checkpoint to restore.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from typing import Any, List, Optional

import numpy as np
import tensorflow as tf

from tfde import exchange, semi_sync
from tfde.errors import CheckpointError, ConfigError
from tfde.flavour import IS_KERAS3
from tfde.saving import registered

FORMAT_VERSION = 1
STATE_FILE = "checkpoint.json"
MANIFEST = "manifest.json"
PARTIAL = ".partial"
# A checkpoint directory: ckpt-<step>, or ckpt-<step>-<n> for the n-th
# save of a step whose name checkpoint.json already held.
_NAME = re.compile(r"ckpt-(\d{9})(?:-(\d+))?$")
KILL_AT_COMMIT_POINT = "TFDE_TEST_KILL_AT_COMMIT_POINT"  # test hook, see the module docstring


class _CommitPoints:
    """Counts the points of one commit; kills the process at the one
    KILL_AT_COMMIT_POINT names (tests only; unset: does nothing)."""

    def __init__(self):
        raw = os.environ.get(KILL_AT_COMMIT_POINT)
        self._kill_at = int(raw) if raw not in (None, "") else None
        self._next = 0

    def __call__(self) -> None:
        if self._next == self._kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self._next += 1


def write_atomic(path: str, text: str, point=lambda: None) -> None:
    """Replaces `path` with `text` so that a crash leaves the old or the new
    file, never a mix (temporary file, fsync, os.replace, fsync the directory).
    `point` is called before each change on disk (a commit's test hook)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    point()
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    point()
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(name: str) -> Optional[int]:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def _refuse_a_job_it_cannot_see() -> None:
    """Raises ConfigError when a launcher's environment says this process is
    one of several workers (exchange.launched_job) while the manager sees no
    strategy or exchange: every worker would then write its part as worker
    0 of 1, into the same files."""
    said = exchange.launched_job()
    if said is not None:
        size, source = said
        raise ConfigError(
            f"this process is one of {size} workers ({source}), but this CheckpointManager sees no "
            "tf.distribute strategy and no tfde exchange, so every worker would write its part as the only "
            "worker, into the same files. Create the manager inside strategy.scope() or pass strategy=; "
            "with another engine, install its tfde exchange first (docs/saving.md, docs/distributed.md)"
        )


def _worker_prefix(path: str, rank: int, size: int) -> str:
    return os.path.join(path, f"worker-{rank:05d}-of-{size:05d}")


class CheckpointManager:
    """Saves and restores `objects` (e.g. model=model, optimizer=opt) with
    every tfde Variable they reach, keeping the last `max_to_keep`.

    Every worker of a distributed job must call save() and restore() at the
    same point (they synchronize).  The strategy of a tf.distribute job is the
    one in scope when the manager is created (or `strategy=`); a job run by an
    engine outside tf.distribute installs its exchange first (docs/distributed.md).

    Example:
      >>> manager = tfde.saving.CheckpointManager(tmp_dir, model=model, optimizer=model.optimizer)
      >>> manager.save()        # -> '<tmp_dir>/ckpt-000000010'
      >>> manager.restore()     # the latest checkpoint, or None when there is none
    """

    def __init__(
        self,
        directory: str,
        max_to_keep: Optional[int] = 5,
        strategy: Optional[tf.distribute.Strategy] = None,
        **objects: Any,
    ) -> None:
        if not objects:
            raise ConfigError(
                "CheckpointManager needs the objects to save, e.g. "
                "CheckpointManager(dir, model=model, optimizer=model.optimizer)"
            )
        missing = sorted(name for name, obj in objects.items() if obj is None)
        if missing:  # e.g. model.optimizer before compile(): TensorFlow failed at the first save
            raise ConfigError(
                f"CheckpointManager got None for {', '.join(missing)}; pass the objects themselves (a model's "
                "optimizer exists once the model is compiled)"
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ConfigError(f"max_to_keep must be an int >= 1 or None (keep all), got {max_to_keep!r}")
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self._objects = objects
        self._strategy = (
            strategy
            if strategy is not None
            else (tf.distribute.get_strategy() if tf.distribute.has_strategy() else None)
        )
        self._checkpoint = tf.train.Checkpoint(**objects)

    # ------------------------------------------------------------ state

    def _state(self) -> dict:
        path = os.path.join(self.directory, STATE_FILE)
        if not os.path.exists(path):
            return {"format": FORMAT_VERSION, "latest": None, "checkpoints": []}
        try:
            with open(path) as f:
                state = json.load(f)
        except ValueError as e:
            raise CheckpointError(
                f"{path} is not valid JSON ({e}); it is corrupted. Delete it to start over, "
                "or restore a checkpoint directory by path"
            ) from None
        if state.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path} has format {state.get('format')!r}, this tfde reads {FORMAT_VERSION}")
        return state

    @property
    def checkpoints(self) -> List[str]:
        """Paths of the complete checkpoints, oldest first."""
        return [os.path.join(self.directory, name) for name in self._state()["checkpoints"]]

    @property
    def latest_checkpoint(self) -> Optional[str]:
        latest = self._state()["latest"]
        return None if latest is None else os.path.join(self.directory, latest)

    def _default_step(self) -> int:
        for obj in self._objects.values():
            for candidate in (obj, getattr(obj, "optimizer", None)):
                iterations = getattr(candidate, "iterations", None)
                if iterations is not None:
                    return int(iterations.numpy() if hasattr(iterations, "numpy") else iterations)
        return len(self._state()["checkpoints"])

    # ------------------------------------------------------------ save

    def save(self, step: Optional[int] = None) -> str:
        """Writes a checkpoint named after `step` (default: the optimizer's
        iterations) and returns its path.  Every worker calls it.  Saving a
        step again replaces that step's checkpoint (under a new name, see
        the module docstring).

        The workers give one directory they all share (the checkpoint then
        restores into any number of workers), or each a directory of its
        own (e.g. with its rank in the path: each worker then writes and
        restores its part there, and it restores into the same number of
        workers only); a mix of the two is refused.  During semi-synchronous
        training every worker syncs first, so the checkpoint holds every
        worker's updates (tfde/semi_sync.py)."""
        semi_sync.sync_now()
        host = exchange.host_collectives(self._strategy)
        if host is None:
            _refuse_a_job_it_cannot_see()
        rank, size = (0, 1) if host is None else (host.rank, host.size)
        own_directory = self._own_directories(host)
        manages = rank == 0 or own_directory  # the worker that manages this directory's files
        step = self._default_step() if step is None else int(step)
        suffix = 0
        if manages:
            os.makedirs(self.directory, exist_ok=True)
            self._remove_leftovers()
            suffix = self._free_suffix(step)
        if host is not None and not own_directory:  # every worker takes the first one's name (and waits for it)
            suffix = int(host.gather(np.array([suffix], np.int64))[0])
        name = f"ckpt-{step:09d}" + (f"-{suffix}" if suffix else "")
        final = os.path.join(self.directory, name)
        partial = final + PARTIAL
        if manages:
            os.makedirs(partial)
        exchange.barrier(self._strategy)
        self._checkpoint.write(_worker_prefix(partial, rank, size))
        exchange.barrier(self._strategy)
        if manages:
            self._commit(partial, final, name, step, size, [rank] if own_directory else list(range(size)))
        exchange.barrier(self._strategy)
        return final

    def _own_directories(self, host) -> bool:
        """Whether every worker saves to a directory of its own (False: all
        share one, or the job has one worker).  Every worker calls it."""
        if host is None:
            return False
        ids = host.gather(np.array([_directory_id(self.directory)], np.int64)).tolist()
        if len(set(ids)) == 1:
            return False
        if len(set(ids)) == len(ids):
            return True
        raise CheckpointError(
            f"the {len(ids)} workers save checkpoints to {len(set(ids))} directories ({self.directory!r} here): "
            "some share one and some do not. Give all workers one shared directory (a checkpoint that restores "
            "into any number of workers), or each worker a directory of its own, e.g. with its rank in the path"
        )

    def _remove_leftovers(self) -> None:
        """Removes what crashed saves left: `.partial` directories, temporary
        state files and (when checkpoint.json exists, proving the directory
        is this manager's) checkpoint directories it does not name."""
        state_exists = os.path.exists(os.path.join(self.directory, STATE_FILE))
        named = set(self._state()["checkpoints"])
        for entry in os.listdir(self.directory):
            path = os.path.join(self.directory, entry)
            if not os.path.isdir(path):
                if entry.startswith(STATE_FILE + ".tmp-"):
                    os.remove(path)
            elif entry.endswith(PARTIAL) or (state_exists and _NAME.match(entry) and entry not in named):
                shutil.rmtree(path, ignore_errors=True)

    def _free_suffix(self, step: int) -> int:
        """0 for ckpt-<step>, n for ckpt-<step>-n: the first name that neither
        checkpoint.json nor the directory holds (a directory it names is
        never written again)."""
        named = set(self._state()["checkpoints"])
        suffix = 0
        while True:
            name = f"ckpt-{step:09d}" + (f"-{suffix}" if suffix else "")
            if (
                name not in named
                and not os.path.lexists(os.path.join(self.directory, name))
                and not os.path.lexists(os.path.join(self.directory, name + PARTIAL))
            ):
                return suffix
            suffix += 1

    def _commit(self, partial: str, final: str, name: str, step: int, size: int, writers: List[int]) -> None:
        """Makes the checkpoint in `partial` the latest.  The replace of
        checkpoint.json is the commit: before it the state names the
        previous checkpoints (untouched), after it the new one (complete,
        renamed into place before).  Directories are removed only once the
        state no longer names them.  `writers`: the workers whose files
        this directory must hold (all of the job's, or this worker's when
        each has a directory of its own)."""
        point = _CommitPoints()
        point()
        for w in writers:
            index = _worker_prefix(partial, w, size) + ".index"
            if not os.path.exists(index):
                raise CheckpointError(
                    f"worker {w}'s files are not in {partial}: the workers do not share {self.directory!r} (each "
                    "sees a directory of its own, e.g. on its own disk), so this checkpoint would be incomplete. "
                    "Give every worker the same directory on a filesystem they share, or each worker a directory "
                    "path of its own (e.g. with its rank in it)"
                )
        files = {f: os.path.getsize(os.path.join(partial, f)) for f in sorted(os.listdir(partial))}
        for f in files:
            with open(os.path.join(partial, f), "rb") as fh:
                os.fsync(fh.fileno())
        manifest = {"format": FORMAT_VERSION, "step": step, "workers": size, "files": files}
        if len(writers) < size:
            manifest["writers"] = writers  # a directory of one worker's own (save())
        write_atomic(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True), point)
        state = self._state()
        point()
        os.rename(partial, final)  # `name` is new: nothing is replaced
        _fsync_dir(self.directory)
        # The same step saved again: the new checkpoint replaces the old one.
        kept = [c for c in state["checkpoints"] if _step_of(c) != step] + [name]
        dropped = [c for c in state["checkpoints"] if _step_of(c) == step]
        if self.max_to_keep is not None and len(kept) > self.max_to_keep:
            dropped, kept = dropped + kept[: -self.max_to_keep], kept[-self.max_to_keep :]
        write_atomic(
            os.path.join(self.directory, STATE_FILE),
            json.dumps({"format": FORMAT_VERSION, "latest": name, "checkpoints": kept}, indent=1),
            point,
        )
        for old in dropped:  # only after the state file no longer names them
            point()
            shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)
        point()

    # ------------------------------------------------------------ restore

    def restore(self, path: Optional[str] = None) -> Optional[str]:
        """Restores `path` (default: the latest checkpoint) into the objects;
        returns the path, or None when there is no checkpoint yet.  Every
        worker calls it; Variables built later (e.g. by a model's first call)
        are restored when they are built."""
        path = self.latest_checkpoint if path is None else os.fspath(path)
        if path is None:
            return None
        _refuse_unbuilt_keras3_models(self._objects)
        # Local rows of semi-synchronous training would hide the restored
        # ones; copies of the stores are made anew after the restore.
        with semi_sync.rewriting_stores():
            semi_sync.discard_local()
            host = exchange.host_collectives(self._strategy)
            sources = read_manifest(path, (0, 1) if host is None else (host.rank, host.size))
            registered.check_optimizers(self._checkpoint, sources[0][0], sources[0][1])
            registered.restore_sources(sources[0][0], sources)
            # TensorFlow restores the dense variables (the step and the
            # learning rate among them) before tfde's tables: a tfde Variable
            # that does not fit the checkpoint refuses it before the read.
            registered.check_before_read(self._checkpoint, sources[0][0])
            self._checkpoint.read(sources[0][0]).expect_partial()
        return path


def _refuse_unbuilt_keras3_models(objects) -> None:
    """Keras 3 fails inside Keras when a checkpoint restores into a model
    built later ("'EagerTensor' object has no attribute
    '_serialize_to_tensors'", then a model with extra weights), with or
    without tfde: say what to do before that happens."""
    if not IS_KERAS3:
        return  # tf-keras restores into what is built later
    for name, obj in objects.items():
        if isinstance(obj, tf.keras.Model) and not obj.built:
            raise ConfigError(
                f"{name} ({type(obj).__name__}) is not built yet, and Keras 3 cannot restore a checkpoint into "
                "layers it builds later; call the model on one batch first (a functional model is built "
                "already), then restore()"
            )


def _directory_id(directory: str) -> int:
    """A number naming `directory` (its real path) on this machine."""
    digest = hashlib.sha256(os.path.realpath(directory).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def read_manifest(path: str, worker=None):
    """[(bundle prefix, file name)] of every writer of the checkpoint at
    `path`, after checking that each file is there with its recorded size.
    worker: (rank, size) of the reading worker in its job; a checkpoint in a
    directory of one worker's own is read by that worker of a job of the
    same size only."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise CheckpointError(
            f"{path} has no {MANIFEST}: it is not a complete tfde checkpoint (a save that "
            "did not finish, or another kind of directory)"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        workers, files = int(manifest["workers"]), dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is unreadable ({e}); the checkpoint is corrupted") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format {manifest.get('format')!r}, this tfde reads {FORMAT_VERSION}"
        )
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing from the checkpoint; it was deleted or not copied")
        actual = os.path.getsize(file)
        if actual != size:
            raise CheckpointError(
                f"{file} has {actual} bytes, the manifest says {size}: the file is truncated or "
                "was replaced; restore an earlier checkpoint"
            )
    writers = list(range(workers))
    if "writers" in manifest:
        writers = [int(w) for w in manifest["writers"]]
        rank, size = worker if worker is not None else (0, 1)
        if size != workers or writers != [rank]:
            raise CheckpointError(
                f"{path} holds the part of worker {', '.join(map(str, writers))} of a job of {workers} workers that "
                "each saved to a directory of its own; it restores only into worker "
                f"{', '.join(map(str, writers))} of a job of {workers} (this is worker {rank} of {size}). To restore "
                "into another number of workers, save to one directory all workers share"
            )
    return [
        (_worker_prefix(path, r, workers), os.path.basename(_worker_prefix(path, r, workers)) + f" in {path}")
        for r in writers
    ]
