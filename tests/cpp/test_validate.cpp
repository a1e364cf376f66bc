// The C++ API's checks of what it can see (sizes, dtypes, formats, null pointers, a part index):
// each bad value is an mla::Error naming the argument, never a write past a buffer. Every case here
// was a crash or a silently accepted call before these checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include "mla/dispatch.h"
#include "mla/plan.h"
#include "mla/reference.h"
#include "mla/validate.h"

namespace mla {
namespace {

// Runs fn, which must throw mla::Error whose message contains `needle`.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected an error naming " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A valid one-request sparse decode over a MODEL1 cache of one 16-token page, with a one-part plan
// (all buffers owned here, so a call that passes validation runs without reading outside them).
struct SparseCase {
  std::vector<uint16_t> q = std::vector<uint16_t>(kHeadDimModel1, 0);
  std::vector<uint8_t> kv = std::vector<uint8_t>(16 * 584, 0);
  std::vector<int32_t> indices = {3};
  std::vector<uint16_t> out = std::vector<uint16_t>(kHeadDimV);
  std::vector<float> lse = std::vector<float>(1);
  std::vector<int32_t> rows = std::vector<int32_t>(kPlanRowInts), num_splits = std::vector<int32_t>(2);
  SparseDecodeParams p;
  SparseCase() {
    p.b = p.s_q = p.h_q = 1;
    p.d_qk = kHeadDimModel1;
    p.format = KvFormat::kModel1;
    p.softmax_scale = 0.1f;
    p.q = q.data();
    p.q_stride_b = p.q_stride_s = p.q_stride_h = kHeadDimModel1;
    p.kv = {kv.data(), 1, 16, 16 * 584};
    p.topk = 1;
    p.indices = indices.data();
    p.indices_stride_b = p.indices_stride_s = 1;
    p.o.out = out.data();
    p.o.out_stride_b = p.o.out_stride_s = p.o.out_stride_h = kHeadDimV;
    p.o.lse = lse.data();
    p.o.lse_stride_b = p.o.lse_stride_s = p.o.lse_stride_h = 1;
    DecodePlanParams pp = sparse_plan_params(p);
    pp.num_sm_parts = 1;
    pp.tile_scheduler_metadata = rows.data();
    pp.num_splits = num_splits.data();
    plan_decode_host(pp);
    p.split.num_sm_parts = 1;
    p.split.tile_scheduler_metadata = rows.data();
    p.split.num_splits = num_splits.data();
  }
};

TEST(Validate, SparseBaseRuns) {
  SparseCase c;
  reference::sparse_decode(c.p);
  EXPECT_TRUE(std::isfinite(c.lse[0]));
}

TEST(Validate, SparseOutputDtypeIsBf16) {
  for (DType t : {DType::kFP8E4M3, DType::kFloat32, DType(7)}) {  // FP8 wrote 2 bytes per 1-byte element
    SparseCase c;
    c.p.o.out_dtype = t;
    expect_error([&] { reference::sparse_decode(c.p); }, "out: dtype");
  }
}

TEST(Validate, SparseFormatIsKnown) {
  for (int f : {2, 99, -1}) {  // each was run as MODEL1
    SparseCase c;
    c.p.format = KvFormat(f);
    expect_error([&] { reference::sparse_decode(c.p); }, "format");
  }
}

TEST(Validate, SparseNullPointers) {
  {
    SparseCase c;
    c.p.q = nullptr;
    expect_error([&] { validate(c.p); }, "q must not be null");
  }
  {
    SparseCase c;
    c.p.indices = nullptr;
    expect_error([&] { validate(c.p); }, "indices");
  }
  {
    SparseCase c;
    c.p.kv.data = nullptr;
    expect_error([&] { validate(c.p); }, "kv: data");
  }
  {
    SparseCase c;
    c.p.o.lse = nullptr;
    expect_error([&] { validate(c.p); }, "lse");
  }
  {
    SparseCase c;
    c.p.split.num_splits = nullptr;
    expect_error([&] { reference::sparse_decode(c.p); }, "num_splits");
  }
  {
    SparseCase c;  // two parts may split a request: the workspace is required
    c.p.split.num_sm_parts = 2;
    expect_error([&] { validate_split(c.p.split); }, "o_accum and lse_accum");
  }
}

// An extra cache of no page blocks, its data null (an empty allocation), with extra indices: no
// index can name a token in it, so the call is the one without it (it was rejected as "extra_kv
// and extra_indices must be given together"). Its plan is the plan without it.
TEST(Validate, SparseExtraCacheOfNoBlocksIsNoExtra) {
  SparseCase base;
  std::fill(base.kv.begin(), base.kv.end(), uint8_t(0x38));  // finite nonzero keys, scales and RoPE
  std::fill(base.q.begin(), base.q.end(), uint16_t(0x3c00));   // 2^-7 in bf16
  reference::sparse_decode(base.p);
  for (bool with_lengths : {false, true}) {
    SparseCase c;
    c.kv = base.kv, c.q = base.q;
    c.p.kv.data = c.kv.data(), c.p.q = c.q.data();
    std::vector<int32_t> extra_indices = {0, -1}, extra_lengths = {2};
    c.p.extra_kv = {nullptr, 0, 16, 0};
    c.p.extra_topk = 2;
    c.p.extra_indices = extra_indices.data();
    c.p.extra_indices_stride_b = c.p.extra_indices_stride_s = 2;
    c.p.extra_topk_length = with_lengths ? extra_lengths.data() : nullptr;
    EXPECT_FALSE(has_extra_cache(c.p));
    EXPECT_EQ(sparse_plan_params(c.p).extra_topk, 0);
    EXPECT_EQ(required_features(c.p) & kFeatExtraCache, 0u);
    reference::sparse_decode(c.p);
    EXPECT_NE(c.out, std::vector<uint16_t>(kHeadDimV, 0));
    EXPECT_EQ(c.out, base.out);
    EXPECT_EQ(c.lse, base.lse);
  }
}

TEST(Validate, SparseExtraCacheNeedsItsIndicesAndData) {
  {
    SparseCase c;  // blocks given, no indices
    c.p.extra_kv = c.p.kv;
    c.p.extra_topk = 1;
    expect_error([&] { validate(c.p); }, "extra_indices must not be null");
  }
  {
    SparseCase c;  // indices over a cache of one block without data
    std::vector<int32_t> extra_indices = {0};
    c.p.extra_kv = {nullptr, 1, 16, 16 * 584};
    c.p.extra_topk = 1;
    c.p.extra_indices = extra_indices.data();
    expect_error([&] { validate(c.p); }, "extra_kv: data must not be null");
  }
}

DenseDecodeParams dense_base(std::vector<uint16_t>& q, std::vector<uint16_t>& out, std::vector<float>& lse,
                             const std::vector<int32_t>& lens) {
  DenseDecodeParams p;
  p.b = p.s_q = p.h_q = p.h_k = 1;
  p.d_qk = kHeadDimV32;
  p.page_block_size = 16, p.num_blocks = 0, p.max_blocks_per_seq = 0;
  p.softmax_scale = 0.1f;
  p.q = q.data();
  p.seqlens_k = lens.data();
  p.o.out = out.data();
  p.o.lse = lse.data();
  return p;
}

TEST(Validate, DenseNumBlocksAndNullPointers) {
  std::vector<uint16_t> q(kHeadDimV32), out(kHeadDimV);
  std::vector<float> lse(1);
  const std::vector<int32_t> lens = {0};
  EXPECT_NO_THROW(validate(dense_base(q, out, lse, lens)));
  {
    DenseDecodeParams p = dense_base(q, out, lse, lens);
    p.num_blocks = -1;  // accepted before when every length was 0
    expect_error([&] { validate(p); }, "num_blocks");
  }
  {
    DenseDecodeParams p = dense_base(q, out, lse, lens);
    p.num_blocks = 4;  // a cache with blocks but no pointer
    expect_error([&] { validate(p); }, "k_cache must not be null");
  }
  {
    DenseDecodeParams p = dense_base(q, out, lse, lens);
    p.seqlens_k = nullptr;
    expect_error([&] { validate(p); }, "seqlens_k");
  }
  {
    DenseDecodeParams p = dense_base(q, out, lse, lens);
    p.o.out = nullptr;
    expect_error([&] { validate(p); }, "out must not be null");
  }
}

TEST(Validate, PrefillNullPointers) {
  SparsePrefillParams p;
  p.s_q = p.s_kv = p.h_q = p.topk = 1;
  p.softmax_scale = 0.1f;
  expect_error([&] { validate(p); }, "must not be null");
}

// The GPU kernels store out by 4-byte pairs: an out off 4 bytes, or with an odd stride along a
// dimension of extent more than 1, is refused naming out; a stride the call never steps along may
// be anything.
TEST(Validate, DeviceOutputRowsOnFourBytes) {
  alignas(16) static uint16_t buf[64];
  DecodeOutput o;
  o.out = buf;
  o.out_stride_b = 2 * 128 * 512, o.out_stride_s = 128 * 512, o.out_stride_h = 512;
  EXPECT_NO_THROW(validate_device_output(o, 2, 2, 128));
  o.out_stride_h = 514;  // rows off 16 bytes but on 4: the kernels' pairs path
  EXPECT_NO_THROW(validate_device_output(o, 2, 2, 128));
  o.out = buf + 1;
  expect_error([&] { validate_device_output(o, 2, 2, 128); }, "out: must be 4-byte aligned");
  o.out = buf + 2;
  EXPECT_NO_THROW(validate_device_output(o, 2, 2, 128));
  for (int dim = 0; dim < 3; ++dim) {
    DecodeOutput odd = o;
    (dim == 0 ? odd.out_stride_b : dim == 1 ? odd.out_stride_s : odd.out_stride_h) += 1;
    expect_error([&] { validate_device_output(odd, 2, 2, 128); }, "out: strides must be even");
    // The same stride along a dimension of extent 1 is never stepped along.
    EXPECT_NO_THROW(validate_device_output(odd, dim == 0 ? 1 : 2, dim == 1 ? 1 : 2, dim == 2 ? 1 : 128));
  }
}

TEST(Validate, PlanPartIndexInRange) {
  const std::vector<int32_t> lens = {1000, 64, 0, 4096};
  std::vector<int32_t> rows(8 * kPlanRowInts), num_splits(5);
  DecodePlanParams p;
  p.b = 4, p.num_sm_parts = 8;
  p.seqlens_k = lens.data();
  p.tile_scheduler_metadata = rows.data();
  p.num_splits = num_splits.data();
  EXPECT_NO_THROW(plan_decode_host_part(p, 7));
  for (int part : {8, INT_MAX, -2}) expect_error([&] { plan_decode_host_part(p, part); }, "part must be in");
}

}  // namespace
}  // namespace mla
