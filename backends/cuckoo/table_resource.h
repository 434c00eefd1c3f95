// The cuckoo table as a TensorFlow resource, and what every kernel of it
// needs: key views for the core, the thread pool, the table behind a handle,
// and the translation of the core's exceptions into statuses.  Shared by
// ops.cc (the table operations) and step_ops.cc (the fused training step).
#ifndef TFDE_BACKENDS_CUCKOO_TABLE_RESOURCE_H_
#define TFDE_BACKENDS_CUCKOO_TABLE_RESOURCE_H_

#include <cstdint>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cuckoo_table.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfde {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::tstring;
namespace errors = ::tensorflow::errors;

// A table as TF sees it: dtypes and dim fixed at creation.
class TableResource : public ::tensorflow::ResourceBase {
 public:
  TableResource(DataType key_dtype, DataType value_dtype, int64_t dim)
      : key_dtype_(key_dtype),
        value_dtype_(value_dtype),
        dim_(dim),
        value_bytes_(dim * ::tensorflow::DataTypeSize(value_dtype)) {}
  DataType key_dtype() const { return key_dtype_; }
  DataType value_dtype() const { return value_dtype_; }
  int64_t dim() const { return dim_; }
  int64_t value_bytes() const { return value_bytes_; }
  std::string Describe() const {
    return "cuckoo table " + DataTypeString(key_dtype_) + " -> " + DataTypeString(value_dtype_) + "[" +
           std::to_string(dim_) + "]";
  }
  std::string DebugString() const override { return Describe(); }

 private:
  const DataType key_dtype_;
  const DataType value_dtype_;
  const int64_t dim_;
  const int64_t value_bytes_;
};

template <class K>
class TypedTable : public TableResource {
 public:
  TypedTable(DataType kd, DataType vd, int64_t dim, int64_t expected_rows)
      : TableResource(kd, vd, dim), core(value_bytes(), expected_rows) {}
  int64_t MemoryUsed() const override { return core.MemoryBytes(); }
  CuckooTable<K> core;
};

// Tensor key type -> core key type.
template <class TK>
struct CoreKey {
  using type = TK;
};
template <>
struct CoreKey<tstring> {
  using type = std::string;
};

// Key views for the core: int tensors are used in place, strings are viewed.
template <class TK>
struct KeyViews {
  using View = typename KeyTraits<typename CoreKey<TK>::type>::View;
  explicit KeyViews(const Tensor& keys) : data(keys.flat<TK>().data()) {}
  const View* data;
};
template <>
struct KeyViews<tstring> {
  using View = std::string_view;
  explicit KeyViews(const Tensor& keys) {
    auto flat = keys.flat<tstring>();
    storage.reserve(flat.size());
    for (int64_t i = 0; i < flat.size(); ++i) storage.emplace_back(flat(i).data(), flat(i).size());
    data = storage.data();
  }
  std::vector<std::string_view> storage;
  const std::string_view* data;
};

inline ParallelFor PoolOf(OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](int64_t total, int64_t cost, const std::function<void(int64_t, int64_t)>& work) {
    pool->ParallelFor(total, cost, work);
  };
}

// A table that cannot take more rows (its memory or its row ids are
// exhausted: CapacityError, std::bad_alloc from a container, std::length_error
// from a vector asked to outgrow max_size) fails with RESOURCE_EXHAUSTED and a
// message that starts with "tfde.CapacityError: ", which tfde/errors.py
// from_op_error turns back into tfde.CapacityError eagerly (graphs raise
// tf.errors.ResourceExhaustedError, its base class).  Any other error of the
// core is a bad argument.
constexpr char kCapacityPrefix[] = "tfde.CapacityError: ";
#define TFDE_CATCH(ctx, op_name)                                                                                \
  catch (const CapacityError& e) {                                                                              \
    (ctx)->CtxFailure(errors::ResourceExhausted(kCapacityPrefix, op_name, ": ", e.what()));                     \
  }                                                                                                             \
  catch (const std::bad_alloc&) {                                                                               \
    (ctx)->CtxFailure(errors::ResourceExhausted(kCapacityPrefix, op_name, ": out of memory"));                  \
  }                                                                                                             \
  catch (const std::length_error& e) {                                                                          \
    (ctx)->CtxFailure(errors::ResourceExhausted(kCapacityPrefix, op_name, ": out of memory (", e.what(), ")")); \
  }                                                                                                             \
  catch (const std::exception& e) {                                                                             \
    (ctx)->CtxFailure(errors::InvalidArgument(op_name, ": ", e.what()));                                        \
  }

// The table behind input `input`, or nullptr (and a failed ctx) when there is none.
inline TableResource* ResolveAny(OpKernelContext* ctx, int input,
                                 ::tensorflow::core::RefCountPtr<TableResource>* holder) {
  TableResource* raw = nullptr;
  auto status = ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, input), &raw);
  if (!status.ok()) {
    ctx->CtxFailure(errors::FailedPrecondition(
        "tfde table not found (was it destroyed, or created in another process?): ", status.message()));
    return nullptr;
  }
  holder->reset(raw);
  return raw;
}

}  // namespace tfde

#endif  // TFDE_BACKENDS_CUCKOO_TABLE_RESOURCE_H_
