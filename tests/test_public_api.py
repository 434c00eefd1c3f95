"""The public API is annotated: every parameter of every public function and
method of what `tfde` exports (and of the Keras layers and callbacks, the
serving functions and PerKey) has a type, and so does every return but
__init__'s.  Read with inspect; the aliases are in tfde/types.py."""

import inspect

import pytest

import tfde
import tfde.initializers
import tfde.keras.callbacks
import tfde.keras.layers
import tfde.saving


def _public():
    objects = {name: getattr(tfde, name) for name in tfde.__all__}
    objects.update({f"keras.layers.{n}": getattr(tfde.keras.layers, n) for n in ("Embedding", "SquashedEmbedding")})
    objects.update(
        {f"keras.callbacks.{n}": getattr(tfde.keras.callbacks, n) for n in ("ModelCheckpoint", "RestrictCallback")}
    )
    objects.update(
        {
            "saving.apply_changes": tfde.saving.apply_changes,
            "saving.read_changes": tfde.saving.read_changes,
            "initializers.PerKey": tfde.initializers.PerKey,
        }
    )
    found = {}
    for name, obj in objects.items():
        if inspect.ismodule(obj):
            continue
        if inspect.isclass(obj):
            if not obj.__module__.startswith("tfde"):
                continue
            for attr, member in vars(obj).items():
                member = getattr(member, "__func__", member)
                if (not attr.startswith("_") or attr == "__init__") and inspect.isfunction(member):
                    found[f"{name}.{attr}"] = member
        elif inspect.isfunction(obj):
            found[name] = obj
    return found


PUBLIC = _public()


def test_the_public_api_is_large_enough_to_mean_something():
    assert len(PUBLIC) > 80 and "Variable.lookup" in PUBLIC and "keras.layers.Embedding.__init__" in PUBLIC


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_signatures_are_annotated(name):
    signature = inspect.signature(PUBLIC[name])
    bare = [
        p.name
        for p in signature.parameters.values()
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    assert not bare, f"{name}: parameters without a type: {bare}"
    if not name.endswith("__init__"):
        assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return type"


def test_every_error_class_is_exported_at_the_top():
    """docs/guide.md names them as tfde.<Name> (tfde.BuildError once existed
    only as tfde.errors.BuildError)."""
    kinds = [c for c in vars(tfde.errors).values() if isinstance(c, type) and issubclass(c, tfde.errors.TfdeError)]
    assert len(kinds) >= 9
    missing = sorted(c.__name__ for c in kinds if getattr(tfde, c.__name__, None) is not c)
    assert not missing, f"not exported as tfde.<name>: {missing}"
    assert all(c.__name__ in tfde.__all__ for c in kinds)
