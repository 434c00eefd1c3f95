// Stress test of the cuckoo core without TensorFlow: several threads run
// random batches of upserts, finds, removes and accumulations on disjoint
// key ranges and check every answer against a private shadow map; reader
// threads export and size the table concurrently.  At the end the table must
// equal the union of the shadows.
//
//   usage: stress_test [seed] [threads] [ops_per_thread]
// Prints the seed first so a failure can be replayed.  Exit 0 = pass.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuckoo_table.h"

namespace {

constexpr int kDim = 5;  // int32 values per row

using Row = std::vector<int32_t>;

[[noreturn]] void Fail(const std::string& what, uint64_t seed) {
  std::fprintf(stderr, "FAIL (seed %llu): %s\n", static_cast<unsigned long long>(seed), what.c_str());
  std::exit(1);
}

template <class K>
K MakeKey(int thread, int64_t i);
template <>
int64_t MakeKey<int64_t>(int thread, int64_t i) {
  return (static_cast<int64_t>(thread) << 40) + i * 7919 - (int64_t{1} << 41);
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
void Worker(tfde::CuckooTable<K>* table, int thread, uint64_t seed, int64_t ops, std::atomic<bool>* failed) {
  std::mt19937_64 rng(seed * 1000003 + thread);
  std::unordered_map<K, Row> shadow;
  const int64_t key_space = 4000;
  for (int64_t op = 0; op < ops && !failed->load(); ++op) {
    const int kind = static_cast<int>(rng() % 4);
    const int64_t n = 1 + static_cast<int64_t>(rng() % 300);
    std::vector<K> keys(n);
    std::vector<typename tfde::KeyTraits<K>::View> views(n);
    for (int64_t i = 0; i < n; ++i) {
      keys[i] = MakeKey<K>(thread, static_cast<int64_t>(rng() % key_space));
    }
    for (int64_t i = 0; i < n; ++i) views[i] = ViewOf(keys[i]);
    if (kind == 0) {  // upsert: row = (op, i, ...)
      std::vector<Row> rows(n, Row(kDim));
      for (int64_t i = 0; i < n; ++i)
        for (int j = 0; j < kDim; ++j) rows[i][j] = static_cast<int32_t>(op * 31 + i * 7 + j);
      table->Upsert(views.data(), n, tfde::SerialFor, [&](int64_t i, char* row, bool, uint64_t) {
        std::memcpy(row, rows[i].data(), kDim * 4);
      });
      for (int64_t i = 0; i < n; ++i) shadow[keys[i]] = rows[i];
    } else if (kind == 1) {  // accum: missing rows start at zero
      table->Upsert(views.data(), n, tfde::SerialFor, [&](int64_t i, char* row, bool created, uint64_t) {
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
      const int64_t removed = table->Remove(views.data(), n, tfde::SerialFor);
      if (removed != expected)
        Fail("remove count " + std::to_string(removed) + " != " + std::to_string(expected), seed);
    } else {  // find
      table->Find(
          views.data(), n, tfde::SerialFor,
          [&](int64_t i, const char* row) {
            auto it = shadow.find(keys[i]);
            if (it == shadow.end() || std::memcmp(row, it->second.data(), kDim * 4) != 0) {
              failed->store(true);
              Fail("find returned a wrong or stale row", seed);
            }
          },
          [&](int64_t i, uint64_t) {
            if (shadow.count(keys[i])) {
              failed->store(true);
              Fail("find missed a stored key", seed);
            }
          });
    }
  }
  // Final check of this thread's keys.
  std::vector<K> keys;
  for (const auto& kv : shadow) keys.push_back(kv.first);
  std::vector<typename tfde::KeyTraits<K>::View> views(keys.begin(), keys.end());
  int64_t found = 0;
  table->Find(
      views.data(), static_cast<int64_t>(views.size()), tfde::SerialFor,
      [&](int64_t i, const char* row) {
        if (std::memcmp(row, shadow[keys[i]].data(), kDim * 4) != 0) Fail("final row mismatch", seed);
        ++found;
      },
      [&](int64_t, uint64_t) { Fail("final check missed a key", seed); });
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
void Run(const char* name, uint64_t seed, int threads, int64_t ops) {
  tfde::CuckooTable<K> table(kDim * 4, 0);
  std::atomic<bool> failed{false}, done{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back(Worker<K>, &table, t, seed, ops, &failed);
  // A reader exporting and sizing while writers run: exports must never
  // crash and every chunk must be within bounds.
  std::thread reader([&] {
    while (!done.load()) {
      int64_t cursor = 0, rows = 0;
      while (cursor >= 0) {
        int64_t chunk = 0;
        cursor = table.Export(cursor, 97, [&](const K&, const char*) { ++chunk; });
        if (chunk > 97) Fail("export chunk larger than max_rows", seed);
        rows += chunk;
      }
      if (table.Size() < 0) Fail("negative size", seed);
    }
  });
  for (auto& t : ts) t.join();
  done.store(true);
  reader.join();
  // The table is now quiescent: export must see exactly Size() rows, and a
  // parallel find over everything exported must hit every key.
  std::vector<K> all;
  int64_t cursor = 0;
  while (cursor >= 0) cursor = table.Export(cursor, 1000, [&](const K& k, const char*) { all.push_back(k); });
  if (static_cast<int64_t>(all.size()) != table.Size())
    Fail(std::string(name) + ": export saw " + std::to_string(all.size()) + " rows, size " +
             std::to_string(table.Size()), seed);
  std::vector<typename tfde::KeyTraits<K>::View> views(all.begin(), all.end());
  std::atomic<int64_t> hits{0};
  table.Find(views.data(), static_cast<int64_t>(views.size()), ThreadsFor,
             [&](int64_t, const char*) { hits.fetch_add(1); }, [&](int64_t, uint64_t) {});
  if (hits.load() != table.Size()) Fail(std::string(name) + ": parallel find missed keys", seed);
  // Growth from empty with one big batch, in parallel.
  tfde::CuckooTable<K> big(8, 0);
  const int64_t n = 200000;
  std::vector<K> keys;
  for (int64_t i = 0; i < n; ++i) keys.push_back(MakeKey<K>(9, i));
  std::vector<typename tfde::KeyTraits<K>::View> bviews(keys.begin(), keys.end());
  big.Upsert(bviews.data(), n, ThreadsFor, [&](int64_t i, char* row, bool, uint64_t) {
    std::memcpy(row, &i, 8);
  });
  std::atomic<int64_t> ok{0};
  big.Find(bviews.data(), n, ThreadsFor, [&](int64_t i, const char* row) {
    int64_t v;
    std::memcpy(&v, row, 8);
    if (v == i) ok.fetch_add(1);
  }, [&](int64_t, uint64_t) {});
  if (ok.load() != n || big.Size() != n) Fail(std::string(name) + ": bulk insert lost rows", seed);
  big.Clear();
  if (big.Size() != 0) Fail("clear left rows", seed);
  std::printf("%s: %d threads x %lld ops ok, final size %lld\n", name, threads,
              static_cast<long long>(ops), static_cast<long long>(table.Size()));
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10)
                                 : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const int threads = argc > 2 ? std::atoi(argv[2]) : 4;
  const int64_t ops = argc > 3 ? std::atoll(argv[3]) : 3000;
  std::printf("stress_test seed %llu\n", static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  Run<int64_t>("int64 keys", seed, threads, ops);
  Run<std::string>("string keys", seed, threads, ops);
  std::printf("PASS\n");
  return 0;
}
