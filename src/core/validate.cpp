#include "mla/validate.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include "mla/formats.h"

namespace mla {

namespace {

void check_common_decode(int b, int s_q, int h_q, int d_v, float scale) {
  MLA_CHECK(b > 0, "q: batch size must be > 0, got ", b);
  MLA_CHECK(s_q > 0, "q: s_q (dim 1) must be > 0, got ", s_q);
  MLA_CHECK(h_q > 0, "q: h_q (dim 2) must be > 0, got ", h_q);
  MLA_CHECK(d_v == kHeadDimV, "head_dim_v must be ", kHeadDimV, ", got ", d_v);
  MLA_CHECK(std::isfinite(scale), "softmax_scale must be finite, got ", scale);
}

// The outputs every decode call writes through. The API cannot see whether a pointer is valid, but
// a null one is an error, not a crash.
void check_decode_outputs(const DecodeOutput& o) {
  MLA_CHECK(o.out != nullptr, "out must not be null");
  MLA_CHECK(o.lse != nullptr, "lse must not be null");
}

void check_sparse_cache(const SparseKvCache& c, KvFormat f, const char* name) {
  MLA_CHECK(c.page_block_size > 0, name, ": page_block_size (dim 1) must be > 0, got ", c.page_block_size);
  MLA_CHECK(c.num_blocks >= 0, name, ": num_blocks must be >= 0, got ", c.num_blocks);
  MLA_CHECK(c.num_blocks == 0 || c.data != nullptr, name, ": data must not be null with ", c.num_blocks,
            " page blocks");
  const int64_t block_bytes = int64_t(c.page_block_size) * bytes_per_token(f);
  MLA_CHECK(c.num_blocks <= 1 || c.stride_block >= block_bytes, name, ": stride(0) must be >= page_block_size * ",
            bytes_per_token(f), " = ", block_bytes, " bytes, got ", c.stride_block);
}

}  // namespace

void validate(const DenseDecodeParams& p) {
  check_common_decode(p.b, p.s_q, p.h_q, p.d_v, p.softmax_scale);
  MLA_CHECK(p.h_k > 0, "k_cache: h_k (dim 2) must be > 0, got ", p.h_k);
  MLA_CHECK(p.h_q % p.h_k == 0, "q: h_q (", p.h_q, ") must be a multiple of h_k (", p.h_k, ")");
  MLA_CHECK(p.d_qk == kHeadDimV32 || p.d_qk == kHeadDimModel1, "q: head dim (dim 3) must be 576 or 512, got ", p.d_qk);
  MLA_CHECK(p.page_block_size > 0, "k_cache: page_block_size (dim 1) must be > 0, got ", p.page_block_size);
  MLA_CHECK(p.num_blocks >= 0, "k_cache: num_blocks (dim 0) must be >= 0, got ", p.num_blocks);
  MLA_CHECK(p.max_blocks_per_seq >= 0, "block_table: max_blocks_per_seq (dim 1) must be >= 0, got ",
            p.max_blocks_per_seq);
  MLA_CHECK(p.q != nullptr, "q must not be null");
  MLA_CHECK(p.num_blocks == 0 || p.k_cache != nullptr, "k_cache must not be null with ", p.num_blocks,
            " page blocks");
  MLA_CHECK(p.seqlens_k != nullptr, "seqlens_k (cache_seqlens) must not be null");
  MLA_CHECK(p.max_blocks_per_seq == 0 || p.block_table != nullptr, "block_table must not be null with ",
            p.max_blocks_per_seq, " columns (max_blocks_per_seq)");
  check_decode_outputs(p.o);
  MLA_CHECK(p.dtype == DType::kBF16 || p.dtype == DType::kFP16 || p.dtype == DType::kFP8E4M3,
            "q: dtype must be bfloat16, float16 or float8_e4m3fn, got ", to_string(p.dtype));
  if (p.dtype == DType::kFP8E4M3) {
    MLA_CHECK(p.descale_q && p.descale_k, "descale_q and descale_k are required for an FP8 cache");
    MLA_CHECK(p.o.out_dtype == DType::kBF16, "FP8 dense decode writes bfloat16 output, got ", to_string(p.o.out_dtype));
  } else {
    MLA_CHECK(p.o.out_dtype == p.dtype, "out: dtype must equal q's (", to_string(p.dtype), "), got ",
              to_string(p.o.out_dtype));
  }
}

void validate(const SparseDecodeParams& p) {
  check_common_decode(p.b, p.s_q, p.h_q, p.d_v, p.softmax_scale);
  MLA_CHECK(p.h_q <= kMaxHeadsQ, "q: h_q (dim 2) must be <= ", kMaxHeadsQ, ", got ", p.h_q);
  MLA_CHECK(p.format == KvFormat::kV32 || p.format == KvFormat::kModel1, "format must be V3.2 or MODEL1, got ",
            int(p.format));
  MLA_CHECK(p.o.out_dtype == DType::kBF16, "out: dtype must be bfloat16 (sparse decode), got ",
            to_string(p.o.out_dtype));
  MLA_CHECK(p.d_qk == head_dim_qk(p.format), "q: head dim (dim 3) must be ", head_dim_qk(p.format), " for the ",
            to_string(p.format), " cache format, got ", p.d_qk);
  MLA_CHECK(p.topk > 0, "indices: topk (dim 2) must be > 0, got ", p.topk);
  // Pointers after the sizes that say a tensor is not empty (an empty one may have none).
  MLA_CHECK(p.q != nullptr, "q must not be null");
  MLA_CHECK(p.indices != nullptr, "indices must not be null");
  check_decode_outputs(p.o);
  check_sparse_cache(p.kv, p.format, "kv");
  if (p.extra_kv.data || p.extra_indices) {
    // An extra cache of no page blocks may have no data (an empty allocation): extra_indices says
    // that the call has one.
    MLA_CHECK(p.extra_topk > 0, "extra_indices: extra_topk (dim 2) must be > 0, got ", p.extra_topk);
    MLA_CHECK(p.extra_indices, "extra_indices must not be null with an extra cache (extra_kv.data given)");
    check_sparse_cache(p.extra_kv, p.format, "extra_kv");
  } else {
    MLA_CHECK(!p.extra_topk_length, "extra_topk_length needs extra_kv and extra_indices");
  }
}

void validate_device_output(const DecodeOutput& o, int b, int s_q, int h_q) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(o.out);
  MLA_CHECK(address % 4 == 0, "out: must be 4-byte aligned on the GPU, got an address of ", address % 4,
            " mod 4");
  const bool even = (b <= 1 || o.out_stride_b % 2 == 0) && (s_q <= 1 || o.out_stride_s % 2 == 0) &&
                    (h_q <= 1 || o.out_stride_h % 2 == 0);
  MLA_CHECK(even, "out: strides must be even on the GPU, got (", o.out_stride_b, ", ", o.out_stride_s, ", ",
            o.out_stride_h, ")");
}

void validate_split(const DecodeSplit& s) {
  MLA_CHECK(s.num_sm_parts > 0, "num_sm_parts must be > 0, got ", s.num_sm_parts);
  MLA_CHECK(s.tile_scheduler_metadata != nullptr, "tile_scheduler_metadata must not be null");
  MLA_CHECK(s.num_splits != nullptr, "num_splits must not be null");
  MLA_CHECK(s.num_sm_parts == 1 || (s.o_accum != nullptr && s.lse_accum != nullptr),
            "o_accum and lse_accum (the split workspace) must not be null with num_sm_parts = ", s.num_sm_parts);
}

void validate(const SparsePrefillParams& p) {
  MLA_CHECK(p.s_q > 0, "q: s_q (dim 0) must be > 0, got ", p.s_q);
  MLA_CHECK(p.s_kv > 0, "kv: s_kv (dim 0) must be > 0, got ", p.s_kv);
  MLA_CHECK(p.h_q > 0 && p.h_q <= kMaxHeadsQ, "q: h_q (dim 1) must be in [1, ", kMaxHeadsQ, "], got ", p.h_q);
  MLA_CHECK(p.d_qk == kHeadDimV32 || p.d_qk == kHeadDimModel1, "q: head dim (dim 2) must be 576 or 512, got ", p.d_qk);
  MLA_CHECK(p.d_v == kHeadDimV, "d_v must be ", kHeadDimV, ", got ", p.d_v);
  MLA_CHECK(p.topk > 0, "indices: topk (dim 2) must be > 0, got ", p.topk);
  MLA_CHECK(std::isfinite(p.softmax_scale), "sm_scale must be finite, got ", p.softmax_scale);
  for (auto [ptr, name] : {std::pair<const void*, const char*>{p.q, "q"}, {p.kv, "kv"}, {p.indices, "indices"},
                            {p.out, "out"}, {p.max_logits, "max_logits"}, {p.lse, "lse"}})
    MLA_CHECK(ptr != nullptr, name, " must not be null");
}

}  // namespace mla
