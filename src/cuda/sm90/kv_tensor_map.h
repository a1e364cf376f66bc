// Host side: the TMA tensor maps of a paged dense cache and of a dense call's queries. The cache is
// [num_blocks, page, h_k, d] 16-bit elements read in 64 x 64 boxes (64 tokens of one page and head,
// 64 dims: 128-byte rows, 128-byte swizzle). A block index past the cache (how kernels name an
// invalid block-table entry) loads zeros.
// L2 promotion 128 bytes, the box's row: each row of a box is one 128-byte line of a token's record
// (the next 128 bytes belong to the next box, loaded right after). On an H200, replays alternated
// with the 256-byte promotion used before, it was faster in every dense case timed: b=128 h_q=128
// s_k=4096 varlen 278.5 -> 274.6 and 280.4 -> 278.5 us, b=8 s_k=32768 117.4 -> 116.1, b=2
// s_k=65536 76.2 -> 75.3, b=1 s_k=65536 49.8 -> 49.5, h_q=16 s_k=8192 300.3 -> 299.6.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mla/params.h"

namespace mla::cuda::sm90 {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status);
    return err == cudaSuccess && status == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr)
               : nullptr;
  }();
  return fn;
}

// A 4-D map of T (__nv_bfloat16 or __half) elements, unit element strides, 128-byte swizzle,
// 128-byte L2 promotion, out-of-bounds elements loading as zeros.
template <typename T>
CUresult encode_4d(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map, const void* base,
                   const cuuint64_t (&dims)[4], const cuuint64_t (&strides)[3], const cuuint32_t (&box)[4]) {
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
                const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// T: __nv_bfloat16 or __half; d: the cache's last dimension (576 or 512).
template <typename T>
cudaError_t encode_kv_tensor_map(CUtensorMap* map, const DenseDecodeParams& p, int d) {
  const auto encode = tensor_map_encoder();
  if (!encode) return cudaErrorNotSupported;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(p.h_k), cuuint64_t(p.page_block_size), cuuint64_t(p.num_blocks)};
  const cuuint64_t strides[3] = {cuuint64_t(p.k_stride_head) * sizeof(T), cuuint64_t(p.k_stride_token) * sizeof(T),
                                 cuuint64_t(p.k_stride_block) * sizeof(T)};
  const cuuint32_t box[4] = {64, 1, 64, 1};
  return encode_4d<T>(encode, map, p.k_cache, dims, strides, box) == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The queries of KV head `group` of request req as one tensor of s_q x (h_q / h_k) rows, so that
// a 64-row tile is one box per 64 columns: [b, h_k, rows, d] 16-bit elements read in 64 x 64 boxes
// (128-byte swizzle), rows past the last loading as zeros. Row r is token r / hpg, head
// group * hpg + r % hpg, which is one stride apart from row r - 1 only where a token's heads follow
// the last token's (q_stride_s == hpg * q_stride_h) or there is one token. TMA also needs the
// rows and the base on 16 bytes. Returns false, having encoded nothing, for any other Q: the
// kernel then copies its rows one by one.
template <typename T>
bool encode_q_tensor_map(CUtensorMap* map, const DenseDecodeParams& p, int d) {
  const auto encode = tensor_map_encoder();
  const int64_t hpg = p.h_q / p.h_k, rows = int64_t(p.s_q) * hpg, es = sizeof(T);
  if (!encode || (p.s_q > 1 && p.q_stride_s != hpg * p.q_stride_h)) return false;
  // A dimension of extent 1 never applies its stride, which the caller may have left at anything:
  // it gets the packed one (its elements right after the dimension below).
  const int64_t row = rows > 1 ? p.q_stride_h * es : d * es;
  const int64_t head_group = p.h_k > 1 ? hpg * p.q_stride_h * es : rows * row;
  const int64_t batch = p.b > 1 ? p.q_stride_b * es : p.h_k * head_group;
  auto fits = [](int64_t stride) { return stride > 0 && stride % 16 == 0 && stride < (int64_t(1) << 40); };
  if (reinterpret_cast<uintptr_t>(p.q) % 16 != 0 || !fits(row) || !fits(head_group) || !fits(batch)) return false;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(rows), cuuint64_t(p.h_k), cuuint64_t(p.b)};
  const cuuint64_t strides[3] = {cuuint64_t(row), cuuint64_t(head_group), cuuint64_t(batch)};
  const cuuint32_t box[4] = {64, 64, 1, 1};
  return encode_4d<T>(encode, map, p.q, dims, strides, box) == CUDA_SUCCESS;
}

}  // namespace mla::cuda::sm90
