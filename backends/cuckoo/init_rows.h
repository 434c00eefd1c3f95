// Deterministic initial rows: the starting value of a key that has never been
// written is a pure function of (stable hash of the key, seed, column), so
// every worker that meets a new key computes the same row without talking to
// any other (docs/design.md, decision 3).  No TensorFlow includes.
//
// Element j of the row of a key with stable hash h under seed s draws from
//   base = Mix64(h ^ Mix64(s)),  draw(j, a) = Mix64(base + (j*256 + a) * G)
// (G = 0x9E3779B97F4A7C15), a SplitMix64 stream per element; a = 0, 1, ...
// counts the draws that element needed.  uniform01(x) = (x >> 11) * 2^-53.
// A normal draw is Box-Muller's r cos t, r = sqrt(-2 log(1 - uniform01(draw
// a))), t = 2 pi uniform01(draw a + 1); the normal kind gives element 2q + 1
// the pair's other normal, r sin t of element 2q's draws (the truncated
// normal redraws each element on its own, so it keeps one normal per draw).
#ifndef TFDE_BACKENDS_CUCKOO_INIT_ROWS_H_
#define TFDE_BACKENDS_CUCKOO_INIT_ROWS_H_

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hash.h"

namespace tfde {

enum class InitKind {
  kDefaults = 0,         // caller supplies the rows; nothing is generated here
  kConstant = 1,         // p0
  kUniform = 2,          // [p0, p1)
  kNormal = 3,           // mean p0, stddev p1
  kTruncatedNormal = 4,  // mean p0, stddev p1, redrawn beyond 2 stddev
};

// Parses the op attribute; throws std::invalid_argument on anything else.
inline InitKind ParseInitKind(const std::string& s) {
  if (s == "defaults") return InitKind::kDefaults;
  if (s == "constant") return InitKind::kConstant;
  if (s == "uniform") return InitKind::kUniform;
  if (s == "normal") return InitKind::kNormal;
  if (s == "truncated_normal") return InitKind::kTruncatedNormal;
  throw std::invalid_argument("unknown init kind '" + s +
                              "'; expected defaults, constant, uniform, normal or truncated_normal");
}

struct InitSpec {
  InitKind kind = InitKind::kDefaults;
  double p0 = 0.0;
  double p1 = 0.0;
  int64_t seed = 0;
};

namespace init_internal {
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
// A truncated-normal element gives up after this many rejected pairs and
// clamps (probability of reaching it: 0.0455^64, i.e. never in practice).
constexpr int kMaxTruncatedAttempts = 64;

inline double Uniform01(uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; }
inline uint64_t Draw(uint64_t base, int64_t j, int a) {
  return Mix64(base + (static_cast<uint64_t>(j) * 256u + static_cast<uint64_t>(a)) * kGolden);
}
// Box-Muller's radius r and angle t of element j's draws 2 * attempt and
// 2 * attempt + 1: r cos t and r sin t are two standard normals.
inline void BoxMuller(uint64_t base, int64_t j, int attempt, double* r, double* t) {
  const double u1 = 1.0 - Uniform01(Draw(base, j, 2 * attempt));  // (0, 1]
  const double u2 = Uniform01(Draw(base, j, 2 * attempt + 1));
  *r = std::sqrt(-2.0 * std::log(u1));
  *t = 6.283185307179586 * u2;
}
inline double StandardNormal(uint64_t base, int64_t j, int attempt) {
  double r, t;
  BoxMuller(base, j, attempt, &r, &t);
  return r * std::cos(t);
}
}  // namespace init_internal

// Writes `dim` values for the key with stable hash `key_hash` into `out`,
// converting each double with static_cast<V>.
template <class V>
void FillInitialRow(const InitSpec& spec, uint64_t key_hash, int64_t dim, V* out) {
  using namespace init_internal;
  const uint64_t base = Mix64(key_hash ^ Mix64(static_cast<uint64_t>(spec.seed)));
  switch (spec.kind) {
    case InitKind::kDefaults:
      throw std::logic_error("FillInitialRow called with InitKind::kDefaults");
    case InitKind::kConstant:
      for (int64_t j = 0; j < dim; ++j) out[j] = static_cast<V>(spec.p0);
      return;
    case InitKind::kUniform:
      for (int64_t j = 0; j < dim; ++j)
        out[j] = static_cast<V>(spec.p0 + (spec.p1 - spec.p0) * Uniform01(Draw(base, j, 0)));
      return;
    case InitKind::kNormal:
      // Box-Muller pairs: elements 2q and 2q + 1 take the two normals of
      // element 2q's draws (r cos t and r sin t), one logarithm per pair.
      for (int64_t j = 0; j < dim; j += 2) {
        double r, t;
        BoxMuller(base, j, 0, &r, &t);
        out[j] = static_cast<V>(spec.p0 + spec.p1 * (r * std::cos(t)));
        if (j + 1 < dim) out[j + 1] = static_cast<V>(spec.p0 + spec.p1 * (r * std::sin(t)));
      }
      return;
    case InitKind::kTruncatedNormal:
      for (int64_t j = 0; j < dim; ++j) {
        double z = 2.0;
        for (int a = 0; a < kMaxTruncatedAttempts; ++a) {
          z = StandardNormal(base, j, a);
          if (std::fabs(z) <= 2.0) break;
        }
        z = std::fmax(-2.0, std::fmin(2.0, z));
        out[j] = static_cast<V>(spec.p0 + spec.p1 * z);
      }
      return;
  }
}

}  // namespace tfde

#endif  // TFDE_BACKENDS_CUCKOO_INIT_ROWS_H_
