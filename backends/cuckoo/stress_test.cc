// Stress test of the cuckoo core without TensorFlow, for every key type:
//
//   1. disjoint keys: several threads run random batches of upserts, finds,
//      removes and accumulations (by Upsert and in place by WithRows) on disjoint key ranges and check every
//      answer against a private shadow map.  Thread 0 uses big batches split
//      over several shard groups by a threaded parallel-for (the path TF's
//      intra-op pool takes); the others use small serial batches.  A reader
//      exports, sizes, measures and finds concurrently.  At the end the table
//      must equal the union of the shadows.
//   2. shared keys: every thread upserts, removes, finds and holds (WithRows,
//      two tables nested as TfdeTableApply does) the same few hundred keys
//      while one also clears the table now and then.  A key's
//      row is a function of the key (RowOf), so whatever the interleaving a
//      find or an export must return exactly that row, and Size() must never
//      be negative (ExportOp sizes its outputs by it).
//   3. bulk: one big batch into an empty table, in parallel.
//
// Built plainly by tests/test_native_core.py and under -fsanitize=thread and
// -fsanitize=address,undefined by tests/test_sanitizers.py.
//
//   usage: stress_test [seed] [threads] [ops_per_thread] [bulk_rows]
// Prints the seed first so a failure can be replayed.  Exit 0 = pass.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuckoo_table.h"

namespace {

constexpr int kDim = 5;                  // int32 values per row
constexpr int64_t kKeySpace = 4000;      // keys per thread in phase 1 (small batches)
constexpr int64_t kBigKeySpace = 30000;  // keys of thread 0 in phase 1 (big batches)
constexpr int64_t kMaxBatch = 300;       // keys per small batch
// Big batches reach past tfde::kMinKeysPerGroup keys, so writes split the
// shards into several groups locked by different threads.
constexpr int64_t kMaxBigBatch = 3 * tfde::kMinKeysPerGroup;
constexpr int64_t kSharedKeys = 256;  // keys every thread hits in phase 2

using Row = std::vector<int32_t>;

uint64_t g_seed = 0;

[[noreturn]] void Fail(const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "FAIL (seed %llu): %s\n", static_cast<unsigned long long>(g_seed), what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

template <class K>
K MakeKey(int thread, int64_t i);
template <>
int64_t MakeKey<int64_t>(int thread, int64_t i) {
  return (static_cast<int64_t>(thread) << 40) + i * 7919 - (int64_t{1} << 41);
}
template <>
int32_t MakeKey<int32_t>(int thread, int64_t i) {
  return static_cast<int32_t>((thread - 4) * 1000000 + i * 3);
}
template <>
std::string MakeKey<std::string>(int thread, int64_t i) {
  // Lengths vary from 1 to ~30 bytes to cover the word and tail paths.
  return std::string(i % 23, 'k') + "/" + std::to_string(thread) + "/" + std::to_string(i);
}

template <class K>
typename tfde::KeyTraits<K>::View ViewOf(const K& k) {
  return k;
}

template <class K>
uint64_t HashOf(const K& k) {
  return tfde::StableHash(ViewOf(k));
}

// Phase 2's row of a key: a function of the key alone.
template <class K>
Row RowOf(const K& k) {
  const uint64_t h = HashOf(k);
  Row r(kDim);
  for (int j = 0; j < kDim; ++j) r[j] = static_cast<int32_t>(h >> (8 * j)) ^ j;
  return r;
}

// Parallel-for over std::threads, to exercise concurrent shards in one call.
void ThreadsFor(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& work) {
  std::vector<std::thread> ts;
  const int64_t parts = 3;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t b = total * p / parts, e = total * (p + 1) / parts;
    if (b < e) ts.emplace_back([&, b, e] { work(b, e); });
  }
  for (auto& t : ts) t.join();
}

template <class K>
struct Batch {
  std::vector<K> keys;
  std::vector<typename tfde::KeyTraits<K>::View> views;
  void Fill(int thread, std::mt19937_64& rng, int64_t n, int64_t key_space) {
    keys.resize(n);
    views.resize(n);
    for (int64_t i = 0; i < n; ++i) keys[i] = MakeKey<K>(thread, static_cast<int64_t>(rng() % key_space));
    for (int64_t i = 0; i < n; ++i) views[i] = ViewOf(keys[i]);
  }
};

// Phase 1 worker: random ops on this thread's keys, checked against a shadow.
template <class K>
void DisjointWorker(tfde::CuckooTable<K>* table, int thread, int64_t ops) {
  std::mt19937_64 rng(g_seed * 1000003 + thread);
  const bool big = thread == 0;
  const tfde::ParallelFor pfor = big ? tfde::ParallelFor(ThreadsFor) : tfde::ParallelFor(tfde::SerialFor);
  const int64_t key_space = big ? kBigKeySpace : kKeySpace;
  std::unordered_map<K, Row> shadow;
  Batch<K> batch;
  for (int64_t op = 0; op < (big ? ops / 20 + 1 : ops); ++op) {
    const int kind = static_cast<int>(rng() % 5);
    const int64_t n = 1 + static_cast<int64_t>(rng() % (big ? kMaxBigBatch : kMaxBatch));
    batch.Fill(thread, rng, n, key_space);
    const auto& keys = batch.keys;
    if (kind == 0) {  // upsert: row = (op, i, ...); the last duplicate wins
      std::vector<Row> rows(n, Row(kDim));
      for (int64_t i = 0; i < n; ++i)
        for (int j = 0; j < kDim; ++j) rows[i][j] = static_cast<int32_t>(op * 31 + i * 7 + j);
      table->Upsert(batch.views.data(), n, pfor,
                    [&](int64_t i, char* row, bool, uint64_t) { std::memcpy(row, rows[i].data(), kDim * 4); });
      for (int64_t i = 0; i < n; ++i) shadow[keys[i]] = rows[i];
    } else if (kind == 1) {  // accum: missing rows start at zero; duplicates all add
      table->Upsert(batch.views.data(), n, pfor, [&](int64_t i, char* row, bool created, uint64_t hash) {
        if (hash != HashOf(keys[i])) Fail("upsert passed the wrong stable hash");
        int32_t* r = reinterpret_cast<int32_t*>(row);
        for (int j = 0; j < kDim; ++j) r[j] = (created ? 0 : r[j]) + static_cast<int32_t>(i + j);
      });
      for (int64_t i = 0; i < n; ++i) {
        auto it = shadow.find(keys[i]);
        if (it == shadow.end()) it = shadow.emplace(keys[i], Row(kDim, 0)).first;
        for (int j = 0; j < kDim; ++j) it->second[j] += static_cast<int32_t>(i + j);
      }
    } else if (kind == 2) {  // remove
      int64_t expected = 0;
      for (int64_t i = 0; i < n; ++i) expected += shadow.erase(keys[i]);
      const int64_t removed = table->Remove(batch.views.data(), n, pfor);
      if (removed != expected) Fail("remove count " + std::to_string(removed) + " != " + std::to_string(expected));
    } else if (kind == 3) {  // accum in place (WithRows): created rows start at zero; duplicates all add
      table->WithRows(
          batch.views.data(), n,
          [&](int64_t i, char* row, uint64_t hash) {
            if (hash != HashOf(keys[i])) Fail("WithRows passed the wrong stable hash");
            std::memset(row, 0, kDim * 4);
          },
          [&](char* const* rows) {
            for (int64_t i = 0; i < n; ++i) {
              int32_t* r = reinterpret_cast<int32_t*>(rows[i]);
              for (int j = 0; j < kDim; ++j) r[j] += static_cast<int32_t>(i + j);
            }
          });
      for (int64_t i = 0; i < n; ++i) {
        auto it = shadow.find(keys[i]);
        if (it == shadow.end()) it = shadow.emplace(keys[i], Row(kDim, 0)).first;
        for (int j = 0; j < kDim; ++j) it->second[j] += static_cast<int32_t>(i + j);
      }
    } else {  // find: the callbacks only read the shadow
      std::atomic<int64_t> wrong{0};
      table->Find(
          batch.views.data(), n, pfor,
          [&](int64_t i, const char* row) {
            auto it = shadow.find(keys[i]);
            if (it == shadow.end() || std::memcmp(row, it->second.data(), kDim * 4) != 0) wrong.fetch_add(1);
          },
          [&](int64_t i, uint64_t hash) {
            if (hash != HashOf(keys[i]) || shadow.count(keys[i])) wrong.fetch_add(1);
          });
      if (wrong.load() != 0) Fail(std::to_string(wrong.load()) + " finds returned a wrong, stale or missing row");
    }
  }
  // Final check of this thread's keys.
  std::vector<K> keys;
  for (const auto& kv : shadow) keys.push_back(kv.first);
  std::vector<typename tfde::KeyTraits<K>::View> views(keys.begin(), keys.end());
  table->Find(
      views.data(), static_cast<int64_t>(views.size()), tfde::SerialFor,
      [&](int64_t i, const char* row) {
        if (std::memcmp(row, shadow[keys[i]].data(), kDim * 4) != 0) Fail("final row mismatch");
      },
      [&](int64_t, uint64_t) { Fail("final check missed a key"); });
}

// Exports the whole table in chunks of `chunk` rows; calls check(key, row)
// for each and returns how many rows it saw.
template <class K, class Check>
int64_t ExportAll(const tfde::CuckooTable<K>& table, int64_t chunk, Check check) {
  int64_t cursor = 0, rows = 0;
  while (cursor >= 0) {
    int64_t in_chunk = 0;
    cursor = table.Export(cursor, chunk, [&](const K& k, const char* row) {
      check(k, row);
      ++in_chunk;
    });
    if (in_chunk > chunk) Fail("export chunk larger than max_rows");
    rows += in_chunk;
  }
  return rows;
}

template <class K>
void DisjointPhase(const char* name, int threads, int64_t ops) {
  tfde::CuckooTable<K> table(kDim * 4, 0);
  std::atomic<bool> done{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back(DisjointWorker<K>, &table, t, ops);
  // A reader exporting, sizing, measuring and finding while writers run:
  // nothing may crash, and every chunk must be within bounds.
  std::thread reader([&] {
    std::mt19937_64 rng(g_seed ^ 0xABCDEF);
    Batch<K> batch;
    while (!done.load()) {
      ExportAll(table, 97, [](const K&, const char*) {});
      if (table.Size() < 0) Fail(std::string(name) + ": negative size");
      if (table.MemoryBytes() <= 0) Fail(std::string(name) + ": no memory in use");
      batch.Fill(static_cast<int>(rng() % threads), rng, 1 + rng() % 2000, kKeySpace);
      table.Find(
          batch.views.data(), static_cast<int64_t>(batch.views.size()), ThreadsFor, [](int64_t, const char*) {},
          [](int64_t, uint64_t) {});
    }
  });
  for (auto& t : ts) t.join();
  done.store(true);
  reader.join();
  // The table is now quiescent: export must see exactly Size() rows, and a
  // parallel find over everything exported must hit every key.
  std::vector<K> all;
  ExportAll(table, 1000, [&](const K& k, const char*) { all.push_back(k); });
  if (static_cast<int64_t>(all.size()) != table.Size())
    Fail(std::string(name) + ": export saw " + std::to_string(all.size()) + " rows, size " +
         std::to_string(table.Size()));
  std::vector<typename tfde::KeyTraits<K>::View> views(all.begin(), all.end());
  std::atomic<int64_t> hits{0};
  table.Find(
      views.data(), static_cast<int64_t>(views.size()), ThreadsFor, [&](int64_t, const char*) { hits.fetch_add(1); },
      [&](int64_t, uint64_t) {});
  if (hits.load() != table.Size()) Fail(std::string(name) + ": parallel find missed keys");
  std::printf("%s: disjoint keys, %d threads x %lld ops ok, final size %lld\n", name, threads,
              static_cast<long long>(ops), static_cast<long long>(table.Size()));
}

template <class K>
void SharedPhase(const char* name, int threads, int64_t ops) {
  tfde::CuckooTable<K> table(kDim * 4, 0), second(kDim * 4, 0);
  std::vector<K> universe;
  std::vector<Row> rows;
  for (int64_t i = 0; i < kSharedKeys; ++i) {
    universe.push_back(MakeKey<K>(7, i));
    rows.push_back(RowOf(universe.back()));
  }
  auto check_row = [&](const K& k, const char* row) {
    const Row want = RowOf(k);
    if (std::memcmp(row, want.data(), kDim * 4) != 0) Fail(std::string(name) + ": a shared key holds a torn row");
  };
  std::atomic<bool> done{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(g_seed * 7919 + t);
      for (int64_t op = 0; op < ops; ++op) {
        const int64_t n = 1 + static_cast<int64_t>(rng() % 64);
        std::vector<int64_t> idx(n);
        std::vector<typename tfde::KeyTraits<K>::View> views(n);
        for (int64_t i = 0; i < n; ++i) {
          idx[i] = static_cast<int64_t>(rng() % kSharedKeys);
          views[i] = ViewOf(universe[idx[i]]);
        }
        const int kind = static_cast<int>(rng() % 8);
        if (kind < 3) {
          table.Upsert(views.data(), n, tfde::SerialFor,
                       [&](int64_t i, char* row, bool, uint64_t) { std::memcpy(row, rows[idx[i]].data(), kDim * 4); });
        } else if (kind < 6) {
          const int64_t removed = table.Remove(views.data(), n, tfde::SerialFor);
          if (removed < 0 || removed > n) Fail(std::string(name) + ": remove count out of range");
        } else if (kind == 6) {
          table.Find(
              views.data(), n, tfde::SerialFor, [&](int64_t i, const char* row) { check_row(universe[idx[i]], row); },
              [](int64_t, uint64_t) {});
        } else if (t == 0 && op % 16 == 7) {
          table.Clear();
        } else {  // both tables' rows held at once, in the same order by every thread (as TfdeTableApply)
          auto fill = [&](int64_t i, char* row, uint64_t) { std::memcpy(row, rows[idx[i]].data(), kDim * 4); };
          table.WithRows(views.data(), n, fill, [&](char* const* first) {
            second.WithRows(views.data(), n, fill, [&](char* const* other) {
              for (int64_t i = 0; i < n; ++i) {
                check_row(universe[idx[i]], first[i]);
                check_row(universe[idx[i]], other[i]);
                std::memcpy(first[i], rows[idx[i]].data(), kDim * 4);
              }
            });
          });
        }
        const int64_t size = table.Size();
        if (size < 0 || size > kSharedKeys)
          Fail(std::string(name) + ": size " + std::to_string(size) + " outside [0, " + std::to_string(kSharedKeys) +
               "] while keys are inserted and removed concurrently");
      }
    });
  }
  std::thread reader([&] {
    while (!done.load()) {
      if (ExportAll(table, 13, check_row) > kSharedKeys) Fail(std::string(name) + ": export saw a key twice");
      const int64_t size = table.Size();
      if (size < 0 || size > kSharedKeys) Fail(std::string(name) + ": size " + std::to_string(size) + " out of range");
    }
  });
  for (auto& t : ts) t.join();
  done.store(true);
  reader.join();
  const int64_t exported = ExportAll(table, 50, check_row);
  if (exported != table.Size())
    Fail(std::string(name) + ": shared keys: export saw " + std::to_string(exported) + " rows, size " +
         std::to_string(table.Size()));
  std::printf("%s: shared keys, %d threads x %lld ops ok, final size %lld\n", name, threads,
              static_cast<long long>(ops), static_cast<long long>(table.Size()));
}

template <class K>
void BulkPhase(const char* name, int64_t n) {
  // Growth from empty with one big batch, in parallel.
  tfde::CuckooTable<K> big(8, 0);
  std::vector<K> keys;
  for (int64_t i = 0; i < n; ++i) keys.push_back(MakeKey<K>(9, i));
  std::vector<typename tfde::KeyTraits<K>::View> views(keys.begin(), keys.end());
  big.Upsert(views.data(), n, ThreadsFor, [&](int64_t i, char* row, bool, uint64_t) { std::memcpy(row, &i, 8); });
  std::atomic<int64_t> ok{0};
  big.Find(
      views.data(), n, ThreadsFor,
      [&](int64_t i, const char* row) {
        int64_t v;
        std::memcpy(&v, row, 8);
        if (v == i) ok.fetch_add(1);
      },
      [&](int64_t, uint64_t) {});
  if (ok.load() != n || big.Size() != n) Fail(std::string(name) + ": bulk insert lost rows");
  big.Clear();
  if (big.Size() != 0) Fail("clear left rows");
  std::printf("%s: bulk insert of %lld keys ok\n", name, static_cast<long long>(n));
}

template <class K>
void Run(const char* name, int threads, int64_t ops, int64_t bulk) {
  DisjointPhase<K>(name, threads, ops);
  SharedPhase<K>(name, threads, ops);
  BulkPhase<K>(name, bulk);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  g_seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10)
                    : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const int threads = argc > 2 ? std::atoi(argv[2]) : 4;
  const int64_t ops = argc > 3 ? std::atoll(argv[3]) : 3000;
  const int64_t bulk = argc > 4 ? std::atoll(argv[4]) : 200000;
  if (threads < 1 || ops < 1 || bulk < 1) {
    std::fprintf(stderr, "usage: stress_test [seed] [threads >= 1] [ops_per_thread >= 1] [bulk_rows >= 1]\n");
    return 2;
  }
  std::printf("stress_test seed %llu\n", static_cast<unsigned long long>(g_seed));
  std::fflush(stdout);
  Run<int64_t>("int64 keys", threads, ops, bulk);
  Run<int32_t>("int32 keys", threads, ops, bulk);
  Run<std::string>("string keys", threads, ops, bulk);
  std::printf("PASS\n");
  return 0;
}
