// Native ops of the Redis backend: TfdeRedisFind (rows and an exists mask,
// missing keys from an init spec or defaults) and TfdeRedisInsert (upsert),
// used by tfde/tables/redis_table.py for lookups and writes and by serving
// exports that keep reading Redis.  Thin: validates shapes, routes keys to
// buckets as redis_table.py lays them out, and pipelines HMGET / HSET
// through resp_client.h.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "../cuckoo/hash.h"
#include "../cuckoo/op_support.h"
#include "resp_client.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

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

// Passwords registered by the process (tfde.RedisTableCreator) under an id,
// so they never appear in a graph: the ops name the id.  Serving processes
// give them in environment variables instead.
struct Credentials {
  std::string password, sentinel_password;
};
std::mutex credentials_mu;
std::map<std::string, Credentials>& CredentialsRegistry() {
  static auto* registry = new std::map<std::string, Credentials>();
  return *registry;
}

class RegisterCredentialsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    for (int i = 0; i < 3; ++i)
      OP_REQUIRES(ctx, ctx->input(i).dims() == 0,
                  errors::InvalidArgument("credentials are scalars, got shape ", ctx->input(i).shape().DebugString()));
    std::lock_guard<std::mutex> lock(credentials_mu);
    CredentialsRegistry()[std::string(ctx->input(0).scalar<tstring>()())] =
        Credentials{std::string(ctx->input(1).scalar<tstring>()()), std::string(ctx->input(2).scalar<tstring>()())};
  }
};

// Attrs every Redis op shares: where the table lives and how to connect.
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
    int64_t mode, db, connect_ms, socket_ms, retries;
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
    OP_REQUIRES_OK(ctx, ctx->GetAttr("retries", &retries));
    OP_REQUIRES(ctx, mode >= 0 && mode <= 2,
                errors::InvalidArgument("mode must be 0 (cluster), 1 (sentinel) or 2 (standalone), got ", mode));
    OP_REQUIRES(ctx, !servers.empty(), errors::InvalidArgument("servers must name at least one host:port"));
    for (const std::string& s : servers) {
      const size_t colon = s.rfind(':');
      int port = 0;
      OP_REQUIRES(ctx, colon != std::string::npos && colon > 0 && (port = std::atoi(s.c_str() + colon + 1)) > 0 &&
                           port < 65536,
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
    config.retries = static_cast<int>(retries);
    client_ = std::make_unique<resp::Client>(std::move(config));
  }

 protected:
  // Keys grouped by bucket (the low half of the stable hash, multiply-shift,
  // as tfde/tables/redis_table.py lays them out), in batch order.
  template <class TK>
  void Route(const Tensor& keys, std::vector<uint64_t>* hashes, std::vector<std::string>* fields,
             std::vector<std::vector<int64_t>>* by_bucket) const {
    auto flat = keys.flat<TK>();
    const int64_t n = keys.dim_size(0);
    const uint64_t nb = buckets_.size();
    hashes->resize(n);
    fields->resize(n);
    by_bucket->assign(nb, {});
    for (int64_t i = 0; i < n; ++i) {
      (*hashes)[i] = HashOf<TK>(flat(i));
      (*fields)[i] = FieldOf<TK>(flat(i));
      (*by_bucket)[((*hashes)[i] & 0xFFFFFFFFULL) * nb >> 32].push_back(i);
    }
  }

  // Fails ctx with an error naming the servers, the operation and the table.
  void Fail(OpKernelContext* ctx, const char* op, const std::exception& e) const {
    const auto* redis_error = dynamic_cast<const resp::Error*>(&e);
    const std::string what = std::string(op) + " of table '" + table_name_ + "': " + e.what();
    if (redis_error == nullptr) {
      ctx->CtxFailure(errors::InvalidArgument("tfde Redis ", what));
    } else if (redis_error->transient()) {
      ctx->CtxFailure(errors::Unavailable("tfde Redis ", what));
    } else {
      ctx->CtxFailure(errors::FailedPrecondition("tfde Redis ", what));
    }
  }

  std::string Describe() const {
    return "Redis table '" + table_name_ + "' " + DataTypeString(value_dtype_) + "[" + std::to_string(dim_) +
           "] on " + client_->Describe();
  }

  int64_t dim_ = 0;
  DataType value_dtype_ = ::tensorflow::DT_INVALID;
  std::vector<std::string> buckets_;  // full Redis key of each bucket, in bucket order
  std::string table_name_;
  size_t chunk_ = 1024;               // keys per command (keys_sending_size)
  std::unique_ptr<resp::Client> client_;
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
    std::vector<uint64_t> hashes;
    std::vector<std::string> fields;
    std::vector<std::vector<int64_t>> by_bucket;
    Route<TK>(keys, &hashes, &fields, &by_bucket);
    // One HMGET per (bucket, chunk of keys); positions[c] = the keys of command c.
    std::vector<resp::Command> commands;
    std::vector<std::vector<int64_t>> positions;
    for (size_t b = 0; b < by_bucket.size(); ++b) {
      for (size_t s = 0; s < by_bucket[b].size(); s += chunk_) {
        resp::Command c{buckets_[b], {"HMGET", buckets_[b]}};
        positions.emplace_back(by_bucket[b].begin() + s, by_bucket[b].begin() + std::min(s + chunk_, by_bucket[b].size()));
        for (int64_t i : positions.back()) c.args.push_back(fields[i]);
        commands.push_back(std::move(c));
      }
    }
    char* out = const_cast<char*>(values->tensor_data().data());
    bool* ex = exists->flat<bool>().data();
    OP_REQUIRES_OK(ctx, WithValueType(value_dtype_, [&](auto v) {
      using V = decltype(v);
      const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(V);
      try {
        client_->Pipeline(commands, [&](size_t c, const resp::Reply& r) {
          if (r.type != resp::Reply::kArray || r.elements.size() != positions[c].size())
            throw resp::Error("a malformed HMGET reply for " + buckets_[0], true);
          for (size_t j = 0; j < positions[c].size(); ++j) {
            const int64_t i = positions[c][j];
            const resp::Reply& value = r.elements[j];
            if (value.type != resp::Reply::kBulk) {
              missing.template Fill<V>(i, hashes[i], dim_, out + i * row_bytes);
              ex[i] = false;
              continue;
            }
            if (value.str.size() != row_bytes)
              throw std::length_error("a row in " + std::string(commands[c].key) + " has " +
                                      std::to_string(value.str.size()) + " bytes, expected " +
                                      std::to_string(row_bytes) + " for " + Describe() +
                                      ": the table holds another dim or dtype");
            std::memcpy(out + i * row_bytes, value.str.data(), row_bytes);
            ex[i] = true;
          }
        });
      } catch (const std::exception& e) {
        Fail(ctx, "find", e);
      }
    }));
  }

 private:
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
    std::vector<uint64_t> hashes;
    std::vector<std::string> fields;
    std::vector<std::vector<int64_t>> by_bucket;
    Route<TK>(keys, &hashes, &fields, &by_bucket);
    const size_t row_bytes = static_cast<size_t>(dim_) * ::tensorflow::DataTypeSize(value_dtype_);
    const char* rows = values.tensor_data().data();
    // One HSET per (bucket, chunk of keys), field value pairs in batch order:
    // a key given twice keeps its last row, as in every table.
    std::vector<resp::Command> commands;
    for (size_t b = 0; b < by_bucket.size(); ++b) {
      for (size_t s = 0; s < by_bucket[b].size(); s += chunk_) {
        resp::Command c{buckets_[b], {"HSET", buckets_[b]}};
        for (size_t k = s; k < std::min(s + chunk_, by_bucket[b].size()); ++k) {
          const int64_t i = by_bucket[b][k];
          c.args.push_back(fields[i]);
          c.args.emplace_back(rows + i * row_bytes, row_bytes);
        }
        commands.push_back(std::move(c));
      }
    }
    try {
      client_->Pipeline(commands, [](size_t, const resp::Reply&) {});
    } catch (const std::exception& e) {
      Fail(ctx, "insert", e);
    }
  }
};

#define TFDE_REDIS_ATTRS                                          \
  Attr("Tkey: {int32, int64, string}")                            \
      .Attr("Tvalue: {float, double, half, bfloat16}")            \
      .Attr("dim: int")                                           \
      .Attr("buckets: list(string)")                              \
      .Attr("table_name: string = ''")                            \
      .Attr("chunk: int = 1024")                                  \
      .Attr("mode: int")                                          \
      .Attr("servers: list(string)")                              \
      .Attr("master_name: string = ''")                           \
      .Attr("db: int = 0")                                        \
      .Attr("user: string = ''")                                  \
      .Attr("credentials: string = ''")                           \
      .Attr("password_env: string = ''")                          \
      .Attr("sentinel_user: string = ''")                         \
      .Attr("sentinel_password_env: string = ''")                 \
      .Attr("connect_timeout_ms: int = 1000")                     \
      .Attr("socket_timeout_ms: int = 1000")                      \
      .Attr("retries: int = 4")

REGISTER_OP("TfdeRedisRegisterCredentials")
    .Input("id: string")
    .Input("password: string")
    .Input("sentinel_password: string")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);
REGISTER_KERNEL_BUILDER(Name("TfdeRedisRegisterCredentials").Device(::tensorflow::DEVICE_CPU),
                        RegisterCredentialsOp);

REGISTER_OP("TfdeRedisInsert")
    .Input("keys: Tkey")
    .Input("values: Tvalue")
    .Output("written: int64")
    .TFDE_REDIS_ATTRS
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeRedisFind")
    .Input("keys: Tkey")
    .Input("defaults: Tvalue")
    .Output("values: Tvalue")
    .Output("exists: bool")
    .TFDE_REDIS_ATTRS
    .Attr("init_kind: {'defaults', 'constant', 'uniform', 'normal', 'truncated_normal'} = 'defaults'")
    .Attr("init_p0: float = 0.0")
    .Attr("init_p1: float = 0.0")
    .Attr("init_seed: int = 0")
    .SetIsStateful()  // reads a store that changes under it
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      ::tensorflow::shape_inference::ShapeHandle keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &keys));
      c->set_output(0, c->Matrix(c->Dim(keys, 0), dim));
      c->set_output(1, c->Vector(c->Dim(keys, 0)));
      return ::absl::OkStatus();
    });

#define TFDE_REGISTER_REDIS(TK)                                                                          \
  REGISTER_KERNEL_BUILDER(                                                                              \
      Name("TfdeRedisFind").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), RedisFindOp<TK>); \
  REGISTER_KERNEL_BUILDER(                                                                              \
      Name("TfdeRedisInsert").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), RedisInsertOp<TK>)
TFDE_REGISTER_REDIS(int32_t);
TFDE_REGISTER_REDIS(int64_t);
TFDE_REGISTER_REDIS(tstring);

}  // namespace
}  // namespace tfde
