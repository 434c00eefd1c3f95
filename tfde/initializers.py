"""Initial values of keys that have no stored row yet.

docs/design.md, decision 3: the initial row of a key is a deterministic function of
(key, seed), so workers that meet a new key agree on it without talking.  The
native ops generate such rows for the usual distributions; this module maps
TensorFlow / Keras 3 / tf-keras initializer objects (or a constant) onto them.

Fan-based initializers (Glorot, He, Lecun, VarianceScaling) see a table of
unknown height, so both fans are taken as ``dim``: a row is initialized as if
it belonged to a ``[dim, dim]`` matrix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np

from tfde.errors import ConfigError
from tfde.hashing import mix64, stable_hash_py

SUPPORTED = (
    "a number (constant rows), 'zeros', 'ones', 'uniform', 'normal', 'truncated_normal', or an "
    "initializer object: Zeros, Ones, Constant(scalar), RandomUniform, RandomNormal, TruncatedNormal, "
    "VarianceScaling, GlorotUniform/Normal, HeUniform/Normal, LecunUniform/Normal (from tf.keras, keras, "
    "tf_keras or tf.*_initializer), or tfde.initializers.PerKey(fn) for a custom function of the keys"
)


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """A native initializer: ``kind`` with parameters p0, p1 and a seed.

    kind: 'constant' (value p0), 'uniform' ([p0, p1)), 'normal' (mean p0,
    stddev p1) or 'truncated_normal' (mean p0, stddev p1, cut at 2 stddev).
    """

    kind: str
    p0: float = 0.0
    p1: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("constant", "uniform", "normal", "truncated_normal"):
            raise ConfigError(f"unknown init kind {self.kind!r}")
        for name in ("p0", "p1"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"initializer parameter {name}={getattr(self, name)} is not finite")
        if self.kind == "uniform" and self.p0 > self.p1:
            raise ConfigError(f"a uniform initializer needs minval <= maxval, got minval {self.p0} > maxval {self.p1}")
        if self.kind in ("normal", "truncated_normal") and self.p1 < 0:
            raise ConfigError(f"a {self.kind} initializer needs stddev >= 0, got {self.p1}")

    def attrs(self) -> dict:
        """Keyword attributes of the native ops."""
        return dict(init_kind=self.kind, init_p0=float(self.p0), init_p1=float(self.p1), init_seed=int(self.seed))


@dataclasses.dataclass(frozen=True)
class PerKey:
    """A custom initializer: ``fn(keys) -> [n, dim]`` rows for a vector of keys.

    ``fn`` must be deterministic in the keys for workers to agree.
    """

    fn: Callable


def _seed_of(init, default_seed: int) -> int:
    """The seed the user gave `init`, else `default_seed`.  Keras 3 gives an
    unseeded initializer a random .seed of its own in every process (so
    workers, and a process that reloads a model, would disagree on the
    initial rows of new keys); the seed the user passed, None when none, is
    kept in ._init_seed."""
    seed = getattr(init, "_init_seed", getattr(init, "seed", None))
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    return default_seed


def resolve(init, dim: int, default_seed: int):
    """Maps `init` to an InitSpec (native) or a PerKey (custom)."""
    if init is None:
        return InitSpec("uniform", -0.05, 0.05, default_seed)  # Keras Embedding's default
    if isinstance(init, (InitSpec, PerKey)):
        return init
    if isinstance(init, bool):
        raise ConfigError(f"initializer must be a number or an initializer, got the bool {init!r}")
    if isinstance(init, (int, float)):
        return InitSpec("constant", float(init), 0.0, default_seed)
    if isinstance(init, str):
        named = {
            "zeros": InitSpec("constant", 0.0),
            "ones": InitSpec("constant", 1.0),
            "uniform": InitSpec("uniform", -0.05, 0.05),
            "random_uniform": InitSpec("uniform", -0.05, 0.05),
            "normal": InitSpec("normal", 0.0, 0.05),
            "random_normal": InitSpec("normal", 0.0, 0.05),
            "truncated_normal": InitSpec("truncated_normal", 0.0, 0.05),
        }
        if init.lower() in named:
            return dataclasses.replace(named[init.lower()], seed=default_seed)
        raise ConfigError(f"unknown initializer name {init!r}; expected {SUPPORTED}")
    names = {cls.__name__ for cls in type(init).__mro__}
    seed = _seed_of(init, default_seed)
    if "Zeros" in names or "ZerosInitializer" in names:
        return InitSpec("constant", 0.0, 0.0, seed)
    if "Ones" in names:
        return InitSpec("constant", 1.0, 0.0, seed)
    if "Constant" in names:
        value = getattr(init, "value", None)
        try:
            return InitSpec("constant", float(value), 0.0, seed)
        except (TypeError, ValueError):
            raise ConfigError(
                f"Constant initializer value {value!r} is not a scalar; tfde rows start from a scalar "
                "constant or a distribution. Use tfde.initializers.PerKey(fn) for per-key rows."
            ) from None
    if "VarianceScaling" in names:
        scale = float(getattr(init, "scale", 1.0))
        distribution = str(getattr(init, "distribution", "truncated_normal"))
        n = max(1.0, float(dim))  # fan_in == fan_out == fan_avg == dim
        if distribution == "uniform":
            limit = math.sqrt(3.0 * scale / n)
            return InitSpec("uniform", -limit, limit, seed)
        if distribution in ("truncated_normal",):
            return InitSpec("truncated_normal", 0.0, math.sqrt(scale / n) / 0.87962566103423978, seed)
        if distribution in ("untruncated_normal", "normal"):
            return InitSpec("normal", 0.0, math.sqrt(scale / n), seed)
        raise ConfigError(f"VarianceScaling distribution {distribution!r} is not supported")
    if "RandomUniform" in names:
        return InitSpec("uniform", float(init.minval), float(init.maxval), seed)
    if "TruncatedNormal" in names:
        return InitSpec("truncated_normal", float(init.mean), float(init.stddev), seed)
    if "RandomNormal" in names:
        return InitSpec("normal", float(init.mean), float(init.stddev), seed)
    raise ConfigError(f"initializer {init!r} (type {type(init).__name__}) is not supported; expected {SUPPORTED}")


def default_seed_for(name: str, seed: Optional[int]) -> int:
    """The seed a Variable uses when its initializer has none: its own
    `seed=` argument, else a stable hash of its name, so every worker agrees."""
    if seed is not None:
        return int(seed)
    return stable_hash_py(name) & 0x7FFFFFFFFFFFFFFF


def init_rows_reference(keys, spec: InitSpec, dim: int):
    """Pure-Python reference of the native initial rows (float64 numpy
    [n, dim]); the definition is in backends/cuckoo/init_rows.h."""
    golden, m = 0x9E3779B97F4A7C15, (1 << 64) - 1
    out = np.empty((len(keys), dim), np.float64)
    p0, p1 = float(np.float32(spec.p0)), float(np.float32(spec.p1))  # op attrs are float32

    def u01(x):
        return (x >> 11) * 2.0**-53

    for i, key in enumerate(keys):
        base = mix64(stable_hash_py(key) ^ mix64(spec.seed & m))

        def draw(j, a):
            return mix64((base + ((j * 256 + a) * golden)) & m)

        def normal(j, attempt, trig=math.cos):  # trig=math.sin: the other normal of the Box-Muller pair
            u1 = 1.0 - u01(draw(j, 2 * attempt))
            u2 = u01(draw(j, 2 * attempt + 1))
            return math.sqrt(-2.0 * math.log(u1)) * trig(6.283185307179586 * u2)

        for j in range(dim):
            if spec.kind == "constant":
                out[i, j] = p0
            elif spec.kind == "uniform":
                out[i, j] = p0 + (p1 - p0) * u01(draw(j, 0))
            elif spec.kind == "normal":  # Box-Muller pairs: 2q + 1 takes r sin t of element 2q's draws
                out[i, j] = p0 + p1 * normal(j - j % 2, 0, math.cos if j % 2 == 0 else math.sin)
            else:
                z = 2.0
                for a in range(64):
                    z = normal(j, a)
                    if abs(z) <= 2.0:
                        break
                out[i, j] = p0 + p1 * max(-2.0, min(2.0, z))
    return out
