// CPU sparse prefill: each query row attends its own top-k tokens of a BF16 KV, blocks of 64 slots
// through the same online softmax as decode. Rows are independent, so there is no split.
#include <algorithm>
#include <vector>

#include "mla/formats.h"
#include "mla/reference.h"
#include "mla/validate.h"
#include "online_softmax.h"

namespace mla::reference {

void sparse_prefill(const SparsePrefillParams& p) {
  validate(p);
  if (p.topk_length)
    for (int s = 0; s < p.s_q; ++s)
      MLA_CHECK(p.topk_length[s] >= 0, "topk_length[", s, "] must be >= 0, got ", p.topk_length[s]);
  parallel_for(p.s_q, [&](int s) {
    OnlineSoftmax sm(p.h_q, p.d_v);
    std::vector<float> q(size_t(p.h_q) * p.d_qk), keys(size_t(kPlanBlockSize) * p.d_qk), z(kPlanBlockSize);
    std::vector<uint8_t> valid(kPlanBlockSize);
    std::vector<float> max_z(p.h_q, -kInf);
    const float scale = p.softmax_scale * kLog2e;
    for (int h = 0; h < p.h_q; ++h) {
      const uint16_t* src = p.q + s * p.q_stride_s + h * p.q_stride_h;
      for (int d = 0; d < p.d_qk; ++d) q[size_t(h) * p.d_qk + d] = bf16_to_float(src[d]) * scale;
    }
    const int len = p.topk_length ? std::clamp(p.topk_length[s], 0, p.topk) : p.topk;
    const int32_t* idx = p.indices + s * p.indices_stride_s;
    for (int slot0 = 0; slot0 < len; slot0 += kPlanBlockSize) {
      const int n = std::min(kPlanBlockSize, len - slot0);
      for (int t = 0; t < n; ++t) {
        const int32_t tok = idx[slot0 + t];
        valid[t] = tok >= 0 && tok < p.s_kv;
        if (!valid[t]) continue;
        const uint16_t* src = p.kv + int64_t(tok) * p.kv_stride_s;
        for (int d = 0; d < p.d_qk; ++d) keys[size_t(t) * p.d_qk + d] = bf16_to_float(src[d]);
      }
      for (int h = 0; h < p.h_q; ++h) {
        for (int t = 0; t < n; ++t) {
          z[t] = valid[t] ? dot(&q[size_t(h) * p.d_qk], &keys[size_t(t) * p.d_qk], p.d_qk) : 0.f;
          if (valid[t]) max_z[h] = std::fmax(max_z[h], z[t]);
        }
        sm.update(h, z.data(), valid.data(), n, keys.data(), p.d_qk);
      }
    }
    // Statistics in base 2 (z is already in log2 units) or converted to natural log.
    const float unit = p.log2_stats ? 1.f : kLn2;
    for (int h = 0; h < p.h_q; ++h) {
      const int64_t row = int64_t(s) * p.h_q + h;
      const float sink = p.attn_sink ? p.attn_sink[h] : -kInf;
      const float out_scale = sm.output_scale(h, sink);
      const float* acc = sm.acc(h);
      for (int d = 0; d < p.d_v; ++d) p.out[row * p.d_v + d] = float_to_bf16(acc[d] * out_scale);
      const float lse2 = sm.lse2(h);
      p.lse[row] = lse2 == -kInf ? kInf : lse2 * unit;
      p.max_logits[row] = max_z[h] == -kInf ? -kInf : max_z[h] * unit;
    }
  });
}

}  // namespace mla::reference
