// The CPU kernel's instruction sets: the operations each one provides to the tile algorithm
// (kernels/cpu/tile_kernels.h), for plain C++ and, on x86-64, AVX2, AVX-512 and AVX-512 BF16. Each set
// and its copy of the tile algorithm are compiled inside the set's namespace and compile-target
// region, so the package needs no instruction-set compiler flags and runs on any CPU; sparse_mla_cpu.cc
// picks a set at run time. The SIMD sets' exp and BF16 rounding are written once, over their integer
// primitives, in kernels/cpu/vector_math.h.
//
// Included once, by sparse_mla_cpu.cc, inside its anonymous namespace in jsmla::cpu, after the
// standard and intrinsics headers (no include guard: the tile algorithm is included once per set).

// ---- Constants shared by every instruction set -----------------------------------------------------

// BF16 bits of the magnitude of each float8_e4m3fn code (the sign bit is OR-ed in separately). Every
// FP8 value is exact in BF16; the two NaN codes become the quiet NaN 0x7fc0.
struct Fp8Table {
  uint16_t magnitude[128];
};

constexpr Fp8Table make_fp8_table() {
  Fp8Table table{};
  for (int code = 0; code < 128; ++code) {
    const int exponent = code >> 3;
    const int mantissa = code & 7;
    uint16_t bits = 0;
    if (code == 0x7f) {
      bits = 0x7fc0;
    } else if (exponent > 0) {
      bits = static_cast<uint16_t>(((exponent + 120) << 7) | (mantissa << 4));
    } else if (mantissa > 0) {  // subnormal mantissa * 2^-9: normalise around its leading bit
      const int lead = mantissa >= 4 ? 2 : (mantissa >= 2 ? 1 : 0);
      bits = static_cast<uint16_t>(((lead - 9 + 127) << 7) | ((mantissa - (1 << lead)) << (7 - lead)));
    }
    table.magnitude[code] = bits;
  }
  return table;
}

alignas(64) constexpr Fp8Table kFp8 = make_fp8_table();

// BF16 bits of the magnitude of each FP4 e2m1 code (0, 0.5, 1, 1.5, 2, 3, 4, 6), twice: byte 2m and
// 2m + 1 of the table are the low and high byte of code m's bits, for byte shuffles.
struct Fp4Table {
  uint16_t magnitude[8];
};

constexpr Fp4Table make_fp4_table() {
  Fp4Table table{};
  for (int code = 1; code < 8; ++code) {
    const int exponent = code >> 1;
    const int mantissa = code & 1;
    table.magnitude[code] = static_cast<uint16_t>(exponent == 0 ? 0x3f00  // 0.5
                                                                : ((exponent + 126) << 7) | (mantissa << 6));
  }
  return table;
}

alignas(16) constexpr Fp4Table kFp4 = make_fp4_table();
static_assert(kFp4.magnitude[1] == 0x3f00 && kFp4.magnitude[2] == 0x3f80 && kFp4.magnitude[5] == 0x4040 &&
                  kFp4.magnitude[7] == 0x40c0,
              "the FP4 -> BF16 table must decode 0.5, 1, 3 and 6 exactly");
static_assert(kFp8.magnitude[0x38] == 0x3f80 && kFp8.magnitude[0x7e] == 0x43e0 && kFp8.magnitude[1] == 0x3b00 &&
                  kFp8.magnitude[7] == 0x3c60,
              "the FP8 -> BF16 table must decode 1.0, 448 and the smallest and largest subnormals exactly");

// e^x for x <= 0: x clamped at kMinArgument (so every result is a normal float), x = n ln2 + r with
// n = round(x log2 e), e^r by a degree-5 polynomial, then scaled by 2^n. Every instruction set runs
// these operations in this order.
constexpr float kMinArgument = -86.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kExpPolynomial[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static_assert(kMinArgument * kLog2e > -126.0f, "2^n of the clamped argument must be a normal float");

// Lane indices that interleave two 32-lane vectors a and b (indices 32.. select b) into word i =
// (a[i], b[i]) for the first 16 words; adding 16 gives the next 16.
struct InterleaveTable {
  uint16_t lane[32];
};

constexpr InterleaveTable make_interleave_table() {
  InterleaveTable table{};
  for (int i = 0; i < 32; ++i) table.lane[i] = static_cast<uint16_t>(i % 2 == 0 ? i / 2 : 32 + i / 2);
  return table;
}

alignas(64) constexpr InterleaveTable kInterleave = make_interleave_table();

inline uint32_t bits_of(float x) { return float_to_bits(x); }
inline float float_of(uint32_t bits) { return bits_to_float(bits); }

// ---- Plain C++ --------------------------------------------------------------------------------------

namespace portable {

struct Ops {
  static constexpr int kLanes = 8;
  static constexpr int kAccumulators = 8;
  static constexpr int kMaxHeadVectors = 2;
  static constexpr int kChunk = 16;
  struct F {
    float lane[kLanes];
  };
  struct A {  // a BF16 pair split into two floats: the odd (high) and even (low) element
    F high, low;
  };
  using B = A;
  struct H {
    uint16_t lane[kChunk];
  };

  static F zero() { return set1(0.0f); }
  static F set1(float x) {
    F r;
    for (float& lane : r.lane) lane = x;
    return r;
  }
  static F load(const float* p) {
    F r;
    std::memcpy(r.lane, p, sizeof(r.lane));
    return r;
  }
  static void store(float* p, const F& x) { std::memcpy(p, x.lane, sizeof(x.lane)); }
  static F add(const F& a, const F& b) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.lane[i] = a.lane[i] + b.lane[i];
    return r;
  }
  static F sub(const F& a, const F& b) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.lane[i] = a.lane[i] - b.lane[i];
    return r;
  }
  static F mul(const F& a, const F& b) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.lane[i] = a.lane[i] * b.lane[i];
    return r;
  }
  static F max(const F& a, const F& b) {  // a > b ? a : b, as the x86 max instructions
    F r;
    for (int i = 0; i < kLanes; ++i) r.lane[i] = a.lane[i] > b.lane[i] ? a.lane[i] : b.lane[i];
    return r;
  }
  static F fma(const F& a, const F& b, const F& c) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.lane[i] = std::fma(a.lane[i], b.lane[i], c.lane[i]);
    return r;
  }
  static float exp_lane(float x) {
    x = x > kMinArgument ? x : kMinArgument;
    const float shifted = std::fma(x, kLog2e, kRoundingShift);
    const float n = shifted - kRoundingShift;
    float r = std::fma(n, -kLn2High, x);
    r = std::fma(n, -kLn2Low, r);
    float y = kExpPolynomial[0];
    for (int i = 1; i < 6; ++i) y = std::fma(y, r, kExpPolynomial[i]);
    y = std::fma(y, r * r, r);
    y = y + 1.0f;
    const uint32_t exponent = bits_of(shifted) - bits_of(kRoundingShift) + 127u;
    return y * float_of(exponent << 23);
  }
  static F exp_nonpositive(const F& x) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.lane[i] = exp_lane(x.lane[i]);
    return r;
  }
  static uint32_t round_bits(uint32_t bits) { return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u; }
  static F round_bf16(const F& x) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.lane[i] = float_of(round_bits(bits_of(x.lane[i])));
    return r;
  }
  static void store_pairs(uint32_t* words, const F& even, const F& odd) {
    for (int i = 0; i < kLanes; ++i) words[i] = (bits_of(even.lane[i]) >> 16) | (bits_of(odd.lane[i]) & 0xffff0000u);
  }
  static A split(uint32_t word) { return {set1(float_of(word & 0xffff0000u)), set1(float_of(word << 16))}; }
  static A load_a(const uint32_t* words) {
    A r;
    for (int i = 0; i < kLanes; ++i) {
      r.high.lane[i] = float_of(words[i] & 0xffff0000u);
      r.low.lane[i] = float_of(words[i] << 16);
    }
    return r;
  }
  static B broadcast_b(const uint32_t* word) { return split(*word); }
  // The product of two BF16 values is exact in float, so `acc + a * b` rounds once, as a fused step.
  static F dot(const F& acc, const A& a, const B& b) {
    F r;
    for (int i = 0; i < kLanes; ++i) {
      const float step = acc.lane[i] + a.high.lane[i] * b.high.lane[i];
      r.lane[i] = step + a.low.lane[i] * b.low.lane[i];
    }
    return r;
  }
  static H zero_h() { return H{}; }
  static H fp8_to_bf16(const uint8_t* codes) {
    H r;
    for (int i = 0; i < kChunk; ++i) {
      r.lane[i] = static_cast<uint16_t>(kFp8.magnitude[codes[i] & 0x7f] | ((codes[i] & 0x80u) << 8));
    }
    return r;
  }
  static H fp4_to_bf16(const uint8_t* codes) {
    H r;
    for (int i = 0; i < kChunk; ++i) {
      const uint8_t code = static_cast<uint8_t>(i % 2 ? codes[i / 2] >> 4 : codes[i / 2] & 0xfu);
      r.lane[i] = static_cast<uint16_t>(kFp4.magnitude[code & 7] | ((code & 8u) << 12));
    }
    return r;
  }
  static H load_bf16(const uint8_t* bytes) {
    H r;
    for (int i = 0; i < kChunk; ++i) r.lane[i] = load_u16_le(bytes + 2 * i);
    return r;
  }
  static H scale_bf16(const H& x, float low_scale, float high_scale) {
    H r;
    for (int i = 0; i < kChunk; ++i) {
      const float scale = i < kChunk / 2 ? low_scale : high_scale;
      const uint32_t bits = bits_of(float_of(static_cast<uint32_t>(x.lane[i]) << 16) * scale);
      r.lane[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    return r;
  }
  static void store_bf16(uint16_t* lanes, const H& x) { std::memcpy(lanes, x.lane, sizeof(x.lane)); }
  static void store_interleaved(uint32_t* words, const H& even, const H& odd) {
    for (int i = 0; i < kChunk; ++i) words[i] = even.lane[i] | (static_cast<uint32_t>(odd.lane[i]) << 16);
  }
};

#include "tile_kernels.h"

}  // namespace portable

// ---- x86-64: AVX2, AVX-512, AVX-512 BF16 ------------------------------------------------------------
//
// Each set is compiled inside a region that applies its target to every function defined there; the
// whole package is built for the baseline CPU, and a set's code only runs where the CPU reports it.
#if JSMLA_CPU_X86
#define JSMLA_PRAGMA(text) _Pragma(#text)
#if defined(__clang__)
#define JSMLA_BEGIN_TARGET(features) \
  JSMLA_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define JSMLA_END_TARGET JSMLA_PRAGMA(clang attribute pop)
#else
#define JSMLA_BEGIN_TARGET(features) JSMLA_PRAGMA(GCC push_options) JSMLA_PRAGMA(GCC target(features))
#define JSMLA_END_TARGET JSMLA_PRAGMA(GCC pop_options)
#endif
#define JSMLA_INLINE inline __attribute__((always_inline))

JSMLA_BEGIN_TARGET("avx2,fma")
namespace avx2 {

struct Ops {
  static constexpr int kLanes = 8;
  static constexpr int kAccumulators = 8;
  static constexpr int kMaxHeadVectors = 2;
  static constexpr int kChunk = 16;
  using F = __m256;
  struct A {
    __m256 high, low;
  };
  using B = A;
  using H = __m256i;

  static JSMLA_INLINE F zero() { return _mm256_setzero_ps(); }
  static JSMLA_INLINE F set1(float x) { return _mm256_set1_ps(x); }
  static JSMLA_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static JSMLA_INLINE void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static JSMLA_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static JSMLA_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static JSMLA_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static JSMLA_INLINE F max(F a, F b) { return _mm256_max_ps(a, b); }
  static JSMLA_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static JSMLA_INLINE __m256i ints(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  // 32-bit integer lanes, for vector_math.h.
  using I = __m256i;
  static JSMLA_INLINE I bits(F x) { return _mm256_castps_si256(x); }
  static JSMLA_INLINE F from_bits(I x) { return _mm256_castsi256_ps(x); }
  static JSMLA_INLINE I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static JSMLA_INLINE I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static JSMLA_INLINE I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  template <int kShift>
  static JSMLA_INLINE I shift_left(I x) { return _mm256_slli_epi32(x, kShift); }
  template <int kShift>
  static JSMLA_INLINE I shift_right(I x) { return _mm256_srli_epi32(x, kShift); }
  static F exp_nonpositive(F x);
  static I round_bits(I bits);
  static F round_bf16(F x);
  static JSMLA_INLINE void store_pairs(uint32_t* words, F even, F odd) {
    const __m256i packed = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(even), 16),
                                           _mm256_and_si256(_mm256_castps_si256(odd), ints(0xffff0000u)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), packed);
  }
  static JSMLA_INLINE A load_a(const uint32_t* words) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
    return {_mm256_castsi256_ps(_mm256_and_si256(w, ints(0xffff0000u))), _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static JSMLA_INLINE B broadcast_b(const uint32_t* word) {
    return {set1(float_of(*word & 0xffff0000u)), set1(float_of(*word << 16))};
  }
  static JSMLA_INLINE F dot(F acc, const A& a, const B& b) { return fma(a.low, b.low, fma(a.high, b.high, acc)); }
  static JSMLA_INLINE H zero_h() { return _mm256_setzero_si256(); }
  static JSMLA_INLINE __m256i words16(uint16_t x) { return _mm256_set1_epi16(static_cast<short>(x)); }
  static JSMLA_INLINE H fp8_to_bf16(const uint8_t* codes) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m256i magnitude = _mm256_and_si256(x, words16(0x7f));
    const __m256i normal = _mm256_add_epi16(_mm256_slli_epi16(magnitude, 4), words16(0x3c00));
    // Subnormal codes (magnitude < 8) from the table: byte indices (2m, 2m + 1) of word m.
    const __m256i table =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp8.magnitude)));
    const __m256i index = _mm256_add_epi16(_mm256_mullo_epi16(magnitude, words16(0x0202)), words16(0x0100));
    const __m256i subnormal = _mm256_shuffle_epi8(table, index);
    __m256i r = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi16(words16(8), magnitude));
    r = _mm256_blendv_epi8(r, words16(0x7fc0), _mm256_cmpeq_epi16(magnitude, words16(0x7f)));
    return _mm256_or_si256(r, _mm256_slli_epi16(_mm256_and_si256(x, words16(0x80)), 8));
  }
  static JSMLA_INLINE H fp4_to_bf16(const uint8_t* codes) {
    // Byte i of the 8 code bytes becomes word pair (low nibble, high nibble), then each word's bits come
    // from the table by the byte indices (2m, 2m + 1) of its magnitude m.
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    const __m256i nibbles = _mm256_or_si256(_mm256_and_si256(bytes, ints(0xf)),
                                            _mm256_slli_epi32(_mm256_and_si256(bytes, ints(0xf0)), 12));
    const __m256i magnitude = _mm256_and_si256(nibbles, words16(7));
    const __m256i table =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4.magnitude)));
    const __m256i index = _mm256_add_epi16(_mm256_mullo_epi16(magnitude, words16(0x0202)), words16(0x0100));
    const __m256i r = _mm256_shuffle_epi8(table, index);
    return _mm256_or_si256(r, _mm256_slli_epi16(_mm256_and_si256(nibbles, words16(8)), 12));
  }
  static JSMLA_INLINE H load_bf16(const uint8_t* bytes) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  }
  static JSMLA_INLINE __m256i scaled_half(__m128i half, F scale) {
    const F value = mul(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)), scale);
    return _mm256_srli_epi32(round_bits(_mm256_castps_si256(value)), 16);
  }
  static JSMLA_INLINE H scale_bf16(H x, float low_scale, float high_scale) {
    const __m256i low = scaled_half(_mm256_castsi256_si128(x), set1(low_scale));
    const __m256i high = scaled_half(_mm256_extracti128_si256(x, 1), set1(high_scale));
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xd8);
  }
  static JSMLA_INLINE void store_bf16(uint16_t* lanes, H x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), x);
  }
  static JSMLA_INLINE void store_interleaved(uint32_t* words, H even, H odd) {
    const __m256i low = _mm256_unpacklo_epi16(even, odd);
    const __m256i high = _mm256_unpackhi_epi16(even, odd);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), _mm256_permute2x128_si256(low, high, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 8), _mm256_permute2x128_si256(low, high, 0x31));
  }
};

#include "vector_math.h"
#include "tile_kernels.h"

}  // namespace avx2
JSMLA_END_TARGET

JSMLA_BEGIN_TARGET("avx2,fma,avx512f,avx512bw")
namespace avx512 {

struct Ops {
  static constexpr int kLanes = 16;
  static constexpr int kAccumulators = 16;
  static constexpr int kMaxHeadVectors = 4;
  static constexpr int kChunk = 32;
  using F = __m512;
  struct A {
    __m512 high, low;
  };
  using B = A;
  using H = __m512i;

  static JSMLA_INLINE F zero() { return _mm512_setzero_ps(); }
  static JSMLA_INLINE F set1(float x) { return _mm512_set1_ps(x); }
  static JSMLA_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static JSMLA_INLINE void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static JSMLA_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static JSMLA_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static JSMLA_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static JSMLA_INLINE F max(F a, F b) { return _mm512_max_ps(a, b); }
  static JSMLA_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static JSMLA_INLINE __m512i ints(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  // 32-bit integer lanes, for vector_math.h.
  using I = __m512i;
  static JSMLA_INLINE I bits(F x) { return _mm512_castps_si512(x); }
  static JSMLA_INLINE F from_bits(I x) { return _mm512_castsi512_ps(x); }
  static JSMLA_INLINE I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static JSMLA_INLINE I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  static JSMLA_INLINE I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  template <int kShift>
  static JSMLA_INLINE I shift_left(I x) { return _mm512_slli_epi32(x, kShift); }
  template <int kShift>
  static JSMLA_INLINE I shift_right(I x) { return _mm512_srli_epi32(x, kShift); }
  static F exp_nonpositive(F x);
  static I round_bits(I bits);
  static F round_bf16(F x);
  static JSMLA_INLINE void store_pairs(uint32_t* words, F even, F odd) {
    const __m512i packed = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                           _mm512_and_si512(_mm512_castps_si512(odd), ints(0xffff0000u)));
    _mm512_storeu_si512(words, packed);
  }
  static JSMLA_INLINE A load_a(const uint32_t* words) {
    const __m512i w = _mm512_loadu_si512(words);
    return {_mm512_castsi512_ps(_mm512_and_si512(w, ints(0xffff0000u))), _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static JSMLA_INLINE B broadcast_b(const uint32_t* word) {
    return {set1(float_of(*word & 0xffff0000u)), set1(float_of(*word << 16))};
  }
  static JSMLA_INLINE F dot(F acc, const A& a, const B& b) { return fma(a.low, b.low, fma(a.high, b.high, acc)); }
  static JSMLA_INLINE H zero_h() { return _mm512_setzero_si512(); }
  static JSMLA_INLINE __m512i words16(uint16_t x) { return _mm512_set1_epi16(static_cast<short>(x)); }
  static JSMLA_INLINE H fp8_to_bf16(const uint8_t* codes) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i magnitude = _mm512_and_si512(x, words16(0x7f));
    const uint16_t* table = kFp8.magnitude;
    const __m512i below_64 =
        _mm512_permutex2var_epi16(_mm512_loadu_si512(table), magnitude, _mm512_loadu_si512(table + 32));
    const __m512i from_64 =
        _mm512_permutex2var_epi16(_mm512_loadu_si512(table + 64), magnitude, _mm512_loadu_si512(table + 96));
    const __m512i r = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(magnitude, words16(64)), below_64, from_64);
    return _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(x, words16(0x80)), 8));
  }
  static JSMLA_INLINE H fp4_to_bf16(const uint8_t* codes) {
    // Byte i of the 16 code bytes becomes word pair (low nibble, high nibble).
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i nibbles = _mm512_or_si512(_mm512_and_si512(bytes, ints(0xf)),
                                            _mm512_slli_epi32(_mm512_and_si512(bytes, ints(0xf0)), 12));
    const __m512i table = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4.magnitude)));
    const __m512i r = _mm512_permutexvar_epi16(_mm512_and_si512(nibbles, words16(7)), table);
    return _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(nibbles, words16(8)), 12));
  }
  static JSMLA_INLINE H load_bf16(const uint8_t* bytes) { return _mm512_loadu_si512(bytes); }
  static JSMLA_INLINE __m256i scaled_half(__m256i half, F scale) {
    const F value = mul(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)), scale);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(_mm512_castps_si512(value)), 16));
  }
  static JSMLA_INLINE H scale_bf16(H x, float low_scale, float high_scale) {
    const __m256i low = scaled_half(_mm512_castsi512_si256(x), set1(low_scale));
    const __m256i high = scaled_half(_mm512_extracti64x4_epi64(x, 1), set1(high_scale));
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  static JSMLA_INLINE void store_bf16(uint16_t* lanes, H x) { _mm512_storeu_si512(lanes, x); }
  static JSMLA_INLINE void store_interleaved(uint32_t* words, H even, H odd) {
    const __m512i low_lanes = _mm512_loadu_si512(kInterleave.lane);
    const __m512i high_lanes = _mm512_add_epi16(low_lanes, words16(16));
    _mm512_storeu_si512(words, _mm512_permutex2var_epi16(even, low_lanes, odd));
    _mm512_storeu_si512(words + 16, _mm512_permutex2var_epi16(even, high_lanes, odd));
  }
};

#include "vector_math.h"
#include "tile_kernels.h"

}  // namespace avx512
JSMLA_END_TARGET

#if JSMLA_CPU_X86_BF16
JSMLA_BEGIN_TARGET("avx2,fma,avx512f,avx512bw,avx512bf16")
namespace avx512_bf16 {

// AVX-512 with the pair products done by VDPBF16PS (acc + odd*odd, then + even*even, each rounded).
struct Ops : avx512::Ops {
  using A = __m512bh;
  using B = __m512bh;
  static JSMLA_INLINE A load_a(const uint32_t* words) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(words)); }
  static JSMLA_INLINE B broadcast_b(const uint32_t* word) {
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(*word)));
  }
  static JSMLA_INLINE F dot(F acc, A a, B b) { return _mm512_dpbf16_ps(acc, a, b); }
};

#include "tile_kernels.h"

}  // namespace avx512_bf16
JSMLA_END_TARGET
#endif  // JSMLA_CPU_X86_BF16
#endif  // JSMLA_CPU_X86
