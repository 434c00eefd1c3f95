// Pieces shared by tfde's TensorFlow op kernels (cuckoo tables, Redis
// serving reads): value-type dispatch, the init attrs, the rows a missing
// key reads, and the rule attrs of the fused step's apply ops.
// TensorFlow-dependent; the table cores are not.
#ifndef TFDE_BACKENDS_CUCKOO_OP_SUPPORT_H_
#define TFDE_BACKENDS_CUCKOO_OP_SUPPORT_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "init_rows.h"
#include "rules.h"
#include "tensorflow/core/framework/bfloat16.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfde {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::Tensor;
namespace errors = ::tensorflow::errors;

constexpr int64_t kMaxDim = 1 << 16;  // widest row a table accepts

// The `dim` attr of an op, checked.  Shape functions must call this before
// they size an output by it: InferenceContext aborts the process on a
// negative dimension (a CHECK failure, not an error).
inline ::absl::Status CheckDimAttr(int64_t dim) {
  if (dim < 1 || dim > kMaxDim) return errors::InvalidArgument("dim must be between 1 and ", kMaxDim, ", got ", dim);
  return ::absl::OkStatus();
}

// Runs `body` with V bound to the C++ type of `dtype`.
template <class Body>
::absl::Status WithValueType(DataType dtype, Body body) {
  switch (dtype) {
    case ::tensorflow::DT_FLOAT:
      body(float{});
      return ::absl::OkStatus();
    case ::tensorflow::DT_DOUBLE:
      body(double{});
      return ::absl::OkStatus();
    case ::tensorflow::DT_HALF:
      body(Eigen::half{});
      return ::absl::OkStatus();
    case ::tensorflow::DT_BFLOAT16:
      body(::tensorflow::bfloat16{});
      return ::absl::OkStatus();
    default:
      return errors::InvalidArgument("tfde tables hold float32, float64, float16 or bfloat16 values, not ",
                                     DataTypeString(dtype));
  }
}

// Reads the init attrs shared by find and accum.
inline ::absl::Status ReadInitSpec(OpKernelConstruction* ctx, InitSpec* spec) {
  std::string kind;
  float p0 = 0, p1 = 0;
  int64_t seed = 0;
  TF_RETURN_IF_ERROR(ctx->GetAttr("init_kind", &kind));
  TF_RETURN_IF_ERROR(ctx->GetAttr("init_p0", &p0));
  TF_RETURN_IF_ERROR(ctx->GetAttr("init_p1", &p1));
  TF_RETURN_IF_ERROR(ctx->GetAttr("init_seed", &seed));
  try {
    spec->kind = ParseInitKind(kind);
  } catch (const std::exception& e) {
    return errors::InvalidArgument(e.what());
  }
  spec->p0 = p0;
  spec->p1 = p1;
  spec->seed = seed;
  return ::absl::OkStatus();
}

// A fused apply's gradients and scalars (its Tgrad) are in the dtype the
// table's rule computes in: double for float64 tables, float for the others
// (tfde/optimizer_rules.py compute_dtype).
inline ::absl::Status CheckGradDtype(DataType value, DataType grad) {
  const DataType compute = value == ::tensorflow::DT_DOUBLE ? ::tensorflow::DT_DOUBLE : ::tensorflow::DT_FLOAT;
  if (grad == compute) return ::absl::OkStatus();
  return errors::InvalidArgument("gradients of ", DataTypeString(value), " tables are computed in ",
                                 DataTypeString(compute), ", got ", DataTypeString(grad));
}

// The dtypes an accum op (TfdeTableAccum, TfdeRedisAccum) takes deltas in
// for a table of `value`: the table's own, float32 or float64.  The sum is
// taken in the wider of the two compute types (float32 for half and
// bfloat16) and rounded to the table's type once; a float64 sum goes to
// half and bfloat16 through float32, as TensorFlow's cast goes
// (docs/guide.md, `accum`).
inline ::absl::Status CheckDeltaDtype(DataType value, DataType delta) {
  if (delta == value || delta == ::tensorflow::DT_FLOAT || delta == ::tensorflow::DT_DOUBLE) return ::absl::OkStatus();
  return errors::InvalidArgument("deltas for a ", DataTypeString(value), " table must be ", DataTypeString(value),
                                 ", float or double, got ", DataTypeString(delta));
}

// Reads the rule attrs shared by the fused step's apply ops (TfdeTableApply,
// TfdeRedisApply): `rule` and its options into `spec`, and the slots'
// initial values.
inline ::absl::Status ReadRuleAttrs(OpKernelConstruction* ctx, std::string* rule, RuleSpec* spec,
                                    std::vector<float>* slot_init) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("rule", rule));
  try {
    spec->kind = ParseRuleKind(*rule);
  } catch (const std::exception& e) {
    return errors::InvalidArgument(e.what());
  }
  TF_RETURN_IF_ERROR(ctx->GetAttr("momentum", &spec->momentum));
  TF_RETURN_IF_ERROR(ctx->GetAttr("nesterov", &spec->nesterov));
  TF_RETURN_IF_ERROR(ctx->GetAttr("amsgrad", &spec->amsgrad));
  TF_RETURN_IF_ERROR(ctx->GetAttr("centered", &spec->centered));
  return ctx->GetAttr("slot_init", slot_init);
}

// Reads the policy-state attrs shared by the fused step's apply ops: `S`
// state tables, each with a `state_mode` ("add": the written key's state
// plus the step's value, a count; "set": the value, a time) and a
// `state_init` (an absent key's state).  `adds` gets one flag per table.
inline ::absl::Status ReadStateAttrs(OpKernelConstruction* ctx, int* count, std::vector<bool>* adds,
                                     std::vector<float>* init) {
  std::vector<std::string> modes;
  TF_RETURN_IF_ERROR(ctx->GetAttr("S", count));
  TF_RETURN_IF_ERROR(ctx->GetAttr("state_mode", &modes));
  TF_RETURN_IF_ERROR(ctx->GetAttr("state_init", init));
  if (modes.size() != static_cast<size_t>(*count) || init->size() != modes.size())
    return errors::InvalidArgument("state_mode and state_init need one entry per state table (S = ", *count, "), got ",
                                   modes.size(), " and ", init->size());
  adds->clear();
  for (size_t i = 0; i < modes.size(); ++i) {
    if (modes[i] != "add" && modes[i] != "set")
      return errors::InvalidArgument("state_mode[", i, "] must be 'add' or 'set', got '", modes[i], "'");
    adds->push_back(modes[i] == "add");
  }
  return ::absl::OkStatus();
}

// Source of a missing key's row: the `defaults` tensor ([n, dim] or [1, dim])
// or the init spec.  Validated once; Fill is then safe for any i < n.
struct MissingRows {
  InitSpec spec;
  const char* defaults = nullptr;  // set when spec.kind == kDefaults
  bool broadcast = false;          // defaults is a single row

  // `dim` and `what` (for messages) describe the store the rows are for.
  ::absl::Status Prepare(const Tensor& t, int64_t n, int64_t dim, const std::string& what) {
    if (spec.kind != InitKind::kDefaults) return ::absl::OkStatus();
    const bool ok_shape = t.dims() == 2 && t.dim_size(1) == dim && (t.dim_size(0) == n || t.dim_size(0) == 1);
    if (!ok_shape)
      return errors::InvalidArgument("defaults must have shape [", n, ", ", dim, "] or [1, ", dim, "] for ", n,
                                     " keys and a ", what, ", got ", t.shape().DebugString());
    defaults = static_cast<const char*>(t.tensor_data().data());
    broadcast = t.dim_size(0) == 1 && n != 1;
    return ::absl::OkStatus();
  }

  template <class V>
  void Fill(int64_t i, uint64_t hash, int64_t dim, char* out) const {
    if (spec.kind == InitKind::kDefaults) {
      std::memcpy(out, defaults + (broadcast ? 0 : i) * dim * sizeof(V), dim * sizeof(V));
    } else {
      FillInitialRow<V>(spec, hash, dim, reinterpret_cast<V*>(out));
    }
  }
};

}  // namespace tfde

#endif  // TFDE_BACKENDS_CUCKOO_OP_SUPPORT_H_
