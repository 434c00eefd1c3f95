"""Saving, restoring and exporting tfde Variables (docs/saving.md).

* tf.train.Checkpoint / CheckpointManager, tf-keras save_weights: tfde's
  registered checkpoint saver streams every Variable (tfde/saving/registered.py);
* model.save / save_weights in Keras formats: the layers' own save hooks
  (tfde/keras/store.py);
* tfde.saving.CheckpointManager: distributed jobs, each worker writing its
  own files, restorable into another number of workers (tfde/saving/manager.py);
* tfde.export_for_serving and incremental exports (tfde/saving/serving.py).
"""

from tfde.saving import registered as _registered
from tfde.saving.manager import CheckpointManager
from tfde.saving.serving import apply_changes, export_changes, export_for_serving, read_changes

_registered.register()

__all__ = ["CheckpointManager", "export_for_serving", "export_changes", "read_changes", "apply_changes"]
