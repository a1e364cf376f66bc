// Scalar conversions and the FP8 cache codecs: exact bytes for known values, round trips.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "mla/formats.h"

namespace mla {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808000u)), 0x3f80);  // halfway, even stays
  EXPECT_EQ(float_to_bf16(bits_float(0x3f818000u)), 0x3f82);  // halfway, odd rounds up
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808001u)), 0x3f81);  // above halfway
  EXPECT_EQ(float_to_bf16(std::nanf("")), 0x7fc0);
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) continue;  // NaN payloads are canonicalised
    EXPECT_EQ(float_to_bf16(bf16_to_float(uint16_t(h))), h);
  }
}

TEST(Fp16, KnownValuesAndRoundTrip) {
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);  // halfway to 65536 rounds to even: infinity
  EXPECT_EQ(float_to_fp16(std::ldexp(1.f, -24)), 0x0001);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.f, -25)), 0x0000);      // tie to even
  EXPECT_EQ(float_to_fp16(std::ldexp(3.f, -25)), 0x0002);      // tie to even
  EXPECT_EQ(float_to_fp16(-std::ldexp(1.f, -14)), 0x8400);     // smallest normal
  EXPECT_EQ(float_to_fp16(std::nanf("")) & 0x7e00, 0x7e00);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;
    EXPECT_EQ(float_to_fp16(fp16_to_float(uint16_t(h))), h) << h;
  }
}

TEST(Fp8E4M3, KnownValues) {
  EXPECT_EQ(float_to_fp8e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_fp8e4m3(-1.0f), 0xb8);
  EXPECT_EQ(float_to_fp8e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8e4m3(464.0f), 0x7e);  // halfway to 480 (NaN): even mantissa stays
  EXPECT_EQ(float_to_fp8e4m3(465.0f), 0x7f);  // not saturating: NaN, as torch's cast
  EXPECT_EQ(float_to_fp8e4m3(std::ldexp(1.f, -9)), 0x01);
  EXPECT_EQ(float_to_fp8e4m3(std::ldexp(1.f, -10)), 0x00);  // tie to even
  EXPECT_EQ(float_to_fp8e4m3(std::ldexp(3.f, -10)), 0x02);  // tie to even
  EXPECT_EQ(float_to_fp8e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_fp8e4m3(std::nanf("")), 0x7f);
  EXPECT_EQ(float_to_fp8e4m3(1.0625f), 0x38);  // 1 + 1/16: tie, even stays at 1.0
  EXPECT_EQ(float_to_fp8e4m3(1.1875f), 0x3a);  // 1 + 3/16: tie, odd rounds up to 1.25
  EXPECT_FLOAT_EQ(fp8e4m3_to_float(0x7e), 448.f);
  EXPECT_FLOAT_EQ(fp8e4m3_to_float(0x08), std::ldexp(1.f, -6));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(0xff)));
}

TEST(Fp8E4M3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) EXPECT_EQ(float_to_fp8e4m3(fp8e4m3_to_float(uint8_t(c))), c) << c;
}

TEST(Ue8m0, PowersOfTwo) {
  EXPECT_EQ(ue8m0_to_float(127), 1.0f);
  EXPECT_EQ(ue8m0_to_float(120), std::ldexp(1.f, -7));
  EXPECT_EQ(ue8m0_to_float(130), 8.0f);
  EXPECT_TRUE(std::isnan(ue8m0_to_float(255)));
}

TEST(QuantizationScale, PowerOfTwoRoundedUp) {
  EXPECT_EQ(quantization_scale(448.f), 1.f);
  EXPECT_EQ(quantization_scale(449.f), 2.f);
  EXPECT_EQ(quantization_scale(448.f / 32), 1.f / 32);
  EXPECT_EQ(quantization_scale(0.f), std::ldexp(1.f, -13));  // max(s, 1e-4) -> 2^-13
  EXPECT_EQ(quantization_scale(1.f), 1.f / 256);              // 1/448 -> 2^-8
}

std::vector<uint16_t> token_of(std::vector<float> values) {
  std::vector<uint16_t> t(values.size());
  for (size_t i = 0; i < values.size(); ++i) t[i] = float_to_bf16(values[i]);
  return t;
}

TEST(V32, ExactBytes) {
  std::vector<float> x(576, 0.5f);
  x[0] = 448.f;   // tile 0: amax 448 -> scale 1
  x[130] = 3.f;   // tile 1: amax 3 -> 3/448 -> 2^-7
  for (int r = 0; r < 64; ++r) x[512 + r] = float(r) - 7.25f;
  const auto in = token_of(x);
  std::vector<uint8_t> block(2 * 656, 0xcd);
  quantize_token(KvFormat::kV32, in.data(), block.data(), 2, 1);
  const uint8_t* rec = block.data() + 656;
  EXPECT_EQ(block[0], 0xcd);  // token 0 untouched
  EXPECT_EQ(rec[0], 0x7e);    // 448 / 1
  EXPECT_EQ(rec[1], 0x30);    // 0.5 / 1
  EXPECT_EQ(rec[130], 0x7c);  // 3 / 2^-7 = 384
  EXPECT_EQ(rec[129], 0x68);  // 0.5 / 2^-7 = 64
  float scales[4];
  std::memcpy(scales, rec + 512, 16);
  EXPECT_EQ(scales[0], 1.f);
  EXPECT_EQ(scales[1], 1.f / 128);
  EXPECT_EQ(scales[2], 1.f / 512);  // 0.5/448 -> 2^-9
  EXPECT_EQ(scales[3], 1.f / 512);
  EXPECT_EQ(std::memcmp(rec + 528, in.data() + 512, 128), 0);  // RoPE verbatim

  std::vector<float> back(576);
  dequantize_token(KvFormat::kV32, block.data(), 2, 1, back.data());
  for (int d = 0; d < 576; ++d) EXPECT_EQ(back[d], bf16_to_float(in[d])) << d;  // all exactly representable
}

TEST(Model1, BlockInterleavedLayout) {
  const int page = 3;
  std::vector<uint8_t> block(page * 584, 0xcd);
  for (int t = 0; t < page; ++t) {
    std::vector<float> x(512, 0.25f * float(t + 1));
    x[64 * 2] = 14.f;  // tile 2 of every token: 14/448 = 2^-5
    for (int r = 0; r < 64; ++r) x[448 + r] = float(t * 100 + r);
    const auto in = token_of(x);
    quantize_token(KvFormat::kModel1, in.data(), block.data(), page, t);
  }
  for (int t = 0; t < page; ++t) {
    const uint8_t* rec = block.data() + t * 576;
    const uint8_t* sc = block.data() + page * 576 + t * 8;
    const float v = 0.25f * float(t + 1);
    const int e = int(std::ceil(std::log2(v / 448.f)));
    EXPECT_EQ(sc[0], 127 + e) << t;
    EXPECT_EQ(sc[2], 127 - 5) << t;
    EXPECT_EQ(sc[7], 0) << t;                       // pad byte
    EXPECT_EQ(rec[0], float_to_fp8e4m3(v / std::ldexp(1.f, e)));
    uint16_t rope0;
    std::memcpy(&rope0, rec + 448, 2);
    EXPECT_EQ(bf16_to_float(rope0), float(t * 100));
    std::vector<float> back(512);
    dequantize_token(KvFormat::kModel1, block.data(), page, t, back.data());
    EXPECT_EQ(back[0], v);
    EXPECT_EQ(back[128], 14.f);
    EXPECT_EQ(back[448 + 5], float(t * 100 + 5));
  }
}

TEST(Codecs, RandomRoundTripWithinE4M3Precision) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 0.3f);
  for (KvFormat f : {KvFormat::kV32, KvFormat::kModel1}) {
    const int d = head_dim_qk(f), page = 5;
    const int nope = f == KvFormat::kV32 ? V32Layout::kNope : Model1Layout::kNope;
    const int tile = f == KvFormat::kV32 ? V32Layout::kTile : Model1Layout::kTile;
    std::vector<uint8_t> block(page * bytes_per_token(f));
    for (int t = 0; t < page; ++t) {
      std::vector<float> x(d);
      for (auto& v : x) v = dist(rng);
      const auto in = token_of(x);
      quantize_token(f, in.data(), block.data(), page, t);
      std::vector<float> back(d);
      dequantize_token(f, block.data(), page, t, back.data());
      for (int i = 0; i < d; ++i) {
        const float orig = bf16_to_float(in[i]);
        if (i >= nope) {
          EXPECT_EQ(back[i], orig);
          continue;
        }
        float amax = 0.f;
        for (int j = i / tile * tile; j < (i / tile + 1) * tile; ++j) amax = std::max(amax, std::fabs(bf16_to_float(in[j])));
        const float scale = quantization_scale(amax);
        // e4m3: 3 mantissa bits (relative half-ulp 2^-4), subnormal step 2^-9; then a bf16 rounding.
        const float tol = std::max(std::fabs(orig) * 0.0625f, scale * std::ldexp(1.f, -10)) * 1.01f +
                          std::fabs(orig) * 0.0079f;
        EXPECT_LE(std::fabs(back[i] - orig), tol) << to_string(f) << " dim " << i;
      }
    }
  }
}

}  // namespace
}  // namespace mla
