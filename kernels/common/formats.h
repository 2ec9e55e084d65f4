// KV-cache format traits: the byte layout of every supported format, usable on the host and on the
// device. jax_sparse_mla/formats.py mirrors this table; tests/test_formats.py checks they agree.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JSMLA_HD __host__ __device__ __forceinline__
#else
#define JSMLA_HD inline
#endif

namespace jsmla {

// Numbering is part of the FFI attribute contract (attribute `kv_format`): append, never renumber.
enum class FormatId : int32_t {
  kDsv32 = 0,
  kGlmNsa = 1,
  kGlm53Nope = 2,
  kDsv4 = 3,
  kDsv41 = 4,
  kDots3Swa = 5,
  kBf16_576 = 6,
  kBf16_512 = 7,
  kDsv4Nvfp4 = 8,
  kDsv41Fp4 = 9,
};

enum class Layout : int32_t {
  kInline = 0,  // each token row holds the quantized values, scales and bf16 lanes
  kFooter = 1,  // a page stores all data rows, then all scale rows
  kBf16 = 2,    // unquantized bfloat16 rows
};

enum class ScaleKind : int32_t {
  kNone = 0,
  kFp32 = 1,   // little-endian float32 per group
  kUe8m0 = 2,  // one exponent byte per group: 2^(b-127)
  kE4m3 = 3,   // one float8_e4m3fn byte per group
};

struct FormatTraits {
  FormatId id;
  Layout layout;
  ScaleKind scale_kind;
  int32_t d_qk;              // query/key width
  int32_t d_v;               // value/output width: V is the first d_v lanes of K
  int32_t bytes_per_token;   // nominal payload per token (data + scales)
  int32_t quant_dim;         // leading K lanes stored quantized (see quant_bits)
  int32_t quant_bits;        // 8: FP8 e4m3; 4: FP4 e2m1, two lanes a byte (lane 2i in the low nibble); 0: none
  int32_t bf16_dim;          // trailing K lanes stored as BF16 (rope, or the whole bf16 row)
  int32_t group_size;        // quantized lanes per scale
  int32_t num_groups;        // quant_dim / group_size
  int32_t data_row_bytes;    // inline: the whole row payload; footer: the data row; bf16: 2*d_qk
  int32_t scale_offset;      // inline: byte offset of the scales in the row; footer: 0 (scale row)
  int32_t scale_row_bytes;   // footer: bytes of one scale row (with padding); otherwise 0
  int32_t bf16_offset;       // byte offset of the bf16 lanes in the (data) row
  int32_t max_candidates;    // candidates past this position of an index row are ignored; 0 = none
  bool pow2_scales;          // quantize_kv produces power-of-two scales
  bool dual_cache;           // an extra cache may join the softmax

  constexpr int32_t scale_bytes() const {
    return scale_kind == ScaleKind::kFp32 ? 4 : (scale_kind == ScaleKind::kNone ? 0 : 1);
  }
  // Bytes of the quantized lanes at the start of a (data) row.
  constexpr int32_t quant_bytes() const { return quant_dim * quant_bits / 8; }
};

// How the CUDA kernels turn a row's stored lanes into MMA operands; the planner's cost model gives each
// a row cost of its own (on an H200's Hopper family they differ by up to 1.8x):
//  * kConverted: FP8/FP4 lanes converted to BF16 with their scales folded in (power-of-two FP32 scales,
//    or a footer's UE8M0/E4M3 scales);
//  * kExactScales: FP8 lanes with arbitrary FP32 scales, applied per scale group in FP32 to the scores
//    and to P (a power-of-two scale is exact in BF16, an arbitrary one is not);
//  * kDirect: BF16 rows, used as stored.
enum class RowConversion : int32_t { kConverted = 0, kExactScales = 1, kDirect = 2 };

constexpr RowConversion row_conversion(const FormatTraits& f) {
  if (f.layout == Layout::kBf16) return RowConversion::kDirect;
  return f.scale_kind == ScaleKind::kFp32 && !f.pow2_scales ? RowConversion::kExactScales : RowConversion::kConverted;
}

// clang-format off
inline constexpr FormatTraits kFormatTable[] = {
  //  id                   layout            scale               dqk   dv    bpt   qdim qbit bf16 grp ng  data  soff srow b16off maxc  pow2   dual
  {FormatId::kDsv32,      Layout::kInline, ScaleKind::kFp32,  576,  512,  656,  512, 8,   64,  128, 4,  656,  512, 0,  528,   0,   true,  false},
  {FormatId::kGlmNsa,     Layout::kInline, ScaleKind::kFp32,  576,  512,  656,  512, 8,   64,  128, 4,  656,  512, 0,  528,   0,   false, false},
  {FormatId::kGlm53Nope,  Layout::kInline, ScaleKind::kFp32,  512,  512,  528,  512, 8,   0,   128, 4,  528,  512, 0,  528,   0,   false, false},
  {FormatId::kDsv4,       Layout::kFooter, ScaleKind::kUe8m0, 512,  512,  584,  448, 8,   64,  64,  7,  576,  0,   8,  448,   0,   true,  true},
  {FormatId::kDsv41,      Layout::kFooter, ScaleKind::kUe8m0, 512,  512,  528,  512, 8,   0,   32,  16, 512,  0,   16, 512,   0,   true,  true},
  {FormatId::kDots3Swa,   Layout::kFooter, ScaleKind::kUe8m0, 1088, 1024, 1160, 1024, 8,  64,  128, 8,  1152, 0,   8,  1024,  513, true,  false},
  {FormatId::kBf16_576,   Layout::kBf16,   ScaleKind::kNone,  576,  512,  1152, 0,   0,   576, 0,   0,  1152, 0,   0,  0,     0,   false, false},
  {FormatId::kBf16_512,   Layout::kBf16,   ScaleKind::kNone,  512,  512,  1024, 0,   0,   512, 0,   0,  1024, 0,   0,  0,     0,   false, false},
  {FormatId::kDsv4Nvfp4,  Layout::kFooter, ScaleKind::kE4m3,  512,  512,  384,  448, 4,   64,  16,  28, 352,  0,   32, 224,   0,   false, true},
  {FormatId::kDsv41Fp4,   Layout::kFooter, ScaleKind::kE4m3,  512,  512,  288,  512, 4,   0,   16,  32, 256,  0,   32, 256,   0,   false, true},
};
// clang-format on
inline constexpr int kNumFormats = sizeof(kFormatTable) / sizeof(kFormatTable[0]);

constexpr const FormatTraits& format_traits(FormatId id) { return kFormatTable[static_cast<int>(id)]; }

constexpr bool consistent(const FormatTraits& f) {
  return f.quant_dim + f.bf16_dim == f.d_qk && f.d_v <= f.d_qk &&
         (f.quant_dim == 0 ? f.quant_bits == 0 : (f.quant_bits == 8 || f.quant_bits == 4)) &&
         (f.quant_bits != 4 || f.scale_kind == ScaleKind::kE4m3) &&
         (f.group_size == 0 ? f.num_groups == 0 : f.num_groups * f.group_size == f.quant_dim) &&
         f.quant_bytes() <= (f.bf16_dim > 0 ? f.bf16_offset : f.data_row_bytes) &&
         (f.layout == Layout::kFooter
              ? f.data_row_bytes + f.scale_row_bytes == f.bytes_per_token &&
                    f.num_groups * f.scale_bytes() <= f.scale_row_bytes
              : f.data_row_bytes == f.bytes_per_token) &&
         f.bf16_offset + 2 * f.bf16_dim <= f.data_row_bytes &&
         (f.layout != Layout::kInline || f.scale_offset + f.num_groups * f.scale_bytes() <= f.data_row_bytes);
}

// Every row is self-consistent and sits at the index of its FormatId (format_traits() indexes by id).
constexpr bool table_consistent() {
  for (int i = 0; i < kNumFormats; ++i) {
    if (!consistent(kFormatTable[i]) || static_cast<int>(kFormatTable[i].id) != i) return false;
  }
  return true;
}
static_assert(table_consistent(), "format table rows must be self-consistent and in FormatId order");

// One of `slices` equal lane slices of a format's quantized lanes, as the kernels that split every row
// between the blocks of a cluster see it (the Hopper family's tile of dots3_swa rows): the slice has the
// format's layout, scales and row addressing, quant_dim / slices quantized lanes in num_groups / slices
// scale groups, the format's BF16 lanes after them (which slices gather them is the kernel's choice:
// load_tile.cuh, slice_gathers) and V as its quantized lanes. Slice s reads the quantized bytes from s * quant_bytes() and the scales
// from group s * num_groups of the format's row.
constexpr FormatTraits lane_slice(const FormatTraits& f, int slices) {
  if (slices == 1) return f;
  FormatTraits s = f;
  s.quant_dim = f.quant_dim / slices;
  s.num_groups = f.num_groups / slices;
  s.d_qk = s.quant_dim + f.bf16_dim;
  s.d_v = f.d_v / slices;
  return s;
}

// Whether a format splits into `slices` such slices: FP8 lanes, whole scale groups and 16-lane steps in
// each, and V being exactly the quantized lanes (each slice's V is its own quantized lanes).
constexpr bool splits_into_lane_slices(const FormatTraits& f, int slices) {
  return slices >= 1 && f.quant_dim % slices == 0 && f.num_groups % slices == 0 && f.d_v == f.quant_dim &&
         f.quant_bits == 8 && (f.quant_dim / slices) % 16 == 0;
}

}  // namespace jsmla
