"""Lazy update rules of the optimizers tfde supports on embedding rows.

Each rule applies the wrapped optimizer's own formula (Keras 3 and tf-keras
use the same ones) to the rows a batch touched, reading its hyperparameters
from the optimizer at every step.  "Lazy": rows that were not touched keep
their values and slots (no momentum decay, no weight decay for them); the
step count of Adam's bias correction is the optimizer's global iteration.

A rule is ``update(opt, w, g, slots, lr, t) -> (w', slots')`` on ``[n, dim]``
tensors of the compute dtype, with t = iterations + 1 (float).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

import tensorflow as tf

from tfde.errors import UnsupportedOptimizerError


def compute_dtype(value_dtype: tf.DType) -> tf.DType:
    """The dtype a table's optimizer step computes in: float64 for float64
    tables, float32 for the others (float16 and bfloat16 rows and slots are
    read, updated in float32 and rounded back), on every path."""
    return tf.float64 if value_dtype == tf.float64 else tf.float32


def hp(opt, name: str, default=None):
    """A hyperparameter of `opt` as a Python value or tensor (callables are called)."""
    value = getattr(opt, name, default)
    if callable(value) and not isinstance(value, tf.Variable):
        value = value()
    return value


def _f(value, dtype):
    return tf.cast(value, dtype)


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    # (slot name, initial value of a missing row) for this optimizer instance.
    slots: Callable[[object], Tuple[Tuple[str, float], ...]]
    update: Callable[..., Tuple[tf.Tensor, Dict[str, tf.Tensor]]]


def _sgd_slots(opt):
    return (("momentum", 0.0),) if float(hp(opt, "momentum", 0.0)) != 0.0 else ()


def _sgd(opt, w, g, s, lr, t):
    momentum = float(hp(opt, "momentum", 0.0))
    if momentum == 0.0:
        return w - g * lr, {}
    mom = _f(momentum, w.dtype)
    m = s["momentum"] * mom - g * lr
    if hp(opt, "nesterov", False):
        return w + m * mom - g * lr, {"momentum": m}
    return w + m, {"momentum": m}


def _adagrad(opt, w, g, s, lr, t):
    acc = s["accumulator"] + g * g
    eps = _f(hp(opt, "epsilon", 1e-7), w.dtype)
    return w - lr * g / tf.sqrt(acc + eps), {"accumulator": acc}


def _adam_slots(opt):
    return (("m", 0.0), ("v", 0.0)) + ((("vhat", 0.0),) if hp(opt, "amsgrad", False) else ())


def _adam(opt, w, g, s, lr, t):
    b1, b2 = _f(hp(opt, "beta_1", 0.9), w.dtype), _f(hp(opt, "beta_2", 0.999), w.dtype)
    b1_t, b2_t = tf.pow(b1, t), tf.pow(b2, t)
    alpha = lr * tf.sqrt(1 - b2_t) / (1 - b1_t)
    m = s["m"] + (g - s["m"]) * (1 - b1)
    v = s["v"] + (g * g - s["v"]) * (1 - b2)
    new = {"m": m, "v": v}
    v_used = v
    if hp(opt, "amsgrad", False):
        new["vhat"] = v_used = tf.maximum(s["vhat"], v)
    eps = _f(hp(opt, "epsilon", 1e-7), w.dtype)
    if hp(opt, "adaptive_epsilon", False):  # tf-keras Adam option
        eps = eps * tf.sqrt(1 - b2_t)
    return w - (m * alpha) / (tf.sqrt(v_used) + eps), new


def _rmsprop_slots(opt):
    out = (("velocity", 0.0),)
    if float(hp(opt, "momentum", 0.0)) > 0:
        out += (("momentum", 0.0),)
    if hp(opt, "centered", False):
        out += (("average_gradient", 0.0),)
    return out


def _rmsprop(opt, w, g, s, lr, t):
    rho = _f(hp(opt, "rho", 0.9), w.dtype)
    eps = _f(hp(opt, "epsilon", 1e-7), w.dtype)
    vel = rho * s["velocity"] + (1 - rho) * g * g
    new = {"velocity": vel}
    if hp(opt, "centered", False):
        avg = rho * s["average_gradient"] + (1 - rho) * g
        new["average_gradient"] = avg
        denom = vel - avg * avg + eps
    else:
        denom = vel + eps
    inc = lr * g / tf.sqrt(denom)
    momentum = float(hp(opt, "momentum", 0.0))
    if momentum > 0:
        mom = _f(momentum, w.dtype) * s["momentum"] + inc
        new["momentum"] = mom
        return w - mom, new
    return w - inc, new


def _ftrl_slots(opt):
    return (("accumulator", float(hp(opt, "initial_accumulator_value", 0.1))), ("linear", 0.0))


def ftrl_power(opt) -> Callable:
    """x -> x ** -learning_rate_power: a square root for the default power
    of -0.5 (correctly rounded, as the fused step's C++ computes it too;
    TensorFlow's pow is an approximation that differs in the last bit for
    a quarter of the inputs), else tf.pow."""
    power = hp(opt, "learning_rate_power", -0.5)
    if not isinstance(power, tf.Tensor) and float(power) == -0.5:
        return tf.sqrt
    return lambda x: tf.pow(x, -_f(power, x.dtype))


def _ftrl(opt, w, g, s, lr, t):
    power = ftrl_power(opt)
    l1 = _f(hp(opt, "l1_regularization_strength", 0.0), w.dtype)
    l2 = _f(hp(opt, "l2_regularization_strength", 0.0), w.dtype) + _f(hp(opt, "beta", 0.0), w.dtype) / (2.0 * lr)
    shrink = _f(hp(opt, "l2_shrinkage_regularization_strength", 0.0), w.dtype)
    acc = s["accumulator"]
    grad_to_use = g + 2 * shrink * w
    new_acc = acc + g * g
    linear = s["linear"] + grad_to_use - (power(new_acc) - power(acc)) / lr * w
    quadratic = power(new_acc) / lr + 2 * l2
    w_new = (tf.clip_by_value(linear, -l1, l1) - linear) / quadratic
    return w_new, {"accumulator": new_acc, "linear": linear}


RULES = {
    "SGD": Rule("SGD", _sgd_slots, _sgd),
    "Adagrad": Rule("Adagrad", lambda o: (("accumulator", float(hp(o, "initial_accumulator_value", 0.1))),), _adagrad),
    "Adam": Rule("Adam", _adam_slots, _adam),
    "AdamW": Rule("AdamW", _adam_slots, _adam),  # decoupled weight decay is applied by the wrapper
    "RMSprop": Rule("RMSprop", _rmsprop_slots, _rmsprop),
    "Ftrl": Rule("Ftrl", _ftrl_slots, _ftrl),
}
SUPPORTED_NAMES = tuple(RULES)


def rule_for(opt) -> Rule:
    """The Rule of a Keras optimizer, or UnsupportedOptimizerError naming the supported ones."""
    module = type(opt).__module__
    if ".legacy" in module:
        raise UnsupportedOptimizerError(
            f"{type(opt).__name__} from {module} is a legacy optimizer; use the non-legacy class "
            f"(e.g. tf.keras.optimizers.{type(opt).__name__}). Supported: {', '.join(SUPPORTED_NAMES)}"
        )
    for cls in type(opt).__mro__:
        if cls.__name__ in RULES:
            return RULES[cls.__name__]
    raise UnsupportedOptimizerError(
        f"tfde cannot apply {type(opt).__name__} lazily to embedding rows. Supported optimizers (Keras 3 or "
        f"tf-keras): {', '.join(SUPPORTED_NAMES)}."
    )
