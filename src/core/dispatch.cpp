#include "mla/dispatch.h"

#include "mla/plan.h"

namespace mla {

namespace {

constexpr struct {
  Feature bit;
  const char* name;
} kFeatureNames[] = {
    {kFeatBF16, "bf16"},
    {kFeatFP16, "fp16"},
    {kFeatFP8, "fp8 cache"},
    {kFeatHeadDim576, "d_qk 576"},
    {kFeatHeadDim512, "d_qk 512"},
    {kFeatV32Format, "V3.2 format"},
    {kFeatModel1Format, "MODEL1 format"},
    {kFeatAttnSink, "attn_sink"},
    {kFeatTopkLength, "topk_length"},
    {kFeatExtraCache, "extra cache"},
    {kFeatExtraTopkLength, "extra_topk_length"},
    {kFeatCausal, "causal"},
    {kFeatPageSize64, "page size 64"},
    {kFeatOtherPageSize, "page size other than 64"},
    {kFeatHeadsOver64, "more than 64 query rows per KV head"},
    {kFeatHeadsOver32, "more than 32 query rows per KV head"},
    {kFeatHeadsOver16, "more than 16 query rows per KV head"},
};

uint32_t head_dim_bit(int d_qk) { return d_qk == kHeadDimV32 ? kFeatHeadDim576 : kFeatHeadDim512; }

}  // namespace

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::kDenseDecode: return "dense decode";
    case OpKind::kSparseDecode: return "sparse decode";
    case OpKind::kSparsePrefill: return "sparse prefill";
  }
  return "unknown op";
}

std::string feature_names(uint32_t features) {
  std::string s;
  for (const auto& f : kFeatureNames) {
    if (!(features & f.bit)) continue;
    if (!s.empty()) s += ", ";
    s += f.name;
  }
  return s;
}

uint32_t required_features(const DenseDecodeParams& p) {
  uint32_t f = head_dim_bit(p.d_qk);
  f |= p.dtype == DType::kFP16 ? kFeatFP16 : p.dtype == DType::kFP8E4M3 ? kFeatFP8 : kFeatBF16;
  f |= p.page_block_size == 64 ? kFeatPageSize64 : kFeatOtherPageSize;
  if (p.causal && p.s_q > 1) f |= kFeatCausal;
  const int rows = p.h_k > 0 ? p.s_q * (p.h_q / p.h_k) : 0;
  if (rows > 16) f |= kFeatHeadsOver16;
  if (rows > 32) f |= kFeatHeadsOver32;
  if (rows > 64) f |= kFeatHeadsOver64;
  return f;
}

uint32_t required_features(const SparseDecodeParams& p) {
  uint32_t f = kFeatBF16 | head_dim_bit(p.d_qk);
  f |= p.format == KvFormat::kV32 ? kFeatV32Format : kFeatModel1Format;
  if (p.attn_sink) f |= kFeatAttnSink;
  if (p.topk_length) f |= kFeatTopkLength;
  if (has_extra_cache(p)) f |= kFeatExtraCache;
  if (has_extra_cache(p) && p.extra_topk_length) f |= kFeatExtraTopkLength;
  if (p.h_q > 16) f |= kFeatHeadsOver16;
  if (p.h_q > 32) f |= kFeatHeadsOver32;
  if (p.h_q > 64) f |= kFeatHeadsOver64;
  return f;
}

uint32_t required_features(const SparsePrefillParams& p) {
  uint32_t f = kFeatBF16 | head_dim_bit(p.d_qk);
  if (p.attn_sink) f |= kFeatAttnSink;
  if (p.topk_length) f |= kFeatTopkLength;
  if (p.h_q > 16) f |= kFeatHeadsOver16;
  if (p.h_q > 32) f |= kFeatHeadsOver32;
  if (p.h_q > 64) f |= kFeatHeadsOver64;
  return f;
}

int select_implementation(const std::vector<ImplementationInfo>& table, OpKind op, int arch, uint32_t features,
                          const std::string& forced) {
  bool forced_exists = forced.empty();
  std::string why;
  for (size_t i = 0; i < table.size(); ++i) {
    const ImplementationInfo& impl = table[i];
    if (impl.op != op) continue;
    if (!forced.empty() && forced != impl.name) continue;
    forced_exists = true;
    if (arch < impl.min_arch || arch > impl.max_arch) {
      why += detail::concat("; ", impl.name, " runs on sm_", impl.min_arch, "..sm_", impl.max_arch);
      continue;
    }
    const uint32_t missing = features & ~impl.features;
    if (missing == 0) return int(i);
    why += detail::concat("; ", impl.name, " lacks ", feature_names(missing));
  }
  MLA_CHECK(forced_exists, "MLA_KERNELS_IMPL=", forced, " names no implementation of ", op_name(op));
  MLA_CHECK(false, "no implementation of ", op_name(op), " on sm_", arch, " supports this call (",
            feature_names(features), ")", why);
  return -1;
}

}  // namespace mla
