// Stable key hashing for tfde.  No TensorFlow includes.
//
// This hash is part of tfde's on-disk and in-Redis format (docs/design.md, decision 4):
// it decides which shard and which Redis bucket owns a key.  It must never
// change silently; tfde/hashing.py holds a numpy reference implementation and
// the tests compare the two bit for bit.
//
// Definition (all arithmetic on uint64, wrapping):
//   mix64(z):  z += 0x9E3779B97F4A7C15
//              z  = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//              z  = (z ^ (z >> 27)) * 0x94D049BB133111EB
//              return z ^ (z >> 31)
//   integer key k (int32 or int64, sign-extended to int64, then reinterpreted
//   as uint64):           hash = mix64(k)
//   byte string s of length L:
//              h = mix64(L ^ 0x5F3759DF5F3759DF)
//              for each 8-byte little-endian word w of s (the last word padded
//              with zero bytes):  h = mix64(h ^ w)
//              hash = h
//   shard of a key among n shards:  ((hash >> 32) * n) >> 32
//   Redis bucket among n buckets:   ((hash & 0xFFFFFFFF) * n) >> 32
//   (tfde/hashing.py route_low_py says the same in Python)
// An int32 key and the int64 key with the same value hash identically.
#ifndef TFDE_BACKENDS_CUCKOO_HASH_H_
#define TFDE_BACKENDS_CUCKOO_HASH_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace tfde {

inline uint64_t Mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline uint64_t StableHash(int64_t key) { return Mix64(static_cast<uint64_t>(key)); }
inline uint64_t StableHash(int32_t key) { return StableHash(static_cast<int64_t>(key)); }

inline uint64_t StableHash(std::string_view s) {
  uint64_t h = Mix64(static_cast<uint64_t>(s.size()) ^ 0x5F3759DF5F3759DFULL);
  const char* p = s.data();
  size_t left = s.size();
  while (left >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (x86-64, aarch64)
    h = Mix64(h ^ w);
    p += 8;
    left -= 8;
  }
  if (left > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, left);
    h = Mix64(h ^ w);
  }
  return h;
}
inline uint64_t StableHash(const std::string& s) { return StableHash(std::string_view(s)); }

// Shard owning a key among `num_shards` (>= 1): multiply-shift on the high
// 32 bits, so consecutive ids spread evenly and no modulo bias appears.
inline int32_t ShardOf(uint64_t hash, int32_t num_shards) {
  return static_cast<int32_t>(((hash >> 32) * static_cast<uint64_t>(num_shards)) >> 32);
}

// Redis bucket of a key among `num_buckets` (>= 1): the same multiply-shift
// on the low 32 bits, so a key's bucket does not depend on its shard.
inline size_t RedisBucketOf(uint64_t hash, size_t num_buckets) {
  return static_cast<size_t>(((hash & 0xFFFFFFFFULL) * static_cast<uint64_t>(num_buckets)) >> 32);
}

}  // namespace tfde

#endif  // TFDE_BACKENDS_CUCKOO_HASH_H_
