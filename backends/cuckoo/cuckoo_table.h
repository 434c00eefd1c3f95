// tfde's concurrent cuckoo hash table: key -> fixed-size row of bytes.
// No TensorFlow includes; the op kernels in ops.cc convert tensors and call it.
//
// Layout
//   A table is kNumShards independent shards, each guarded by its own
//   shared_mutex.  A key's shard comes from a remix of its stable hash, so it
//   is independent of the Variable-level shard routing in hash.h.
//   Each shard is a bucketized cuckoo hash (kSlotsPerBucket slots per 64-byte
//   bucket, two candidate buckets per key, partial-key alternate index) whose
//   slots hold the key's 64-bit internal hash and a row id.  Rows live in an
//   arena of geometrically growing chunks and never move, so growing a shard
//   rehashes only its slots (12 bytes each, from the hashes they hold) - the
//   pause of one growth is bounded by the size of one shard, about
//   1/kNumShards of the table.
//
// Thread safety
//   Every public member may be called concurrently from any thread.  Batch
//   writes split the shards into groups, one per worker of the ParallelFor
//   the caller provides; a worker holds its group's exclusive locks while it
//   walks the batch and handles the keys of its shards in batch order, so
//   duplicates behave as if applied one after another.  Batch reads split
//   the keys into ranges; each worker holds every shard's lock shared for
//   the duration of its range.
#ifndef TFDE_BACKENDS_CUCKOO_CUCKOO_TABLE_H_
#define TFDE_BACKENDS_CUCKOO_CUCKOO_TABLE_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "hash.h"
#include "row_copy.h"

namespace tfde {

// Root of the errors the core throws; the kernels turn them into TF statuses.
class TableError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A shard would need more than kMaxRowsPerShard rows.
class CapacityError : public TableError {
 public:
  using TableError::TableError;
};

// How a key is stored (K) and how callers pass it in (View).
template <class K>
struct KeyTraits {
  static_assert(std::is_same_v<K, int64_t> || std::is_same_v<K, int32_t>, "int keys");
  using View = K;
  // The internal hash of an integer key is a bijection of its value (each
  // step of Mix64 is invertible), so two int keys are equal exactly when
  // their 64-bit internal hashes are: a probe compares the hashes kept in
  // the bucket and never reads the key.  Keys are kept (in each arena
  // chunk's key array) only for export.
  static constexpr bool kHashIsKey = true;
};
template <>
struct KeyTraits<std::string> {
  using View = std::string_view;
  // Different strings can share a hash: a probe whose hash matches also
  // compares the key, kept in a side vector.
  static constexpr bool kHashIsKey = false;
};

// ParallelFor(total, cost_per_unit_ns, work): calls work(begin, end) over
// disjoint ranges covering [0, total), possibly on several threads, and
// returns when all are done.  The kernels pass TF's intra-op pool.
using ParallelFor = std::function<void(int64_t, int64_t, const std::function<void(int64_t, int64_t)>&)>;
inline void SerialFor(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& work) {
  if (total > 0) work(0, total);
}

// Tunables.
constexpr int kSlotsPerBucket = 5;  // 5 hashes + 5 row ids: one 64-byte line
constexpr int kShardBits = 6;       // 64 shards per table
constexpr int kNumShards = 1 << kShardBits;
constexpr double kMaxLoadFactor = 0.90;     // grow a shard before it gets fuller
constexpr int kMaxKicks = 256;              // random-walk length before a forced grow
constexpr int64_t kMinBucketsPerShard = 4;  // 20 slots: an empty table is small
constexpr int kFirstChunkLog2 = 6;          // an unsized shard's first chunk: 64 rows
constexpr uint32_t kEmptyRow = 0xFFFFFFFFu;
constexpr int64_t kMaxRowsPerShard = 0xFFFFFFF0LL;  // row ids are uint32
constexpr int kPrefetchDistance = 8;         // pipeline stage distance: buckets fetched 2x, rows 1x this far ahead
constexpr int64_t kMinKeysPerGroup = 4096;   // a write batch uses one worker per this many keys...
constexpr int64_t kMaxGroups = 16;           // ...and at most this many workers
constexpr int64_t kMaxBatch = 0xFFFFFFF0LL;  // key indices are uint32 inside a batch
constexpr int64_t kHugePageBytes = 2 << 20;
// Arena chunks at least this big use transparent huge pages.  Below it the
// RSS slack of a partly used huge page would matter more than the faults saved.
constexpr int64_t kHugePageChunkBytes = 2 << 20;

// Internal remix of the stable hash: shard = top bits, bucket = low bits,
// bits 20..51 pick the alternate bucket.
inline uint64_t InternalHash(uint64_t stable) { return Mix64(stable ^ 0xD6E8FEB86659FD93ULL); }
inline int ShardIndex(uint64_t ih) { return static_cast<int>(ih >> (64 - kShardBits)); }
inline uint32_t AltSeed(uint64_t ih) { return static_cast<uint32_t>(ih >> 20); }

// Prefetches every cache line of [p, p + bytes).
inline void PrefetchLines(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  __builtin_prefetch(p + bytes - 1);  // the last line, when p is not line-aligned
}

// Uninitialized memory of `bytes`, or nullptr when there is none: blocks of
// at least kHugePageChunkBytes are 2 MiB aligned and advised for transparent
// huge pages (one fault per 2 MiB instead of per 4 KiB when they are first
// written, and fewer TLB misses under random access); smaller ones are
// aligned to `align`.  Pages are not touched here, so a big block costs
// address space, not RSS, until it is written.  Release with std::free.
inline void* AllocateAligned(size_t bytes, size_t align) {
  void* mem = nullptr;
  const bool huge = bytes >= static_cast<size_t>(kHugePageChunkBytes);
  if (posix_memalign(&mem, huge ? static_cast<size_t>(kHugePageBytes) : align, bytes) != 0) return nullptr;
#ifdef MADV_HUGEPAGE
  if (huge) madvise(mem, bytes, MADV_HUGEPAGE);
#endif
  return mem;
}

// Allocator for big per-batch and per-shard arrays (AllocateAligned; small
// blocks aligned as T asks, a bucket: one cache line).
template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t count) {
    const size_t bytes = count * sizeof(T);
    void* mem = AllocateAligned(bytes, std::max(alignof(T), sizeof(void*)));
    if (mem == nullptr) throw CapacityError("out of memory allocating " + std::to_string(bytes) + " bytes");
    return static_cast<T*>(mem);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const {
    return false;
  }
};
template <class T>
using BigVector = std::vector<T, HugePageAllocator<T>>;

// The hashes of a write batch (two uint64 per key) live in blocks from a
// small process-wide cache, so a big batch does not page-fault fresh memory
// (which the kernel zeroes) on every call (an update of 1M stored keys at
// dim 64: 37 -> 34 ms).  At most kScratchCacheBytes stay cached between calls.
constexpr size_t kScratchCacheBytes = size_t{64} << 20;

class ScratchCache {
 public:
  // Never destroyed: TF's thread pools may still run a kernel while the
  // process exits, after function-local statics are destroyed; and a
  // destroyed cache's vector would drop its blocks unfreed (LeakSanitizer
  // reported them, tests/test_sanitizers.py).  The blocks stay reachable.
  static ScratchCache& Global() {
    static ScratchCache* const cache = new ScratchCache();
    return *cache;
  }
  // A block of at least `words` uint64s (its size in *got).
  uint64_t* Take(size_t words, size_t* got) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t b = 0; b < free_.size(); ++b)
        if (free_[b].second >= words && (best == free_.size() || free_[b].second < free_[best].second)) best = b;
      if (best != free_.size()) {
        const auto block = free_[best];
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        cached_bytes_ -= block.second * 8;
        *got = block.second;
        return block.first;
      }
    }
    *got = words;
    return HugePageAllocator<uint64_t>().allocate(words);
  }
  void Give(uint64_t* block, size_t words) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_bytes_ + words * 8 <= kScratchCacheBytes) {
        free_.emplace_back(block, words);
        cached_bytes_ += words * 8;
        return;
      }
    }
    HugePageAllocator<uint64_t>().deallocate(block, words);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<uint64_t*, size_t>> free_;  // cached blocks and their sizes in words
  size_t cached_bytes_ = 0;
};

// Stable and internal hash of every key of a batch, computed in parallel.
template <class View>
class BatchHashes {
 public:
  BatchHashes(const View* keys, int64_t n, const ParallelFor& pfor) {
    if (n > kMaxBatch) throw TableError("a batch holds at most 2^32-16 keys, got " + std::to_string(n));
    block_ = ScratchCache::Global().Take(2 * static_cast<size_t>(std::max<int64_t>(n, 1)), &words_);
    stable_ = block_;
    ih_ = block_ + n;
    pfor(n, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        stable_[i] = StableHash(keys[i]);
        ih_[i] = InternalHash(stable_[i]);
      }
    });
  }
  ~BatchHashes() { ScratchCache::Global().Give(block_, words_); }
  BatchHashes(const BatchHashes&) = delete;
  BatchHashes& operator=(const BatchHashes&) = delete;

  uint64_t stable(int64_t i) const { return stable_[i]; }
  uint64_t ih(int64_t i) const { return ih_[i]; }

 private:
  uint64_t* block_ = nullptr;
  size_t words_ = 0;
  uint64_t* stable_ = nullptr;
  uint64_t* ih_ = nullptr;
};

// One shard.  Not thread-safe by itself: CuckooTable holds its lock.
//
// A slot holds a key's full 64-bit internal hash and its row id, five slots
// to a 64-byte bucket, so a probe reads one line per bucket and, for integer
// keys, nothing else (KeyTraits::kHashIsKey).  A row holds only the value,
// so a 256-byte row (dim 64, float32) is exactly four aligned lines.
template <class K>
class CuckooShard {
 public:
  using Traits = KeyTraits<K>;
  using View = typename Traits::View;

  // row_value_bytes: bytes of one row's value.  presized: the caller asked
  // for room for expected_rows up front; the rows' memory is then allocated
  // and its pages mapped now (as a presized libcuckoo map constructs its
  // buckets), so the first inserts do not page-fault.
  CuckooShard(int64_t row_value_bytes, int64_t expected_rows, bool presized)
      : key_bytes_(Traits::kHashIsKey ? static_cast<int64_t>(sizeof(K)) : 0),
        stride_(RoundUp8(row_value_bytes)),
        first_chunk_log2_(FirstChunkLog2(expected_rows)) {
    InitBuckets(BucketsFor(expected_rows));
    if (presized) {
      const int64_t bytes = ChunkBytes(0);
      chunks_.push_back(AllocateChunk(bytes));
      MapPages(chunks_.back(), bytes);
    }
  }
  ~CuckooShard() { FreeChunks(); }
  CuckooShard(const CuckooShard&) = delete;
  CuckooShard& operator=(const CuckooShard&) = delete;

  int64_t size() const { return size_; }
  // Number of row ids handed out so far (live or on the free list).
  int64_t row_limit() const { return next_row_; }
  bool live(int64_t row) const { return (live_[row >> 6] >> (row & 63)) & 1; }
  const char* value_at(int64_t row) const { return Locate(row).value; }
  char* value_at(int64_t row) { return Locate(row).value; }
  const K& key_at(int64_t row) const {
    if constexpr (Traits::kHashIsKey) {
      return *reinterpret_cast<const K*>(Locate(row).key);
    } else {
      return side_keys_[row];
    }
  }

  // Brings both buckets of a key into cache ahead of its probe.  Fetching
  // the second one for every key costs less than waiting for it for the
  // keys that are there (at 76% load after presizing, about one in four) or
  // absent (find of 1M stored keys at dim 64: 18.7 -> 15 ms).
  void Prefetch(uint64_t ih) const {
    const int64_t b1 = ih & mask_;
    __builtin_prefetch(&buckets_[b1]);
    __builtin_prefetch(&buckets_[AltBucket(b1, ih)]);
  }

  // Row id holding `key` (whose internal hash is ih), or kEmptyRow.
  uint32_t Lookup(View key, uint64_t ih) const {
    const int64_t b1 = ih & mask_;
    uint32_t row = ScanBucket(b1, ih, key);
    if (row != kEmptyRow) return row;
    return ScanBucket(AltBucket(b1, ih), ih, key);
  }

  // Row id of `key`, inserting an uninitialized row when absent.
  uint32_t FindOrInsert(View key, uint64_t ih, bool* created) {
    uint32_t row = Lookup(key, ih);
    if (row != kEmptyRow) {
      *created = false;
      return row;
    }
    if (static_cast<double>(size_ + 1) > kMaxLoadFactor * capacity()) Grow();
    row = AllocateRow(key);
    PlaceOrGrow(ih, row);
    ++size_;
    *created = true;
    return row;
  }

  // Makes room for `rows` live rows without further growth.
  void Reserve(int64_t rows) {
    const int64_t want = BucketsFor(rows);
    if (want > static_cast<int64_t>(buckets_.size())) Rehash(want);
  }

  bool Remove(View key, uint64_t ih) {
    const int64_t b1 = ih & mask_;
    for (int64_t b : {b1, AltBucket(b1, ih)}) {
      Bucket& bk = buckets_[b];
      for (int s = 0; s < kSlotsPerBucket; ++s) {
        if (Holds(bk, s, ih, key)) {
          FreeRow(bk.row[s]);
          bk.row[s] = kEmptyRow;
          --size_;
          return true;
        }
      }
    }
    return false;
  }

  void Clear() {
    FreeChunks();
    side_keys_.clear();
    side_keys_.shrink_to_fit();
    live_.clear();
    live_.shrink_to_fit();
    free_rows_.clear();
    free_rows_.shrink_to_fit();
    next_row_ = 0;
    size_ = 0;
    InitBuckets(kMinBucketsPerShard);
  }

  // Bytes this shard holds on the heap (slots, rows, keys, bookkeeping).
  int64_t MemoryBytes() const {
    int64_t bytes = static_cast<int64_t>(buckets_.capacity() * sizeof(Bucket)) +
                    static_cast<int64_t>(live_.capacity() * 8 + free_rows_.capacity() * 4);
    for (size_t c = 0; c < chunks_.size(); ++c) bytes += ChunkBytes(static_cast<int>(c));
    if constexpr (!Traits::kHashIsKey) {
      bytes += side_keys_.capacity() * sizeof(std::string);
      for (const auto& k : side_keys_) bytes += k.capacity() > 15 ? k.capacity() : 0;
    }
    return bytes;
  }

 private:
  struct alignas(64) Bucket {
    uint64_t hash[kSlotsPerBucket];  // internal hash of the slot's key
    uint32_t row[kSlotsPerBucket];   // kEmptyRow marks a free slot
  };
  static_assert(sizeof(Bucket) == 64, "a bucket is one cache line");

  // Where a row's value and (int keys) key live.
  struct Place {
    char* value;
    char* key;
  };

  static int64_t RoundUp8(int64_t x) { return (x + 7) & ~int64_t{7}; }
  // A shard sized for `expected_rows` gets them all in its first arena chunk
  // (one allocation, huge pages when big); otherwise chunks start small.
  static int FirstChunkLog2(int64_t expected_rows) {
    int log2 = kFirstChunkLog2;
    while (log2 < 30 && (int64_t{1} << log2) < expected_rows) ++log2;
    return log2;
  }
  static int64_t BucketsFor(int64_t rows) {
    int64_t b = kMinBucketsPerShard;
    while (static_cast<double>(b) * kSlotsPerBucket * kMaxLoadFactor < static_cast<double>(rows)) b <<= 1;
    return b;
  }
  double capacity() const { return static_cast<double>(buckets_.size()) * kSlotsPerBucket; }

  // Arena chunk c holds 2^(first_chunk_log2_ + c) rows: their values, then
  // (int keys) their keys.
  int64_t ChunkRows(int c) const { return int64_t{1} << (first_chunk_log2_ + c); }
  int64_t ChunkBytes(int c) const { return ChunkRows(c) * (stride_ + key_bytes_); }

  void InitBuckets(int64_t n) {
    Bucket empty;
    std::fill(std::begin(empty.hash), std::end(empty.hash), uint64_t{0});
    std::fill(std::begin(empty.row), std::end(empty.row), kEmptyRow);
    buckets_.assign(n, empty);
    buckets_.shrink_to_fit();
    mask_ = n - 1;
  }

  int64_t AltBucket(int64_t b, uint64_t ih) const {
    const uint64_t delta = ((static_cast<uint64_t>(AltSeed(ih)) * 0xC6A4A7935BD1E995ULL) >> 32) | 1u;
    return static_cast<int64_t>((static_cast<uint64_t>(b) ^ delta) & mask_);
  }

  bool Holds(const Bucket& bk, int s, uint64_t ih, View key) const {
    if (bk.hash[s] != ih || bk.row[s] == kEmptyRow) return false;
    if constexpr (Traits::kHashIsKey) {
      return true;
    } else {
      return std::string_view(side_keys_[bk.row[s]]) == key;
    }
  }

  uint32_t ScanBucket(int64_t b, uint64_t ih, View key) const {
    const Bucket& bk = buckets_[b];
    for (int s = 0; s < kSlotsPerBucket; ++s) {
      if (Holds(bk, s, ih, key)) return bk.row[s];
    }
    return kEmptyRow;
  }

  bool TryPlace(int64_t b, uint64_t ih, uint32_t row) {
    Bucket& bk = buckets_[b];
    for (int s = 0; s < kSlotsPerBucket; ++s) {
      if (bk.row[s] == kEmptyRow) {
        bk.hash[s] = ih;
        bk.row[s] = row;
        return true;
      }
    }
    return false;
  }

  // Puts (ih,row) into its primary bucket or its alternate, kicking residents
  // along a random walk; when the walk is too long, grows and places the
  // entry that is left without a slot.
  void PlaceOrGrow(uint64_t ih, uint32_t row) {
    while (true) {
      const int64_t b = ih & mask_;
      if (TryPlace(b, ih, row)) return;
      int64_t cur = AltBucket(b, ih);
      if (TryPlace(cur, ih, row)) return;
      for (int kick = 0; kick < kMaxKicks; ++kick) {
        walk_state_ = walk_state_ * 6364136223846793005ULL + 1442695040888963407ULL;
        const int s = static_cast<int>((walk_state_ >> 33) % kSlotsPerBucket);
        Bucket& bk = buckets_[cur];
        std::swap(bk.hash[s], ih);
        std::swap(bk.row[s], row);
        cur = AltBucket(cur, ih);  // the evicted entry's other bucket (XOR is its own inverse)
        if (TryPlace(cur, ih, row)) return;
      }
      // (ih,row) is homeless: grow, which rehashes every resident, then
      // place it in the bigger table.
      Grow();
    }
  }

  void Grow() { Rehash(static_cast<int64_t>(buckets_.size()) * 2); }

  void Rehash(int64_t num_buckets) {
    BigVector<Bucket> old;
    old.swap(buckets_);
    InitBuckets(num_buckets);
    for (const Bucket& bk : old) {
      for (int s = 0; s < kSlotsPerBucket; ++s) {
        if (bk.row[s] != kEmptyRow) PlaceOrGrow(bk.hash[s], bk.row[s]);
      }
    }
  }

  // The arena chunk of a row id, and the row's index inside it.
  std::pair<int, int64_t> ChunkOf(int64_t row) const {
    const uint64_t q = static_cast<uint64_t>(row) + (uint64_t{1} << first_chunk_log2_);
    const int c = 63 - __builtin_clzll(q) - first_chunk_log2_;
    return {c, static_cast<int64_t>(q - (uint64_t{1} << (first_chunk_log2_ + c)))};
  }

  Place Locate(int64_t row) const {
    const auto [c, off] = ChunkOf(row);
    char* chunk = chunks_[c];
    return {chunk + off * stride_, chunk + ChunkRows(c) * stride_ + off * key_bytes_};
  }

  uint32_t AllocateRow(View key) {
    uint32_t row;
    if (!free_rows_.empty()) {
      row = free_rows_.back();
      free_rows_.pop_back();
    } else {
      if (next_row_ >= kMaxRowsPerShard)
        throw CapacityError("a cuckoo shard is full (" + std::to_string(next_row_) +
                            " rows); spread the table over more shards (num_shards=)");
      row = static_cast<uint32_t>(next_row_++);
      const int c = ChunkOf(row).first;
      if (static_cast<size_t>(c) >= chunks_.size()) chunks_.push_back(AllocateChunk(ChunkBytes(c)));
      if ((row >> 6) >= live_.size()) live_.push_back(0);
      if constexpr (!Traits::kHashIsKey) side_keys_.emplace_back();
    }
    if constexpr (Traits::kHashIsKey) {
      std::memcpy(Locate(row).key, &key, sizeof(K));
    } else {
      side_keys_[row].assign(key.data(), key.size());
    }
    live_[row >> 6] |= uint64_t{1} << (row & 63);
    return row;
  }

  // Chunks are at least 64-byte aligned, so rows whose size is a multiple of
  // 64 fill whole cache lines; big ones use huge pages (AllocateAligned).
  static char* AllocateChunk(int64_t bytes) {
    void* mem = AllocateAligned(static_cast<size_t>(bytes), 64);
    if (mem == nullptr)
      throw CapacityError("out of memory allocating " + std::to_string(bytes) + " bytes for a cuckoo shard");
    return static_cast<char*>(mem);
  }

  // Maps the pages of [mem, mem + bytes) now rather than at first write.
  static void MapPages(char* mem, int64_t bytes) {
#ifdef MADV_POPULATE_WRITE
    if (madvise(mem, bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
    // Kernels before 5.14: write one byte per page (the rows hold garbage
    // until inserted anyway).
    for (int64_t off = 0; off < bytes; off += 4096) mem[off] = 0;
  }

  void FreeRow(uint32_t row) {
    live_[row >> 6] &= ~(uint64_t{1} << (row & 63));
    if constexpr (!Traits::kHashIsKey) {
      side_keys_[row].clear();
      side_keys_[row].shrink_to_fit();
    }
    free_rows_.push_back(row);
  }

  void FreeChunks() {
    for (char* c : chunks_) std::free(c);
    chunks_.clear();
  }

  const int64_t key_bytes_;     // sizeof(K) for int keys (kept in the chunks), else 0
  const int64_t stride_;        // bytes between consecutive rows in a chunk
  const int first_chunk_log2_;  // arena chunk c holds 2^(first_chunk_log2_ + c) rows
  BigVector<Bucket> buckets_;   // size is a power of two; mask_ = size - 1
  int64_t mask_ = 0;
  std::vector<char*> chunks_;                    // see ChunkRows / ChunkBytes
  std::vector<std::string> side_keys_;           // string keys, indexed by row id
  std::vector<uint64_t> live_;                   // bit per row id: 1 while the row holds a key
  std::vector<uint32_t> free_rows_;              // removed row ids, reused first
  int64_t next_row_ = 0;                         // row ids below this have been handed out
  int64_t size_ = 0;                             // live rows == occupied slots
  uint64_t walk_state_ = 0x853C49E6748FEA9BULL;  // LCG for cuckoo kicks
};

// The whole table: kNumShards shards, each with its own lock.
template <class K>
class CuckooTable {
 public:
  using View = typename KeyTraits<K>::View;

  CuckooTable(int64_t value_bytes, int64_t expected_rows) : value_bytes_(value_bytes) {
    if (value_bytes <= 0) throw TableError("row size must be positive, got " + std::to_string(value_bytes));
    for (int s = 0; s < kNumShards; ++s) {
      shards_[s].shard =
          std::make_unique<CuckooShard<K>>(value_bytes, expected_rows / kNumShards + 1, expected_rows > 0);
    }
  }

  int64_t value_bytes() const { return value_bytes_; }

  // For each key i: on_hit(i, const char* row) when present, else
  // on_miss(i, stable_hash).  Callbacks for different keys run concurrently;
  // each writes only its own output position i.
  //
  // Reads need no shard grouping: each worker takes every shard's lock
  // shared once, then walks its range of keys in batch order (so outputs are
  // written sequentially) as a three-stage software pipeline: hash key
  // i + 2D and prefetch its bucket; probe key i + D (its bucket is cached by
  // now) and prefetch its row's lines; hand key i's row (cached by now) to
  // its callback.  Rows do not move while the locks are held, so the row
  // found in the second stage is still the key's row in the third.  Without
  // the row stage a key's row lines are fetched only when copied, one key at
  // a time (find of 1M keys at dim 64: 36 ms -> 18 ms).
  template <class OnHit, class OnMiss>
  void Find(const View* keys, int64_t n, const ParallelFor& pfor, OnHit on_hit, OnMiss on_miss) const {
    FirstError error;
    pfor(n, 70, [&](int64_t begin, int64_t end) {
      error.Run([&] {
        std::shared_lock<std::shared_mutex> locks[kNumShards];
        for (int s = 0; s < kNumShards; ++s) locks[s] = std::shared_lock<std::shared_mutex>(shards_[s].mu);
        constexpr int64_t D = kPrefetchDistance;
        constexpr int64_t kRing = 4 * D;  // > 2D: key i's entry outlives the hashing of key i + 2D
        uint64_t stable[kRing], ih[kRing];
        const char* found[kRing];  // key's row, or nullptr when absent
        auto hash_stage = [&](int64_t j) {
          const int64_t r = j % kRing;
          stable[r] = StableHash(keys[j]);
          ih[r] = InternalHash(stable[r]);
          shards_[ShardIndex(ih[r])].shard->Prefetch(ih[r]);
        };
        auto probe_stage = [&](int64_t j) {
          const int64_t r = j % kRing;
          const CuckooShard<K>& sh = *shards_[ShardIndex(ih[r])].shard;
          const uint32_t row = sh.Lookup(keys[j], ih[r]);
          found[r] = row == kEmptyRow ? nullptr : sh.value_at(row);
          if (found[r] != nullptr) PrefetchLines(found[r], value_bytes_);
        };
        for (int64_t j = begin; j < std::min(end, begin + 2 * D); ++j) hash_stage(j);
        for (int64_t j = begin; j < std::min(end, begin + D); ++j) probe_stage(j);
        for (int64_t i = begin; i < end; ++i) {
          if (i + 2 * D < end) hash_stage(i + 2 * D);
          if (i + D < end) probe_stage(i + D);
          const int64_t r = i % kRing;
          if (found[r] != nullptr) {
            on_hit(i, found[r]);
          } else {
            on_miss(i, stable[r]);
          }
        }
        StoreFence();  // the callbacks may have streamed their rows (row_copy.h)
      });
    });
    error.Rethrow();
  }

  // For each key i, in batch order within its shard: update(i, char* row,
  // bool created, stable_hash); a created row holds garbage until written.
  template <class Update>
  void Upsert(const View* keys, int64_t n, const ParallelFor& pfor, Update update) {
    const BatchHashes<View> hashes(keys, n, pfor);
    RunByShardGroups(hashes, n, pfor, [&](auto owns) { UpsertLocked(keys, hashes, n, owns, update); });
  }

  // Every key's row in place, for a caller that reads and writes the rows of
  // the same keys in several tables in one pass (TfdeTableApply: a row and
  // its optimizer slots).  Takes every shard's lock exclusively, inserts the
  // absent keys and calls fill(i, char* row, stable_hash) for each created
  // row right after its insertion (fill must write the whole row: no other
  // call sees it before), then body(char* const* rows), rows[i] being key
  // i's row, with the locks still held.  The pointers stay valid until body
  // returns: a shard grows its buckets but never moves its rows' chunks, and
  // nothing removes a row while the locks are held.  Serial (one thread).
  template <class Fill, class Body>
  void WithRows(const View* keys, int64_t n, Fill fill, Body body) {
    const BatchHashes<View> hashes(keys, n, SerialFor);  // before the locks: it takes the scratch cache's
    std::vector<char*> rows(n, nullptr);
    std::unique_lock<std::shared_mutex> locks[kNumShards];
    for (int s = 0; s < kNumShards; ++s) locks[s] = std::unique_lock<std::shared_mutex>(shards_[s].mu);
    UpsertLocked(
        keys, hashes, n, [](int64_t) { return true; },
        [&](int64_t i, char* row, bool created, uint64_t stable) {
          rows[i] = row;
          if (created) fill(i, row, stable);
        });
    body(static_cast<char* const*>(rows.data()));
  }

  // Removes the keys present; returns how many were removed.
  int64_t Remove(const View* keys, int64_t n, const ParallelFor& pfor) {
    const BatchHashes<View> hashes(keys, n, pfor);
    std::atomic<int64_t> removed{0};
    RunByShardGroups(hashes, n, pfor, [&](auto owns) {
      SizeDelta removed_here(&size_);  // counted under this group's locks: see size_
      for (int64_t i = 0; i < n; ++i) {
        const int64_t ahead = i + 2 * kPrefetchDistance;
        if (ahead < n && owns(ahead)) ShardOf(hashes.ih(ahead)).Prefetch(hashes.ih(ahead));
        if (owns(i)) removed_here.delta -= ShardOf(hashes.ih(i)).Remove(keys[i], hashes.ih(i));
      }
      removed.fetch_add(-removed_here.delta, std::memory_order_relaxed);
    });
    return removed.load();
  }

  void Clear() {
    for (Slot& slot : shards_) {
      std::unique_lock<std::shared_mutex> lock(slot.mu);
      size_.fetch_sub(slot.shard->size(), std::memory_order_relaxed);
      slot.shard->Clear();
    }
  }

  int64_t Size() const { return size_.load(std::memory_order_relaxed); }

  int64_t MemoryBytes() const {
    int64_t bytes = sizeof(*this);
    for (const Slot& slot : shards_) {
      std::shared_lock<std::shared_mutex> lock(slot.mu);
      bytes += slot.shard->MemoryBytes();
    }
    return bytes;
  }

  // Chunked export.  A cursor is (shard << 32 | row id); start with 0.  Calls
  // emit(const K& key, const char* row) for at most max_rows live rows at or
  // after the cursor and returns the cursor to continue from, or -1 when the
  // table is exhausted.  Rows never move, so a table that grows between calls
  // is still walked exactly once; rows inserted or removed between calls may
  // or may not be seen.
  template <class Emit>
  int64_t Export(int64_t cursor, int64_t max_rows, Emit emit) const {
    if (cursor < 0) throw TableError("export cursor must be >= 0, got " + std::to_string(cursor));
    if (max_rows <= 0) throw TableError("export max_rows must be > 0, got " + std::to_string(max_rows));
    int64_t shard = cursor >> 32, row = cursor & 0xFFFFFFFFLL, emitted = 0;
    for (; shard < kNumShards; ++shard, row = 0) {
      const Slot& slot = shards_[shard];
      std::shared_lock<std::shared_mutex> lock(slot.mu);
      const CuckooShard<K>& sh = *slot.shard;
      for (; row < sh.row_limit(); ++row) {
        if (!sh.live(row)) continue;
        if (emitted == max_rows) return (shard << 32) | row;
        emit(sh.key_at(row), sh.value_at(row));
        ++emitted;
      }
    }
    return -1;
  }

 private:
  struct Slot {
    mutable std::shared_mutex mu;  // guards *shard
    std::unique_ptr<CuckooShard<K>> shard;
  };

  // Records the first exception thrown by a worker so that it can be
  // rethrown on the calling thread: exceptions must not escape into the
  // caller's thread pool.
  class FirstError {
   public:
    template <class Body>
    void Run(Body body) {
      try {
        body();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    void Rethrow() {
      if (error_) std::rethrow_exception(error_);
    }

   private:
    std::mutex mu_;
    std::exception_ptr error_;
  };

  CuckooShard<K>& ShardOf(uint64_t ih) { return *shards_[ShardIndex(ih)].shard; }

  // Adds `delta` to *size when it goes out of scope: at the end of a shard
  // group's work, its locks still held, and also when the work throws (rows
  // created before a CapacityError stay in the shards and are counted).
  struct SizeDelta {
    explicit SizeDelta(std::atomic<int64_t>* size) : size(size) {}
    ~SizeDelta() { size->fetch_add(delta, std::memory_order_relaxed); }
    SizeDelta(const SizeDelta&) = delete;
    SizeDelta& operator=(const SizeDelta&) = delete;
    std::atomic<int64_t>* size;
    int64_t delta = 0;
  };

  // Upsert's work on the keys i with owns(i), whose shards' locks the caller
  // holds exclusively.  Pass 1 updates the keys already present and collects
  // the others, so pass 2 can grow each shard once instead of doubling
  // repeatedly.  A new key appears only in pass 2, so its duplicates stay in
  // order.
  template <class Owns, class Update>
  void UpsertLocked(const View* keys, const BatchHashes<View>& hashes, int64_t n, Owns owns, Update&& update) {
    std::vector<uint32_t> fresh;
    int64_t fresh_in[kNumShards] = {0};
    for (int64_t i = 0; i < n; ++i) {
      const int64_t ahead = i + 2 * kPrefetchDistance;
      if (ahead < n && owns(ahead)) ShardOf(hashes.ih(ahead)).Prefetch(hashes.ih(ahead));
      if (!owns(i)) continue;
      CuckooShard<K>& sh = ShardOf(hashes.ih(i));
      const uint32_t row = sh.Lookup(keys[i], hashes.ih(i));
      if (row != kEmptyRow) {
        update(i, sh.value_at(row), false, hashes.stable(i));
      } else {
        fresh.push_back(static_cast<uint32_t>(i));
        ++fresh_in[ShardIndex(hashes.ih(i))];
      }
    }
    if (fresh.empty()) return;
    for (int s = 0; s < kNumShards; ++s)
      if (fresh_in[s] > 0) shards_[s].shard->Reserve(shards_[s].shard->size() + fresh_in[s]);
    // Counted into size_ while the locks are held (SizeDelta), also when a
    // later key throws: see size_.
    SizeDelta created_here(&size_);
    for (size_t f = 0; f < fresh.size(); ++f) {
      if (f + kPrefetchDistance < fresh.size()) {
        const uint64_t h = hashes.ih(fresh[f + kPrefetchDistance]);
        ShardOf(h).Prefetch(h);
      }
      const uint32_t i = fresh[f];
      bool created = false;
      CuckooShard<K>& sh = ShardOf(hashes.ih(i));
      const uint32_t row = sh.FindOrInsert(keys[i], hashes.ih(i), &created);
      update(i, sh.value_at(row), created, hashes.stable(i));
      created_here.delta += created;
    }
  }

  // Splits the shards into one contiguous group per worker.  Each worker
  // locks its group exclusively and calls body(owns), where owns(i) tells
  // whether key i belongs to the group; the body walks the batch in order
  // and handles its own keys, so every shard sees its keys in batch order
  // and inputs are read front to back.  Small batches use one group.
  template <class Body>
  void RunByShardGroups(const BatchHashes<View>& hashes, int64_t n, const ParallelFor& pfor, Body body) {
    const int64_t workers = std::max<int64_t>(1, std::thread::hardware_concurrency());
    const int64_t groups = std::clamp<int64_t>(std::min(n / kMinKeysPerGroup, workers), 1, kMaxGroups);
    FirstError error;
    pfor(groups, std::max<int64_t>(1, n / groups) * 100, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        error.Run([&] {
          const int s0 = static_cast<int>(g * kNumShards / groups);
          const int s1 = static_cast<int>((g + 1) * kNumShards / groups);
          std::unique_lock<std::shared_mutex> locks[kNumShards];
          for (int s = s0; s < s1; ++s) locks[s] = std::unique_lock<std::shared_mutex>(shards_[s].mu);
          body([&hashes, s0, s1](int64_t i) {
            const int s = ShardIndex(hashes.ih(i));
            return s >= s0 && s < s1;
          });
        });
      }
    });
    error.Rethrow();
  }

  const int64_t value_bytes_;  // bytes of one value row
  Slot shards_[kNumShards];
  // Live rows over all shards.  Invariant: every change of a shard's row
  // count is added here while that shard's lock is held (Upsert and Remove
  // through SizeDelta, Clear directly), so the per-shard parts of any value
  // read are each a prefix of that shard's history and Size() is never
  // negative, nor above the rows stored.  Counting after the locks were
  // released let a Remove (or Clear) of a key subtract it before the Upsert
  // that created it had added it: sizes of -4 under concurrent inserts and
  // removes of the same keys, and ExportOp (which sizes its outputs by
  // Size()) aborted the process on a negative shape (stress_test.cc, phase 2).
  std::atomic<int64_t> size_{0};
};

}  // namespace tfde

#endif  // TFDE_BACKENDS_CUCKOO_CUCKOO_TABLE_H_
