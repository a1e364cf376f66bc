// Argument checks of the torch front-end. Every message starts with the op's name, names the
// argument, and says what was expected and what was given.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "mla/types.h"

namespace mla::torch_ops {

using at::Tensor;

// The checks of one op call: `ArgChecker c("sparse_decode_fwd", q.device())`.
class ArgChecker {
 public:
  ArgChecker(const char* op, c10::Device device) : op_(op), device_(device) {}

  const char* op() const { return op_; }

  // Rank, dtype, device and a contiguous last dimension: what every tensor argument needs.
  void tensor(const Tensor& t, const char* name, int64_t dim, std::initializer_list<at::ScalarType> dtypes) const {
    TORCH_CHECK(t.dim() == dim, op_, ": ", name, " must be a ", dim, "-D tensor, got ", t.dim(), "-D with shape ",
                t.sizes());
    bool ok = false;
    for (auto d : dtypes) ok = ok || t.scalar_type() == d;
    if (!ok) {
      std::string want;
      for (auto d : dtypes) want += (want.empty() ? "" : " or ") + std::string(c10::toString(d));
      TORCH_CHECK(false, op_, ": ", name, " must have dtype ", want, ", got ", t.scalar_type());
    }
    TORCH_CHECK(t.device() == device_, op_, ": ", name, " must be on ", device_, " (the device of q), got ",
                t.device());
    TORCH_CHECK(t.dim() == 0 || t.size(-1) == 1 || t.stride(-1) == 1, op_, ": ", name,
                " must have a contiguous last dimension, got strides ", t.strides());
  }

  void opt_tensor(const std::optional<Tensor>& t, const char* name, int64_t dim,
                  std::initializer_list<at::ScalarType> dtypes) const {
    if (t.has_value()) tensor(*t, name, dim, dtypes);
  }

  void shape(const Tensor& t, const char* name, const std::vector<int64_t>& expected, const char* what) const {
    TORCH_CHECK(t.sizes() == at::IntArrayRef(expected), op_, ": ", name, " must have shape ", what, " = ",
                at::IntArrayRef(expected), ", got ", t.sizes());
  }

  void contiguous(const Tensor& t, const char* name) const {
    TORCH_CHECK(t.is_contiguous(), op_, ": ", name, " must be contiguous, got strides ", t.strides(), " for shape ",
                t.sizes());
  }

  // Strides handed to kernels are int32 on the GPU.
  void strides_fit_int32(const Tensor& t, const char* name) const {
    for (int64_t s : t.strides())
      TORCH_CHECK(s <= INT32_MAX, op_, ": ", name, " has a stride ", s, " that exceeds the int32 range");
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
    TORCH_CHECK(false, op, ": ", e.what());
  }
}

}  // namespace mla::torch_ops
