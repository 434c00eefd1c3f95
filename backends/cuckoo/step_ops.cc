// The fused training step of the cuckoo backend (docs/lookups.md, "The fused
// step"): TfdeTableLookup reads the rows of a step's lookups of several
// tables (below); TfdeTableApply writes one optimizer step of several tables.
//
// For each part (one Variable's row table, its optimizer slot tables, and
// this step's gradient of its step buffer) it does in one kernel what the
// Python path of tfde/optimizer.py does in ~40 TensorFlow ops:
//   1. sums the gradient rows per distinct key (a buffer may hold a key
//      twice: features sharing a table), in input order;
//   2. leaves out the keys whose summed gradient is not finite, and the
//      keys no gradient row names;
//   3. holds the rows of the others in the row table and every slot table
//      (inserting a missing row with the step buffer's row when given, else
//      its initial row; a missing slot with its initial value);
//   4. applies the optimizer rule (rules.h, the formulas of
//      tfde/optimizer_rules.py) to each row and its slots in place:
//      one pass over each table;
//   5. where the part has a restrict policy's state table (float64, one
//      value per key: tfde/policy.py FrequencyRestrictPolicy's counts,
//      TimestampRestrictPolicy's times), adds the step's value to each
//      written key's state ("add") or sets it ("set"), in the same pass
//      and under the same hold of the key's rows.
// Every input of every part is checked before anything is read or written,
// so a refused call changes nothing.
#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cuckoo_table.h"
#include "hash.h"
#include "init_rows.h"
#include "op_support.h"
#include "rules.h"
#include "table_resource.h"
#include "tensorflow/core/framework/bfloat16.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/blocking_counter.h"

namespace tfde {
namespace {

using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::TensorShape;

// Positions of the distinct keys of a batch, in order of first appearance,
// and for every position the index of its key among them.  Open addressing
// on the keys' stable hashes (a scratch table of twice the batch, rebuilt
// per call).
template <class View>
struct Distinct {
  std::vector<int64_t> first;  // position of each distinct key's first appearance
  std::vector<int64_t> of;     // position -> index into `first`

  Distinct(const View* keys, int64_t n) : of(n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    std::vector<int64_t> slots(cap, -1);  // index into `first`, or -1
    first.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      int64_t s = static_cast<int64_t>(StableHash(keys[i]) & static_cast<uint64_t>(cap - 1));
      while (slots[s] >= 0 && !(keys[first[slots[s]]] == keys[i])) s = (s + 1) & (cap - 1);
      if (slots[s] < 0) {
        slots[s] = static_cast<int64_t>(first.size());
        first.push_back(i);
      }
      of[i] = slots[s];
    }
  }
};

template <class V, class C>
inline C ToCompute(V v) {
  return static_cast<C>(static_cast<std::conditional_t<std::is_same_v<C, double>, double, float>>(v));
}

// One part's tables and inputs, checked.
template <class K>
struct Part {
  TypedTable<K>* table = nullptr;
  std::vector<TypedTable<K>*> slots;
  const Tensor* keys = nullptr;
  const Tensor* indices = nullptr;
  const Tensor* grads = nullptr;
  const Tensor* defaults = nullptr;  // [b, dim] step-buffer rows, or nullptr: init spec
  InitSpec init;
  bool decay = false;
  TypedTable<K>* state = nullptr;  // the policy state table, or nullptr
  bool state_adds = false;         // "add" (else "set")
  double state_value = 0, state_init = 0;
};

// The estimated work of a part of `keys` keys on `table`, for RunParts's
// order: its distinct keys, the keys new to the table (each drawn an initial
// row and inserted) and its cache misses all grow with the table's size,
// while the keys per part are often the same (one per example and feature):
// a model's smallest tables (tens of rows) take a few microseconds a step,
// its biggest most of the op's time.
template <class Table>
int64_t PartCost(int64_t keys, const Table& table) {
  return (keys + table.core.Size()) * table.dim();
}

// Runs work(p) for every part p in [0, n) side by side on the intra-op
// pool, the biggest (by cost(p)) first, each part on one thread: a part's
// own table calls are serial, since a ParallelFor inside a pool task could
// wait for tasks queued behind it.  Returns the first failure (the core's
// exceptions translated as TFDE_CATCH does).
template <class Work, class Cost>
::absl::Status RunParts(OpKernelContext* ctx, int n, Work work, Cost cost) {
  std::vector<int> order(n);
  for (int p = 0; p < n; ++p) order[p] = p;
  std::vector<int64_t> costs(n);
  for (int p = 0; p < n; ++p) costs[p] = cost(p);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return costs[a] > costs[b]; });
  std::mutex mu;
  ::absl::Status first_error;
  auto run = [&](int p) {
    ::absl::Status status;
    try {
      work(p);
    } catch (const CapacityError& e) {
      status = errors::ResourceExhausted(kCapacityPrefix, e.what());
    } catch (const std::bad_alloc&) {
      status = errors::ResourceExhausted(kCapacityPrefix, "out of memory");
    } catch (const std::length_error& e) {
      status = errors::ResourceExhausted(kCapacityPrefix, "out of memory (", e.what(), ")");
    } catch (const std::exception& e) {
      status = errors::InvalidArgument(e.what());
    }
    if (!status.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok()) first_error = status;
    }
  };
  if (n == 0) return first_error;
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  ::tensorflow::BlockingCounter done(n - 1);
  for (int i = 1; i < n; ++i) {
    pool->Schedule([&, i] {
      run(order[i]);
      done.DecrementCount();
    });
  }
  run(order[0]);  // the biggest, on this thread
  done.Wait();
  return first_error;
}

class TableApplyOp : public OpKernel {
 public:
  explicit TableApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("M", &m_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tkey", &key_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tvalue", &value_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tgrad", &grad_dtype_));
    std::string rule;
    OP_REQUIRES_OK(ctx, ReadRuleAttrs(ctx, &rule, &spec_, &slot_init_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
    std::vector<std::string> kinds;
    std::vector<float> p0, p1;
    std::vector<int64_t> seeds;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_kind", &kinds));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_p0", &p0));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_p1", &p1));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_seed", &seeds));
    const size_t n = static_cast<size_t>(n_);
    OP_REQUIRES(ctx, kinds.size() == n && p0.size() == n && p1.size() == n && seeds.size() == n && decay_.size() == n,
                errors::InvalidArgument("init_kind, init_p0, init_p1, init_seed and decay need one entry per part (",
                                        n_, "), got ", kinds.size(), ", ", p0.size(), ", ", p1.size(), ", ",
                                        seeds.size(), ", ", decay_.size()));
    const int slots = spec_.NumSlots();
    OP_REQUIRES(ctx, m_ == n_ * slots,
                errors::InvalidArgument("rule '", rule, "' keeps ", slots, " slot(s) per table: expected ", n_ * slots,
                                        " slot tables for ", n_, " part(s), got ", m_));
    OP_REQUIRES(ctx, static_cast<int>(slot_init_.size()) == slots,
                errors::InvalidArgument("slot_init needs one value per slot (", slots, "), got ", slot_init_.size()));
    OP_REQUIRES_OK(ctx, CheckGradDtype(value_dtype_, grad_dtype_));
    OP_REQUIRES_OK(ctx, ReadStateAttrs(ctx, &s_, &state_adds_, &state_init_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("state_part", &state_part_));
    OP_REQUIRES(
        ctx, state_part_.size() == static_cast<size_t>(s_),
        errors::InvalidArgument("state_part needs one entry per state table (S = ", s_, "), got ", state_part_.size()));
    std::vector<bool> has_state(n, false);
    for (int i = 0; i < s_; ++i) {
      OP_REQUIRES(ctx, state_part_[i] >= 0 && state_part_[i] < n_ && !has_state[state_part_[i]],
                  errors::InvalidArgument("state_part[", i, "] = ", state_part_[i], " must name a part (0..", n_ - 1,
                                          ") that no other state table names"));
      has_state[state_part_[i]] = true;
    }
    inits_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      try {
        inits_[i].kind = ParseInitKind(kinds[i]);
      } catch (const std::exception& e) {
        ctx->CtxFailure(errors::InvalidArgument(e.what()));
        return;
      }
      inits_[i].p0 = p0[i];
      inits_[i].p1 = p1[i];
      inits_[i].seed = seeds[i];
    }
  }

  void Compute(OpKernelContext* ctx) override {
    switch (key_dtype_) {
      case ::tensorflow::DT_INT64:
        return Run<int64_t>(ctx);
      case ::tensorflow::DT_INT32:
        return Run<int32_t>(ctx);
      default:
        return Run<tstring>(ctx);
    }
  }

 private:
  template <class TK>
  void Run(OpKernelContext* ctx) {
    using K = typename CoreKey<TK>::type;
    OpInputList tables, slot_tables, keys, indices, grads, defaults;
    OP_REQUIRES_OK(ctx, ctx->input_list("tables", &tables));
    OP_REQUIRES_OK(ctx, ctx->input_list("slot_tables", &slot_tables));
    OP_REQUIRES_OK(ctx, ctx->input_list("keys", &keys));
    OP_REQUIRES_OK(ctx, ctx->input_list("indices", &indices));
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("defaults", &defaults));
    const Tensor* hyper_input = nullptr;
    OP_REQUIRES_OK(ctx, ctx->input("hyper", &hyper_input));
    const Tensor& hyper = *hyper_input;
    const Tensor* state_values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->input("state_values", &state_values));
    OP_REQUIRES(ctx, state_values->dims() == 1 && state_values->dim_size(0) == s_,
                errors::InvalidArgument("state_values must be a vector of ", s_,
                                        " values (one per state table), got "
                                        "shape ",
                                        state_values->shape().DebugString()));
    const int slots = spec_.NumSlots();
    OP_REQUIRES(ctx, hyper.dims() == 1 && hyper.dim_size(0) >= spec_.NumHyper(),
                errors::InvalidArgument("hyper must be a vector of at least ", spec_.NumHyper(), " values, got shape ",
                                        hyper.shape().DebugString()));

    // Every check, for every part, before anything is read or written.
    std::vector<::tensorflow::core::RefCountPtr<TableResource>> holders(n_ + m_ + s_);
    std::vector<Part<K>> parts(n_);
    for (int p = 0; p < n_; ++p) {
      Part<K>& part = parts[p];
      part.table = Typed<K>(ctx, p, &holders[p], nullptr);
      if (part.table == nullptr) return;
      const int64_t dim = part.table->dim();
      for (int s = 0; s < slots; ++s) {
        const int input = n_ + p * slots + s;
        part.slots.push_back(Typed<K>(ctx, input, &holders[input], part.table));
        if (part.slots.back() == nullptr) return;
      }
      part.keys = &keys[p];
      part.indices = &indices[p];
      part.grads = &grads[p];
      const int64_t b = keys[p].dims() == 1 ? keys[p].dim_size(0) : -1;
      OP_REQUIRES(
          ctx, b >= 0,
          errors::InvalidArgument("part ", p, ": keys must be a vector, got shape ", keys[p].shape().DebugString()));
      OP_REQUIRES(ctx, indices[p].dims() == 1,
                  errors::InvalidArgument("part ", p, ": indices must be a vector, got shape ",
                                          indices[p].shape().DebugString()));
      const int64_t m = indices[p].dim_size(0);
      OP_REQUIRES(
          ctx, grads[p].dims() == 2 && grads[p].dim_size(0) == m && grads[p].dim_size(1) == dim,
          errors::InvalidArgument("part ", p, ": grads must have shape [", m, ", ", dim, "] for ", m, " indices and a ",
                                  part.table->Describe(), ", got ", grads[p].shape().DebugString()));
      const int32_t* idx = indices[p].flat<int32_t>().data();
      for (int64_t j = 0; j < m; ++j) {
        OP_REQUIRES(
            ctx, idx[j] >= 0 && idx[j] < b,
            errors::InvalidArgument("part ", p, ": indices[", j, "] = ", idx[j], " is outside the ", b, " keys"));
      }
      const Tensor& d = defaults[p];
      const bool given = d.dims() == 2 && d.dim_size(0) == b && d.dim_size(1) == dim;
      const bool none = !given && d.dims() == 2 && d.dim_size(0) == 0 && d.dim_size(1) == dim;
      OP_REQUIRES(ctx, given || none,
                  errors::InvalidArgument("part ", p, ": defaults must have shape [", b, ", ", dim, "] or [0, ", dim,
                                          "], got ", d.shape().DebugString()));
      OP_REQUIRES(ctx, given || inits_[p].kind != InitKind::kDefaults,
                  errors::InvalidArgument("part ", p, ": init_kind 'defaults' needs a defaults row per key"));
      part.defaults = given ? &d : nullptr;
      part.init = inits_[p];
      part.decay = decay_[p];
    }
    int state_start = 0, state_stop = 0;
    OP_REQUIRES_OK(ctx, this->InputRange("state_tables", &state_start, &state_stop));
    for (int i = 0; i < s_; ++i) {
      Part<K>& part = parts[state_part_[i]];
      part.state = State<K>(ctx, state_start + i, &holders[n_ + m_ + i]);
      if (part.state == nullptr) return;
      part.state_adds = state_adds_[i];
      part.state_value = state_values->flat<double>()(i);
      part.state_init = state_init_[i];
    }

    std::vector<Tensor*> written(n_);
    for (int p = 0; p < n_; ++p) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(p, TensorShape({}), &written[p]));
      written[p]->scalar<int64_t>()() = 0;
    }
    OP_REQUIRES_OK(ctx, WithValueType(value_dtype_, [&](auto v) {
                     using V = decltype(v);
                     using C = std::conditional_t<std::is_same_v<V, double>, double, float>;
                     Hyper<C> hy;
                     const C* h = hyper.flat<C>().data();
                     for (int i = 0; i < spec_.NumHyper(); ++i) hy.h[i] = h[i];
                     std::vector<int64_t> counts(n_, 0);
                     OP_REQUIRES_OK(
                         ctx, RunParts(
                                  ctx, n_,
                                  [&](int p) {
                                    Hyper<C> part_hy = hy;
                                    if (!parts[p].decay) part_hy.h[1] = C(0);
                                    counts[p] = ApplyPart<TK, V, C>(parts[p], part_hy);
                                  },
                                  [&](int p) { return PartCost(parts[p].indices->NumElements(), *parts[p].table); }));
                     for (int p = 0; p < n_; ++p) written[p]->scalar<int64_t>()() = counts[p];
                   }));
  }

  // The table behind input `input` if its key dtype is TK's and value dtype
  // Tvalue (and, for a slot, the dim of its row table `of`).
  template <class K>
  TypedTable<K>* Typed(OpKernelContext* ctx, int input, ::tensorflow::core::RefCountPtr<TableResource>* holder,
                       const TableResource* of) {
    TableResource* raw = ResolveAny(ctx, input, holder);
    if (raw == nullptr) return nullptr;
    if (raw->key_dtype() != key_dtype_ || raw->value_dtype() != value_dtype_ || (of && raw->dim() != of->dim())) {
      ctx->CtxFailure(errors::InvalidArgument("input ", input, " is a ", raw->Describe(), "; this apply takes ",
                                              DataTypeString(key_dtype_), " -> ", DataTypeString(value_dtype_),
                                              " tables", of ? " of dim " + std::to_string(of->dim()) : std::string()));
      return nullptr;
    }
    return static_cast<TypedTable<K>*>(raw);
  }

  // The policy state table behind input `input`: TK's key dtype, float64
  // values of dim 1.
  template <class K>
  TypedTable<K>* State(OpKernelContext* ctx, int input, ::tensorflow::core::RefCountPtr<TableResource>* holder) {
    TableResource* raw = ResolveAny(ctx, input, holder);
    if (raw == nullptr) return nullptr;
    if (raw->key_dtype() != key_dtype_ || raw->value_dtype() != ::tensorflow::DT_DOUBLE || raw->dim() != 1) {
      ctx->CtxFailure(errors::InvalidArgument("input ", input, " is a ", raw->Describe(),
                                              "; a policy state table holds ", DataTypeString(key_dtype_),
                                              " -> float64 rows of dim 1"));
      return nullptr;
    }
    return static_cast<TypedTable<K>*>(raw);
  }

  // Steps 1-5 of the file comment for one part; returns the keys written.
  template <class TK, class V, class C, class K>
  int64_t ApplyPart(const Part<K>& part, const Hyper<C>& hy) {
    const int64_t b = part.keys->dim_size(0), m = part.indices->dim_size(0), dim = part.table->dim();
    if (b == 0) return 0;
    KeyViews<TK> views(*part.keys);
    using View = std::remove_cv_t<std::remove_pointer_t<decltype(views.data)>>;
    // 1. The gradient per distinct key, summed in input order (the order
    // of the Python path's unsorted_segment_sum, so the sums are the same
    // to the last bit).
    const Distinct<View> distinct(views.data, b);
    const int64_t u = static_cast<int64_t>(distinct.first.size());
    std::vector<C> acc(u * dim, C(0));
    std::vector<char> touched(u, 0);  // keys without a gradient row are not written
    const int32_t* idx = part.indices->template flat<int32_t>().data();
    const C* g = part.grads->template flat<C>().data();
    for (int64_t j = 0; j < m; ++j) {
      const int64_t d = distinct.of[idx[j]];
      touched[d] = 1;
      C* a = &acc[d * dim];
      const C* gj = g + j * dim;
      for (int64_t c = 0; c < dim; ++c) a[c] += gj[c];
    }
    // 2. Keys with a finite gradient (indices into distinct.first).
    std::vector<int64_t> kept;
    kept.reserve(u);
    for (int64_t d = 0; d < u; ++d) {
      bool finite = touched[d] != 0;
      for (int64_t c = 0; c < dim && finite; ++c) finite = std::isfinite(acc[d * dim + c]);
      if (finite) kept.push_back(d);
    }
    const int64_t n = static_cast<int64_t>(kept.size());
    if (n == 0) return 0;
    std::vector<View> kept_keys(n);
    for (int64_t k = 0; k < n; ++k) kept_keys[k] = views.data[distinct.first[kept[k]]];
    const int slots = static_cast<int>(part.slots.size());
    // 3-5. Every table's rows of the kept keys at once (CuckooTable::WithRows:
    // the row table's, then each slot table's, absent keys inserted with
    // their starting rows), then the rule row by row in place.
    const V* defaults = part.defaults ? reinterpret_cast<const V*>(part.defaults->tensor_data().data()) : nullptr;
    std::vector<TypedTable<K>*> tables{part.table};
    tables.insert(tables.end(), part.slots.begin(), part.slots.end());
    const size_t state_t = tables.size();  // the state table's index in `tables`, when there is one
    if (part.state != nullptr) tables.push_back(part.state);
    std::vector<char* const*> rows(tables.size(), nullptr);
    // A created row of table t: the row table's from the step buffer (else
    // its initializer), a slot's its initial value, the state's its own.
    auto fill = [&](size_t t, int64_t k, char* row, uint64_t hash) {
      V* r = reinterpret_cast<V*>(row);
      if (t == state_t) {
        *reinterpret_cast<double*>(row) = part.state_init;
      } else if (t > 0) {
        const V init = static_cast<V>(slot_init_[t - 1]);
        for (int64_t c = 0; c < dim; ++c) r[c] = init;
      } else if (defaults != nullptr) {
        std::memcpy(r, defaults + distinct.first[kept[k]] * dim, dim * sizeof(V));
      } else {
        FillInitialRow<V>(part.init, hash, dim, r);
      }
    };
    auto step = [&] {
      std::vector<C> w(dim), s(std::max(slots, 1) * dim);
      C* ptrs[RuleSpec::kMaxHyper];
      for (int sl = 0; sl < slots; ++sl) ptrs[sl] = &s[sl * dim];
      for (int64_t k = 0; k < n; ++k) {
        if (k + kPrefetchDistance < n)
          for (size_t t = 0; t < state_t; ++t) PrefetchLines(rows[t][k + kPrefetchDistance], dim * sizeof(V));
        V* row = reinterpret_cast<V*>(rows[0][k]);
        for (int64_t c = 0; c < dim; ++c) w[c] = ToCompute<V, C>(row[c]);
        for (int sl = 0; sl < slots; ++sl) {
          const V* r = reinterpret_cast<const V*>(rows[1 + sl][k]);
          for (int64_t c = 0; c < dim; ++c) ptrs[sl][c] = ToCompute<V, C>(r[c]);
        }
        ApplyRule<C>(spec_, hy, dim, w.data(), &acc[kept[k] * dim], ptrs);
        for (int64_t c = 0; c < dim; ++c) row[c] = static_cast<V>(w[c]);
        for (int sl = 0; sl < slots; ++sl) {
          V* r = reinterpret_cast<V*>(rows[1 + sl][k]);
          for (int64_t c = 0; c < dim; ++c) r[c] = static_cast<V>(ptrs[sl][c]);
        }
        if (part.state != nullptr) {
          double* st = reinterpret_cast<double*>(rows[state_t][k]);
          *st = part.state_adds ? *st + part.state_value : part.state_value;
        }
      }
    };
    // Table t's rows held, then table t + 1's inside, ..., the step innermost.
    std::function<void(size_t)> hold = [&](size_t t) {
      if (t == tables.size()) {
        step();
        return;
      }
      tables[t]->core.WithRows(
          kept_keys.data(), n, [&](int64_t k, char* row, uint64_t hash) { fill(t, k, row, hash); },
          [&](char* const* r) {
            rows[t] = r;
            hold(t + 1);
          });
    };
    hold(0);
    return n;
  }

  int n_ = 0, m_ = 0, s_ = 0;
  DataType key_dtype_, value_dtype_, grad_dtype_;
  RuleSpec spec_;
  std::vector<float> slot_init_;
  std::vector<bool> decay_;
  std::vector<int64_t> state_part_;
  std::vector<bool> state_adds_;
  std::vector<float> state_init_;
  std::vector<InitSpec> inits_;
};

// TfdeTableLookup: the forward half of a training step's lookups of several
// tables.  Per part: the distinct keys of `keys` in order of first
// appearance, each key's position among them, and their rows (a missing
// key reads its initial row): what tf.unique and a find do in two ops and
// two hash passes.  Parts run side by side as in TfdeTableApply.
class TableLookupOp : public OpKernel {
 public:
  explicit TableLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tkey", &key_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tvalue", &value_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dims", &dims_));
    std::vector<std::string> kinds;
    std::vector<float> p0, p1;
    std::vector<int64_t> seeds;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_kind", &kinds));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_p0", &p0));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_p1", &p1));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_seed", &seeds));
    const size_t n = static_cast<size_t>(n_);
    OP_REQUIRES(
        ctx, kinds.size() == n && p0.size() == n && p1.size() == n && seeds.size() == n && dims_.size() == n,
        errors::InvalidArgument("dims, init_kind, init_p0, init_p1 and init_seed need one entry per part (", n_, ")"));
    inits_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      try {
        inits_[i].kind = ParseInitKind(kinds[i]);
      } catch (const std::exception& e) {
        ctx->CtxFailure(errors::InvalidArgument(e.what()));
        return;
      }
      OP_REQUIRES(ctx, inits_[i].kind != InitKind::kDefaults,
                  errors::InvalidArgument("part ", i, ": init_kind 'defaults' generates nothing"));
      inits_[i].p0 = p0[i];
      inits_[i].p1 = p1[i];
      inits_[i].seed = seeds[i];
    }
  }

  void Compute(OpKernelContext* ctx) override {
    switch (key_dtype_) {
      case ::tensorflow::DT_INT64:
        return Run<int64_t>(ctx);
      case ::tensorflow::DT_INT32:
        return Run<int32_t>(ctx);
      default:
        return Run<tstring>(ctx);
    }
  }

 private:
  template <class TK>
  void Run(OpKernelContext* ctx) {
    using K = typename CoreKey<TK>::type;
    OpInputList keys;
    OP_REQUIRES_OK(ctx, ctx->input_list("keys", &keys));
    std::vector<::tensorflow::core::RefCountPtr<TableResource>> holders(n_);
    std::vector<TypedTable<K>*> tables(n_);
    for (int p = 0; p < n_; ++p) {
      TableResource* raw = ResolveAny(ctx, p, &holders[p]);
      if (raw == nullptr) return;
      OP_REQUIRES(ctx, raw->key_dtype() == key_dtype_ && raw->value_dtype() == value_dtype_ && raw->dim() == dims_[p],
                  errors::InvalidArgument("part ", p, " is a ", raw->Describe(), "; this lookup takes ",
                                          DataTypeString(key_dtype_), " -> ", DataTypeString(value_dtype_), "[",
                                          dims_[p], "]"));
      OP_REQUIRES(
          ctx, keys[p].dims() == 1,
          errors::InvalidArgument("part ", p, ": keys must be a vector, got shape ", keys[p].shape().DebugString()));
      tables[p] = static_cast<TypedTable<K>*>(raw);
    }
    std::vector<std::unique_ptr<Distinct<typename KeyViews<TK>::View>>> distinct(n_);
    std::vector<std::unique_ptr<KeyViews<TK>>> views(n_);
    auto cost = [&](int p) { return PartCost(keys[p].dim_size(0), *tables[p]); };
    // The distinct keys first (they size the outputs), the parts side by side.
    OP_REQUIRES_OK(ctx, RunParts(
                            ctx, n_,
                            [&](int p) {
                              views[p] = std::make_unique<KeyViews<TK>>(keys[p]);
                              distinct[p] = std::make_unique<Distinct<typename KeyViews<TK>::View>>(
                                  views[p]->data, keys[p].dim_size(0));
                            },
                            cost));
    std::vector<Tensor*> unique(n_), positions(n_), rows(n_);
    for (int p = 0; p < n_; ++p) {
      const int64_t u = static_cast<int64_t>(distinct[p]->first.size());
      OP_REQUIRES_OK(ctx, ctx->allocate_output(p, TensorShape({u}), &unique[p]));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(n_ + p, keys[p].shape(), &positions[p]));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(2 * n_ + p, TensorShape({u, dims_[p]}), &rows[p]));
    }
    OP_REQUIRES_OK(ctx, WithValueType(value_dtype_, [&](auto v) {
                     using V = decltype(v);
                     OP_REQUIRES_OK(ctx,
                                    RunParts(
                                        ctx, n_,
                                        [&](int p) {
                                          const auto& d = *distinct[p];
                                          const int64_t u = static_cast<int64_t>(d.first.size()), dim = dims_[p];
                                          auto in = keys[p].flat<TK>();
                                          auto out_keys = unique[p]->flat<TK>();
                                          for (int64_t k = 0; k < u; ++k) out_keys(k) = in(d.first[k]);
                                          int32_t* pos = positions[p]->flat<int32_t>().data();
                                          for (int64_t i = 0; i < keys[p].dim_size(0); ++i)
                                            pos[i] = static_cast<int32_t>(d.of[i]);
                                          std::vector<typename KeyViews<TK>::View> ukeys(u);
                                          for (int64_t k = 0; k < u; ++k) ukeys[k] = views[p]->data[d.first[k]];
                                          char* out = const_cast<char*>(rows[p]->tensor_data().data());
                                          const int64_t vb = tables[p]->value_bytes();
                                          const InitSpec& init = inits_[p];
                                          tables[p]->core.Find(
                                              ukeys.data(), u, SerialFor,
                                              [&](int64_t k, const char* row) { std::memcpy(out + k * vb, row, vb); },
                                              [&](int64_t k, uint64_t hash) {
                                                FillInitialRow<V>(init, hash, dim, reinterpret_cast<V*>(out + k * vb));
                                              });
                                        },
                                        cost));
                   }));
  }

  int n_ = 0;
  DataType key_dtype_, value_dtype_;
  std::vector<int64_t> dims_;
  std::vector<InitSpec> inits_;
};

REGISTER_OP("TfdeTableLookup")
    .Input("tables: N * resource")
    .Input("keys: N * Tkey")
    .Output("unique: N * Tkey")
    .Output("positions: N * int32")
    .Output("rows: N * Tvalue")
    .Attr("N: int >= 1")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .Attr("dims: list(int)")
    .Attr("init_kind: list(string)")
    .Attr("init_p0: list(float)")
    .Attr("init_p1: list(float)")
    .Attr("init_seed: list(int)")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      int64_t n;
      std::vector<int64_t> dims;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
      if (static_cast<int64_t>(dims.size()) != n) return errors::InvalidArgument("dims needs one entry per part");
      for (int64_t p = 0; p < n; ++p) {
        TF_RETURN_IF_ERROR(CheckDimAttr(dims[p]));
        ::tensorflow::shape_inference::ShapeHandle keys;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(n + p), 1, &keys));
        c->set_output(p, c->Vector(::tensorflow::shape_inference::InferenceContext::kUnknownDim));
        c->set_output(n + p, keys);
        c->set_output(2 * n + p, c->Matrix(::tensorflow::shape_inference::InferenceContext::kUnknownDim, dims[p]));
      }
      return ::absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TfdeTableLookup").Device(::tensorflow::DEVICE_CPU), TableLookupOp);

REGISTER_OP("TfdeTableApply")
    .Input("tables: N * resource")
    .Input("slot_tables: M * resource")
    .Input("keys: N * Tkey")
    .Input("indices: N * int32")
    .Input("grads: N * Tgrad")
    .Input("defaults: N * Tvalue")
    .Input("hyper: Tgrad")
    .Input("state_tables: S * resource")
    .Input("state_values: double")
    .Output("written: N * int64")
    .Attr("N: int >= 1")
    .Attr("M: int >= 0")
    .Attr("S: int >= 0")
    .Attr("Tkey: {int32, int64, string}")
    .Attr("Tvalue: {float, double, half, bfloat16}")
    .Attr("Tgrad: {float, double}")
    .Attr("rule: {'sgd', 'adagrad', 'adam', 'rmsprop', 'ftrl'}")
    .Attr("momentum: bool = false")
    .Attr("nesterov: bool = false")
    .Attr("amsgrad: bool = false")
    .Attr("centered: bool = false")
    .Attr("slot_init: list(float) = []")
    .Attr("decay: list(bool)")
    .Attr("init_kind: list(string)")
    .Attr("init_p0: list(float)")
    .Attr("init_p1: list(float)")
    .Attr("init_seed: list(int)")
    .Attr("state_part: list(int) = []")
    .Attr("state_mode: list(string) = []")
    .Attr("state_init: list(float) = []")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->Scalar());
      return ::absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TfdeTableApply").Device(::tensorflow::DEVICE_CPU), TableApplyOp);

}  // namespace
}  // namespace tfde
