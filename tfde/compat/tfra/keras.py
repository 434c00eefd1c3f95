"""TFRA's dynamic_embedding.keras: `layers` and `callbacks`."""

from tfde.compat.tfra import callbacks, layers
from tfde.compat.tfra._args import GUIDE


def __getattr__(name):
    if name == "models":
        raise AttributeError(
            f"{__name__}.models (TFRA's save_model) has no tfde counterpart: save with "
            "model.save(...) or tfde.CheckpointManager; models with tfde layers save whole "
            f"(see {GUIDE})"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["callbacks", "layers"]
