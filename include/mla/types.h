// Shared vocabulary of the mla-kernels C++ API: element types, KV-cache formats, limits, errors.
// Nothing here depends on PyTorch or on CUDA.
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace mla {

// Element type of a tensor handed to a kernel.
enum class DType : int32_t {
  kBF16 = 0,
  kFP16 = 1,
  kFP8E4M3 = 2,  // float8_e4m3fn: q and cache of FP8 dense decode
  kFloat32 = 3,
};

// How the KV cache of a sparse op stores one token (SPEC §4).
enum class KvFormat : int32_t {
  kV32 = 0,     // d_qk 576: 512 e4m3 NoPE, 4 float32 scales, 64 bf16 RoPE; 656 bytes per token
  kModel1 = 1,  // d_qk 512: block-interleaved 576-byte NoPE+RoPE records, then 8-byte ue8m0 scale records
};

inline const char* to_string(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kFP16: return "float16";
    case DType::kFP8E4M3: return "float8_e4m3fn";
    case DType::kFloat32: return "float32";
  }
  return "unknown";
}

inline const char* to_string(KvFormat f) { return f == KvFormat::kV32 ? "v32" : "model1"; }

// Model dimensions the kernels are written for.
constexpr int kHeadDimV = 512;       // d_v of every op
constexpr int kHeadDimV32 = 576;     // d_qk of DeepSeek V3 / V3.2 (512 NoPE + 64 RoPE)
constexpr int kHeadDimModel1 = 512;  // d_qk of DeepSeek V4 "MODEL1" (448 NoPE + 64 RoPE)
constexpr int kMaxHeadsQ = 128;      // largest h_q any op accepts

// Softmax runs in the log2 domain: scores are scaled by log2(e), lse is reported as ln(2) * log2(l) + ...
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Split-KV planning: a plan block is this many KV tokens (dense) or top-k slots (sparse).
constexpr int kPlanBlockSize = 64;
// Cost of starting a (request, part) piece, in blocks: covers loading q, the epilogue and the combine.
// FlashMLA's value, for kernels of 64 query rows per CTA; at most this.
constexpr int kPlanFixedOverheadBlocks = 5;
// The same for the small-heads sparse kernel (at most 32 heads), whose blocks are memory-bound: a
// piece costs its Q and its first loads, about a block. (Dense calls use the cost above for every
// row count: see plan_fixed_dense.)
constexpr int kPlanFewRowsFixedBlocks = 2;
static_assert(kPlanFewRowsFixedBlocks >= 1 && kPlanFewRowsFixedBlocks <= kPlanFixedOverheadBlocks, "a piece costs");

// Error raised by validation in the core; the message names the argument, what was expected and
// what was given. Front-ends turn it into their own error type (torch: RuntimeError).
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
// Error messages are assembled without iostreams: numbers go through std::to_string / snprintf.
// (An extension built with one libstdc++ and run with another can crash formatting numbers
// through std::ostream; seen with GCC 13 headers on a GCC 14 runtime.) Text<T>::append writes a
// T; front-ends specialise it for their own types.
template <typename T, typename Enable = void>
struct Text;
template <>
struct Text<std::string> {
  static void append(std::string& s, const std::string& v) { s += v; }
};
template <>
struct Text<const char*> {
  static void append(std::string& s, const char* v) { s += v; }
};
template <>
struct Text<char*> : Text<const char*> {};
template <>
struct Text<char> {
  static void append(std::string& s, char v) { s += v; }
};
template <>
struct Text<bool> {
  static void append(std::string& s, bool v) { s += v ? "true" : "false"; }
};
template <typename T>
struct Text<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>>> {
  static void append(std::string& s, T v) { s += std::to_string(v); }
};
template <typename T>
struct Text<T, std::enable_if_t<std::is_floating_point_v<T>>> {
  static void append(std::string& s, T v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", double(v));
    s += buf;
  }
};

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (Text<std::decay_t<Args>>::append(s, args), ...);
  return s;
}
}  // namespace detail

}  // namespace mla

// Throws mla::Error with the streamed message when `cond` is false.
#define MLA_CHECK(cond, ...)                                      \
  do {                                                            \
    if (!(cond)) throw ::mla::Error(::mla::detail::concat(__VA_ARGS__)); \
  } while (0)
