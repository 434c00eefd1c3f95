// TfdeRedisFind: reads rows of a tfde Redis table from inside a TensorFlow
// graph (serving exports that keep reading Redis, tfde/saving/serving.py).
// Thin: validates shapes, routes keys to buckets as tfde/tables/redis_table.py
// lays them out, and asks resp_client.h for the fields.  Read-only.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "../cuckoo/hash.h"
#include "../cuckoo/op_support.h"
#include "resp_client.h"
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

template <class TK>
class RedisFindOp : public OpKernel {
 public:
  explicit RedisFindOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadInitSpec(ctx, &missing_.spec));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tvalue", &value_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("buckets", &buckets_));
    OP_REQUIRES(ctx, dim_ >= 1 && dim_ <= kMaxDim,
                errors::InvalidArgument("dim must be between 1 and ", kMaxDim, ", got ", dim_));
    OP_REQUIRES(ctx, !buckets_.empty(), errors::InvalidArgument("a Redis table needs at least one bucket"));
    resp::Config config;
    std::vector<std::string> servers;
    std::string password_env, sentinel_password_env;
    int64_t mode, db, connect_ms, socket_ms, retries;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("servers", &servers));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mode", &mode));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("master_name", &config.master_name));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("db", &db));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("user", &config.user));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("password_env", &password_env));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sentinel_user", &config.sentinel_user));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sentinel_password_env", &sentinel_password_env));
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
    // Passwords are never in the graph: they come from the environment of
    // the process that runs it.
    if (!password_env.empty() && std::getenv(password_env.c_str()) != nullptr)
      config.password = std::getenv(password_env.c_str());
    if (!sentinel_password_env.empty() && std::getenv(sentinel_password_env.c_str()) != nullptr)
      config.sentinel_password = std::getenv(sentinel_password_env.c_str());
    config.mode = static_cast<int>(mode);
    config.db = static_cast<int>(db);
    config.connect_timeout_ms = static_cast<int>(connect_ms);
    config.socket_timeout_ms = static_cast<int>(socket_ms);
    config.retries = static_cast<int>(retries);
    reader_ = std::make_unique<resp::Reader>(std::move(config));
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
    auto flat = keys.flat<TK>();
    const uint64_t nb = buckets_.size();
    std::vector<uint64_t> hashes(n);
    std::vector<std::string> fields(n);
    std::vector<std::vector<std::string_view>> by_bucket(nb);
    std::vector<std::vector<int64_t>> positions(nb);
    for (int64_t i = 0; i < n; ++i) {
      hashes[i] = HashOf<TK>(flat(i));
      fields[i] = FieldOf<TK>(flat(i));
      // The bucket: the low half of the stable hash, multiply-shift.
      const uint64_t b = ((hashes[i] & 0xFFFFFFFFULL) * nb) >> 32;
      by_bucket[b].push_back(fields[i]);
      positions[b].push_back(i);
    }
    char* out = const_cast<char*>(values->tensor_data().data());
    bool* ex = exists->flat<bool>().data();
    OP_REQUIRES_OK(ctx, WithValueType(value_dtype_, [&](auto v) {
      using V = decltype(v);
      const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(V);
      try {
        reader_->HMGet(buckets_, by_bucket, [&](size_t b, size_t j, const std::string* value) {
          const int64_t i = positions[b][j];
          if (value == nullptr) {
            missing.template Fill<V>(i, hashes[i], dim_, out + i * row_bytes);
            ex[i] = false;
            return;
          }
          if (value->size() != row_bytes)
            throw std::length_error("a row in " + buckets_[b] + " has " + std::to_string(value->size()) +
                                    " bytes, expected " + std::to_string(row_bytes) + " for " + Describe() +
                                    ": the table holds another dim or dtype");
          std::memcpy(out + i * row_bytes, value->data(), row_bytes);
          ex[i] = true;
        });
      } catch (const resp::Error& e) {
        ctx->CtxFailure(e.transient() ? errors::Unavailable("tfde Redis read: ", e.what())
                                      : errors::FailedPrecondition("tfde Redis read: ", e.what()));
      } catch (const std::exception& e) {
        ctx->CtxFailure(errors::InvalidArgument("tfde Redis read: ", e.what()));
      }
    }));
  }

 private:
  std::string Describe() const {
    return "Redis table " + DataTypeString(::tensorflow::DataTypeToEnum<TK>::value) + " -> " +
           DataTypeString(value_dtype_) + "[" + std::to_string(dim_) + "] on " + reader_->Describe();
  }

  MissingRows missing_;
  int64_t dim_ = 0;
  DataType value_dtype_ = ::tensorflow::DT_INVALID;
  std::vector<std::string> buckets_;  // full Redis key of each bucket, in bucket order
  std::unique_ptr<resp::Reader> reader_;
};

REGISTER_OP("TfdeRedisFind")
    .Input("keys: Tkey")
    .Input("defaults: Tvalue")
    .Output("values: Tvalue")
    .Output("exists: bool")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .Attr("dim: int")
    .Attr("buckets: list(string)")
    .Attr("mode: int")
    .Attr("servers: list(string)")
    .Attr("master_name: string = ''")
    .Attr("db: int = 0")
    .Attr("user: string = ''")
    .Attr("password_env: string = ''")
    .Attr("sentinel_user: string = ''")
    .Attr("sentinel_password_env: string = ''")
    .Attr("connect_timeout_ms: int = 1000")
    .Attr("socket_timeout_ms: int = 1000")
    .Attr("retries: int = 4")
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

#define TFDE_REGISTER_REDIS_FIND(TK) \
  REGISTER_KERNEL_BUILDER(           \
      Name("TfdeRedisFind").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), RedisFindOp<TK>)
TFDE_REGISTER_REDIS_FIND(int32_t);
TFDE_REGISTER_REDIS_FIND(int64_t);
TFDE_REGISTER_REDIS_FIND(tstring);

}  // namespace
}  // namespace tfde
