// Online softmax over blocks of keys, in the log2 domain the GPU kernels use: scores arrive
// pre-multiplied by softmax_scale * log2(e), so probabilities are exp2(z - running max).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "mla/types.h"

namespace mla::reference {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Dot product of two float vectors; eight partial sums so the compiler vectorises it.
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Running (max, sum, unnormalised output) of `rows` independent softmax rows.
class OnlineSoftmax {
 public:
  OnlineSoftmax(int rows, int d_v) : d_v_(d_v), m_(rows), l_(rows), acc_(size_t(rows) * d_v) { reset(); }

  void reset() {
    std::fill(m_.begin(), m_.end(), -kInf);
    std::fill(l_.begin(), l_.end(), 0.f);
    std::fill(acc_.begin(), acc_.end(), 0.f);
  }

  // Adds keys t < n with valid[t] to row r: z[t] are log2-domain scores, value t is the first d_v
  // floats of values + t * value_stride.
  void update(int r, const float* z, const uint8_t* valid, int n, const float* values, int value_stride) {
    float mx = -kInf;
    for (int t = 0; t < n; ++t)
      if (valid[t]) mx = std::fmax(mx, z[t]);
    if (mx == -kInf) return;
    const float m_new = std::fmax(m_[r], mx);
    const float alpha = std::exp2(m_[r] - m_new);
    float* o = &acc_[size_t(r) * d_v_];
    if (alpha != 1.f) {
      for (int d = 0; d < d_v_; ++d) o[d] *= alpha;
      l_[r] *= alpha;
    }
    for (int t = 0; t < n; ++t) {
      if (!valid[t]) continue;
      const float p = std::exp2(z[t] - m_new);
      l_[r] += p;
      const float* v = values + size_t(t) * value_stride;
      for (int d = 0; d < d_v_; ++d) o[d] += p * v[d];
    }
    m_[r] = m_new;
  }

  float max2(int r) const { return m_[r]; }
  float sum(int r) const { return l_[r]; }
  const float* acc(int r) const { return &acc_[size_t(r) * d_v_]; }

  // log2(sum) + max, the log2-domain log-sum-exp; -inf for a row with no key.
  float lse2(int r) const { return l_[r] > 0.f ? std::log2(l_[r]) + m_[r] : -kInf; }

  // 1 / (sum + exp(sink)) in the row's scale: the factor that turns the accumulator into the
  // output with the attention sink applied (pass -inf for no sink); 0 for a row with no key.
  float output_scale(int r, float sink_natural) const {
    if (!(l_[r] > 0.f)) return 0.f;
    return 1.f / (l_[r] + std::exp2(sink_natural * kLog2e - m_[r]));
  }

 private:
  int d_v_;
  std::vector<float> m_, l_, acc_;
};

}  // namespace mla::reference
