// The implementation table: which kernel runs a call. Each implementation declares the GPU
// architectures it runs on and the features it supports; the first one (in table order, fastest
// first) that covers the call's features wins. MLA_KERNELS_IMPL=<name> forces one, so every path
// can be tested on one GPU. A call nothing supports is an error that names the missing features.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mla/params.h"

namespace mla {

enum class OpKind : int32_t { kDenseDecode = 0, kSparseDecode = 1, kSparsePrefill = 2 };

// Features a call may need, as bits.
enum Feature : uint32_t {
  kFeatBF16 = 1u << 0,
  kFeatFP16 = 1u << 1,
  kFeatFP8 = 1u << 2,            // FP8 e4m3 dense cache with descales
  kFeatHeadDim576 = 1u << 3,
  kFeatHeadDim512 = 1u << 4,
  kFeatV32Format = 1u << 5,
  kFeatModel1Format = 1u << 6,
  kFeatAttnSink = 1u << 7,
  kFeatTopkLength = 1u << 8,
  kFeatExtraCache = 1u << 9,
  kFeatExtraTopkLength = 1u << 10,
  kFeatCausal = 1u << 11,
  kFeatPageSize64 = 1u << 12,    // page_block_size == 64
  kFeatOtherPageSize = 1u << 13,  // any other page size
  kFeatHeadsOver64 = 1u << 14,   // more than 64 query rows per KV head (dense) / heads (sparse)
  kFeatHeadsOver32 = 1u << 15,   // more than 32 of them (set together with kFeatHeadsOver64 above 64)
  kFeatHeadsOver16 = 1u << 16,   // more than 16 of them (set with the two above where they are)
};

// Human-readable names of the bits set in `features`, comma separated.
std::string feature_names(uint32_t features);

struct ImplementationInfo {
  const char* name;  // e.g. "portable", "sm90"
  OpKind op;
  int min_arch;      // compute capability x 10, e.g. 80
  int max_arch;      // inclusive; e.g. 90 for an sm90a-only kernel, 1000 for "any newer"
  uint32_t features;
};

// Features a call needs.
uint32_t required_features(const DenseDecodeParams& p);
uint32_t required_features(const SparseDecodeParams& p);
uint32_t required_features(const SparsePrefillParams& p);

// Index into `table` of the implementation that runs a call of `op` with `features` on a GPU of
// compute capability `arch` (x 10). `forced` (MLA_KERNELS_IMPL) names an implementation to use,
// or is empty. Throws mla::Error naming the op, the arch and the features nothing supports.
int select_implementation(const std::vector<ImplementationInfo>& table, OpKind op, int arch, uint32_t features,
                          const std::string& forced);

const char* op_name(OpKind op);

}  // namespace mla
