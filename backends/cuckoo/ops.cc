// TensorFlow ops of the tfde cuckoo backend.  Thin: each kernel validates
// dtypes and shapes, converts tensors and calls the core in cuckoo_table.h.
// Every shape is checked before any memory is touched.
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cuckoo_table.h"
#include "init_rows.h"
#include "op_support.h"
#include "table_resource.h"
#include "tensorflow/core/framework/bfloat16.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfde {
namespace {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::tstring;
namespace errors = ::tensorflow::errors;
namespace shape_inference = ::tensorflow::shape_inference;

// Large outputs are written once, right after allocation: asking for
// transparent huge pages first turns ~500 page faults (and their kernel
// entries) into one per 2 MiB.  Only the 2 MiB-aligned interior is advised.
constexpr size_t kHugePage = 2u << 20;
void AdviseHugePages(const Tensor& t) {
  const auto data = t.tensor_data();
  if (data.size() < 4 * kHugePage) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data.data()) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data.data()) + data.size()) & ~(kHugePage - 1);
#ifdef MADV_HUGEPAGE
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

// ---------------------------------------------------------------- create

class CreateTableOp : public OpKernel {
 public:
  explicit CreateTableOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key_dtype", &key_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("value_dtype", &value_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("expected_rows", &expected_rows_));
    OP_REQUIRES(ctx, dim_ >= 1 && dim_ <= kMaxDim,
                errors::InvalidArgument("dim must be between 1 and ", kMaxDim, ", got ", dim_));
    OP_REQUIRES(ctx, expected_rows_ >= 0, errors::InvalidArgument("expected_rows must be >= 0, got ", expected_rows_));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::ContainerInfo cinfo;
    OP_REQUIRES_OK(ctx, cinfo.Init(ctx->resource_manager(), def(), /*use_node_name_as_default=*/true));
    TableResource* table = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->resource_manager()->LookupOrCreate<TableResource>(
                       cinfo.container(), cinfo.name(), &table, [this](TableResource** out) { return Create(out); }));
    ::tensorflow::core::ScopedUnref unref(table);
    OP_REQUIRES(
        ctx, table->key_dtype() == key_dtype_ && table->value_dtype() == value_dtype_ && table->dim() == dim_,
        errors::InvalidArgument("table '", cinfo.name(), "' already exists as a ", table->Describe(), "; asked for ",
                                DataTypeString(key_dtype_), " -> ", DataTypeString(value_dtype_), "[", dim_,
                                "]. Use another name or the same dtypes and dim."));
    Tensor* handle = nullptr;
    ::tensorflow::AllocatorAttributes attr;
    attr.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &handle, attr));
    handle->scalar<::tensorflow::ResourceHandle>()() =
        ::tensorflow::MakeResourceHandle<TableResource>(ctx, cinfo.container(), cinfo.name());
  }

 private:
  ::absl::Status Create(TableResource** out) {
    try {
      switch (key_dtype_) {
        case ::tensorflow::DT_INT64:
          *out = new TypedTable<int64_t>(key_dtype_, value_dtype_, dim_, expected_rows_);
          return ::absl::OkStatus();
        case ::tensorflow::DT_INT32:
          *out = new TypedTable<int32_t>(key_dtype_, value_dtype_, dim_, expected_rows_);
          return ::absl::OkStatus();
        case ::tensorflow::DT_STRING:
          *out = new TypedTable<std::string>(key_dtype_, value_dtype_, dim_, expected_rows_);
          return ::absl::OkStatus();
        default:
          return errors::InvalidArgument("keys must be int32, int64 or string, not ", DataTypeString(key_dtype_));
      }
    } catch (const CapacityError& e) {
      return errors::ResourceExhausted(kCapacityPrefix, "creating a cuckoo table: ", e.what());
    } catch (const std::bad_alloc&) {
      return errors::ResourceExhausted(kCapacityPrefix, "creating a cuckoo table: out of memory");
    } catch (const std::length_error& e) {
      return errors::ResourceExhausted(kCapacityPrefix, "creating a cuckoo table: out of memory (", e.what(), ")");
    } catch (const std::exception& e) {
      return errors::InvalidArgument("creating a cuckoo table: ", e.what());
    }
  }

  DataType key_dtype_, value_dtype_;
  int64_t dim_ = 0, expected_rows_ = 0;
};

// ---------------------------------------------------------------- base

// Resolves input 0 to a table whose key dtype is TK; checks `keys` (input 1)
// is a vector and, when the op has a Tvalue attr, that it matches the table.
template <class TK>
class TableOpBase : public OpKernel {
 public:
  using K = typename CoreKey<TK>::type;

  explicit TableOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (HasNodeAttr(ctx->def(), "Tvalue")) OP_REQUIRES_OK(ctx, ctx->GetAttr("Tvalue", &value_dtype_));
    has_dim_attr_ = HasNodeAttr(ctx->def(), "dim");
    if (has_dim_attr_) OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_attr_));
  }

 protected:
  static bool HasNodeAttr(const ::tensorflow::NodeDef& def, const char* name) { return def.attr().count(name) > 0; }

  // Returns nullptr (and fails ctx) when the handle or dtypes are wrong.
  TypedTable<K>* Resolve(OpKernelContext* ctx, ::tensorflow::core::RefCountPtr<TableResource>* holder) {
    TableResource* raw = ResolveAny(ctx, 0, holder);
    if (raw == nullptr) return nullptr;
    const DataType want_key = ::tensorflow::DataTypeToEnum<TK>::value;
    if (raw->key_dtype() != want_key) {
      ctx->CtxFailure(errors::InvalidArgument("keys are ", DataTypeString(want_key), " but the table is a ",
                                              raw->Describe(), "; cast the keys to ",
                                              DataTypeString(raw->key_dtype())));
      return nullptr;
    }
    if (value_dtype_ != ::tensorflow::DT_INVALID && raw->value_dtype() != value_dtype_) {
      ctx->CtxFailure(errors::InvalidArgument("values are ", DataTypeString(value_dtype_), " but the table is a ",
                                              raw->Describe()));
      return nullptr;
    }
    // Graphs take the outputs' static shape from the dim attr: one that is
    // not the table's would make them lie about it.
    if (has_dim_attr_ && raw->dim() != dim_attr_) {
      ctx->CtxFailure(errors::InvalidArgument("the op's dim attr is ", dim_attr_, " but the table is a ",
                                              raw->Describe(), "; pass dim=", raw->dim()));
      return nullptr;
    }
    return static_cast<TypedTable<K>*>(raw);
  }

  static bool CheckKeys(OpKernelContext* ctx, const Tensor& keys) {
    if (keys.dims() != 1) {
      ctx->CtxFailure(errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
      return false;
    }
    return true;
  }

  // values must be [n, table.dim()].
  static bool CheckRows(OpKernelContext* ctx, const char* what, const Tensor& rows, int64_t n,
                        const TableResource& table) {
    if (rows.dims() != 2 || rows.dim_size(0) != n || rows.dim_size(1) != table.dim()) {
      ctx->CtxFailure(errors::InvalidArgument(what, " must have shape [", n, ", ", table.dim(), "] for ", n,
                                              " keys and a ", table.Describe(), ", got ", rows.shape().DebugString()));
      return false;
    }
    return true;
  }

  DataType value_dtype_ = ::tensorflow::DT_INVALID;
  bool has_dim_attr_ = false;  // find and export have a dim attr
  int64_t dim_attr_ = 0;
};

// ---------------------------------------------------------------- find

template <class TK>
class FindOp : public TableOpBase<TK> {
 public:
  explicit FindOp(OpKernelConstruction* ctx) : TableOpBase<TK>(ctx) {
    OP_REQUIRES_OK(ctx, ReadInitSpec(ctx, &missing_.spec));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    TypedTable<typename TableOpBase<TK>::K>* table = this->Resolve(ctx, &holder);
    if (table == nullptr) return;
    const Tensor& keys = ctx->input(1);
    if (!this->CheckKeys(ctx, keys)) return;
    const int64_t n = keys.dim_size(0);
    MissingRows missing = missing_;
    OP_REQUIRES_OK(ctx, missing.Prepare(ctx->input(2), n, table->dim(), table->Describe()));
    Tensor* values = nullptr;
    Tensor* exists = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, table->dim()}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &exists));
    if (n == 0) return;
    AdviseHugePages(*values);
    char* out = const_cast<char*>(values->tensor_data().data());
    bool* ex = exists->flat<bool>().data();
    const int64_t vb = table->value_bytes(), dim = table->dim();
    KeyViews<TK> views(keys);
    const bool streaming = n * vb >= kStreamingCopyBytes;
    OP_REQUIRES_OK(ctx, WithValueType(table->value_dtype(), [&](auto v) {
                     using V = decltype(v);
                     try {
                       table->core.Find(
                           views.data, n, PoolOf(ctx),
                           [&](int64_t i, const char* row) {
                             CopyRow(out + i * vb, row, vb, streaming);
                             ex[i] = true;
                           },
                           [&](int64_t i, uint64_t hash) {
                             missing.template Fill<V>(i, hash, dim, out + i * vb);
                             ex[i] = false;
                           });
                     }
                     TFDE_CATCH(ctx, "find")
                   }));
  }

 private:
  MissingRows missing_;
};

// ---------------------------------------------------------------- insert / accum

template <class TK>
class InsertOp : public TableOpBase<TK> {
 public:
  using TableOpBase<TK>::TableOpBase;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    auto* table = this->Resolve(ctx, &holder);
    if (table == nullptr) return;
    const Tensor& keys = ctx->input(1);
    const Tensor& values = ctx->input(2);
    if (!this->CheckKeys(ctx, keys)) return;
    const int64_t n = keys.dim_size(0);
    if (!this->CheckRows(ctx, "values", values, n, *table)) return;
    if (n == 0) return;
    const char* src = values.tensor_data().data();
    const int64_t vb = table->value_bytes();
    KeyViews<TK> views(keys);
    // Plain stores, also for big batches: streaming stores measured no
    // faster for inserts (row_copy.h).
    try {
      table->core.Upsert(views.data, n, PoolOf(ctx),
                         [&](int64_t i, char* row, bool, uint64_t) { std::memcpy(row, src + i * vb, vb); });
    }
    TFDE_CATCH(ctx, "insert")
  }
};

template <class TK>
class AccumOp : public TableOpBase<TK> {
 public:
  explicit AccumOp(OpKernelConstruction* ctx) : TableOpBase<TK>(ctx) {
    OP_REQUIRES_OK(ctx, ReadInitSpec(ctx, &missing_.spec));
  }
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    auto* table = this->Resolve(ctx, &holder);
    if (table == nullptr) return;
    const Tensor& keys = ctx->input(1);
    const Tensor& deltas = ctx->input(2);
    if (!this->CheckKeys(ctx, keys)) return;
    const int64_t n = keys.dim_size(0);
    if (!this->CheckRows(ctx, "deltas", deltas, n, *table)) return;
    OP_REQUIRES_OK(ctx, CheckDeltaDtype(table->value_dtype(), deltas.dtype()));
    MissingRows missing = missing_;
    OP_REQUIRES_OK(ctx, missing.Prepare(ctx->input(3), n, table->dim(), table->Describe()));
    if (n == 0) return;
    const int64_t dim = table->dim();
    KeyViews<TK> views(keys);
    // The sum is taken in the wider of the row's and the delta's compute
    // type (half and bfloat16 compute in float) and rounded to the row's
    // type once.
    OP_REQUIRES_OK(
        ctx, WithValueType(table->value_dtype(), [&](auto v) {
          using V = decltype(v);
          OP_REQUIRES_OK(
              ctx, WithValueType(deltas.dtype(), [&](auto dv) {
                using D = decltype(dv);
                using Acc = std::conditional_t<std::is_same_v<V, double> || std::is_same_v<D, double>, double, float>;
                const D* delta = reinterpret_cast<const D*>(deltas.tensor_data().data());
                try {
                  table->core.Upsert(views.data, n, PoolOf(ctx),
                                     [&](int64_t i, char* row, bool created, uint64_t hash) {
                                       if (created) missing.template Fill<V>(i, hash, dim, row);
                                       V* r = reinterpret_cast<V*>(row);
                                       const D* d = delta + i * dim;
                                       for (int64_t j = 0; j < dim; ++j)
                                         r[j] = static_cast<V>(static_cast<Acc>(r[j]) + static_cast<Acc>(d[j]));
                                     });
                }
                TFDE_CATCH(ctx, "accum")
              }));
        }));
  }

 private:
  MissingRows missing_;
};

// ---------------------------------------------------------------- remove / clear / size

template <class TK>
class RemoveOp : public TableOpBase<TK> {
 public:
  using TableOpBase<TK>::TableOpBase;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    auto* table = this->Resolve(ctx, &holder);
    if (table == nullptr) return;
    const Tensor& keys = ctx->input(1);
    if (!this->CheckKeys(ctx, keys)) return;
    Tensor* removed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &removed));
    removed->scalar<int64_t>()() = 0;
    const int64_t n = keys.dim_size(0);
    if (n == 0) return;
    KeyViews<TK> views(keys);
    try {
      removed->scalar<int64_t>()() = table->core.Remove(views.data, n, PoolOf(ctx));
    }
    TFDE_CATCH(ctx, "remove")
  }
};

template <class Fn>
void WithTypedTable(TableResource* t, Fn fn) {
  switch (t->key_dtype()) {
    case ::tensorflow::DT_INT64:
      fn(static_cast<TypedTable<int64_t>*>(t));
      break;
    case ::tensorflow::DT_INT32:
      fn(static_cast<TypedTable<int32_t>*>(t));
      break;
    default:
      fn(static_cast<TypedTable<std::string>*>(t));
      break;
  }
}

class ClearOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    TableResource* t = ResolveAny(ctx, 0, &holder);
    if (t != nullptr) WithTypedTable(t, [](auto* typed) { typed->core.Clear(); });
  }
};

class SizeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    TableResource* t = ResolveAny(ctx, 0, &holder);
    if (t == nullptr) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    WithTypedTable(t, [&](auto* typed) { out->scalar<int64_t>()() = typed->core.Size(); });
  }
};

class MemoryOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    TableResource* t = ResolveAny(ctx, 0, &holder);
    if (t == nullptr) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = t->MemoryUsed();
  }
};

// ---------------------------------------------------------------- export

template <class TK>
class ExportOp : public TableOpBase<TK> {
 public:
  using TableOpBase<TK>::TableOpBase;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> holder;
    auto* table = this->Resolve(ctx, &holder);
    if (table == nullptr) return;
    const Tensor& cursor_t = ctx->input(1);
    const Tensor& max_rows_t = ctx->input(2);
    OP_REQUIRES(ctx, cursor_t.dims() == 0 && max_rows_t.dims() == 0,
                errors::InvalidArgument("cursor and max_rows must be scalars"));
    const int64_t cursor = cursor_t.scalar<int64_t>()();
    const int64_t max_rows = max_rows_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, cursor >= 0, errors::InvalidArgument("export cursor must be >= 0, got ", cursor));
    OP_REQUIRES(ctx, max_rows > 0, errors::InvalidArgument("export max_rows must be > 0, got ", max_rows));
    // Rows go straight into the outputs, allocated for at most the rows the
    // table holds now; rows inserted meanwhile wait for the next chunk (the
    // cursor says where it starts), rows removed meanwhile leave the outputs
    // shorter (a prefix slice of the same buffers).
    const int64_t vb = table->value_bytes();
    const int64_t cap = std::min<int64_t>(max_rows, table->core.Size());
    Tensor keys_t, values_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DataTypeToEnum<TK>::value, TensorShape({cap}), &keys_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(table->value_dtype(), TensorShape({cap, table->dim()}), &values_t));
    AdviseHugePages(values_t);
    auto kflat = keys_t.flat<TK>();
    char* vdst = const_cast<char*>(values_t.tensor_data().data());
    int64_t m = 0, next = -1;
    try {
      next = table->core.Export(cursor, std::max<int64_t>(cap, 1), [&](const auto& k, const char* row) {
        if (m == cap) return;  // only when cap == 0: the walk then returns at the first row
        kflat(m) = TK(k);
        std::memcpy(vdst + m * vb, row, vb);
        ++m;
      });
    }
    TFDE_CATCH(ctx, "export")
    if (!ctx->status().ok()) return;
    if (cap == 0) next = next < 0 ? -1 : cursor;  // empty output; resume where we were
    ctx->set_output(0, keys_t.Slice(0, m));
    ctx->set_output(1, values_t.Slice(0, m));
    Tensor* next_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &next_out));
    next_out->scalar<int64_t>()() = next;
  }
};

// ---------------------------------------------------------------- hashing / init

template <class TK>
class StableHashOp : public OpKernel {
 public:
  explicit StableHashOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shards", &num_shards_));
    // Shards are int32 outputs: more than 2^31 - 1 would wrap.
    OP_REQUIRES(ctx, num_shards_ >= 0 && num_shards_ <= std::numeric_limits<int32_t>::max(),
                errors::InvalidArgument("num_shards must be between 0 and 2147483647, got ", num_shards_));
  }
  // Output 0: the stable hash as int64 (same bits as the uint64);
  // output 1: the shard among num_shards (0 when num_shards == 0).
  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    Tensor *hash = nullptr, *shard = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &hash));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys.shape(), &shard));
    auto in = keys.flat<TK>();
    auto h = hash->flat<int64_t>();
    auto s = shard->flat<int32_t>();
    for (int64_t i = 0; i < in.size(); ++i) {
      uint64_t v;
      if constexpr (std::is_same_v<TK, tstring>) {
        v = StableHash(std::string_view(in(i).data(), in(i).size()));
      } else {
        v = StableHash(in(i));
      }
      h(i) = static_cast<int64_t>(v);
      s(i) = num_shards_ > 0 ? ShardOf(v, static_cast<int32_t>(num_shards_)) : 0;
    }
  }

 private:
  int64_t num_shards_ = 0;
};

template <class TK>
class InitRowsOp : public OpKernel {
 public:
  explicit InitRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadInitSpec(ctx, &spec_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tvalue", &value_dtype_));
    OP_REQUIRES(ctx, dim_ >= 1 && dim_ <= kMaxDim,
                errors::InvalidArgument("dim must be between 1 and ", kMaxDim, ", got ", dim_));
    OP_REQUIRES(ctx, spec_.kind != InitKind::kDefaults,
                errors::InvalidArgument("init_kind 'defaults' generates nothing"));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    OP_REQUIRES(ctx, keys.dims() == 1,
                errors::InvalidArgument("keys must be a vector, got shape ", keys.shape().DebugString()));
    const int64_t n = keys.dim_size(0);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &out));
    auto in = keys.flat<TK>();
    OP_REQUIRES_OK(ctx, WithValueType(value_dtype_, [&](auto v) {
                     using V = decltype(v);
                     V* o = reinterpret_cast<V*>(const_cast<char*>(out->tensor_data().data()));
                     for (int64_t i = 0; i < n; ++i) {
                       uint64_t h;
                       if constexpr (std::is_same_v<TK, tstring>) {
                         h = StableHash(std::string_view(in(i).data(), in(i).size()));
                       } else {
                         h = StableHash(in(i));
                       }
                       FillInitialRow<V>(spec_, h, dim_, o + i * dim_);
                     }
                   }));
  }

 private:
  InitSpec spec_;
  int64_t dim_ = 0;
  DataType value_dtype_;
};

// Forwards its input.  Stateful, so graph optimizers neither merge, fold nor
// move it, and keep its control inputs: tfde's write sections (a
// tf.CriticalSection per Variable) pass the keys of their writes through it,
// making every write depend on the section's lock by data, not only by
// control edges that an optimizer may judge redundant and drop.
class OrderedOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override { ctx->set_output(0, ctx->input(0)); }
};

// ---------------------------------------------------------------- registration

using ::tensorflow::shape_inference::InferenceContext;

::absl::Status RowsShape(InferenceContext* c, int keys_input, int output) {
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  TF_RETURN_IF_ERROR(CheckDimAttr(dim));
  shape_inference::ShapeHandle keys;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(keys_input), 1, &keys));
  c->set_output(output, c->Matrix(c->Dim(keys, 0), dim));
  return ::absl::OkStatus();
}

#define TFDE_INIT_ATTRS                                                                             \
  Attr("init_kind: {'defaults', 'constant', 'uniform', 'normal', 'truncated_normal'} = 'defaults'") \
      .Attr("init_p0: float = 0.0")                                                                 \
      .Attr("init_p1: float = 0.0")                                                                 \
      .Attr("init_seed: int = 0")

REGISTER_OP("TfdeCuckooTable")
    .Output("handle: resource")
    .Attr("key_dtype: {int32, int64, string}")
    .Attr("value_dtype: {float, double, half, bfloat16}")
    .Attr("dim: int")
    .Attr("expected_rows: int = 0")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeTableFind")
    .Input("handle: resource")
    .Input("keys: Tkey")
    .Input("defaults: Tvalue")
    .Output("values: Tvalue")
    .Output("exists: bool")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .Attr("dim: int")
    .TFDE_INIT_ATTRS.SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(RowsShape(c, 1, 0));
      c->set_output(1, c->Vector(c->Dim(c->input(1), 0)));
      return ::absl::OkStatus();
    });

REGISTER_OP("TfdeTableInsert")
    .Input("handle: resource")
    .Input("keys: Tkey")
    .Input("values: Tvalue")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);

REGISTER_OP("TfdeTableAccum")
    .Input("handle: resource")
    .Input("keys: Tkey")
    .Input("deltas: Tdelta")
    .Input("defaults: Tvalue")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .Attr("Tdelta: {float, double, half, bfloat16}")
    .TFDE_INIT_ATTRS.SetShapeFn(::tensorflow::shape_inference::NoOutputs);

REGISTER_OP("TfdeTableRemove")
    .Input("handle: resource")
    .Input("keys: Tkey")
    .Output("removed: int64")
    .Attr("Tkey: {int32, int64, string}")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeTableClear").Input("handle: resource").SetShapeFn(::tensorflow::shape_inference::NoOutputs);
REGISTER_OP("TfdeTableSize")
    .Input("handle: resource")
    .Output("size: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);
REGISTER_OP("TfdeTableMemoryBytes")
    .Input("handle: resource")
    .Output("bytes: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfdeTableExport")
    .Input("handle: resource")
    .Input("cursor: int64")
    .Input("max_rows: int64")
    .Output("keys: Tkey")
    .Output("values: Tvalue")
    .Output("next_cursor: int64")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .Attr("dim: int")
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      TF_RETURN_IF_ERROR(CheckDimAttr(dim));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, c->Matrix(InferenceContext::kUnknownDim, dim));
      c->set_output(2, c->Scalar());
      return ::absl::OkStatus();
    });

REGISTER_OP("TfdeStableHash")
    .Input("keys: Tkey")
    .Output("hash: int64")
    .Output("shard: int32")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("num_shards: int = 0")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return ::absl::OkStatus();
    });

REGISTER_OP("TfdeInitRows")
    .Input("keys: Tkey")
    .Output("values: Tvalue")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .Attr("dim: int")
    .TFDE_INIT_ATTRS.SetShapeFn([](InferenceContext* c) { return RowsShape(c, 0, 0); });

REGISTER_OP("TfdeOrdered")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: type")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);

REGISTER_KERNEL_BUILDER(Name("TfdeOrdered").Device(::tensorflow::DEVICE_CPU), OrderedOp);
REGISTER_KERNEL_BUILDER(Name("TfdeCuckooTable").Device(::tensorflow::DEVICE_CPU), CreateTableOp);
REGISTER_KERNEL_BUILDER(Name("TfdeTableClear").Device(::tensorflow::DEVICE_CPU), ClearOp);
REGISTER_KERNEL_BUILDER(Name("TfdeTableSize").Device(::tensorflow::DEVICE_CPU), SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfdeTableMemoryBytes").Device(::tensorflow::DEVICE_CPU), MemoryOp);

#define TFDE_REGISTER_KEYED(TK)                                                                                \
  REGISTER_KERNEL_BUILDER(Name("TfdeTableFind").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"),   \
                          FindOp<TK>);                                                                         \
  REGISTER_KERNEL_BUILDER(Name("TfdeTableInsert").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          InsertOp<TK>);                                                                       \
  REGISTER_KERNEL_BUILDER(Name("TfdeTableAccum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"),  \
                          AccumOp<TK>);                                                                        \
  REGISTER_KERNEL_BUILDER(Name("TfdeTableRemove").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          RemoveOp<TK>);                                                                       \
  REGISTER_KERNEL_BUILDER(Name("TfdeTableExport").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"), \
                          ExportOp<TK>);                                                                       \
  REGISTER_KERNEL_BUILDER(Name("TfdeStableHash").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"),  \
                          StableHashOp<TK>);                                                                   \
  REGISTER_KERNEL_BUILDER(Name("TfdeInitRows").Device(::tensorflow::DEVICE_CPU).TypeConstraint<TK>("Tkey"),    \
                          InitRowsOp<TK>);

TFDE_REGISTER_KEYED(int64_t)
TFDE_REGISTER_KEYED(int32_t)
TFDE_REGISTER_KEYED(tstring)

}  // namespace
}  // namespace tfde
