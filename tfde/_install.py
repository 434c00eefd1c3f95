"""What `import tfde` checks before it imports TensorFlow (docs/install.md):
that TensorFlow is installed, in one distribution, and new enough.  Uses
only the standard library, so that it can speak when TensorFlow cannot be
imported."""

from __future__ import annotations

import importlib.metadata
from typing import Dict

MIN_TF = (2, 16)
# The distributions that install the `tensorflow` package; each overwrites
# the files of another installed next to it.
TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu")
# What to install when no TensorFlow is there (docs/install.md): from the
# tfde checkout, `pip install ".[cpu]"` or `".[tfrs]"` bring the same.
INSTALL = (
    "pip install 'tensorflow-cpu>=2.16' (Keras 3 only) or pip install 'tensorflow>=2.16' (what tf-keras and "
    "TensorFlow Recommenders need); from the tfde checkout, pip install '.[cpu]' or '.[tfrs]' does it"
)


def installed_tf_distributions() -> Dict[str, str]:
    """{distribution name: version} of the TensorFlow distributions installed."""
    found = {}
    for name in TF_DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def check_distributions(found: Dict[str, str]) -> None:
    """Refuses two TensorFlow distributions of different versions: their
    files overwrote each other, and the package is a mixture of both."""
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{name} {version}" for name, version in sorted(found.items()))
        keep = "tensorflow" if "tensorflow" in found else sorted(found)[0]
        raise ImportError(
            f"this environment holds two distributions of TensorFlow ({listed}), which install the same files over "
            f"each other; keep one: pip uninstall -y {' '.join(sorted(found))} && pip install "
            f"'{keep}=={found[keep]}' (tf-keras and tensorflow-recommenders need `tensorflow`; docs/install.md)"
        )


def missing_tensorflow(error: ImportError) -> ImportError:
    """The ImportError of `import tensorflow` failing: none installed (what
    to install), or one installed that cannot be imported (reinstall that
    one: installing another distribution would mix two)."""
    found = installed_tf_distributions()
    if not found:
        return ImportError(
            f"tfde needs TensorFlow >= {MIN_TF[0]}.{MIN_TF[1]}, which is not installed ({error}); install it: {INSTALL}"
        )
    name, version = sorted(found.items())[0]
    return ImportError(
        f"TensorFlow is installed ({name} {version}) but cannot be imported: {error}; reinstall it: "
        f"pip install --force-reinstall '{name}=={version}'"
    )


def check_version(version: str) -> None:
    """Refuses a TensorFlow older than MIN_TF, naming the upgrade of the
    distribution that is installed (not another one beside it)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < MIN_TF:
        found = installed_tf_distributions()
        name = sorted(found)[0] if found else "tensorflow"
        raise ImportError(
            f"tfde needs TensorFlow >= {MIN_TF[0]}.{MIN_TF[1]}, found {version}; upgrade it: "
            f"pip install -U '{name}>={MIN_TF[0]}.{MIN_TF[1]}'"
        )
