// CPU decode: dense and sparse share one driver that walks the split plan part by part (one task
// per part, like one persistent CTA per part on the GPU), runs an online softmax over each piece's
// blocks, and writes either the final output or a split partial; a combine pass then merges the
// partials of split requests, attention sink included.
#include <algorithm>
#include <cstring>
#include <vector>

#include "mla/formats.h"
#include "mla/reference.h"
#include "mla/sparse_slots.h"
#include "mla/validate.h"
#include "online_softmax.h"

namespace mla::reference {

namespace {

// What a decode op looks like to the driver.
class DecodeProblem {
 public:
  virtual ~DecodeProblem() = default;
  // Query (request i, row s, head h) as floats, multiplied by softmax_scale * log2(e) (and descales).
  virtual void load_q(int i, int s, int h, float* q) const = 0;
  // Keys of block `blk` of request i seen by query row s through KV head g: fills up to 64 rows of
  // `keys` (stride d_qk) and `valid`; returns the number of slots. Invalid slots are never read.
  virtual int gather(int i, int blk, int s, int g, float* keys, uint8_t* valid) const = 0;
  // Attention sink of head h, -inf when there is none.
  float sink(int h) const { return attn_sink ? attn_sink[h] : -kInf; }

  int b = 0, s_q = 0, h_q = 0, h_k = 1, d_qk = 0, d_v = kHeadDimV;
  DecodePlanParams plan;
  DecodeSplit split;
  DecodeOutput o;
  const float* attn_sink = nullptr;  // [h_q] or null
};

int64_t out_offset(const DecodeOutput& o, int i, int s, int h) {
  return i * o.out_stride_b + s * o.out_stride_s + h * o.out_stride_h;
}
int64_t lse_offset(const DecodeOutput& o, int i, int s, int h) {
  return i * o.lse_stride_b + s * o.lse_stride_s + h * o.lse_stride_h;
}

// Split workspace row of (split, s, h).
int64_t accum_row(int s_q, int h_q, int split, int s, int h) { return (int64_t(split) * s_q + s) * h_q + h; }

void run_piece(const DecodeProblem& pb, const PlanPiece& pc, OnlineSoftmax& sm, std::vector<float>& q,
               std::vector<float>& keys, std::vector<uint8_t>& valid, std::vector<float>& z) {
  const int i = pc.req;
  const int heads_per_group = pb.h_q / pb.h_k;
  sm.reset();
  for (int s = 0; s < pb.s_q; ++s)
    for (int h = 0; h < pb.h_q; ++h) pb.load_q(i, s, h, &q[(size_t(s) * pb.h_q + h) * pb.d_qk]);

  for (int blk = pc.block_begin; blk < pc.block_end; ++blk) {
    for (int s = 0; s < pb.s_q; ++s) {
      for (int g = 0; g < pb.h_k; ++g) {
        const int n = pb.gather(i, blk, s, g, keys.data(), valid.data());
        for (int h = g * heads_per_group; h < (g + 1) * heads_per_group; ++h) {
          const float* qh = &q[(size_t(s) * pb.h_q + h) * pb.d_qk];
          for (int t = 0; t < n; ++t) z[t] = valid[t] ? dot(qh, &keys[size_t(t) * pb.d_qk], pb.d_qk) : 0.f;
          sm.update(s * pb.h_q + h, z.data(), valid.data(), n, keys.data(), pb.d_qk);
        }
      }
    }
  }

  for (int s = 0; s < pb.s_q; ++s) {
    for (int h = 0; h < pb.h_q; ++h) {
      const int r = s * pb.h_q + h;
      const float* acc = sm.acc(r);
      if (pc.is_split) {
        // Partial normalised by its own sum; the combine applies the sink.
        const int64_t row = accum_row(pb.s_q, pb.h_q, pc.split_index, s, h);
        const float inv = sm.sum(r) > 0.f ? 1.f / sm.sum(r) : 0.f;
        float* dst = pb.split.o_accum + row * pb.d_v;
        for (int d = 0; d < pb.d_v; ++d) dst[d] = acc[d] * inv;
        pb.split.lse_accum[row] = sm.lse2(r);
      } else {
        const float scale = sm.output_scale(r, pb.sink(h));
        const int64_t base = out_offset(pb.o, i, s, h);
        for (int d = 0; d < pb.d_v; ++d) store_from_float(pb.o.out, base + d, pb.o.out_dtype, acc[d] * scale);
        const float lse2 = sm.lse2(r);
        pb.o.lse[lse_offset(pb.o, i, s, h)] = lse2 == -kInf ? kInf : lse2 * kLn2;
      }
    }
  }
}

void run_decode(const DecodeProblem& pb) {
  check_plan_matches(pb.plan);
  const auto* rows = reinterpret_cast<const PlanRow*>(pb.split.tile_scheduler_metadata);
  parallel_for(pb.split.num_sm_parts, [&](int part) {
    const PlanRow& row = rows[part];
    if (row.begin_req >= pb.b || row.end_req < row.begin_req) return;
    OnlineSoftmax sm(pb.s_q * pb.h_q, pb.d_v);
    std::vector<float> q(size_t(pb.s_q) * pb.h_q * pb.d_qk), keys(size_t(kPlanBlockSize) * pb.d_qk), z(kPlanBlockSize);
    std::vector<uint8_t> valid(kPlanBlockSize);
    for (int k = 0; k <= row.end_req - row.begin_req; ++k) {
      const int req = row.begin_req + k;
      const PlanPiece pc = plan_piece(row, pb.split.num_splits, k, request_blocks(pb.plan, req));
      run_piece(pb, pc, sm, q, keys, valid, z);
    }
  });
  CombineParams cp;
  cp.b = pb.b, cp.s_q = pb.s_q, cp.h_q = pb.h_q, cp.d_v = pb.d_v;
  cp.split = pb.split;
  cp.o = pb.o;
  cp.attn_sink = pb.attn_sink;
  combine(cp);
}

// ---------------------------------------------------------------------------------------------
// Dense: paged BF16 / FP16 / FP8 cache, block table, GQA, bottom-right causal mask.

class DenseProblem final : public DecodeProblem {
 public:
  explicit DenseProblem(const DenseDecodeParams& p) : p_(p) {
    b = p.b, s_q = p.s_q, h_q = p.h_q, h_k = p.h_k, d_qk = p.d_qk, d_v = p.d_v;
    plan = dense_plan_params(p);
    split = p.split;
    o = p.o;
  }

  void load_q(int i, int s, int h, float* q) const override {
    const int64_t base = i * p_.q_stride_b + s * p_.q_stride_s + h * p_.q_stride_h;
    const float scale = p_.softmax_scale * kLog2e * descale(p_.descale_q, i);
    for (int d = 0; d < d_qk; ++d) q[d] = load_as_float(p_.q, base + d, p_.dtype) * scale;
  }

  int gather(int i, int blk, int s, int g, float* keys, uint8_t* valid) const override {
    const int len = p_.seqlens_k[i];
    const int t0 = blk * kPlanBlockSize;
    const int n = std::min(kPlanBlockSize, len - t0);
    // Last key row s may see: bottom-right aligned causal mask.
    const int limit = p_.causal && s_q > 1 ? s + len - s_q : len - 1;
    const float dk = descale(p_.descale_k, i);
    for (int t = 0; t < n; ++t) {
      const int tok = t0 + t;
      valid[t] = tok <= limit;
      if (!valid[t]) continue;
      const int64_t page = p_.block_table[i * p_.block_table_stride + tok / p_.page_block_size];
      const int64_t base = page * p_.k_stride_block + (tok % p_.page_block_size) * p_.k_stride_token + g * p_.k_stride_head;
      for (int d = 0; d < d_qk; ++d) keys[size_t(t) * d_qk + d] = load_as_float(p_.k_cache, base + d, p_.dtype) * dk;
    }
    return std::max(n, 0);
  }

 private:
  float descale(const float* d, int i) const {
    if (p_.dtype != DType::kFP8E4M3 || !d) return 1.f;
    return p_.descale_per_request ? d[i] : d[0];
  }
  const DenseDecodeParams& p_;
};

// ---------------------------------------------------------------------------------------------
// Sparse: FP8 V3.2 / MODEL1 caches addressed by flat token indices, main + extra slots.

class SparseProblem final : public DecodeProblem {
 public:
  explicit SparseProblem(const SparseDecodeParams& p) : p_(p) {
    b = p.b, s_q = p.s_q, h_q = p.h_q, h_k = 1, d_qk = p.d_qk, d_v = p.d_v;
    plan = sparse_plan_params(p);
    split = p.split;
    o = p.o;
    attn_sink = p.attn_sink;
  }

  void load_q(int i, int s, int h, float* q) const override {
    const uint16_t* src = p_.q + i * p_.q_stride_b + s * p_.q_stride_s + h * p_.q_stride_h;
    const float scale = p_.softmax_scale * kLog2e;
    for (int d = 0; d < d_qk; ++d) q[d] = bf16_to_float(src[d]) * scale;
  }

  int gather(int i, int blk, int s, int, float* keys, uint8_t* valid) const override {
    const SparseBlockSlots src = sparse_block_slots(p_, plan, i, s, blk);
    const SparseKvCache& cache = *src.cache;
    const int n = std::max(std::min(kPlanBlockSize, src.slots - src.slot0), 0);
    for (int t = 0; t < n; ++t) {
      const int slot = src.slot0 + t;
      const int64_t tok = slot < src.len ? src.indices[slot] : -1;
      valid[t] = sparse_token_in_cache(cache, tok);
      if (!valid[t]) continue;
      const uint8_t* block = cache.data + (tok / cache.page_block_size) * cache.stride_block;
      dequantize_token(p_.format, block, cache.page_block_size, int(tok % cache.page_block_size),
                       keys + size_t(t) * d_qk);
    }
    return n;
  }

 private:
  const SparseDecodeParams& p_;
};

// Every block-table entry a dense request reads must name a real page block.
void check_block_table(const DenseDecodeParams& p) {
  for (int i = 0; i < p.b; ++i) {
    const int len = p.seqlens_k[i];
    MLA_CHECK(len >= 0, "cache_seqlens[", i, "] must be >= 0, got ", len);
    const long long pages = (static_cast<long long>(len) + p.page_block_size - 1) / p.page_block_size;  // len near 2^31
    MLA_CHECK(pages <= p.max_blocks_per_seq, "cache_seqlens[", i, "] = ", len, " needs ", pages,
              " page blocks but block_table has ", p.max_blocks_per_seq, " columns");
    for (int j = 0; j < int(pages); ++j) {
      const int32_t page = p.block_table[i * p.block_table_stride + j];
      MLA_CHECK(page >= 0 && page < p.num_blocks, "block_table[", i, ", ", j, "] = ", page, " is outside [0, ",
                p.num_blocks, ") (k_cache has ", p.num_blocks, " page blocks)");
    }
  }
}

}  // namespace

void combine(const CombineParams& p) {
  const int32_t* ns = p.split.num_splits;
  parallel_for(p.b, [&](int i) {
    const int n = ns[i + 1] - ns[i];
    if (n <= 1) return;
    std::vector<float> out(p.d_v);
    for (int s = 0; s < p.s_q; ++s) {
      for (int h = 0; h < p.h_q; ++h) {
        auto lse_k = [&](int k) { return p.split.lse_accum[accum_row(p.s_q, p.h_q, ns[i] + k, s, h)]; };
        float m = -kInf;
        for (int k = 0; k < n; ++k) m = std::fmax(m, lse_k(k));
        if (m == -kInf) m = 0.f;
        float sum = 0.f;
        for (int k = 0; k < n; ++k) sum += std::exp2(lse_k(k) - m);
        float g = sum == 0.f ? kInf : std::log2(sum) + m;
        p.o.lse[lse_offset(p.o, i, s, h)] = g * kLn2;
        // Fold the sink into the normaliser: g = log2(2^g + 2^sink2).
        const float sink2 = p.attn_sink ? p.attn_sink[h] * kLog2e : -kInf;
        if (g != kInf) {
          g += std::log2(1.f + std::exp2(sink2 - g));
        } else {
          g = sink2 == -kInf ? kInf : sink2;
        }
        std::fill(out.begin(), out.end(), 0.f);
        for (int k = 0; k < n; ++k) {
          const float w = std::exp2(lse_k(k) - g);
          if (w == 0.f) continue;
          const float* src = p.split.o_accum + accum_row(p.s_q, p.h_q, ns[i] + k, s, h) * p.d_v;
          for (int d = 0; d < p.d_v; ++d) out[d] += w * src[d];
        }
        const int64_t base = out_offset(p.o, i, s, h);
        for (int d = 0; d < p.d_v; ++d) store_from_float(p.o.out, base + d, p.o.out_dtype, out[d]);
      }
    }
  });
}

void dense_decode(const DenseDecodeParams& p) {
  validate(p);
  validate_split(p.split);
  check_block_table(p);
  run_decode(DenseProblem(p));
}

void sparse_decode(const SparseDecodeParams& p) {
  validate(p);
  validate_split(p.split);
  run_decode(SparseProblem(p));
}

}  // namespace mla::reference
