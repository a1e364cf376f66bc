// The implementation table's selection rules: order, architecture ranges, features, the override.
#include <gtest/gtest.h>

#include "mla/dispatch.h"

namespace mla {
namespace {

const std::vector<ImplementationInfo> kTable = {
    {"sm90", OpKind::kSparseDecode, 90, 90, kFeatBF16 | kFeatHeadDim576 | kFeatV32Format | kFeatAttnSink},
    {"portable", OpKind::kSparseDecode, 80, 1000,
     kFeatBF16 | kFeatHeadDim576 | kFeatHeadDim512 | kFeatV32Format | kFeatModel1Format | kFeatAttnSink |
         kFeatExtraCache},
    {"portable", OpKind::kDenseDecode, 80, 1000, kFeatBF16 | kFeatHeadDim576 | kFeatPageSize64},
};

TEST(Dispatch, FirstSupportingImplementationWins) {
  const uint32_t v32 = kFeatBF16 | kFeatHeadDim576 | kFeatV32Format;
  EXPECT_EQ(select_implementation(kTable, OpKind::kSparseDecode, 90, v32, ""), 0);
  EXPECT_EQ(select_implementation(kTable, OpKind::kSparseDecode, 80, v32, ""), 1);   // sm90 is Hopper-only
  EXPECT_EQ(select_implementation(kTable, OpKind::kSparseDecode, 100, v32, ""), 1);  // and not Blackwell
  EXPECT_EQ(select_implementation(kTable, OpKind::kSparseDecode, 90, v32 | kFeatExtraCache, ""), 1);
  EXPECT_EQ(select_implementation(kTable, OpKind::kDenseDecode, 90, kFeatBF16 | kFeatHeadDim576 | kFeatPageSize64, ""),
            2);
}

TEST(Dispatch, OverrideForcesAnImplementation) {
  const uint32_t v32 = kFeatBF16 | kFeatHeadDim576 | kFeatV32Format;
  EXPECT_EQ(select_implementation(kTable, OpKind::kSparseDecode, 90, v32, "portable"), 1);
  try {
    select_implementation(kTable, OpKind::kSparseDecode, 90, v32, "nonesuch");
    FAIL() << "an unknown override must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MLA_KERNELS_IMPL=nonesuch"), std::string::npos) << e.what();
  }
  try {
    select_implementation(kTable, OpKind::kSparseDecode, 90, v32 | kFeatExtraCache, "sm90");
    FAIL() << "a forced implementation lacking a feature must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sm90 lacks extra cache"), std::string::npos) << e.what();
  }
}

TEST(Dispatch, ErrorNamesTheMissingFeature) {
  try {
    select_implementation(kTable, OpKind::kDenseDecode, 90, kFeatFP16 | kFeatHeadDim576 | kFeatPageSize64, "");
    FAIL() << "no implementation has fp16 here";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("dense decode"), std::string::npos) << msg;
    EXPECT_NE(msg.find("portable lacks fp16"), std::string::npos) << msg;
  }
}

TEST(Dispatch, RequiredFeaturesOfACall) {
  SparseDecodeParams s;
  s.d_qk = 512, s.format = KvFormat::kModel1, s.h_q = 128;
  float sink = 0.f;
  s.attn_sink = &sink;
  const uint32_t over16 = kFeatHeadsOver16;
  EXPECT_EQ(required_features(s), kFeatBF16 | kFeatHeadDim512 | kFeatModel1Format | kFeatAttnSink | over16 |
                                      kFeatHeadsOver32 | kFeatHeadsOver64);
  s.h_q = 48;
  EXPECT_EQ(required_features(s),
            kFeatBF16 | kFeatHeadDim512 | kFeatModel1Format | kFeatAttnSink | over16 | kFeatHeadsOver32);
  s.h_q = 32;
  EXPECT_EQ(required_features(s), kFeatBF16 | kFeatHeadDim512 | kFeatModel1Format | kFeatAttnSink | over16);
  s.h_q = 16;
  EXPECT_EQ(required_features(s), kFeatBF16 | kFeatHeadDim512 | kFeatModel1Format | kFeatAttnSink);
  DenseDecodeParams d;
  d.d_qk = 576, d.dtype = DType::kFP16, d.page_block_size = 16, d.s_q = 2, d.h_q = 16, d.h_k = 1, d.causal = true;
  EXPECT_EQ(required_features(d), kFeatFP16 | kFeatHeadDim576 | kFeatOtherPageSize | kFeatCausal | over16);  // 32 rows
  d.s_q = 1;  // 16 rows
  EXPECT_EQ(required_features(d), kFeatFP16 | kFeatHeadDim576 | kFeatOtherPageSize);
  d.s_q = 2;
  d.h_q = 32, d.h_k = 2;  // 2 x 16 rows per KV head
  EXPECT_EQ(required_features(d), kFeatFP16 | kFeatHeadDim576 | kFeatOtherPageSize | kFeatCausal | over16);
  d.h_k = 1;  // 64 rows
  EXPECT_EQ(required_features(d),
            kFeatFP16 | kFeatHeadDim576 | kFeatOtherPageSize | kFeatCausal | over16 | kFeatHeadsOver32);
  EXPECT_EQ(feature_names(kFeatFP16 | kFeatCausal), "fp16, causal");
}

}  // namespace
}  // namespace mla
