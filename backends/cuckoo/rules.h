// The lazy optimizer rules of tfde/optimizer_rules.py, on one row at a time.
// No TensorFlow includes.
//
// tfde/optimizer_rules.py is the reference: each formula here performs the
// same float operations in the same order as its TensorFlow ops there, on
// the compute type C (float for float32/float16/bfloat16 tables, double for
// float64), so both give the same rows (tests/test_step_kernels.py checks
// rtol 1e-6 over every optimizer and option).  The scalars a rule needs
// (learning rate, Adam's bias-corrected step size, 1 - beta, ...) are
// computed by TensorFlow from the optimizer at every step and arrive in
// `Hyper`, so that a schedule or a changed hyperparameter is seen exactly as
// the Python rule sees it.
#ifndef TFDE_BACKENDS_CUCKOO_RULES_H_
#define TFDE_BACKENDS_CUCKOO_RULES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tfde {

enum class RuleKind { kSgd, kAdagrad, kAdam, kRmsprop, kFtrl };

// A rule and the options that change its formula or its slots.
struct RuleSpec {
  RuleKind kind = RuleKind::kSgd;
  bool momentum = false;  // SGD, RMSprop: a momentum slot (momentum > 0)
  bool nesterov = false;  // SGD with momentum
  bool amsgrad = false;   // Adam: a vhat slot
  bool centered = false;  // RMSprop: an average_gradient slot

  // Slots per row, in the order the kernel receives their tables:
  // SGD [momentum]; Adagrad [accumulator]; Adam [m, v, (vhat)];
  // RMSprop [velocity, (momentum), (average_gradient)]; Ftrl [accumulator, linear].
  int NumSlots() const {
    switch (kind) {
      case RuleKind::kSgd:
        return momentum ? 1 : 0;
      case RuleKind::kAdagrad:
        return 1;
      case RuleKind::kAdam:
        return amsgrad ? 3 : 2;
      case RuleKind::kRmsprop:
        return 1 + (momentum ? 1 : 0) + (centered ? 1 : 0);
      case RuleKind::kFtrl:
        return 2;
    }
    return 0;
  }

  // Scalars the rule reads from Hyper (beyond lr and weight_decay).
  static constexpr int kMaxHyper = 8;
  int NumHyper() const {
    switch (kind) {
      case RuleKind::kSgd:
        return 3;  // lr, weight_decay, momentum
      case RuleKind::kAdagrad:
        return 3;  // lr, weight_decay, epsilon
      case RuleKind::kAdam:
        return 6;  // lr, weight_decay, alpha, 1 - beta_1, 1 - beta_2, epsilon (adaptive: scaled)
      case RuleKind::kRmsprop:
        return 6;  // lr, weight_decay, rho, 1 - rho, epsilon, momentum
      case RuleKind::kFtrl:
        return 7;  // lr, weight_decay, unused, l1, 2 * l2 (beta included), 2 * shrinkage, unused
    }
    return 0;
  }
};

// Parses the op attr; throws std::invalid_argument on anything else.
inline RuleKind ParseRuleKind(const std::string& s) {
  if (s == "sgd") return RuleKind::kSgd;
  if (s == "adagrad") return RuleKind::kAdagrad;
  if (s == "adam") return RuleKind::kAdam;
  if (s == "rmsprop") return RuleKind::kRmsprop;
  if (s == "ftrl") return RuleKind::kFtrl;
  throw std::invalid_argument("unknown rule '" + s + "'; expected sgd, adagrad, adam, rmsprop or ftrl");
}

// The step's scalars, in the compute type.  h[0] = learning rate, h[1] =
// weight decay (0: none; AdamW's decoupled decay), then the rule's own
// (RuleSpec::NumHyper).
template <class C>
struct Hyper {
  C h[RuleSpec::kMaxHyper] = {};
};

// Updates one row: w [dim] (in/out), its gradient g [dim] (summed over the
// step; finite), its slots s[k] [dim] (in/out, RuleSpec order).
template <class C>
void ApplyRule(const RuleSpec& spec, const Hyper<C>& hy, int64_t dim, C* w, const C* g, C* const* s) {
  const C* h = hy.h;
  const C lr = h[0];
  if (h[1] != C(0)) {  // rows - rows * wd * lr (optimizer.py, before the rule)
    for (int64_t j = 0; j < dim; ++j) w[j] = w[j] - w[j] * h[1] * lr;
  }
  switch (spec.kind) {
    case RuleKind::kSgd: {
      if (!spec.momentum) {
        for (int64_t j = 0; j < dim; ++j) w[j] = w[j] - g[j] * lr;
        return;
      }
      const C mom = h[2];
      C* m = s[0];
      for (int64_t j = 0; j < dim; ++j) {
        m[j] = m[j] * mom - g[j] * lr;
        w[j] = spec.nesterov ? w[j] + m[j] * mom - g[j] * lr : w[j] + m[j];
      }
      return;
    }
    case RuleKind::kAdagrad: {
      const C eps = h[2];
      C* acc = s[0];
      for (int64_t j = 0; j < dim; ++j) {
        acc[j] = acc[j] + g[j] * g[j];
        w[j] = w[j] - lr * g[j] / std::sqrt(acc[j] + eps);
      }
      return;
    }
    case RuleKind::kAdam: {
      const C alpha = h[2], one_minus_b1 = h[3], one_minus_b2 = h[4], eps = h[5];
      C *m = s[0], *v = s[1];
      for (int64_t j = 0; j < dim; ++j) {
        m[j] = m[j] + (g[j] - m[j]) * one_minus_b1;
        v[j] = v[j] + (g[j] * g[j] - v[j]) * one_minus_b2;
        C v_used = v[j];
        if (spec.amsgrad) v_used = s[2][j] = std::max(s[2][j], v[j]);
        w[j] = w[j] - (m[j] * alpha) / (std::sqrt(v_used) + eps);
      }
      return;
    }
    case RuleKind::kRmsprop: {
      const C rho = h[2], one_minus_rho = h[3], eps = h[4], momentum = h[5];
      C* vel = s[0];
      C* mom = spec.momentum ? s[1] : nullptr;
      C* avg = spec.centered ? s[spec.momentum ? 2 : 1] : nullptr;
      for (int64_t j = 0; j < dim; ++j) {
        vel[j] = rho * vel[j] + one_minus_rho * g[j] * g[j];
        C denom;
        if (spec.centered) {
          avg[j] = rho * avg[j] + one_minus_rho * g[j];
          denom = vel[j] - avg[j] * avg[j] + eps;
        } else {
          denom = vel[j] + eps;
        }
        const C inc = lr * g[j] / std::sqrt(denom);
        if (spec.momentum) {
          mom[j] = momentum * mom[j] + inc;
          w[j] = w[j] - mom[j];
        } else {
          w[j] = w[j] - inc;
        }
      }
      return;
    }
    case RuleKind::kFtrl: {
      // learning_rate_power -0.5 only (tfde/step_kernels.py sends other
      // powers to the Python path): x ** 0.5 is a square root, correctly
      // rounded here and in optimizer_rules.ftrl_power.
      const C l1 = h[3], two_l2 = h[4], two_shrink = h[5];
      C *acc = s[0], *linear = s[1];
      for (int64_t j = 0; j < dim; ++j) {
        const C grad_to_use = g[j] + two_shrink * w[j];
        const C new_acc = acc[j] + g[j] * g[j];
        const C p_new = std::sqrt(new_acc), p_old = std::sqrt(acc[j]);
        linear[j] = linear[j] + grad_to_use - (p_new - p_old) / lr * w[j];
        const C quadratic = p_new / lr + two_l2;
        w[j] = (std::min(std::max(linear[j], -l1), l1) - linear[j]) / quadratic;
        acc[j] = new_acc;
      }
      return;
    }
  }
}

}  // namespace tfde

#endif  // TFDE_BACKENDS_CUCKOO_RULES_H_
