// Argument checks of the torch front-end. Every message starts with the op's name, names the
// argument, and says what was expected and what was given.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "mla/types.h"

namespace mla::detail {
// Torch types in error messages, formatted without iostreams (see mla/types.h).
template <>
struct Text<c10::IntArrayRef> {
  static void append(std::string& s, c10::IntArrayRef v) {
    s += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) s += ", ";
      s += std::to_string(v[i]);
    }
    s += ']';
  }
};
template <>
struct Text<at::ScalarType> {
  static void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
};
template <>
struct Text<c10::Device> {
  static void append(std::string& s, c10::Device v) { s += v.str(); }
};
template <>
struct Text<c10::string_view> {
  static void append(std::string& s, c10::string_view v) { s.append(v.data(), v.size()); }
};
}  // namespace mla::detail

// TORCH_CHECK with the message assembled by mla::detail::concat.
#define MLA_TORCH_CHECK(cond, ...)                                   \
  do {                                                               \
    if (C10_UNLIKELY_OR_CONST(!(cond))) {                            \
      TORCH_CHECK(false, ::mla::detail::concat(__VA_ARGS__));        \
    }                                                                \
  } while (0)

namespace mla::torch_ops {

using at::Tensor;

// The device of the tensor argument the others must share (`name`, usually q); None is an error
// naming it, not a crash in device().
inline c10::Device device_of(const char* op, const Tensor& t, const char* name) {
  MLA_TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got None");
  return t.device();
}

// An integer argument the core takes as int: outside int32 it is an error, never a wrapped value.
inline int narrow_int(const char* op, int64_t v, const char* name) {
  MLA_TORCH_CHECK(v >= INT32_MIN && v <= INT32_MAX, op, ": ", name, " must fit in 32 bits, got ", v);
  return int(v);
}

// Query rows (b * s_q * h_q, each dimension already under 2^31) index the outputs as int.
inline void check_rows(const char* op, const Tensor& q, int64_t rows) {
  MLA_TORCH_CHECK(rows <= INT32_MAX, op, ": q must have fewer than 2^31 query rows (b * s_q * h_q), got shape ",
                  q.sizes());
}

// The checks of one op call: `ArgChecker c("sparse_decode_fwd", device_of(op, q, "q"))`.
class ArgChecker {
 public:
  ArgChecker(const char* op, c10::Device device) : op_(op), device_(device) {}

  const char* op() const { return op_; }

  // Rank, dtype, device and a contiguous last dimension: what every tensor argument needs.
  // Every size below 2^31: the core indexes with int (an expanded dimension can be larger than any
  // allocation).
  void tensor(const Tensor& t, const char* name, int64_t dim, std::initializer_list<at::ScalarType> dtypes) const {
    MLA_TORCH_CHECK(t.defined(), op_, ": ", name, " must be a tensor, got None");
    MLA_TORCH_CHECK(t.dim() == dim, op_, ": ", name, " must be a ", dim, "-D tensor, got ", t.dim(), "-D with shape ",
                t.sizes());
    bool ok = false;
    for (auto d : dtypes) ok = ok || t.scalar_type() == d;
    if (!ok) {
      std::string want;
      for (auto d : dtypes) want += (want.empty() ? "" : " or ") + std::string(c10::toString(d));
      MLA_TORCH_CHECK(false, op_, ": ", name, " must have dtype ", want, ", got ", t.scalar_type());
    }
    MLA_TORCH_CHECK(t.device() == device_, op_, ": ", name, " must be on ", device_, " (the device of q), got ",
                t.device());
    MLA_TORCH_CHECK(t.dim() == 0 || t.size(-1) == 1 || t.stride(-1) == 1, op_, ": ", name,
                " must have a contiguous last dimension, got strides ", t.strides());
    for (int64_t d = 0; d < t.dim(); ++d)
      MLA_TORCH_CHECK(t.size(d) <= INT32_MAX, op_, ": ", name, " dim ", d, " must be < 2^31, got shape ", t.sizes());
  }

  void opt_tensor(const std::optional<Tensor>& t, const char* name, int64_t dim,
                  std::initializer_list<at::ScalarType> dtypes) const {
    if (t.has_value()) tensor(*t, name, dim, dtypes);
  }

  void shape(const Tensor& t, const char* name, const std::vector<int64_t>& expected, const char* what) const {
    MLA_TORCH_CHECK(t.sizes() == at::IntArrayRef(expected), op_, ": ", name, " must have shape ", what, " = ",
                at::IntArrayRef(expected), ", got ", t.sizes());
  }

  void contiguous(const Tensor& t, const char* name) const {
    MLA_TORCH_CHECK(t.is_contiguous(), op_, ": ", name, " must be contiguous, got strides ", t.strides(), " for shape ",
                t.sizes());
  }

  // The CUDA kernels read a cache in `bytes`-sized pieces: its base address and the strides of its
  // first `dims` dimensions must be multiples of that.
  void cuda_alignment(const Tensor& t, const char* name, int bytes, int dims) const {
    const int64_t elem = t.element_size();
    bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
    for (int d = 0; d < dims; ++d) ok = ok && (t.size(d) <= 1 || (t.stride(d) * elem) % bytes == 0);
    MLA_TORCH_CHECK(ok, op_, ": ", name, " must start at a ", bytes, "-byte aligned address and have strides of dims 0..",
                    dims - 1, " that are multiples of ", bytes, " bytes on CUDA, got strides ", t.strides(), " (",
                    elem, "-byte elements)");
  }

 private:
  const char* op_;
  c10::Device device_;
};

// Runs a core function, turning mla::Error into a torch error prefixed with the op's name.
template <typename Fn>
void run_core(const char* op, Fn&& fn) {
  try {
    fn();
  } catch (const mla::Error& e) {
    MLA_TORCH_CHECK(false, op, ": ", e.what());
  }
}

}  // namespace mla::torch_ops
