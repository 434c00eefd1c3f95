// Native ops of the Redis backend: every operation on a table's rows, on
// one client (resp_client.h: one retry policy, one error translation).
// TfdeRedisFind (rows and an exists mask, missing keys from an init spec or
// defaults), TfdeRedisInsert (upsert), TfdeRedisInsertGroup (a step's row
// and slot tables in transactions), TfdeRedisApply (the fused step's
// optimizer write: reads, rule and grouped insert in one op),
// TfdeRedisAccum (server-side addition, applied once per chunk),
// TfdeRedisRemove, TfdeRedisSize, TfdeRedisClear and TfdeRedisExport
// (HSCAN), used by tfde/tables/redis_table.py and by
// serving exports that keep reading Redis.  Thin: validates shapes, routes
// keys to buckets as redis_table.py lays them out, and pipelines the
// commands through resp_client.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../cuckoo/hash.h"
#include "../cuckoo/op_support.h"
#include "../cuckoo/rules.h"
#include "resp_client.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/logging.h"

namespace tfde {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelContext;
using ::tensorflow::TensorShape;
using ::tensorflow::tstring;

// The Redis field of a key: int keys as their little-endian bytes (8 for
// int64, 4 for int32), string keys as their bytes.
template <class TK>
std::string FieldOf(const TK& key) {
  if constexpr (std::is_same_v<TK, tstring>) {
    return std::string(key.data(), key.size());
  } else {
    std::string out(sizeof(TK), '\0');
    std::memcpy(out.data(), &key, sizeof(TK));
    return out;
  }
}

template <class TK>
uint64_t HashOf(const TK& key) {
  if constexpr (std::is_same_v<TK, tstring>) {
    return StableHash(std::string_view(key.data(), key.size()));
  } else {
    return StableHash(key);
  }
}

// Passwords registered by the process (tfde.RedisTableCreator, through
// tfde_redis_register_credentials at the end of this file) under an id, so
// they never appear in a graph: the ops name the id.  Serving processes give
// them in environment variables instead.
struct Credentials {
  std::string password, sentinel_password;
};
std::mutex credentials_mu;
std::map<std::string, Credentials>& CredentialsRegistry() {
  static auto* registry = new std::map<std::string, Credentials>();
  return *registry;
}

// Hints of Fail's messages; tfde/tables/redis_table.py says the same.
constexpr char kOutOfMemoryHint[] = "free memory on the server or raise its maxmemory, then run the step again";
constexpr char kCredentialsHint[] = "check redis_user and redis_password in the Redis config";

// The attrs of error handling (see TFDE_REDIS_ATTRS): error_kinds entries
// "CODE=kind" (tfde/errors.py REDIS_ERROR_KINDS), the table's meta key and
// what to do when it is gone.
::tensorflow::Status ReadErrorAttrs(OpKernelConstruction* ctx, resp::Config* config) {
  std::vector<std::string> kinds;
  TF_RETURN_IF_ERROR(ctx->GetAttr("error_kinds", &kinds));
  static const std::map<std::string, resp::ErrorKind> kByName = {{"transient", resp::ErrorKind::kTransient},
                                                                 {"refused", resp::ErrorKind::kRefused},
                                                                 {"capacity", resp::ErrorKind::kCapacity},
                                                                 {"credentials", resp::ErrorKind::kCredentials}};
  for (const std::string& entry : kinds) {
    const size_t eq = entry.find('=');
    auto it = eq == std::string::npos ? kByName.end() : kByName.find(entry.substr(eq + 1));
    if (it == kByName.end())
      return errors::InvalidArgument("error_kinds entries must be CODE=transient|refused|capacity|credentials, got '",
                                     entry, "'");
    config->error_kinds[entry.substr(0, eq)] = it->second;
  }
  TF_RETURN_IF_ERROR(ctx->GetAttr("table_name", &config->table_name));
  TF_RETURN_IF_ERROR(ctx->GetAttr("meta_key", &config->meta_key));
  TF_RETURN_IF_ERROR(ctx->GetAttr("meta", &config->meta_value));
  TF_RETURN_IF_ERROR(ctx->GetAttr("recreate_meta", &config->recreate_meta));
  if (config->recreate_meta && config->meta_value.empty())
    return errors::InvalidArgument("recreate_meta needs the meta value to write");
  // Straight to stderr, not TF's log: TF_CPP_MIN_LOG_LEVEL=2 (tfde's
  // command, many launchers) would hide a warning that rows were lost.
  config->on_recreate = [](const std::string& message) {
    std::fprintf(stderr, "tfde: warning: %s\n", message.c_str());
  };
  return ::absl::OkStatus();
}

// Attrs every Redis op shares: where the table lives and how to connect.
// The write count of a bucket: a Redis counter in its cluster slot
// ("tfde-writes:<bucket>" when the bucket name has a hash tag, else
// "tfde-writes:{<bucket>}"; tfde/tables/redis_table.py write_count_key says
// the same), named outside the table's own keys (a program that scans
// "<model tag>:*" for a table's hashes does not meet it), that every insert
// into the bucket increments in the same pipeline
// (in the same transaction for TfdeRedisInsertGroup).  The counter only
// grows, so a count at or below one this process has seen acknowledged
// means the server lost acknowledged writes: a failover promoted a replica
// that lagged, or the server came back from an older snapshot, or was
// flushed.  The highest count seen lives here, process-wide, per counter
// and RedisTable (the `writer` attr), so every kernel of a table (eager,
// each tf.function) checks the others' writes too, and a table created
// again under the same name starts afresh.
std::string BesideBucket(const char* kind, const std::string& bucket) {
  const size_t open = bucket.find('{');
  const size_t close = open == std::string::npos ? std::string::npos : bucket.find('}', open + 1);
  if (close != std::string::npos && close > open + 1) return std::string(kind) + ":" + bucket;
  return std::string(kind) + ":{" + bucket + "}";
}
std::string WriteCountKey(const std::string& bucket) { return BesideBucket("tfde-writes", bucket); }

// Steps a replay finds undone (docs/redis.md, "A step run again").  A
// training step's grouped write of bucket b stamps it for this process
// ("tfde-step:<run id>:<bucket>" = "<run id>:<step>"), in the transaction
// that writes the rows, and the process keeps the rows it overwrote
// (StepUndo).  The stamp is this process's own, so workers that write keys
// of one bucket (a shared store: each its own keys) keep apart, and it
// expires a day after its last write (kStepKeysTtlS).  A training read of
// step s finds a bucket stamped with step s of this run as it was before
// step s: the kept rows override what the bucket holds.  So a step that
// failed after writing some buckets, run again, reads what the first
// attempt read, computes the same rows and writes them again: it is applied
// once.  Other processes have other run ids: a stamp of another process
// never matches (and they do not hold this one's rows).
const std::string& RunId();
std::string StepKey(const std::string& bucket) { return BesideBucket(("tfde-step:" + RunId()).c_str(), bucket); }
constexpr int kStepKeysTtlS = 86400;  // a stamp outlives its step by a day at most
const std::string& RunId() {
  static const std::string id = [] {
    std::random_device source;
    char out[17];
    std::snprintf(out, sizeof(out), "%08x%08x", source(), source());
    return std::string(out);
  }();
  return id;
}
std::string StepStamp(int64_t step) { return RunId() + ":" + std::to_string(step); }

// The step input of TfdeRedisFind and TfdeRedisInsertGroup: a scalar int64,
// -1 outside training steps.
::absl::Status ReadStep(OpKernelContext* ctx, int index, int64_t* step) {
  const Tensor& t = ctx->input(index);
  if (t.dims() != 0 || t.dtype() != ::tensorflow::DT_INT64)
    return errors::InvalidArgument("step must be an int64 scalar, got ", DataTypeString(t.dtype()), " of shape ",
                                   t.shape().DebugString());
  *step = t.scalar<int64_t>()();
  if (*step < -1) return errors::InvalidArgument("step must be -1 (no training step) or >= 0, got ", *step);
  return ::absl::OkStatus();
}

class WriteCounts {
 public:
  // The highest count seen of the counter `at` names (server, database,
  // writer and key); 0 when none.
  static int64_t Get(const std::string& at) {
    std::lock_guard<std::mutex> lock(Mu());
    auto it = Seen().find(at);
    return it == Seen().end() ? 0 : it->second;
  }
  // Records a count: the higher of it and what is there, or, after a loss
  // (`lost`), the count itself, so that the loss is reported once.
  static void Put(const std::string& at, int64_t count, bool lost) {
    std::lock_guard<std::mutex> lock(Mu());
    int64_t& last = Seen()[at];
    last = lost ? count : std::max(last, count);
  }

 private:
  static std::mutex& Mu() {
    static std::mutex mu;
    return mu;
  }
  static std::map<std::string, int64_t>& Seen() {
    static std::map<std::string, int64_t> seen;
    return seen;
  }
};

// What this process's training reads of a step saw (TfdeRedisFind with a
// step), kept per table until its write of that step: the keys' fields, the
// rows and whether each was stored, and per bucket whether its stamp was
// this step's.  Those are the rows from before the step (in a stamped
// bucket, the rows StepUndo kept are read in their place), so the step's
// later reads of the table (the optimizer's read-modify-write of the rows
// the forward pass read) take them from here, and its write has StepUndo
// keep them, without asking the server again.  Only the latest read of a
// table is kept; a read or write takes it when it is of the same step and
// holds every key asked, else it asks the server.  Any other write of the
// table by this process forgets it (Forget, before and after the write),
// and a read that was under way meanwhile is not kept: Put keeps a read
// only if no Forget of its table (nor ForgetAll) came since the read began
// (Generation).  Another process writing the same keys within the step is
// not seen; in a job each key has one writer (docs/redis.md, "A step's
// rows, read once").
class StepReads {
 public:
  struct Read {
    int64_t step;
    std::vector<int8_t> again;  // per bucket: 1 stamped with this step, 0 not, -1 not asked (no key there)
    std::vector<std::string> fields;
    Tensor rows, exists;
    std::unordered_map<std::string_view, int64_t> where;  // field -> its row; views of `fields`
  };
  // Where the writes of table `at` (TableAt) stand: taken before a read
  // asks the server, and handed to Put with it.
  static std::pair<uint64_t, uint64_t> Generation(const std::string& at) {
    std::lock_guard<std::mutex> lock(Mu());
    return GenerationLocked(at);
  }
  // Keeps `read` of table `at`, begun at `generation`, unless the table was
  // written (Forget) since.  Indexes the read's fields first.
  static void Put(const std::string& at, std::pair<uint64_t, uint64_t> generation, std::shared_ptr<Read> read) {
    read->where.reserve(read->fields.size());
    for (size_t i = 0; i < read->fields.size(); ++i) read->where[read->fields[i]] = static_cast<int64_t>(i);
    std::lock_guard<std::mutex> lock(Mu());
    if (generation != GenerationLocked(at)) return;
    Kept()[at] = std::move(read);
  }
  // Forgets the read of `at`, whatever its step: the table is written
  // outside a step's write (called before and after that write).
  static void Forget(const std::string& at) {
    std::lock_guard<std::mutex> lock(Mu());
    ++Generations()[at];
    Kept().erase(at);
  }
  // Forgets every kept read: a table was opened (it may be one of the same
  // name made afresh) or written by another client of this process.
  static void ForgetAll() {
    std::lock_guard<std::mutex> lock(Mu());
    ++Epoch();
    Kept().clear();
  }
  // Step `step`'s kept read of table `at` if it holds rows of `dtype` and
  // `dim` in `buckets` buckets for every one of `fields`; (*from)[i] is then
  // the row of fields[i] in it.  Null otherwise.
  static std::shared_ptr<const Read> Holding(const std::string& at, int64_t step, DataType dtype, int64_t dim,
                                             size_t buckets, const std::vector<std::string>& fields,
                                             std::vector<int64_t>* from) {
    std::shared_ptr<const Read> read;
    {
      std::lock_guard<std::mutex> lock(Mu());
      auto it = Kept().find(at);
      if (it != Kept().end() && it->second->step == step) read = it->second;
    }
    if (read == nullptr || read->again.size() != buckets || read->rows.dtype() != dtype || read->rows.dims() != 2 ||
        read->rows.dim_size(1) != dim)
      return nullptr;
    from->resize(fields.size());
    for (size_t i = 0; i < fields.size(); ++i) {
      auto it = read->where.find(fields[i]);
      if (it == read->where.end()) return nullptr;
      (*from)[i] = it->second;
    }
    return read;
  }

 private:
  // Generation of `at`; Mu() held.
  static std::pair<uint64_t, uint64_t> GenerationLocked(const std::string& at) {
    auto it = Generations().find(at);
    return {Epoch(), it == Generations().end() ? 0 : it->second};
  }
  static std::mutex& Mu() {
    static std::mutex mu;
    return mu;
  }
  static std::map<std::string, std::shared_ptr<const Read>>& Kept() {
    static std::map<std::string, std::shared_ptr<const Read>> kept;
    return kept;
  }
  static std::map<std::string, uint64_t>& Generations() {
    static std::map<std::string, uint64_t> generations;
    return generations;
  }
  static uint64_t& Epoch() {
    static uint64_t epoch = 0;
    return epoch;
  }
};

// The rows a training step's writes overwrote, kept in this process per
// bucket (TableAt of the bucket) for the latest step that wrote it: field ->
// the row before the step, "" for a key that was not stored.  A write of
// step s keeps them before it sends anything (its transaction may apply
// with its reply lost); a read of step s takes them for the keys of a
// bucket stamped with step s (StepKey).  A bucket written again by the
// same step (its replay after a failure; its stamp is that step's) keeps
// the rows of the first attempt, which are the ones from before the step;
// a write of a bucket not stamped with its step starts afresh.  Memory: the
// rows of one step's write per bucket.
class StepUndo {
 public:
  // Keeps `old[j]`, the row before step `step` of key `fields[at[j]]`
  // (moved from).  Rows kept for an earlier step go; of this step, a key's
  // kept row stands (an earlier attempt kept the row from before the step).
  // `stamped`: an attempt of this step wrote the bucket; then its rows must
  // be kept already, and false is returned if they are not.
  static bool Keep(const std::string& bucket, int64_t step, bool stamped, const std::vector<std::string>& fields,
                   const std::vector<int64_t>& at, std::vector<std::string>* old) {
    std::lock_guard<std::mutex> lock(Mu());
    Rows& kept = Kept()[bucket];
    if (kept.step != step) {
      if (stamped) return false;
      kept.step = step;
      kept.old.clear();
    }
    for (size_t j = 0; j < at.size(); ++j) kept.old.try_emplace(fields[at[j]], std::move((*old)[j]));
    return true;
  }
  // Calls take(j, row) for each key fields[at[j]] with a row kept for step
  // `step` (the row, "" if the key was not stored); false if nothing is kept
  // for that step.
  template <class Take>
  static bool Restore(const std::string& bucket, int64_t step, const std::vector<std::string>& fields,
                      const std::vector<int64_t>& at, Take take) {
    std::lock_guard<std::mutex> lock(Mu());
    auto it = Kept().find(bucket);
    if (it == Kept().end() || it->second.step != step) return false;
    for (size_t j = 0; j < at.size(); ++j) {
      auto row = it->second.old.find(fields[at[j]]);
      if (row != it->second.old.end()) take(j, row->second);
    }
    return true;
  }

 private:
  struct Rows {
    int64_t step = -1;
    std::unordered_map<std::string, std::string> old;
  };
  static std::mutex& Mu() {
    static std::mutex mu;
    return mu;
  }
  static std::map<std::string, Rows>& Kept() {
    static std::map<std::string, Rows> kept;
    return kept;
  }
};

class RedisOpBase : public OpKernel {
 public:
  explicit RedisOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tvalue", &value_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("buckets", &buckets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
    int64_t chunk;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk", &chunk));
    OP_REQUIRES(ctx, dim_ >= 1 && dim_ <= kMaxDim,
                errors::InvalidArgument("dim must be between 1 and ", kMaxDim, ", got ", dim_));
    OP_REQUIRES(ctx, !buckets_.empty(), errors::InvalidArgument("a Redis table needs at least one bucket"));
    OP_REQUIRES(ctx, chunk >= 1, errors::InvalidArgument("chunk must be >= 1 keys, got ", chunk));
    chunk_ = static_cast<size_t>(chunk);
    resp::Config config;
    std::vector<std::string> servers;
    std::string password_env, sentinel_password_env, credentials;
    int64_t mode, db, connect_ms, socket_ms, deadline_ms;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("servers", &servers));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mode", &mode));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("master_name", &config.master_name));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("db", &db));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("user", &config.user));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("password_env", &password_env));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sentinel_user", &config.sentinel_user));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sentinel_password_env", &sentinel_password_env));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("credentials", &credentials));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("connect_timeout_ms", &connect_ms));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("socket_timeout_ms", &socket_ms));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("retry_deadline_ms", &deadline_ms));
    OP_REQUIRES(ctx, deadline_ms >= 0 && deadline_ms <= std::numeric_limits<int>::max(),
                errors::InvalidArgument("retry_deadline_ms must be 0 to ", std::numeric_limits<int>::max(),
                                        " milliseconds, got ", deadline_ms));
    OP_REQUIRES(ctx, mode >= 0 && mode <= 2,
                errors::InvalidArgument("mode must be 0 (cluster), 1 (sentinel) or 2 (standalone), got ", mode));
    OP_REQUIRES(ctx, !servers.empty(), errors::InvalidArgument("servers must name at least one host:port"));
    for (const std::string& s : servers) {
      const size_t colon = s.rfind(':');
      int port = 0;
      OP_REQUIRES(
          ctx, colon != std::string::npos && colon > 0 && (port = std::atoi(s.c_str() + colon + 1)) > 0 && port < 65536,
          errors::InvalidArgument("servers entries must be host:port, got '", s, "'"));
      config.servers.emplace_back(s.substr(0, colon), port);
    }
    if (!credentials.empty()) {
      std::lock_guard<std::mutex> lock(credentials_mu);
      auto it = CredentialsRegistry().find(credentials);
      OP_REQUIRES(ctx, it != CredentialsRegistry().end(),
                  errors::FailedPrecondition("no Redis credentials registered as '", credentials,
                                             "' in this process (the table was created in another process?)"));
      config.password = it->second.password;
      config.sentinel_password = it->second.sentinel_password;
    }
    if (!password_env.empty() && std::getenv(password_env.c_str()) != nullptr)
      config.password = std::getenv(password_env.c_str());
    if (!sentinel_password_env.empty() && std::getenv(sentinel_password_env.c_str()) != nullptr)
      config.sentinel_password = std::getenv(sentinel_password_env.c_str());
    config.mode = static_cast<int>(mode);
    config.db = static_cast<int>(db);
    config.connect_timeout_ms = static_cast<int>(connect_ms);
    config.socket_timeout_ms = static_cast<int>(socket_ms);
    config.retry_deadline_ms = static_cast<int>(deadline_ms);
    int64_t wait_replicas, wait_timeout_ms;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("write_replicas", &wait_replicas));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("write_replicas_timeout_ms", &wait_timeout_ms));
    OP_REQUIRES(
        ctx,
        wait_replicas >= 0 && wait_replicas <= 1000 && wait_timeout_ms >= 1 &&
            wait_timeout_ms <= std::numeric_limits<int>::max(),
        errors::InvalidArgument("write_replicas must be 0 to 1000 and write_replicas_timeout_ms at least 1, got ",
                                wait_replicas, " and ", wait_timeout_ms));
    config.wait_replicas = static_cast<int>(wait_replicas);
    config.wait_timeout_ms = static_cast<int>(wait_timeout_ms);
    OP_REQUIRES_OK(ctx, ReadErrorAttrs(ctx, &config));
    if (ctx->HasAttr("read_from_replicas"))  // TfdeRedisFind's: the only op that may read a replica
      OP_REQUIRES_OK(ctx, ctx->GetAttr("read_from_replicas", &config.read_from_replicas));
    check_counts_ = !config.recreate_meta;  // recreate_if_missing accepts that rows (and counts) start afresh
    OP_REQUIRES_OK(ctx, ctx->GetAttr("writer", &writer_));
    client_ = std::make_unique<resp::Client>(std::move(config));
    for (const std::string& bucket : buckets_) {
      step_keys_.push_back(StepKey(bucket));
      count_keys_.push_back(WriteCountKey(bucket));
      // In a cluster a bucket's count must share its slot (a bucket named
      // "a{}b{c}" hashes whole, its count would hash "c").
      OP_REQUIRES(ctx, mode != 0 || resp::KeySlot(count_keys_.back()) == resp::KeySlot(bucket),
                  errors::InvalidArgument("the write count of bucket '", bucket,
                                          "' would lie in another cluster slot than the bucket; give the bucket a "
                                          "hash tag ({...}) in redis_hash_tags_runtime"));
    }
  }

 protected:
  // A batch's keys: their stable hashes, their Redis fields, and their
  // positions grouped by bucket (the low half of the hash, multiply-shift,
  // as tfde/tables/redis_table.py lays them out), in batch order.
  struct Routed {
    std::vector<uint64_t> hashes;
    std::vector<std::string> fields;
    std::vector<std::vector<int64_t>> by_bucket;
  };
  template <class TK>
  Routed Route(const Tensor& keys) const {
    auto flat = keys.flat<TK>();
    const int64_t n = keys.dim_size(0);
    const uint64_t nb = buckets_.size();
    Routed r{std::vector<uint64_t>(n), std::vector<std::string>(n), std::vector<std::vector<int64_t>>(nb)};
    for (int64_t i = 0; i < n; ++i) {
      r.hashes[i] = HashOf<TK>(flat(i));
      r.fields[i] = FieldOf<TK>(flat(i));
      r.by_bucket[RedisBucketOf(r.hashes[i], nb)].push_back(i);
    }
    return r;
  }

  // Fails ctx with an error naming the servers, the operation and the table,
  // under the TF code of the tfde error class it stands for and with the
  // text that class carries eagerly, after its name (tfde/errors.py:
  // graph_message / from_op_error).  The texts are those of
  // RedisTable._call's errors (tfde/tables/redis_table.py), so the redis-py
  // path and the native one say the same thing.
  void Fail(OpKernelContext* ctx, const char* op, const std::exception& e) const {
    const auto* redis_error = dynamic_cast<const resp::Error*>(&e);
    const std::string at = "Redis at " + client_->Servers();
    const std::string during = std::string(op) + " of table '" + table_name_ + "'";
    if (redis_error == nullptr) {
      if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
        ctx->CtxFailure(errors::ResourceExhausted("tfde.CapacityError: this process ran out of memory during ", during,
                                                  " (", e.what(), "); use smaller batches"));
      } else {  // a row of another size (std::length_error): the table holds other data
        ctx->CtxFailure(errors::InvalidArgument("tfde.ShapeError: ", during, ": ", e.what()));
      }
      return;
    }
    switch (redis_error->kind()) {
      case resp::ErrorKind::kTransient:
        ctx->CtxFailure(errors::Unavailable("tfde.BackendUnavailableError: ", at, " unreachable during ", during,
                                            " after ", redis_error->attempts(), " attempts in ",
                                            redis_error->waited_ms(), " ms of retries (redis_retry_deadline_ms ",
                                            client_->retry_deadline_ms(), "): ", e.what()));
        break;
      case resp::ErrorKind::kCapacity:
        ctx->CtxFailure(errors::ResourceExhausted("tfde.CapacityError: ", at, " is out of memory during ", during, ": ",
                                                  e.what(), "; ", kOutOfMemoryHint));
        break;
      case resp::ErrorKind::kCredentials:
        ctx->CtxFailure(errors::FailedPrecondition("tfde.CredentialsError: ", at, " refused the credentials during ",
                                                   during, ": ", e.what(), "; ", kCredentialsHint));
        break;
      case resp::ErrorKind::kTableLost:
        ctx->CtxFailure(errors::FailedPrecondition("tfde.BackendError: ", e.what()));
        break;
      case resp::ErrorKind::kRefused:
        ctx->CtxFailure(errors::FailedPrecondition("tfde.BackendError: ", at, " refused ", during, ": ", e.what()));
        break;
    }
  }

  std::string Describe() const {
    return "Redis table '" + table_name_ + "' " + DataTypeString(value_dtype_) + "[" + std::to_string(dim_) + "] on " +
           client_->Describe();
  }

  int64_t dim_ = 0;
  DataType value_dtype_ = ::tensorflow::DT_INVALID;
  std::vector<std::string> buckets_;  // full Redis key of each bucket, in bucket order
  std::string table_name_;
  size_t chunk_ = 1024;  // keys per command (keys_sending_size)
  std::unique_ptr<resp::Client> client_;
  std::vector<std::string> count_keys_;  // WriteCountKey of each bucket
  std::vector<std::string> step_keys_;   // StepKey of each bucket
  bool check_counts_ = true;
  std::string writer_;  // the writer attr: whose acknowledged counts WriteCounts compares with

  // The write counts of one call (see WriteCounts): Before() snapshots what
  // this table saw acknowledged before the call sends anything; Got() keeps
  // each INCR reply (a retry's replaces the first: the last delivery
  // counts); Check(), once the call succeeded, returns "" or why a count at
  // or below its snapshot means lost writes.  Only the replies of a call
  // that succeeded are recorded, and each count is compared with what was
  // acknowledged before it was sent, so neither a retry that meets the same
  // count again on a new master nor another thread's concurrent writes read
  // as a loss.
  class Counts {
   public:
    explicit Counts(const RedisOpBase* op) : op_(op) {}
    void Before(const std::string& counter, const std::string& table) {
      if (seen_.count(counter) != 0) return;
      seen_[counter] = {WriteCounts::Get(op_->CountAt(counter)), -1, table};
    }
    void Got(const std::string& counter, const resp::Reply& r) {
      if (r.type != resp::Reply::kInteger)
        throw resp::Error("a malformed INCR reply for the write count " + counter, true);
      seen_.at(counter).got = r.integer;
    }
    std::string Check() const {
      std::string why;
      for (const auto& [counter, c] : seen_) {
        if (c.got < 0) continue;
        const bool lost = op_->check_counts_ && c.got <= c.before;
        WriteCounts::Put(op_->CountAt(counter), c.got, lost);
        if (!lost || !why.empty()) continue;
        why = "Redis at " + op_->client_->Servers() + " lost acknowledged writes of table '" + c.table +
              "': its write count " + counter + " is " + std::to_string(c.got) + " after this table saw " +
              std::to_string(c.before) + " acknowledged, so at least " + std::to_string(c.before - c.got + 1) +
              " writes are gone (a failover promoted a replica that lagged behind the master, or the server "
              "restarted from an older snapshot or was flushed) and training would go on from stale rows; restore "
              "the tables from a checkpoint, and set \"redis_write_replicas\" in the Redis config so that writes "
              "wait for replicas";
      }
      return why;
    }

   private:
    struct Count {
      int64_t before, got;
      std::string table;
    };
    const RedisOpBase* op_;
    std::map<std::string, Count> seen_;
  };

  // Forgets the tables' kept reads (StepReads) when made and again when
  // gone: held around every write of the tables.
  class Forgetting {
   public:
    explicit Forgetting(std::vector<std::string> tables) : tables_(std::move(tables)) {
      for (const std::string& at : tables_) StepReads::Forget(at);
    }
    ~Forgetting() {
      for (const std::string& at : tables_) StepReads::Forget(at);
    }
    Forgetting(const Forgetting&) = delete;
    Forgetting& operator=(const Forgetting&) = delete;

   private:
    std::vector<std::string> tables_;
  };

  // Why a bucket stamped with a step of this process cannot be read or
  // written as it was before that step.
  static std::string NothingKept(const std::string& bucket, int64_t step) {
    return "bucket " + bucket + " is stamped with step " + std::to_string(step) +
           " of this process, but the process kept no rows of it from before that step";
  }

  // Where StepReads keeps the reads of the table whose first bucket is
  // `bucket`: the servers and database too (two databases of a server may
  // hold tables of one name).
  std::string TableAt(const std::string& bucket) const {
    return client_->Servers() + " db " + std::to_string(client_->db()) + " " + bucket;
  }

  // Where WriteCounts keeps `counter`: keyed by the database too (two
  // databases of a server may hold tables of one name) and by the writer
  // (the RedisTable whose kernels these are).
  std::string CountAt(const std::string& counter) const {
    return client_->Servers() + " db " + std::to_string(client_->db()) + " " + writer_ + " " + counter;
  }
};

template <class TK>
class RedisFindOp : public RedisOpBase {
 public:
  explicit RedisFindOp(OpKernelConstruction* ctx) : RedisOpBase(ctx) {
    OP_REQUIRES_OK(ctx, ReadInitSpec(ctx, &missing_.spec));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    OP_REQUIRES(ctx, keys.dims() == 1,
                errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
    const int64_t n = keys.dim_size(0);
    MissingRows missing = missing_;
    OP_REQUIRES_OK(ctx, missing.Prepare(ctx->input(1), n, dim_, Describe()));
    Tensor* values = nullptr;
    Tensor* exists = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &exists));
    if (n == 0) return;
    int64_t step;
    OP_REQUIRES_OK(ctx, ReadStep(ctx, 2, &step));
    Routed keyed = Route<TK>(keys);  // its fields go to StepReads at the end
    if (step >= 0 && FromStepReads(ctx, keyed, step, missing, values, exists)) return;
    const auto generation = StepReads::Generation(TableAt(buckets_[0]));  // before the server is asked
    // One HMGET per (bucket, chunk of keys); positions[c] = the keys of
    // command c.  A training step's read (step >= 0) also asks each bucket's
    // step stamp (bucket_of[c] says whose; -1 for an HMGET).
    std::vector<resp::Command> commands;
    std::vector<std::vector<int64_t>> positions;
    std::vector<int64_t> bucket_of;
    for (size_t b = 0; b < keyed.by_bucket.size(); ++b) {
      if (step >= 0 && !keyed.by_bucket[b].empty()) {
        commands.push_back(resp::Command{step_keys_[b], {"GET", step_keys_[b]}});
        positions.emplace_back();
        bucket_of.push_back(static_cast<int64_t>(b));
      }
      for (size_t s = 0; s < keyed.by_bucket[b].size(); s += chunk_) {
        resp::Command c{buckets_[b], {"HMGET", buckets_[b]}};
        positions.emplace_back(keyed.by_bucket[b].begin() + s,
                               keyed.by_bucket[b].begin() + std::min(s + chunk_, keyed.by_bucket[b].size()));
        for (int64_t i : positions.back()) c.args.push_back(keyed.fields[i]);
        commands.push_back(std::move(c));
        bucket_of.push_back(-1);
      }
    }
    const std::string stamp = step >= 0 ? StepStamp(step) : "";
    std::vector<bool> undone(keyed.by_bucket.size(), false);  // stamped with this step: StepUndo has its rows
    char* out = const_cast<char*>(values->tensor_data().data());
    bool* ex = exists->flat<bool>().data();
    OP_REQUIRES_OK(
        ctx, WithValueType(value_dtype_, [&](auto v) {
          using V = decltype(v);
          const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(V);
          // Key i's row `value` (null: not stored), read from `where`.
          auto put = [&](int64_t i, const std::string* value, std::string_view where) {
            if (value == nullptr) {
              missing.template Fill<V>(i, keyed.hashes[i], dim_, out + i * row_bytes);
              ex[i] = false;
              return;
            }
            if (value->size() != row_bytes)
              throw std::length_error("a row in " + std::string(where) + " has " + std::to_string(value->size()) +
                                      " bytes, expected " + std::to_string(row_bytes) + " for " + Describe() +
                                      ": the table holds another dim or dtype");
            std::memcpy(out + i * row_bytes, value->data(), row_bytes);
            ex[i] = true;
          };
          try {
            client_->Pipeline(commands, [&](size_t c, const resp::Reply& r) {
              if (bucket_of[c] >= 0) {
                undone[bucket_of[c]] = r.type == resp::Reply::kBulk && r.str == stamp;
                return;
              }
              if (r.type != resp::Reply::kArray || r.elements.size() != positions[c].size())
                throw resp::Error("a malformed HMGET reply for " + std::string(commands[c].key), true);
              for (size_t j = 0; j < positions[c].size(); ++j) {
                const resp::Reply& value = r.elements[j];
                put(positions[c][j], value.type == resp::Reply::kBulk ? &value.str : nullptr, commands[c].key);
              }
            });
            // Rare: the buckets a failed attempt of this step wrote read
            // as they were before it, from the rows this process kept.
            for (size_t b = 0; b < undone.size(); ++b) {
              const std::vector<int64_t>& at = keyed.by_bucket[b];
              if (undone[b] && !StepUndo::Restore(TableAt(buckets_[b]), step, keyed.fields, at,
                                                  [&](size_t j, const std::string& row) {
                                                    put(at[j], row.empty() ? nullptr : &row, buckets_[b]);
                                                  }))
                throw resp::Error(NothingKept(buckets_[b], step), resp::ErrorKind::kRefused);
            }
          } catch (const std::exception& e) {
            Fail(ctx, "find", e);
          }
        }));
    if (!ctx->status().ok() || step < 0) return;
    auto read = std::make_shared<StepReads::Read>();
    read->step = step;
    for (size_t b = 0; b < undone.size(); ++b)
      read->again.push_back(keyed.by_bucket[b].empty() ? -1 : static_cast<int8_t>(undone[b]));
    read->fields = std::move(keyed.fields);  // the commands holding views of them are done
    read->rows = *values;
    read->exists = *exists;
    StepReads::Put(TableAt(buckets_[0]), generation, std::move(read));
  }

 private:
  // Fills `values` and `exists` from this step's kept read of the table
  // (StepReads) if it holds every key; returns whether it did.  A key the
  // read did not find gets this op's missing row (the forward pass may read
  // zeros where the optimizer's read needs the initializer).
  bool FromStepReads(OpKernelContext* ctx, const Routed& keyed, int64_t step, const MissingRows& missing,
                     Tensor* values, Tensor* exists) const {
    std::vector<int64_t> from;
    const std::shared_ptr<const StepReads::Read> read =
        StepReads::Holding(TableAt(buckets_[0]), step, value_dtype_, dim_, buckets_.size(), keyed.fields, &from);
    if (read == nullptr) return false;
    const int64_t n = static_cast<int64_t>(keyed.fields.size());
    const bool* stored = read->exists.flat<bool>().data();
    bool* ex = exists->flat<bool>().data();
    ctx->SetStatus(WithValueType(value_dtype_, [&](auto v) {
      using V = decltype(v);
      const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(V);
      const char* rows = read->rows.tensor_data().data();
      char* out = const_cast<char*>(values->tensor_data().data());
      for (int64_t i = 0; i < n; ++i) {
        ex[i] = stored[from[i]];
        if (ex[i])
          std::memcpy(out + i * row_bytes, rows + from[i] * row_bytes, row_bytes);
        else
          missing.template Fill<V>(i, keyed.hashes[i], dim_, out + i * row_bytes);
      }
    }));
    return true;
  }

  MissingRows missing_;
};

template <class TK>
class RedisInsertOp : public RedisOpBase {
 public:
  using RedisOpBase::RedisOpBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    const Tensor& values = ctx->input(1);
    OP_REQUIRES(ctx, keys.dims() == 1,
                errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
    const int64_t n = keys.dim_size(0);
    OP_REQUIRES(ctx, values.dims() == 2 && values.dim_size(0) == n && values.dim_size(1) == dim_,
                errors::InvalidArgument("values must have shape [", n, ", ", dim_, "] for ", n, " keys and a ",
                                        Describe(), ", got ", values.shape().DebugString()));
    Tensor* written = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &written));
    written->scalar<int64_t>()() = n;
    if (n == 0) return;
    const Routed keyed = Route<TK>(keys);
    const Forgetting forgetting({TableAt(buckets_[0])});
    const size_t row_bytes = static_cast<size_t>(dim_) * ::tensorflow::DataTypeSize(value_dtype_);
    const char* rows = values.tensor_data().data();
    // One HSET per (bucket, chunk of keys), field value pairs in batch order:
    // a key given twice keeps its last row, as in every table.
    std::vector<resp::Command> commands;
    for (size_t b = 0; b < keyed.by_bucket.size(); ++b) {
      for (size_t s = 0; s < keyed.by_bucket[b].size(); s += chunk_) {
        resp::Command c{buckets_[b], {"HSET", buckets_[b]}};
        for (size_t k = s; k < std::min(s + chunk_, keyed.by_bucket[b].size()); ++k) {
          const int64_t i = keyed.by_bucket[b][k];
          c.args.push_back(keyed.fields[i]);
          c.args.emplace_back(rows + i * row_bytes, row_bytes);
        }
        commands.push_back(std::move(c));
      }
      // After the bucket's HSETs on the same connection: counted once applied.
      if (!keyed.by_bucket[b].empty()) commands.push_back(resp::Command{count_keys_[b], {"INCR", count_keys_[b]}});
    }
    Counts counts(this);
    for (const resp::Command& c : commands)
      if (c.args[0] == "INCR") counts.Before(std::string(c.args[1]), table_name_);
    try {
      client_->Write(commands, [&](size_t c, const resp::Reply& r) {
        if (commands[c].args[0] == "INCR") counts.Got(std::string(commands[c].args[1]), r);
      });
    } catch (const std::exception& e) {
      Fail(ctx, "insert", e);
      return;
    }
    const std::string lost = counts.Check();
    if (!lost.empty()) Fail(ctx, "insert", resp::Error(lost, resp::ErrorKind::kTableLost));
  }
};

// SetIsDistributedCommunication: a Redis op talks to a server over the
// network; without it, TF's executor turns its UNAVAILABLE into INTERNAL in
// graphs.
#define TFDE_REDIS_ATTRS                               \
  Attr("Tkey: {int32, int64, string}")                 \
      .Attr("Tvalue: {float, double, half, bfloat16}") \
      .Attr("dim: int")                                \
      .Attr("buckets: list(string)")                   \
      .Attr("table_name: string = ''")                 \
      .Attr("chunk: int = 1024")                       \
      .Attr("mode: int")                               \
      .Attr("servers: list(string)")                   \
      .Attr("master_name: string = ''")                \
      .Attr("db: int = 0")                             \
      .Attr("user: string = ''")                       \
      .Attr("credentials: string = ''")                \
      .Attr("password_env: string = ''")               \
      .Attr("sentinel_user: string = ''")              \
      .Attr("sentinel_password_env: string = ''")      \
      .Attr("connect_timeout_ms: int = 1000")          \
      .Attr("socket_timeout_ms: int = 1000")           \
      .Attr("retry_deadline_ms: int = 60000")          \
      .Attr("write_replicas: int = 0")                 \
      .Attr("write_replicas_timeout_ms: int = 1000")   \
      .Attr("error_kinds: list(string) = []")          \
      .Attr("meta_key: string = ''")                   \
      .Attr("meta: string = ''")                       \
      .Attr("recreate_meta: bool = false")             \
      .Attr("writer: string = ''")                     \
      .SetIsDistributedCommunication()

REGISTER_OP("TfdeRedisInsert")
    .Input("keys: Tkey")
    .Input("values: Tvalue")
    .Output("written: int64")
    .TFDE_REDIS_ATTRS.SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeRedisFind")
    .Input("keys: Tkey")
    .Input("defaults: Tvalue")
    .Input("step: int64")
    .Output("values: Tvalue")
    .Output("exists: bool")
    .TFDE_REDIS_ATTRS.Attr("init_kind: {'defaults', 'constant', 'uniform', 'normal', 'truncated_normal'} = 'defaults'")
    .Attr("init_p0: float = 0.0")
    .Attr("init_p1: float = 0.0")
    .Attr("init_seed: int = 0")
    .Attr("read_from_replicas: bool = false")
    .SetIsStateful()  // reads a store that changes under it
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      TF_RETURN_IF_ERROR(CheckDimAttr(dim));  // a negative dim would abort in Matrix()
      ::tensorflow::shape_inference::ShapeHandle keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &keys));
      c->set_output(0, c->Matrix(c->Dim(keys, 0), dim));
      c->set_output(1, c->Vector(c->Dim(keys, 0)));
      return ::absl::OkStatus();
    });

#define TFDE_REGISTER_REDIS(TK)                                                                                \
  REGISTER_KERNEL_BUILDER(Name("TfdeRedisFind").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"),   \
                          RedisFindOp<TK>);                                                                    \
  REGISTER_KERNEL_BUILDER(Name("TfdeRedisInsert").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          RedisInsertOp<TK>)
TFDE_REGISTER_REDIS(int32_t);
TFDE_REGISTER_REDIS(int64_t);
TFDE_REGISTER_REDIS(tstring);

// ------------------------------------------------------------ grouped insert
// TfdeRedisInsertGroup: a training step's writes of its keys to several
// tables of one RedisTableCreator (a Variable's row table, its optimizer
// slots, its policy state), all-or-nothing per key: a failed step must not
// leave a key's row without its slots.  The tables share storage_slice and
// hash tags, so a key falls in bucket b of every table and bucket b of every
// table lies in one cluster slot (tfde/tables/redis_table.py's layout).  The
// writes go out as MULTI, HSET ..., EXEC transactions: on a cluster one per
// bucket (a transaction may not span slots), on a single server (standalone
// or the sentinels' master) one for the whole call, so a failed call there
// writes nothing at all.  Each HSET holds one table's rows of at most `chunk`
// keys of that bucket.  A training step's write (step >= 0) needs the
// buckets' step stamps and the rows it overwrites: it takes them from the
// step's own read of each table (StepReads), or reads them in one pipeline
// where that read missed a key; StepUndo keeps those rows in this process,
// and the transaction also stamps the buckets (StepKey).
//
// Failures: a connection lost before EXEC makes the server discard the
// transaction; one lost after it leaves it applied; either way the client's
// retry sends it again, and a transaction of absolute values applied twice
// equals once.  A command refused at queue time (OOM, a wrong argument)
// aborts the transaction (EXECABORT): nothing of it is applied, and the op
// fails.  An error inside the EXEC reply (a command that failed while the
// transaction ran, e.g. WRONGTYPE when a bucket key holds a string) means the
// rest of that transaction was applied: the op fails naming the table and
// bucket.
template <class TK>
class RedisInsertGroupOp : public RedisOpBase {
 public:
  explicit RedisInsertGroupOp(OpKernelConstruction* ctx) : RedisOpBase(ctx) {
    if (!ctx->status().ok()) return;
    int64_t mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mode", &mode));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tothers", &other_dtypes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("other_dims", &other_dims_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("other_buckets", &other_buckets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("other_names", &other_names_));
    const size_t k = other_dtypes_.size(), nb = buckets_.size();
    OP_REQUIRES(ctx, other_dims_.size() == k && other_names_.size() == k && other_buckets_.size() == k * nb,
                errors::InvalidArgument("TfdeRedisInsertGroup of ", Describe(), " with ", k,
                                        " other tables needs one dim and one name per table and ", nb,
                                        " buckets per table; got ", other_dims_.size(), " dims, ", other_names_.size(),
                                        " names and ", other_buckets_.size(), " buckets"));
    for (size_t t = 0; t < k; ++t) {
      OP_REQUIRES(ctx, other_dims_[t] >= 1 && other_dims_[t] <= kMaxDim,
                  errors::InvalidArgument("dim of table '", other_names_[t], "' must be between 1 and ", kMaxDim,
                                          ", got ", other_dims_[t]));
      // A transaction may only touch keys of one cluster slot: bucket b of
      // every table must share the slot of this table's bucket b.
      for (size_t b = 0; mode == 0 && b < nb; ++b) {
        const std::string& other = other_buckets_[t * nb + b];
        OP_REQUIRES(
            ctx, resp::KeySlot(other) == resp::KeySlot(buckets_[b]),
            errors::InvalidArgument("bucket ", b, " of table '", other_names_[t], "' (", other, ") is in cluster slot ",
                                    resp::KeySlot(other), " but bucket ", b, " of table '", table_name_, "' (",
                                    buckets_[b], ") is in slot ", resp::KeySlot(buckets_[b]),
                                    "; tables written together must share their hash tags"));
      }
    }
    per_bucket_ = mode == 0;
    for (const std::string& bucket : other_buckets_) {
      other_count_keys_.push_back(WriteCountKey(bucket));
      other_step_keys_.push_back(StepKey(bucket));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    OP_REQUIRES(ctx, keys.dims() == 1,
                errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
    const int64_t n = keys.dim_size(0);
    ::tensorflow::OpInputList others;
    OP_REQUIRES_OK(ctx, ctx->input_list("others", &others));
    const size_t tables = 1 + static_cast<size_t>(others.size());
    OP_REQUIRES(ctx, tables == 1 + other_dims_.size(),
                errors::InvalidArgument("got ", others.size(), " tensors of other rows for ", other_dims_.size(),
                                        " other tables"));
    // Every shape is checked before anything is read or sent.
    std::vector<const char*> rows(tables);
    std::vector<size_t> row_bytes(tables);
    for (size_t t = 0; t < tables; ++t) {
      const Tensor& v = t == 0 ? ctx->input(1) : others[static_cast<int>(t - 1)];
      const int64_t dim = t == 0 ? dim_ : other_dims_[t - 1];
      OP_REQUIRES(ctx, v.dims() == 2 && v.dim_size(0) == n && v.dim_size(1) == dim,
                  errors::InvalidArgument("rows for table '", TableName(t), "' must have shape [", n, ", ", dim,
                                          "] for ", n, " keys and a ", DataTypeString(v.dtype()), "[", dim,
                                          "] table, got ", v.shape().DebugString()));
      rows[t] = v.tensor_data().data();
      row_bytes[t] = static_cast<size_t>(dim) * ::tensorflow::DataTypeSize(v.dtype());
    }
    int64_t step;
    OP_REQUIRES_OK(ctx, ReadStep(ctx, 2 + others.size(), &step));
    Tensor* written = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &written));
    written->scalar<int64_t>()() = n;
    if (n == 0) return;
    WriteGroup(ctx, Route<TK>(keys), rows, row_bytes, step, nullptr);
  }

 protected:
  // Computes the rows a training step writes (TfdeRedisApply) from `old`:
  // per (table, bucket) at t * nb + b, each key's row before the step in
  // keyed.by_bucket[b]'s order ("" for an absent key); it fills the buffers
  // WriteGroup's `rows` point to.  Throws to fail the write (nothing sent).
  using Update = std::function<void(const std::vector<std::vector<std::string>>& old)>;

  // The write of Compute for the keys of `keyed`: rows[t] + i * row_bytes[t]
  // is table t's row of key i.  With `update` (step >= 0) the rows are
  // computed by it once the rows before the step are known.
  void WriteGroup(OpKernelContext* ctx, const Routed& keyed, const std::vector<const char*>& rows,
                  const std::vector<size_t>& row_bytes, int64_t step, const Update& update) {
    const size_t tables = rows.size();
    const size_t nb = buckets_.size();
    const std::string what = "grouped insert into " + std::to_string(tables) + " tables";
    // A training step's write (step >= 0) stamps its buckets and keeps the
    // rows it overwrites in this process (StepKey and StepUndo say why):
    // first each (table, bucket)'s stamp and the rows the step overwrites,
    // at t * nb + b: whether an earlier attempt of this step stamped the
    // bucket, and the rows before the step in by_bucket[b]'s order ("" for
    // an absent key).  They come from this step's reads of the tables
    // (StepReads) where those hold every key; the other tables are read
    // here, in one round trip.  StepUndo keeps the rows before the
    // transaction is sent.
    const std::string stamp = step >= 0 ? StepStamp(step) : "";
    const std::string ttl = std::to_string(kStepKeysTtlS);
    std::vector<std::vector<std::string>> old(tables * nb);
    std::vector<char> again(tables * nb, 0);
    std::vector<char> unread(tables, step >= 0 ? 1 : 0);
    for (size_t t = 0; step >= 0 && t < tables; ++t)
      unread[t] = !FromStepReads(keyed, t, step, row_bytes[t], &old, &again);
    // From here the tables' kept reads are forgotten, and again when the
    // write is done (it may apply in part and fail).
    std::vector<std::string> kept_at;
    for (size_t t = 0; t < tables; ++t) kept_at.push_back(TableAt(BucketOf(t, 0)));
    const Forgetting forgetting(std::move(kept_at));
    if (std::find(unread.begin(), unread.end(), 1) != unread.end()) {
      try {
        ReadBeforeStep(keyed, unread, stamp, &old, &again);
      } catch (const std::exception& e) {
        Fail(ctx, what.c_str(), e);  // nothing was written
        return;
      }
    }
    if (update) {
      try {
        // A bucket an earlier attempt of this step wrote (its stamp is this
        // step's) holds that attempt's rows: the step computes from the rows
        // kept from before it, as a read of the step returns them.
        for (size_t tb = 0; tb < tables * nb; ++tb) {
          const std::vector<int64_t>& at = keyed.by_bucket[tb % nb];
          if (at.empty() || !unread[tb / nb] || !again[tb]) continue;
          const std::string& bucket = BucketOf(tb / nb, tb % nb);
          if (!StepUndo::Restore(TableAt(bucket), step, keyed.fields, at,
                                 [&](size_t j, const std::string& row) { old[tb][j] = row; }))
            throw resp::Error(NothingKept(bucket, step), resp::ErrorKind::kRefused);
        }
        update(old);
      } catch (const std::exception& e) {
        Fail(ctx, what.c_str(), e);  // nothing was written
        return;
      }
    }
    for (size_t tb = 0; step >= 0 && tb < tables * nb; ++tb) {
      const std::string& bucket = BucketOf(tb / nb, tb % nb);
      if (!keyed.by_bucket[tb % nb].empty() &&
          !StepUndo::Keep(TableAt(bucket), step, again[tb], keyed.fields, keyed.by_bucket[tb % nb], &old[tb])) {
        Fail(ctx, what.c_str(), resp::Error(NothingKept(bucket, step), resp::ErrorKind::kRefused));
        return;  // nothing was written
      }
    }

    // commands: per transaction MULTI, its commands, EXEC.  role[c] is -1
    // for a MULTI, -2 for an EXEC, else the index into queued[tx_of[c]] of
    // the command.
    std::vector<resp::Command> commands;
    std::vector<size_t> tx_of;
    std::vector<int64_t> role;
    enum Kind { kRows, kCount, kStamp };  // an HSET of rows; an INCR of a write count; a SET of a step stamp
    struct Queued {
      Kind kind;
      size_t table, bucket, command;
    };
    std::vector<std::vector<Queued>> queued;  // per transaction, the commands between MULTI and EXEC
    auto add = [&](resp::Command c, int64_t r) {
      commands.push_back(std::move(c));
      tx_of.push_back(queued.size() - 1);
      role.push_back(r);
    };
    auto queue = [&](resp::Command c, Kind kind, size_t t, size_t b) {
      queued.back().push_back(Queued{kind, t, b, commands.size()});
      add(std::move(c), static_cast<int64_t>(queued.back().size() - 1));
    };
    for (size_t b = 0; b < nb; ++b) {
      const std::vector<int64_t>& at = keyed.by_bucket[b];
      if (at.empty()) continue;
      if (per_bucket_ || queued.empty()) {
        queued.emplace_back();
        add(resp::Command{buckets_[b], {"MULTI"}}, -1);
      }
      for (size_t t = 0; t < tables; ++t) {
        if (step >= 0 && !again[t * nb + b])
          queue(resp::Command{StepKeyOf(t, b), {"SET", StepKeyOf(t, b), stamp, "EX", ttl}}, kStamp, t, b);
        const std::string& bucket = BucketOf(t, b);
        for (size_t s = 0; s < at.size(); s += chunk_) {
          resp::Command c{bucket, {"HSET", bucket}};
          for (size_t j = s; j < std::min(s + chunk_, at.size()); ++j) {
            c.args.push_back(keyed.fields[at[j]]);
            c.args.emplace_back(rows[t] + at[j] * row_bytes[t], row_bytes[t]);
          }
          queue(std::move(c), kRows, t, b);
        }
        queue(resp::Command{CountKeyOf(t, b), {"INCR", CountKeyOf(t, b)}}, kCount, t, b);
      }
      if (per_bucket_) add(resp::Command{buckets_[b], {"EXEC"}}, -2);
    }
    if (!per_bucket_) add(resp::Command{commands.front().key, {"EXEC"}}, -2);

    // Replies are judged after the pipeline: a retry delivers a transaction
    // again from its MULTI, which resets its verdict (the last delivery
    // counts).  A transaction holds absolute values (rows, the stamp), so
    // applied twice it equals once.
    std::vector<std::string> problem(queued.size());
    Counts counts(this);
    for (const auto& tx : queued)
      for (const Queued& q : tx)
        if (q.kind == kCount) counts.Before(CountKeyOf(q.table, q.bucket), TableName(q.table));
    auto judge = [&](size_t c, const resp::Reply& r) {
      const size_t tx = tx_of[c];
      if (role[c] == -1) {
        problem[tx].clear();
        if (r.type != resp::Reply::kStatus || r.str != "OK") problem[tx] = "MULTI was not acknowledged";
      } else if (role[c] >= 0) {
        if (r.type != resp::Reply::kStatus || r.str != "QUEUED")
          problem[tx] = std::string(commands[c].args[0]) + " " + std::string(commands[c].key) +
                        " was not queued; the transaction was not applied";
      } else if (r.type == resp::Reply::kNil) {
        problem[tx] = "EXEC discarded the transaction; none of its writes were applied";
      } else if (r.type != resp::Reply::kArray || r.elements.size() != queued[tx].size()) {
        problem[tx] = "EXEC sent a malformed reply (" + std::to_string(r.elements.size()) + " results for " +
                      std::to_string(queued[tx].size()) + " commands); the transaction's outcome is unknown";
      } else {
        for (size_t j = 0; j < r.elements.size(); ++j) {
          const Queued& q = queued[tx][j];
          const resp::Reply& got = r.elements[j];
          if (got.type != resp::Reply::kError) {
            if (q.kind == kCount) counts.Got(CountKeyOf(q.table, q.bucket), got);
            continue;
          }
          const std::string where = " (table '" + TableName(q.table) + "', bucket " + std::to_string(q.bucket) + ")";
          const std::string command =
              std::string(commands[q.command].args[0]) + " " + std::string(commands[q.command].key);
          problem[tx] = command + where + " failed inside the transaction: " + got.str;
          if (q.kind == kCount)  // the rows were written; their count was not
            problem[tx] += "; the transaction's other commands ran";
          else
            problem[tx] += "; its other writes were applied, so keys of bucket " + std::to_string(q.bucket) +
                           " may be written to some of the tables and not to others" +
                           (q.kind == kStamp ? ", and a run of this step again may not read what it read first" : "");
          break;
        }
      }
    };
    try {
      client_->Write(commands, judge);
    } catch (const resp::Error& e) {
      // A transaction refused by the server (EXECABORT) or never sent
      // (unreachable) was applied to none of its keys.
      const std::string why = std::string(e.what()) + " (a key's writes to all " + std::to_string(tables) +
                              " tables are applied together or not at all)";
      Fail(ctx, what.c_str(),
           e.transient() ? resp::Error(why, e.attempts(), e.waited_ms()) : resp::Error(why, e.kind()));
      return;
    } catch (const std::exception& e) {
      Fail(ctx, what.c_str(), e);
      return;
    }
    for (const std::string& p : problem)
      if (!p.empty()) {
        Fail(ctx, what.c_str(), resp::Error(p, resp::ErrorKind::kRefused));
        return;
      }
    const std::string lost = counts.Check();
    if (!lost.empty()) Fail(ctx, what.c_str(), resp::Error(lost, resp::ErrorKind::kTableLost));
  }

 protected:
  // Fills table t's `old` and `again` (see ReadBeforeStep) from this
  // step's latest read of the table, if it holds every key and bucket of the
  // write; returns whether it did.  In a bucket an earlier attempt of the
  // step wrote, that read returned the rows kept from before the step.
  bool FromStepReads(const Routed& keyed, size_t t, int64_t step, size_t row_bytes,
                     std::vector<std::vector<std::string>>* old, std::vector<char>* again) const {
    const size_t nb = buckets_.size();
    std::vector<int64_t> from;
    const std::shared_ptr<const StepReads::Read> read =
        StepReads::Holding(TableAt(BucketOf(t, 0)), step, t == 0 ? value_dtype_ : other_dtypes_[t - 1],
                           t == 0 ? dim_ : other_dims_[t - 1], nb, keyed.fields, &from);
    if (read == nullptr) return false;
    const char* rows = read->rows.tensor_data().data();
    const bool* stored = read->exists.flat<bool>().data();
    std::vector<std::vector<std::string>> found(nb);
    for (size_t b = 0; b < nb; ++b) {
      const std::vector<int64_t>& at = keyed.by_bucket[b];
      if (at.empty()) continue;
      if (read->again[b] < 0) return false;
      found[b].reserve(at.size());
      for (int64_t i : at)
        found[b].push_back(stored[from[i]] ? std::string(rows + from[i] * row_bytes, row_bytes) : std::string());
    }
    for (size_t b = 0; b < nb; ++b) {
      if (keyed.by_bucket[b].empty()) continue;
      (*old)[t * nb + b] = std::move(found[b]);
      (*again)[t * nb + b] = static_cast<char>(read->again[b]);
    }
    return true;
  }

  // The first round trip of a training step's write (see Compute), for the
  // tables marked `unread`: per written (table, bucket) at t * nb + b,
  // `again` (its stamp is this step's: an earlier attempt of the step wrote
  // it; StepUndo then keeps the rows it kept for that attempt), and `old`
  // (each key's row as the bucket holds it, "" where absent).  Reads only;
  // throws what the client throws.
  void ReadBeforeStep(const Routed& keyed, const std::vector<char>& unread, const std::string& stamp,
                      std::vector<std::vector<std::string>>* old, std::vector<char>* again) const {
    const size_t nb = buckets_.size();
    constexpr size_t kStamp = static_cast<size_t>(-1);
    std::vector<resp::Command> reads;
    std::vector<std::pair<size_t, size_t>> at;  // per command: (t * nb + b, its first key in by_bucket[b] or kStamp)
    for (size_t b = 0; b < nb; ++b) {
      if (keyed.by_bucket[b].empty()) continue;
      for (size_t t = 0; t < unread.size(); ++t) {
        if (!unread[t]) continue;
        const size_t tb = t * nb + b;
        (*old)[tb].assign(keyed.by_bucket[b].size(), std::string());
        reads.push_back(resp::Command{StepKeyOf(t, b), {"GET", StepKeyOf(t, b)}});
        at.emplace_back(tb, kStamp);
        const std::vector<int64_t>& keys = keyed.by_bucket[b];
        for (size_t s = 0; s < keys.size(); s += chunk_) {
          resp::Command c{BucketOf(t, b), {"HMGET", BucketOf(t, b)}};
          for (size_t j = s; j < std::min(s + chunk_, keys.size()); ++j) c.args.push_back(keyed.fields[keys[j]]);
          reads.push_back(std::move(c));
          at.emplace_back(tb, s);
        }
      }
    }
    client_->Pipeline(reads, [&](size_t c, const resp::Reply& r) {
      const auto [tb, s] = at[c];
      if (s == kStamp) {
        (*again)[tb] = r.type == resp::Reply::kBulk && r.str == stamp;
        return;
      }
      const size_t count = std::min(chunk_, keyed.by_bucket[tb % nb].size() - s);
      if (r.type != resp::Reply::kArray || r.elements.size() != count)
        throw resp::Error("a malformed HMGET reply for " + std::string(reads[c].key), true);
      for (size_t j = 0; j < count; ++j) {
        const resp::Reply& v = r.elements[j];
        (*old)[tb][s + j] = v.type == resp::Reply::kBulk ? v.str : std::string();
      }
    });
  }

  const std::string& BucketOf(size_t table, size_t bucket) const {
    return table == 0 ? buckets_[bucket] : other_buckets_[(table - 1) * buckets_.size() + bucket];
  }
  const std::string& TableName(size_t table) const { return table == 0 ? table_name_ : other_names_[table - 1]; }
  const std::string& CountKeyOf(size_t table, size_t bucket) const {
    return table == 0 ? count_keys_[bucket] : other_count_keys_[(table - 1) * buckets_.size() + bucket];
  }
  const std::string& StepKeyOf(size_t table, size_t bucket) const {
    return table == 0 ? step_keys_[bucket] : other_step_keys_[(table - 1) * buckets_.size() + bucket];
  }

  std::vector<DataType> other_dtypes_;
  std::vector<int64_t> other_dims_;
  std::vector<std::string> other_buckets_;  // table-major: other table t's bucket b at t * nb + b
  std::vector<std::string> other_names_;
  std::vector<std::string> other_count_keys_;  // WriteCountKey of other_buckets_, in their order
  std::vector<std::string> other_step_keys_;   // StepKey of other_buckets_
  bool per_bucket_ = true;                     // cluster: one transaction per bucket (slot)
};

REGISTER_OP("TfdeRedisInsertGroup")
    .Input("keys: Tkey")
    .Input("values: Tvalue")
    .Input("others: Tothers")
    .Input("step: int64")
    .Output("written: int64")
    .TFDE_REDIS_ATTRS.Attr("Tothers: list({float, double, half, bfloat16}) >= 0")
    .Attr("other_dims: list(int)")
    .Attr("other_buckets: list(string)")
    .Attr("other_names: list(string)")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

#define TFDE_REGISTER_REDIS_GROUP(TK)                                                                               \
  REGISTER_KERNEL_BUILDER(Name("TfdeRedisInsertGroup").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          RedisInsertGroupOp<TK>)
TFDE_REGISTER_REDIS_GROUP(int32_t);
TFDE_REGISTER_REDIS_GROUP(int64_t);
TFDE_REGISTER_REDIS_GROUP(tstring);
// ------------------------------------------------------------ end of grouped insert

// ------------------------------------------------------------ the fused step's write
// TfdeRedisApply: a training step's optimizer write of one Variable whose
// row table and slot tables are Redis tables of one creator
// (tfde/step_kernels.py: the fused step on Redis).  Inputs: the distinct
// keys the step trains, their gradients summed over the step (the compute
// type Tgrad: double for float64 tables, float for the others), the rows a
// missing key starts from (`defaults`, or the init attrs), the step and the
// rule's scalars (backends/cuckoo/rules.h Hyper, in the compute type).  The
// rule runs in the compute type on rows and slots read in the table's dtype
// and rounded back to it, as the Python path and TfdeTableApply do for
// float16 and bfloat16 tables.  In one op: keys whose gradient
// is not finite are dropped; the rows and slots before the step come from
// the step's kept read where it holds them, the rest from one pipelined
// read (the grouped insert's first round trip, which reads them anyway to
// keep them for a replay); the rule of tfde/optimizer_rules.py runs row by
// row (rules.h, the same float operations); the rows and slots are written
// in the grouped insert's transactions, stamped and kept as a training
// write is (a step run again applies once).  With S = 1 the last of the
// other tables is the restrict policy's state (double[1], tfde/policy.py
// fused_state): each written key's state gets `state_value` added
// ("add", a count) or is set to it ("set", a time), in the same
// transactions as its row and slots.  Output: the keys written.
template <class TK>
class RedisApplyOp : public RedisInsertGroupOp<TK> {
  using Base = RedisInsertGroupOp<TK>;

 public:
  explicit RedisApplyOp(OpKernelConstruction* ctx) : Base(ctx) {
    if (!ctx->status().ok()) return;
    OP_REQUIRES_OK(ctx, ReadInitSpec(ctx, &missing_.spec));
    std::string rule;
    OP_REQUIRES_OK(ctx, ReadRuleAttrs(ctx, &rule, &spec_, &slot_init_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
    const size_t slots = static_cast<size_t>(spec_.NumSlots());
    std::vector<bool> adds;
    OP_REQUIRES_OK(ctx, ReadStateAttrs(ctx, &states_, &adds, &state_init_));
    OP_REQUIRES(
        ctx, states_ <= 1,
        errors::InvalidArgument("a Variable has at most one policy state table: S must be 0 or 1, got ", states_));
    state_adds_ = !adds.empty() && adds[0];
    OP_REQUIRES(ctx, this->other_dims_.size() == slots + static_cast<size_t>(states_) && slot_init_.size() == slots,
                errors::InvalidArgument("rule '", rule, "' keeps ", slots, " slot(s): expected as many slot tables (",
                                        slots + static_cast<size_t>(states_),
                                        " with the policy state table) and slot_init values, got ",
                                        this->other_dims_.size(), " and ", slot_init_.size()));
    if (states_ == 1)
      OP_REQUIRES(
          ctx, this->other_dims_[slots] == 1 && this->other_dtypes_[slots] == ::tensorflow::DT_DOUBLE,
          errors::InvalidArgument("the policy state table '", this->other_names_[slots], "' must be double[1], got ",
                                  DataTypeString(this->other_dtypes_[slots]), "[", this->other_dims_[slots], "]"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tgrad", &grad_dtype_));
    OP_REQUIRES_OK(ctx, CheckGradDtype(this->value_dtype_, grad_dtype_));
    for (size_t s = 0; s < slots; ++s)
      OP_REQUIRES(ctx, this->other_dims_[s] == this->dim_ && this->other_dtypes_[s] == this->value_dtype_,
                  errors::InvalidArgument("slot table '", this->other_names_[s], "' must be ",
                                          DataTypeString(this->value_dtype_), "[", this->dim_, "] like its rows, got ",
                                          DataTypeString(this->other_dtypes_[s]), "[", this->other_dims_[s], "]"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    const Tensor& grads = ctx->input(1);
    const Tensor& hyper = ctx->input(4);
    const int64_t dim = this->dim_;
    const DataType compute = grad_dtype_;  // double for float64 tables, float for the others (the constructor)
    // Every input is checked before anything is read or sent.
    OP_REQUIRES(ctx, keys.dims() == 1,
                errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
    const int64_t n = keys.dim_size(0);
    OP_REQUIRES(ctx,
                grads.dtype() == compute && grads.dims() == 2 && grads.dim_size(0) == n && grads.dim_size(1) == dim,
                errors::InvalidArgument("grads must be ", DataTypeString(compute), "[", n, ", ", dim, "] for ", n,
                                        " keys and a ", this->Describe(), ", got ", DataTypeString(grads.dtype()),
                                        grads.shape().DebugString()));
    MissingRows missing = missing_;
    OP_REQUIRES_OK(ctx, missing.Prepare(ctx->input(2), n, dim, this->Describe()));
    int64_t step;
    OP_REQUIRES_OK(ctx, ReadStep(ctx, 3, &step));
    OP_REQUIRES(ctx, step >= 0, errors::InvalidArgument("the fused step needs the training step's number, got ", step));
    OP_REQUIRES(
        ctx, hyper.dtype() == compute && hyper.dims() == 1 && hyper.dim_size(0) >= spec_.NumHyper(),
        errors::InvalidArgument("hyper must be a ", DataTypeString(compute), " vector of at least ", spec_.NumHyper(),
                                " values, got ", DataTypeString(hyper.dtype()), hyper.shape().DebugString()));
    ::tensorflow::OpInputList state_value;
    OP_REQUIRES_OK(ctx, ctx->input_list("state_value", &state_value));
    for (int i = 0; i < state_value.size(); ++i)
      OP_REQUIRES(
          ctx, state_value[i].dims() == 0,
          errors::InvalidArgument("state_value must be a scalar, got shape ", state_value[i].shape().DebugString()));
    const double state = states_ == 1 ? state_value[0].scalar<double>()() : 0.0;
    Tensor* written = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &written));
    written->scalar<int64_t>()() = 0;
    if (n == 0) return;
    typename Base::Routed all = this->template Route<TK>(keys);
    {
      std::unordered_set<std::string_view> seen;
      seen.reserve(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i)
        OP_REQUIRES(ctx, seen.insert(all.fields[i]).second,
                    errors::InvalidArgument("keys must be distinct (their gradients summed per key); key ", i,
                                            " repeats an earlier one"));
    }
    auto run = [&](auto v) {
      // V: the table's dtype; C: the compute type (Tgrad).
      using V = decltype(v);
      using C = std::conditional_t<std::is_same_v<V, double>, double, float>;
      const C* g = grads.flat<C>().data();
      // Keys whose summed gradient is finite; the others keep
      // their rows and slots as they are.
      std::vector<int64_t> kept;
      kept.reserve(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        bool finite = true;
        for (int64_t c = 0; c < dim && finite; ++c) finite = std::isfinite(g[i * dim + c]);
        if (finite) kept.push_back(i);
      }
      written->scalar<int64_t>()() = static_cast<int64_t>(kept.size());
      if (kept.empty()) return;
      const typename Base::Routed keyed = Only(std::move(all), kept);
      // The row and slot tables (the rule's), then the policy state table.
      const size_t tables = 1 + this->other_dims_.size() - static_cast<size_t>(states_), nb = this->buckets_.size();
      const size_t row_bytes = static_cast<size_t>(dim) * sizeof(V);
      std::vector<std::vector<char>> out(tables, std::vector<char>(kept.size() * row_bytes));
      std::vector<double> states(static_cast<size_t>(states_) * kept.size());
      std::vector<const char*> rows(tables);
      std::vector<size_t> bytes(tables, row_bytes);
      for (size_t t = 0; t < tables; ++t) rows[t] = out[t].data();
      if (states_ == 1) {
        rows.push_back(reinterpret_cast<const char*>(states.data()));
        bytes.push_back(sizeof(double));
      }
      Hyper<C> hy;
      const C* h = hyper.flat<C>().data();
      for (int i = 0; i < spec_.NumHyper(); ++i) hy.h[i] = h[i];
      if (!decay_) hy.h[1] = C(0);
      // A stored row of table t (bucket b) has the size its dim and dtype give.
      auto expect_size = [&](const std::string& stored, size_t bytes, size_t t, size_t b) {
        if (stored.size() != bytes)
          throw std::length_error("a row in " + this->BucketOf(t, b) + " has " + std::to_string(stored.size()) +
                                  " bytes, expected " + std::to_string(bytes) +
                                  ": the table holds another dim or dtype");
      };
      auto update = [&](const std::vector<std::vector<std::string>>& old) {
        // Key k's row and slots in the compute type (table t at t * dim).
        std::vector<C> work(tables * static_cast<size_t>(dim));
        std::vector<C*> slot_rows(tables - 1);
        for (size_t t = 1; t < tables; ++t) slot_rows[t - 1] = &work[t * dim];
        for (size_t b = 0; b < nb; ++b) {
          const std::vector<int64_t>& at = keyed.by_bucket[b];
          for (size_t j = 0; j < at.size(); ++j) {
            const int64_t k = at[j];  // among the kept keys
            for (size_t t = 0; t < tables; ++t) {
              const std::string& before = old[t * nb + b][j];
              V* row = reinterpret_cast<V*>(out[t].data() + k * row_bytes);
              if (before.empty()) {  // absent: its starting row
                if (t == 0) {
                  missing.template Fill<V>(kept[k], keyed.hashes[k], dim, reinterpret_cast<char*>(row));
                } else {
                  std::fill(row, row + dim, static_cast<V>(slot_init_[t - 1]));
                }
              } else {
                expect_size(before, row_bytes, t, b);
                std::memcpy(row, before.data(), row_bytes);
              }
              C* w = &work[t * dim];
              for (int64_t c = 0; c < dim; ++c) w[c] = static_cast<C>(row[c]);
            }
            ApplyRule<C>(spec_, hy, dim, work.data(), g + kept[k] * dim, slot_rows.data());
            for (size_t t = 0; t < tables; ++t) {
              V* row = reinterpret_cast<V*>(out[t].data() + k * row_bytes);
              const C* w = &work[t * dim];
              for (int64_t c = 0; c < dim; ++c) row[c] = static_cast<V>(w[c]);
            }
            if (states_ == 1) {  // the policy's state: a count plus the value, or the value
              const std::string& before = old[tables * nb + b][j];
              double value = state_init_[0];
              if (!before.empty()) {
                expect_size(before, sizeof(double), tables, b);
                std::memcpy(&value, before.data(), sizeof(double));
              }
              states[k] = state_adds_ ? value + state : state;
            }
          }
        }
      };
      this->WriteGroup(ctx, keyed, rows, bytes, step, update);
    };
    OP_REQUIRES_OK(ctx, WithValueType(this->value_dtype_, run));
  }

 private:
  // `all` for the keys at positions `kept` (ascending) only, numbered
  // 0..kept.size()-1 in that order (each bucket's keys stay in batch order).
  static typename Base::Routed Only(typename Base::Routed all, const std::vector<int64_t>& kept) {
    typename Base::Routed only;
    std::vector<int64_t> number(all.fields.size(), -1);
    for (size_t k = 0; k < kept.size(); ++k) {
      number[kept[k]] = static_cast<int64_t>(k);
      only.hashes.push_back(all.hashes[kept[k]]);
      only.fields.push_back(std::move(all.fields[kept[k]]));
    }
    only.by_bucket.resize(all.by_bucket.size());
    for (size_t b = 0; b < all.by_bucket.size(); ++b)
      for (int64_t i : all.by_bucket[b])
        if (number[i] >= 0) only.by_bucket[b].push_back(number[i]);
    return only;
  }

  MissingRows missing_;
  RuleSpec spec_;
  std::vector<float> slot_init_;
  int states_ = 0;  // 1: the last other table holds the restrict policy's state
  std::vector<float> state_init_;
  bool state_adds_ = false;  // state_mode "add" (else "set")
  bool decay_ = false;
  DataType grad_dtype_ = ::tensorflow::DT_INVALID;
};

REGISTER_OP("TfdeRedisApply")
    .Input("keys: Tkey")
    .Input("grads: Tgrad")
    .Input("defaults: Tvalue")
    .Input("step: int64")
    .Input("hyper: Tgrad")
    .Input("state_value: S * double")
    .Output("written: int64")
    .Attr("Tgrad: {float, double} = DT_FLOAT")  // the default: graphs made when grads were Tvalue (float32 tables)
    .TFDE_REDIS_ATTRS.Attr("Tothers: list({float, double, half, bfloat16}) >= 0")
    .Attr("other_dims: list(int)")
    .Attr("other_buckets: list(string)")
    .Attr("other_names: list(string)")
    .Attr("rule: string")
    .Attr("momentum: bool = false")
    .Attr("nesterov: bool = false")
    .Attr("amsgrad: bool = false")
    .Attr("centered: bool = false")
    .Attr("slot_init: list(float)")
    .Attr("decay: bool = false")
    .Attr("S: int >= 0 = 0")  // 1: the last of the other tables is the restrict policy's state table
    .Attr("state_mode: list(string) = []")
    .Attr("state_init: list(float) = []")
    .Attr("init_kind: {'defaults', 'constant', 'uniform', 'normal', 'truncated_normal'} = 'defaults'")
    .Attr("init_p0: float = 0.0")
    .Attr("init_p1: float = 0.0")
    .Attr("init_seed: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

#define TFDE_REGISTER_REDIS_APPLY(TK)                                                                         \
  REGISTER_KERNEL_BUILDER(Name("TfdeRedisApply").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          RedisApplyOp<TK>)
TFDE_REGISTER_REDIS_APPLY(int32_t);
TFDE_REGISTER_REDIS_APPLY(int64_t);
TFDE_REGISTER_REDIS_APPLY(tstring);

// ------------------------------------------------------------ accum, remove, size, clear
// The rest of a table's operations on the training path, on the same client
// as find and insert (one retry policy, one error translation):
//   TfdeRedisAccum:  adds deltas to rows on the server, atomically per key,
//                    through the Lua script the op is given (redis_table.py
//                    _ACCUM_LUA, one EVAL per (bucket, chunk of keys)).  Each
//                    EVAL first sets a marker key unique to that chunk of this
//                    call (SET NX EX, in the bucket's hash slot), so a chunk
//                    sent again by a retry after a lost reply is applied once.
//   TfdeRedisRemove: HDEL of a (bucket, chunk)'s fields in a Lua script
//                    (redis_table.py _REMOVE_LUA) that keeps its count in a
//                    marker like accum's, so a retried chunk answers the
//                    same count: returns how many keys were there.
//   TfdeRedisSize:   HLEN of every bucket, summed.
//   TfdeRedisClear:  DEL of every bucket.

// "f", "d", "h" or "b": how the accum script reads and writes values of `dtype`.
const char* ValueKind(DataType dtype) {
  switch (dtype) {
    case ::tensorflow::DT_FLOAT:
      return "f";
    case ::tensorflow::DT_DOUBLE:
      return "d";
    case ::tensorflow::DT_HALF:
      return "h";
    default:
      return "b";  // bfloat16: the op's attr allows no other type
  }
}

// 32 hex digits drawn afresh from the system's random source on every call
// (never a seeded generator, whose sequence a forked process would repeat):
// a call's id in its markers, unique across the processes sharing a table.
std::string RandomCallId() {
  std::random_device source;
  char out[33];
  std::snprintf(out, sizeof(out), "%08x%08x%08x%08x", source(), source(), source(), source());
  return out;
}

// The prefix of bucket `bucket`'s markers: the bucket's own name when it has
// a hash tag (its first non-empty {...}, which the marker then shares), else
// the whole name as the tag.  Either way a marker lies in its bucket's
// cluster slot, as a script's keys must.
std::string MarkerBase(const std::string& bucket) {
  const size_t open = bucket.find('{');
  const size_t close = open == std::string::npos ? std::string::npos : bucket.find('}', open + 1);
  if (close != std::string::npos && close > open + 1) return bucket;
  return "{" + bucket + "}";
}

// The names of the markers of `buckets` for the script `what` ("applied",
// "removed") up to the call id, one per bucket; refused when one would lie
// in another cluster slot than its bucket (a bucket named "a{}b{c}" hashes
// whole, its marker would hash "c").
::absl::Status MarkerBases(const std::vector<std::string>& buckets, const char* what, std::vector<std::string>* out) {
  for (const std::string& bucket : buckets) {
    out->push_back(MarkerBase(bucket) + ":" + what + ":");
    if (resp::KeySlot(out->back()) != resp::KeySlot(bucket))
      return errors::InvalidArgument("the markers of bucket '", bucket,
                                     "' would lie in another cluster slot than the bucket; give the bucket a hash "
                                     "tag ({...}) in redis_hash_tags_runtime");
  }
  return ::absl::OkStatus();
}

// An op whose commands are EVALs of one Lua script (attr `script`), one per
// (bucket, chunk of keys), each with a marker key of its own call and chunk
// (KEYS[2], named "<bucket's marker base><what>:<call id>:<chunk>", living
// marker_ttl_s seconds) through which a chunk resent by a retry is applied
// once.
class RedisScriptOp : public RedisOpBase {
 public:
  RedisScriptOp(OpKernelConstruction* ctx, const char* what) : RedisOpBase(ctx) {
    if (!ctx->status().ok()) return;
    int64_t ttl;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("script", &script_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("marker_ttl_s", &ttl));
    OP_REQUIRES(ctx, !script_.empty(), errors::InvalidArgument(name(), " needs its Lua script"));
    OP_REQUIRES(ctx, ttl >= 1, errors::InvalidArgument("marker_ttl_s must be >= 1 second, got ", ttl));
    OP_REQUIRES_OK(ctx, MarkerBases(buckets_, what, &marker_bases_));
    ttl_ = std::to_string(ttl);
  }

 protected:
  // The EVALs of one call: the script, its 2 keys, then `head`, then what
  // add_key(i, &args) adds for each key i of the chunk.  The commands hold
  // views of `markers` (which never moves) and of what head and add_key give.
  std::vector<resp::Command> Commands(const std::vector<std::vector<int64_t>>& by_bucket,
                                      const std::vector<std::string_view>& head,
                                      const std::function<void(int64_t, std::vector<std::string_view>*)>& add_key,
                                      std::deque<std::string>* markers) const {
    const std::string call = RandomCallId();
    std::vector<resp::Command> commands;
    for (size_t b = 0; b < by_bucket.size(); ++b) {
      for (size_t s = 0; s < by_bucket[b].size(); s += chunk_) {
        markers->push_back(marker_bases_[b] + call + ":" + std::to_string(commands.size()));
        resp::Command c{buckets_[b], {"EVAL", script_, "2", buckets_[b], markers->back()}};
        c.args.insert(c.args.end(), head.begin(), head.end());
        for (size_t k = s; k < std::min(s + chunk_, by_bucket[b].size()); ++k) add_key(by_bucket[b][k], &c.args);
        commands.push_back(std::move(c));
      }
    }
    return commands;
  }

  std::string script_, ttl_;
  std::vector<std::string> marker_bases_;  // per bucket: its markers' names up to the call id
};

template <class TK>
class RedisAccumOp : public RedisScriptOp {
 public:
  explicit RedisAccumOp(OpKernelConstruction* ctx) : RedisScriptOp(ctx, "applied") { dim_text_ = std::to_string(dim_); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    OP_REQUIRES(ctx, keys.dims() == 1,
                errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
    const int64_t n = keys.dim_size(0);
    for (int input = 1; input <= 2; ++input) {
      const Tensor& rows = ctx->input(input);
      OP_REQUIRES(
          ctx, rows.dims() == 2 && rows.dim_size(0) == n && rows.dim_size(1) == dim_,
          errors::InvalidArgument(input == 1 ? "deltas" : "initial rows", " must have shape [", n, ", ", dim_, "] for ",
                                  n, " keys and a ", Describe(), ", got ", rows.shape().DebugString()));
    }
    const DataType delta_dtype = ctx->input(1).dtype();
    OP_REQUIRES_OK(ctx, CheckDeltaDtype(value_dtype_, delta_dtype));
    Tensor* applied = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &applied));
    applied->scalar<int64_t>()() = n;
    if (n == 0) return;
    const Routed keyed = Route<TK>(keys);
    const size_t row_bytes = static_cast<size_t>(dim_) * ::tensorflow::DataTypeSize(value_dtype_);
    const size_t delta_bytes = static_cast<size_t>(dim_) * ::tensorflow::DataTypeSize(delta_dtype);
    // The rows' kind, then the deltas' where they differ (the script adds in
    // Lua's doubles and rounds to the row's type once).
    std::string kinds = ValueKind(value_dtype_);
    if (delta_dtype != value_dtype_) kinds += ValueKind(delta_dtype);
    const Forgetting forgetting({TableAt(buckets_[0])});
    const char* deltas = ctx->input(1).tensor_data().data();
    const char* init = ctx->input(2).tensor_data().data();
    std::deque<std::string> markers;
    // ARGV: value kinds, dim, marker TTL, then (field, delta, initial row) per key.
    const std::vector<resp::Command> commands = Commands(
        keyed.by_bucket, {kinds, dim_text_, ttl_},
        [&](int64_t i, std::vector<std::string_view>* args) {
          args->push_back(keyed.fields[i]);
          args->emplace_back(deltas + i * delta_bytes, delta_bytes);
          args->emplace_back(init + i * row_bytes, row_bytes);
        },
        &markers);
    try {
      client_->Write(commands, [&](size_t c, const resp::Reply& r) {
        if (r.type != resp::Reply::kInteger)
          throw resp::Error("a malformed accum script reply for " + std::string(commands[c].key), true);
      });
    } catch (const std::exception& e) {
      Fail(ctx, "accum", e);
    }
  }

 private:
  std::string dim_text_;
};

template <class TK>
class RedisRemoveOp : public RedisScriptOp {
 public:
  explicit RedisRemoveOp(OpKernelConstruction* ctx) : RedisScriptOp(ctx, "removed") {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    OP_REQUIRES(ctx, keys.dims() == 1,
                errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
    Tensor* removed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &removed));
    removed->scalar<int64_t>()() = 0;
    if (keys.dim_size(0) == 0) return;
    const Routed keyed = Route<TK>(keys);
    const Forgetting forgetting({TableAt(buckets_[0])});
    std::deque<std::string> markers;
    // ARGV: marker TTL, then the fields.
    const std::vector<resp::Command> commands = Commands(
        keyed.by_bucket, {ttl_},
        [&](int64_t i, std::vector<std::string_view>* args) { args->push_back(keyed.fields[i]); }, &markers);
    // Each script counts the distinct present fields of its chunk and keeps
    // the count in its marker; one sent again by a retry removes nothing and
    // answers the kept count, so the total is exact.
    std::vector<int64_t> counts(commands.size(), 0);
    try {
      client_->Write(commands, [&](size_t c, const resp::Reply& r) {
        if (r.type != resp::Reply::kInteger)
          throw resp::Error("a malformed remove script reply for " + std::string(commands[c].key), true);
        counts[c] = r.integer;
      });
    } catch (const std::exception& e) {
      Fail(ctx, "remove", e);
      return;
    }
    int64_t total = 0;
    for (int64_t k : counts) total += k;
    removed->scalar<int64_t>()() = total;
  }
};

// One command per bucket, no keys: HLEN (size) or DEL (clear).
class RedisBucketsOp : public RedisOpBase {
 public:
  RedisBucketsOp(OpKernelConstruction* ctx, const char* command, const char* what)
      : RedisOpBase(ctx), command_(command), what_(what) {}

  void Compute(OpKernelContext* ctx) override {
    const Forgetting forgetting(command_ == std::string_view("DEL") ? std::vector<std::string>{TableAt(buckets_[0])}
                                                                    : std::vector<std::string>{});
    std::vector<resp::Command> commands;
    for (const std::string& bucket : buckets_) commands.push_back(resp::Command{bucket, {command_, bucket}});
    std::vector<int64_t> counts(commands.size(), 0);
    try {
      client_->Pipeline(
          commands,
          [&](size_t c, const resp::Reply& r) {
            if (r.type != resp::Reply::kInteger)
              throw resp::Error("a malformed " + std::string(command_) + " reply for " + buckets_[c], true);
            counts[c] = r.integer;
          },
          command_ == std::string_view("DEL"));
    } catch (const std::exception& e) {
      Fail(ctx, what_, e);
      return;
    }
    int64_t total = 0;
    for (int64_t k : counts) total += k;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = command_ == std::string_view("DEL") ? 0 : total;
  }

 private:
  const char* command_;
  const char* what_;
};

class RedisSizeOp : public RedisBucketsOp {
 public:
  explicit RedisSizeOp(OpKernelConstruction* ctx) : RedisBucketsOp(ctx, "HLEN", "size") {}
};

class RedisClearOp : public RedisBucketsOp {
 public:
  explicit RedisClearOp(OpKernelConstruction* ctx) : RedisBucketsOp(ctx, "DEL", "clear") {}
};

REGISTER_OP("TfdeRedisAccum")
    .Input("keys: Tkey")
    .Input("deltas: Tdelta")
    .Input("init: Tvalue")
    .Output("applied: int64")
    .TFDE_REDIS_ATTRS.Attr("Tdelta: {float, double, half, bfloat16}")
    .Attr("script: string")
    .Attr("marker_ttl_s: int = 3600")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeRedisRemove")
    .Input("keys: Tkey")
    .Output("removed: int64")
    .TFDE_REDIS_ATTRS.Attr("script: string")
    .Attr("marker_ttl_s: int = 3600")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeRedisSize")
    .Output("size: int64")
    .TFDE_REDIS_ATTRS.SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeRedisClear")
    .Output("cleared: int64")
    .TFDE_REDIS_ATTRS.SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

#define TFDE_REGISTER_REDIS_KEYED(TK)                                                                          \
  REGISTER_KERNEL_BUILDER(Name("TfdeRedisAccum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"),  \
                          RedisAccumOp<TK>);                                                                   \
  REGISTER_KERNEL_BUILDER(Name("TfdeRedisRemove").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          RedisRemoveOp<TK>)
TFDE_REGISTER_REDIS_KEYED(int32_t);
TFDE_REGISTER_REDIS_KEYED(int64_t);
TFDE_REGISTER_REDIS_KEYED(tstring);
REGISTER_KERNEL_BUILDER(Name("TfdeRedisSize").Device(::tensorflow::DEVICE_CPU), RedisSizeOp);
REGISTER_KERNEL_BUILDER(Name("TfdeRedisClear").Device(::tensorflow::DEVICE_CPU), RedisClearOp);
// ------------------------------------------------------------ end of accum, remove, size, clear

// ------------------------------------------------------------ export
// TfdeRedisExport: at most max_rows (key, row) pairs of the table from
// `cursor` (0 starts an export) and the cursor to continue from, or -1 when
// done.  It walks the buckets in turn with HSCAN (always on the master: a
// checkpoint must not miss writes a replica has not seen yet), buffering a
// page's rows beyond max_rows, and looks one row ahead so that the last
// chunk already says -1.  An export in progress lives in a process-wide
// registry under its cursor (a kernel of another graph may continue it); a
// failed call leaves it where it was, so the same cursor can be asked
// again.  Like every SCAN, a key may come twice while its hash is resized;
// importing an export is an upsert, so that is harmless.
struct ExportState {
  std::string table;                                     // whose export it is (RedisExportOp::Identity)
  uint64_t used = 0;                                     // when it was last kept (exports_tick)
  size_t bucket = 0;                                     // the bucket being scanned
  std::string scan = "0";                                // its HSCAN cursor
  std::deque<std::pair<std::string, std::string>> rows;  // (field, row) fetched, not returned yet
};
constexpr size_t kMaxOpenExports = 64;  // abandoned exports beyond this are dropped, least recently used first
constexpr int kScanCount = 1000;        // HSCAN COUNT: fields per page, roughly
std::mutex exports_mu;
int64_t next_export = 1;
uint64_t exports_tick = 0;
std::map<int64_t, ExportState>& Exports() {
  static auto* exports = new std::map<int64_t, ExportState>();
  return *exports;
}

template <class TK>
class RedisExportOp : public RedisOpBase {
 public:
  using RedisOpBase::RedisOpBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& cursor_t = ctx->input(0);
    const Tensor& max_rows_t = ctx->input(1);
    OP_REQUIRES(ctx, cursor_t.dims() == 0 && max_rows_t.dims() == 0,
                errors::InvalidArgument("cursor and max_rows must be scalars, got shapes ",
                                        cursor_t.shape().DebugString(), " and ", max_rows_t.shape().DebugString()));
    const int64_t cursor = cursor_t.scalar<int64_t>()();
    const int64_t max_rows = max_rows_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, max_rows > 0,
                errors::InvalidArgument("tfde.ShapeError: export max_rows must be > 0, got ", max_rows));
    OP_REQUIRES(ctx, cursor >= 0,
                errors::InvalidArgument(
                    "tfde.ShapeError: export cursor must be 0 (start) or one an export returned, got ", cursor));
    int64_t id = cursor;
    ExportState state;
    {
      std::lock_guard<std::mutex> lock(exports_mu);
      if (cursor == 0) {
        id = next_export++;
        state.table = Identity();
      } else {
        auto it = Exports().find(cursor);
        // Another table's cursor is as unknown here as a finished one.
        OP_REQUIRES(ctx, it != Exports().end() && it->second.table == Identity(),
                    errors::InvalidArgument("tfde.ShapeError: export cursor ", cursor, " of ", Describe(),
                                            " is unknown or finished; start again from 0"));
        state = std::move(it->second);
        Exports().erase(it);
      }
    }
    const size_t want = static_cast<size_t>(std::min<int64_t>(max_rows, int64_t{1} << 40)) + 1;  // one ahead
    try {
      while (state.rows.size() < want && state.bucket < buckets_.size()) Scan(&state);
    } catch (const std::exception& e) {
      // A page is added whole or not at all, so the state is still good.
      if (cursor != 0) Keep(cursor, std::move(state));
      Fail(ctx, "export", e);
      return;
    }
    const size_t n = std::min(state.rows.size(), static_cast<size_t>(max_rows));
    const size_t row_bytes = static_cast<size_t>(dim_) * ::tensorflow::DataTypeSize(value_dtype_);
    for (size_t i = 0; i < n; ++i) {
      const auto& [field, row] = state.rows[i];
      if (row.size() == row_bytes && FieldFits<TK>(field)) continue;
      const bool bad_row = row.size() != row_bytes;
      ctx->CtxFailure(errors::InvalidArgument(
          "tfde.ShapeError: export of table '", table_name_, "': a ", bad_row ? "row" : "field", " of ",
          bad_row ? row.size() : field.size(), " bytes where ", bad_row ? row_bytes : sizeof(TK), " are expected for ",
          Describe(), ": the table holds data written by another program or format"));
      if (cursor != 0) Keep(cursor, std::move(state));
      return;
    }
    Tensor* keys = nullptr;
    Tensor* values = nullptr;
    Tensor* next = nullptr;
    ::absl::Status allocated = ctx->allocate_output(0, TensorShape({static_cast<int64_t>(n)}), &keys);
    if (allocated.ok()) allocated = ctx->allocate_output(1, TensorShape({static_cast<int64_t>(n), dim_}), &values);
    if (allocated.ok()) allocated = ctx->allocate_output(2, TensorShape({}), &next);
    if (!allocated.ok()) {
      if (cursor != 0) Keep(cursor, std::move(state));
      ctx->CtxFailure(allocated);
      return;
    }
    auto flat = keys->flat<TK>();
    char* out = const_cast<char*>(values->tensor_data().data());
    for (size_t i = 0; i < n; ++i) {
      const auto& [field, row] = state.rows.front();
      if constexpr (std::is_same_v<TK, tstring>) {
        flat(i) = tstring(field);
      } else {
        std::memcpy(&flat(i), field.data(), sizeof(TK));
      }
      std::memcpy(out + i * row_bytes, row.data(), row_bytes);
      state.rows.pop_front();
    }
    const bool done = state.rows.empty() && state.bucket >= buckets_.size();
    next->scalar<int64_t>()() = done ? -1 : id;
    if (!done) Keep(id, std::move(state));
  }

 private:
  template <class K>
  static bool FieldFits(const std::string& field) {
    if constexpr (std::is_same_v<K, tstring>) {
      return true;
    } else {
      return field.size() == sizeof(K);
    }
  }

  // One HSCAN page of the current bucket into state->rows.
  void Scan(ExportState* state) const {
    const std::string& bucket = buckets_[state->bucket];
    const std::string count = std::to_string(kScanCount);
    std::vector<resp::Command> commands{resp::Command{bucket, {"HSCAN", bucket, state->scan, "COUNT", count}}};
    resp::Reply page;
    client_->Pipeline(commands, [&](size_t, const resp::Reply& r) {  // a retry's page replaces the first
      if (r.type != resp::Reply::kArray || r.elements.size() != 2 || r.elements[0].type != resp::Reply::kBulk ||
          r.elements[1].type != resp::Reply::kArray || r.elements[1].elements.size() % 2 != 0)
        throw resp::Error("a malformed HSCAN reply for " + bucket, true);
      page = r;
    });
    const auto& items = page.elements[1].elements;
    for (size_t i = 0; i + 1 < items.size(); i += 2) state->rows.emplace_back(items[i].str, items[i + 1].str);
    state->scan = page.elements[0].str;
    if (state->scan == "0") {
      ++state->bucket;
      state->scan = "0";
    }
  }

  // Which table an export walks: its servers, buckets and row type.
  std::string Identity() const {
    std::string id = Describe();
    for (const std::string& bucket : buckets_) id += "\n" + bucket;
    return id;
  }

  static void Keep(int64_t id, ExportState state) {
    std::lock_guard<std::mutex> lock(exports_mu);
    state.used = ++exports_tick;
    Exports()[id] = std::move(state);
    while (Exports().size() > kMaxOpenExports) {
      auto oldest = Exports().begin();
      for (auto it = Exports().begin(); it != Exports().end(); ++it)
        if (it->second.used < oldest->second.used) oldest = it;
      Exports().erase(oldest);
    }
  }
};

REGISTER_OP("TfdeRedisExport")
    .Input("cursor: int64")
    .Input("max_rows: int64")
    .Output("keys: Tkey")
    .Output("values: Tvalue")
    .Output("next: int64")
    .TFDE_REDIS_ATTRS.SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      TF_RETURN_IF_ERROR(CheckDimAttr(dim));
      ::tensorflow::shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->UnknownDim(), dim));
      c->set_output(2, c->Scalar());
      return ::absl::OkStatus();
    });

#define TFDE_REGISTER_REDIS_EXPORT(TK)                                                                         \
  REGISTER_KERNEL_BUILDER(Name("TfdeRedisExport").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          RedisExportOp<TK>)
TFDE_REGISTER_REDIS_EXPORT(int32_t);
TFDE_REGISTER_REDIS_EXPORT(int64_t);
TFDE_REGISTER_REDIS_EXPORT(tstring);
// ------------------------------------------------------------ end of export

}  // namespace
}  // namespace tfde

// Registers the passwords of a RedisTableCreator under `id` (see
// CredentialsRegistry).  A plain C function that tfde/tables/redis_table.py
// calls through ctypes on the loaded op library, so that a password never
// becomes a tensor, an attr or a graph constant in any mode (eager,
// tf.function, TF1 graphs).  Lengths are explicit: a password may hold any
// bytes.  Returns 0.
extern "C" __attribute__((visibility("default"))) int tfde_redis_register_credentials(const char* id, size_t id_len,
                                                                                      const char* password,
                                                                                      size_t password_len,
                                                                                      const char* sentinel_password,
                                                                                      size_t sentinel_password_len) {
  std::lock_guard<std::mutex> lock(tfde::credentials_mu);
  tfde::CredentialsRegistry()[std::string(id, id_len)] =
      tfde::Credentials{std::string(password, password_len), std::string(sentinel_password, sentinel_password_len)};
  return 0;
}

// The native client's wait before the next attempt after `failures` failures
// in a row, in milliseconds (resp::BackoffMs), for tests to compare with the
// redis-py side's backoff_s without sleeping.
extern "C" __attribute__((visibility("default"))) int tfde_redis_backoff_ms(int failures) {
  return tfde::resp::BackoffMs(failures);
}

// Forgets every training read this process kept (StepReads): called when a
// Redis table is opened, which may be a table of the same name made afresh
// or filled by redis-py (tfde/tables/redis_table.py).
extern "C" __attribute__((visibility("default"))) void tfde_redis_forget_reads() { tfde::StepReads::ForgetAll(); }
