// The CPU kernel's tile algorithm, written once over an instruction-set interface `Ops`:
// dequantization of candidate rows into a token tile, and attention of one head block over a tile
// (S = Q·Kᵀ and O = P·V as register-blocked dot products over BF16 pairs, online softmax per tile).
//
// This file is a textual template, deliberately without an include guard: sparse_mla_cpu.cc includes it
// once per instruction set, inside that set's namespace (which defines `Ops`) and compile-target
// region, so every function here is compiled for that set. Every instruction set runs the same
// sequence of roundings (each multiply-add is an explicit fused `Ops::fma`, the pair dot product is
// two fused steps, odd element first, as the BF16 instruction defines it) and the kernel's threads
// treat subnormals as the BF16 instruction does (see FlushSubnormals), so on x86-64 every set gives
// the same bits.
//
// Ops provides, for F (kLanes float lanes), A/B (pair operands) and H (kChunk BF16 lanes):
//   kLanes, kAccumulators (F accumulators of a register block), kMaxHeadVectors (widest head
//   sub-block of a register block, in F vectors), kChunk;
//   zero, set1, load, store, add, sub, mul, max, fma(a, b, c) = a*b + c rounded once,
//   exp_nonpositive(x) (e^x for x <= 0), round_bf16(x) (round to nearest even BF16, as float),
//   store_pairs(words, even, odd) (BF16-exact floats packed as pairs);
//   load_a(words), broadcast_b(word), dot(acc, a, b) (acc + a.odd*b.odd, then + a.even*b.even);
//   fp8_to_bf16(bytes), fp4_to_bf16(bytes) (kChunk / 2 bytes, lane 2i in the low nibble of byte i),
//   load_bf16(bytes), scale_bf16(h, low, high) (BF16 of each lane times `low` in the first half of the
//   lanes and `high` in the second, rounded to nearest even), zero_h, store_bf16(lanes, h),
//   store_interleaved(words, even, odd).

using F = typename Ops::F;
using A = typename Ops::A;
using B = typename Ops::B;
using H = typename Ops::H;

// acc[x][v] = sum over `pairs` steps of a[step][v] · b[x][step], with a advancing `a_step` words per
// step, row x of b at `b + x * b_row` and b advancing `b_step` words per step.
template <int HeadVectors, int Rows>
inline void pair_dot_block(const uint32_t* a, int64_t a_step, const uint32_t* b, int64_t b_row, int64_t b_step,
                           int64_t pairs, F (&acc)[Rows][HeadVectors]) {
  for (int x = 0; x < Rows; ++x) {
    for (int v = 0; v < HeadVectors; ++v) acc[x][v] = Ops::zero();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    A a_vectors[HeadVectors];
    for (int v = 0; v < HeadVectors; ++v) a_vectors[v] = Ops::load_a(a + v * Ops::kLanes);
    for (int x = 0; x < Rows; ++x) {
      const B b_word = Ops::broadcast_b(b + x * b_row);
      for (int v = 0; v < HeadVectors; ++v) acc[x][v] = Ops::dot(acc[x][v], a_vectors[v], b_word);
    }
    a += a_step;
    b += b_step;
  }
}

// Scaled scores of the tile's rows [0, rows) (rows a multiple of kRowGranule) for the head block:
// scores[x][h] = sum over segments of sm_scale * scale(x, segment) * (q[h] · K(x)) restricted to the
// segment (scale 1 without FP32 scales).
template <int HeadVectors>
void tile_scores(const AttendJob& job, int64_t rows) {
  constexpr int kRows = Ops::kAccumulators / HeadVectors;
  static_assert(cpu::kRowGranule % kRows == 0, "register blocks must tile the padded candidate rows");
  const FormatTraits& f = *job.format;
  const int head_block = job.head_block;
  const int64_t row_words = f.d_qk / 2;
  const int segments = cpu::num_segments(f);
  const bool segment_scales = f.scale_kind == ScaleKind::kFp32;
  const F uniform_factor = Ops::set1(job.sm_scale);
  for (int segment = 0; segment < segments; ++segment) {
    const int64_t first_pair = static_cast<int64_t>(segment) * (cpu::kSegmentLanes / 2);
    const int64_t pairs = std::min<int64_t>(cpu::kSegmentLanes / 2, row_words - first_pair);
    for (int v0 = 0; v0 < head_block / Ops::kLanes; v0 += HeadVectors) {
      for (int64_t x0 = 0; x0 < rows; x0 += kRows) {
        F acc[kRows][HeadVectors];
        pair_dot_block<HeadVectors, kRows>(job.q_pairs + first_pair * head_block + v0 * Ops::kLanes, head_block,
                                           job.k_pairs + x0 * row_words + first_pair, row_words, 1,
                                           pairs, acc);
        for (int x = 0; x < kRows; ++x) {
          const F factor = segment_scales ? Ops::set1(job.sm_scale * job.scales[(x0 + x) * segments + segment])
                                          : uniform_factor;
          float* row = job.scores + (x0 + x) * head_block + v0 * Ops::kLanes;
          for (int v = 0; v < HeadVectors; ++v) {
            float* lanes = row + v * Ops::kLanes;
            Ops::store(lanes, segment == 0 ? Ops::mul(acc[x][v], factor)
                                           : Ops::fma(acc[x][v], factor, Ops::load(lanes)));
          }
        }
      }
    }
  }
}

// Online softmax over the `count` real rows of the tile's scores (`rows` padded rows): updates the
// running max and the running sum (of the FP32 probabilities, so lse keeps FP32 accuracy), writes
// alpha = exp(old max - new max) and the probabilities rounded to BF16 for P·V, as pairs of rows
// (pairs past the real rows are zero).
void tile_softmax(const AttendJob& job, int64_t count, int64_t rows) {
  const int head_block = job.head_block;
  for (int v = 0; v < head_block / Ops::kLanes; ++v) {
    const int lane0 = v * Ops::kLanes;
    F tile_max = Ops::load(job.scores + lane0);
    for (int64_t c = 1; c < count; ++c) tile_max = Ops::max(tile_max, Ops::load(job.scores + c * head_block + lane0));
    const F old_max = Ops::load(job.row_max + lane0);
    const F new_max = Ops::max(old_max, tile_max);
    Ops::store(job.alpha + lane0, Ops::exp_nonpositive(Ops::sub(old_max, new_max)));
    Ops::store(job.row_max + lane0, new_max);
    F sum = Ops::zero();
    for (int64_t pair = 0; pair < rows / 2; ++pair) {
      const int64_t even = 2 * pair;
      F p_even = Ops::zero();
      F p_odd = Ops::zero();
      const float* even_scores = job.scores + even * head_block + lane0;
      if (even < count) p_even = Ops::exp_nonpositive(Ops::sub(Ops::load(even_scores), new_max));
      if (even + 1 < count) p_odd = Ops::exp_nonpositive(Ops::sub(Ops::load(even_scores + head_block), new_max));
      sum = Ops::add(Ops::add(sum, p_even), p_odd);
      Ops::store_pairs(job.probabilities + pair * head_block + lane0, Ops::round_bf16(p_even),
                       Ops::round_bf16(p_odd));
    }
    Ops::store(job.row_sum + lane0, Ops::fma(Ops::load(job.row_sum + lane0), Ops::load(job.alpha + lane0), sum));
  }
}

// output[d][h] = alpha[h] * output[d][h] + sum over the tile's pairs of P · V.
template <int HeadVectors>
void tile_values(const AttendJob& job, int64_t pairs, bool rescale) {
  constexpr int kRows = Ops::kAccumulators / HeadVectors;
  const int head_block = job.head_block;
  const int d_v = job.format->d_v;
  static_assert(32 % kRows == 0, "register blocks must tile the value lanes (a multiple of 32)");
  for (int v0 = 0; v0 < head_block / Ops::kLanes; v0 += HeadVectors) {
    F alpha[HeadVectors];
    for (int v = 0; v < HeadVectors; ++v) alpha[v] = Ops::load(job.alpha + (v0 + v) * Ops::kLanes);
    for (int x0 = 0; x0 < d_v; x0 += kRows) {
      F acc[kRows][HeadVectors];
      pair_dot_block<HeadVectors, kRows>(job.probabilities + v0 * Ops::kLanes, head_block, job.v_pairs + x0, 1, d_v,
                                         pairs, acc);
      for (int x = 0; x < kRows; ++x) {
        float* row = job.output + static_cast<int64_t>(x0 + x) * head_block + v0 * Ops::kLanes;
        for (int v = 0; v < HeadVectors; ++v) {
          float* lanes = row + v * Ops::kLanes;
          const F previous = Ops::load(lanes);
          Ops::store(lanes, rescale ? Ops::fma(previous, alpha[v], acc[x][v]) : Ops::add(previous, acc[x][v]));
        }
      }
    }
  }
}

template <int HeadVectors>
void add_tile_with(const AttendJob& job, bool first_tile) {
  const int64_t rows = (job.rows + cpu::kRowGranule - 1) / cpu::kRowGranule * cpu::kRowGranule;
  tile_scores<HeadVectors>(job, rows);
  tile_softmax(job, job.rows, rows);
  tile_values<HeadVectors>(job, (job.rows + 1) / 2, /*rescale=*/!first_tile);
}

void add_tile(const AttendJob& job, bool first_tile) {
  const int head_vectors = std::min(job.head_block / Ops::kLanes, Ops::kMaxHeadVectors);
  if (head_vectors >= 4) {
    if constexpr (Ops::kMaxHeadVectors >= 4) add_tile_with<4>(job, first_tile);
  } else if (head_vectors == 2) {
    add_tile_with<2>(job, first_tile);
  } else {
    add_tile_with<1>(job, first_tile);
  }
}

void start(const AttendJob& job) {
  const F minus_infinity = Ops::set1(-std::numeric_limits<float>::infinity());
  for (int lane = 0; lane < job.head_block; lane += Ops::kLanes) {
    Ops::store(job.row_max + lane, minus_infinity);
    Ops::store(job.row_sum + lane, Ops::zero());
  }
  std::fill(job.output, job.output + static_cast<int64_t>(job.format->d_v) * job.head_block, 0.0f);
}

// The K lanes [lane, lane + kChunk) of a candidate row of format f and, for lanes below d_v, its V lanes.
struct RowChunk {
  H k;
  H v;
};

inline RowChunk dequantize_chunk(const FormatTraits& f, const uint8_t* data, const uint8_t* scales, int lane) {
  if (lane < f.quant_dim) {
    const H codes = f.quant_bits == 4 ? Ops::fp4_to_bf16(data + lane / 2) : Ops::fp8_to_bf16(data + lane);
    const float low_scale = group_scale(f, scales, lane / f.group_size);
    const float high_scale = group_scale(f, scales, (lane + Ops::kChunk / 2) / f.group_size);
    // FP32 scales: K keeps the codes (its segment's scale multiplies the partial score in FP32), V the
    // values rounded to BF16. Other scales: the values, exact.
    if (f.scale_kind == ScaleKind::kFp32) {
      return {codes, lane < f.d_v ? Ops::scale_bf16(codes, low_scale, high_scale) : codes};
    }
    const H values = Ops::scale_bf16(codes, low_scale, high_scale);
    return {values, values};
  }
  const H values = Ops::load_bf16(data + f.bf16_offset + 2 * (lane - f.quant_dim));
  return {values, values};
}

void dequantize(const DequantizeJob& job) {
  const FormatTraits& f = *job.format;  // widths and tile layout; each row is read with its list's format
  const TokenTile& tile = job.tile;
  const int64_t row_words = f.d_qk / 2;
  const int segments = cpu::num_segments(f);
  for (int64_t even = job.begin; even < job.end; even += 2) {
    const uint8_t* data[2] = {nullptr, nullptr};
    const uint8_t* scales[2] = {nullptr, nullptr};
    const FormatTraits* formats[2] = {&f, &f};
    for (int i = 0; i < 2; ++i) {
      const int64_t c = even + i;
      uint16_t* k_row = reinterpret_cast<uint16_t*>(tile.k_pairs + c * row_words);
      if (c >= job.count) {
        std::fill(k_row, k_row + f.d_qk, static_cast<uint16_t>(0));
        if (tile.scales != nullptr) std::fill(tile.scales + c * segments, tile.scales + (c + 1) * segments, 0.0f);
        continue;
      }
      const int32_t list = job.candidates[c].list;
      const CacheView& cache = *job.caches[list];
      const int64_t slot = job.candidates[c].slot;
      formats[i] = job.formats[list];
      data[i] = cache.data_row(slot);
      scales[i] = formats[i]->quant_dim > 0 ? cache.scales(*formats[i], slot) : nullptr;
      if (tile.scales != nullptr) {
        for (int s = 0; s < segments; ++s) {
          tile.scales[c * segments + s] = s * cpu::kSegmentLanes < f.quant_dim ? group_scale(f, scales[i], s) : 1.0f;
        }
      }
    }
    uint16_t* k_rows[2] = {reinterpret_cast<uint16_t*>(tile.k_pairs + even * row_words),
                           reinterpret_cast<uint16_t*>(tile.k_pairs + (even + 1) * row_words)};
    uint32_t* v_words = tile.v_pairs + (even / 2) * static_cast<int64_t>(f.d_v);
    for (int lane = 0; lane < f.d_qk; lane += Ops::kChunk) {
      RowChunk chunks[2] = {{Ops::zero_h(), Ops::zero_h()}, {Ops::zero_h(), Ops::zero_h()}};
      for (int i = 0; i < 2; ++i) {
        if (data[i] == nullptr) continue;
        chunks[i] = dequantize_chunk(*formats[i], data[i], scales[i], lane);
        Ops::store_bf16(k_rows[i] + lane, chunks[i].k);
      }
      if (lane < f.d_v) Ops::store_interleaved(v_words + lane, chunks[0].v, chunks[1].v);
    }
  }
}
