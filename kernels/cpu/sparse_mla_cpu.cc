// The C++ CPU kernel: instruction-set detection and dispatch, and the driver that runs the tile
// kernels (tile_kernels.h, compiled per instruction set in instruction_sets.h) on threads.
//
// With one head block per token (H <= 64) a work item is a token: its thread compacts the candidate
// list to the valid candidates, then dequantizes each candidate tile just before attending to it, so
// the tile stays in the core's cache. With several head blocks a call runs in phases separated by
// barriers: (1) every token's candidate list is compacted; then, for waves of tokens whose tiles fit a
// memory budget, (2) their tiles are dequantized (work items: a token and a block of rows) and (3)
// each (token, head block) attends to its token's tile. Every work item computes the same values
// whichever thread runs it, and tile boundaries depend only on the format, so results are bitwise
// independent of the thread count and of the other tokens of the batch.
#include "sparse_mla_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JSMLA_CPU_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define JSMLA_CPU_X86 0
#endif
// The BF16 dot-product intrinsics need GCC 10 or clang 9; older compilers build the other sets.
#if JSMLA_CPU_X86 && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10)
#define JSMLA_CPU_X86_BF16 1
#else
#define JSMLA_CPU_X86_BF16 0
#endif

#include "../common/numeric.h"
#include "tile_layout.h"

namespace jsmla {
namespace cpu {
namespace {

#include "instruction_sets.h"

// ---- Dispatch -----------------------------------------------------------------------------------------

struct SupportedSets {
  bool set[kNumInstructionSets] = {true, false, false, false};
};

SupportedSets detect_instruction_sets() {
  SupportedSets supported;
#if JSMLA_CPU_X86
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return supported;
  const bool fma = ecx & (1u << 12);
  const bool os_saves_state = (ecx & (1u << 27)) && (ecx & (1u << 28));  // OSXSAVE and AVX
  if (!os_saves_state) return supported;
  uint32_t xcr0_low = 0, xcr0_high = 0;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  const bool ymm_state = (xcr0_low & 0x6u) == 0x6u;     // SSE and AVX registers
  const bool zmm_state = (xcr0_low & 0xe6u) == 0xe6u;   // plus the AVX-512 mask and upper registers
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return supported;
  const unsigned max_subleaf = eax;
  const bool avx2 = ebx & (1u << 5);
  const bool avx512 = (ebx & (1u << 16)) && (ebx & (1u << 30));  // F and BW
  bool bf16 = false;
  if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) bf16 = eax & (1u << 5);
  supported.set[static_cast<int>(InstructionSet::kAvx2)] = ymm_state && avx2 && fma;
  supported.set[static_cast<int>(InstructionSet::kAvx512)] = ymm_state && zmm_state && avx2 && fma && avx512;
  supported.set[static_cast<int>(InstructionSet::kAvx512Bf16)] =
      JSMLA_CPU_X86_BF16 && supported.set[static_cast<int>(InstructionSet::kAvx512)] && bf16;
#endif
  return supported;
}

const SupportedSets& supported_sets() {
  static const SupportedSets supported = detect_instruction_sets();
  return supported;
}

const TileKernels& tile_kernels([[maybe_unused]] InstructionSet set) {  // only x86-64 has a choice
  static constexpr TileKernels kPortable{portable::dequantize, portable::start, portable::add_tile};
#if JSMLA_CPU_X86
  static constexpr TileKernels kAvx2{avx2::dequantize, avx2::start, avx2::add_tile};
  static constexpr TileKernels kAvx512{avx512::dequantize, avx512::start, avx512::add_tile};
#if JSMLA_CPU_X86_BF16
  static constexpr TileKernels kAvx512Bf16{avx512_bf16::dequantize, avx512_bf16::start, avx512_bf16::add_tile};
  if (set == InstructionSet::kAvx512Bf16) return kAvx512Bf16;
#endif
  if (set == InstructionSet::kAvx512) return kAvx512;
  if (set == InstructionSet::kAvx2) return kAvx2;
#endif
  return kPortable;
}

// ---- Threads ------------------------------------------------------------------------------------------

int usable_cores() {
#if defined(__linux__)
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) return std::max(1, CPU_COUNT(&mask));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// All threads of a call wait here between phases: a counter and a generation word. A waiter spins a
// little, then sleeps on the generation (a Linux futex; elsewhere it yields). Not std::condition_variable:
// its wait() carries a libstdc++ 12 symbol version, which would raise the wheel's manylinux tag. Every
// thread of the call arrives at every barrier, so none waits forever; the last to arrive resets the
// counter before it advances the generation, so no thread reaches the next barrier early; a wake-up
// between a waiter's check and its sleep is not lost (the futex sleeps only while the word still holds
// the generation it saw). The acquire/release pairs make each phase's writes visible to the next.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void arrive_and_wait() {
    const int32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(static_cast<int32_t>(static_cast<uint32_t>(generation) + 1u), std::memory_order_release);
      wake_all();
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins >= kSpinsBeforeSleep) sleep_while(generation);
    }
  }

 private:
  static constexpr int kSpinsBeforeSleep = 256;
  static_assert(sizeof(std::atomic<int32_t>) == sizeof(int32_t) && std::atomic<int32_t>::is_always_lock_free,
                "the futex reads the generation word in place");
  void sleep_while(int32_t generation) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<int32_t*>(&generation_), FUTEX_WAIT_PRIVATE, generation, nullptr, nullptr, 0);
#else
    (void)generation;
    std::this_thread::yield();
#endif
  }
  void wake_all() {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<int32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
  }

  const int count_;
  std::atomic<int> arrived_{0};
  std::atomic<int32_t> generation_{0};
};

// Memory for one call, reused by later calls so that a call does not page-fault fresh memory.
class WorkspacePool {
 public:
  struct Block {
    std::unique_ptr<uint8_t[]> bytes;
    size_t size = 0;
    uint8_t* aligned() const {
      return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes.get()) + 63) & ~uintptr_t{63});
    }
  };

  Block acquire(size_t size) {
    Block block;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        block = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (block.size < size) {
      block.bytes.reset(new uint8_t[size + 64]);
      block.size = size;
    }
    return block;
  }

  void release(Block block) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(block));
  }

 private:
  std::mutex mutex_;
  std::vector<Block> free_;
};

WorkspacePool& workspace_pool() {
  static WorkspacePool* pool = new WorkspacePool();  // never destroyed: calls may run during exit
  return *pool;
}

// ---- The driver ---------------------------------------------------------------------------------------

// Tiles shared by several head blocks are dequantized in waves of tokens whose tiles take at most this
// many bytes (so they stay in the last-level cache), or as many tokens as keep every thread busy.
constexpr int64_t kWaveBytes = 4 << 20;
// Candidate rows per dequantization work item.
constexpr int64_t kDequantizeRows = 128;
// Without an explicit thread count, a thread is added per this many multiply-adds of work.
constexpr double kMultiplyAddsPerThread = 1 << 23;

constexpr int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

struct HeadBlock {
  int first;
  int size;   // real heads
  int width;  // 16, 32 or 64 lanes
};

std::vector<HeadBlock> head_blocks(int num_heads) {
  std::vector<HeadBlock> blocks;
  for (int first = 0; first < num_heads;) {
    const int remaining = num_heads - first;
    const int width = remaining > 32 ? kMaxHeadBlock : (remaining > 16 ? 32 : 16);
    const int size = std::min(width, remaining);
    blocks.push_back({first, size, width});
    first += size;
  }
  return blocks;
}

// Byte offsets of a tile of `capacity` candidate rows.
struct TileGeometry {
  int64_t padded_rows = 0;
  int64_t v_offset = 0, scale_offset = 0, bytes = 0;
};

TileGeometry tile_geometry(const FormatTraits& f, int64_t capacity) {
  TileGeometry g;
  g.padded_rows = round_up(std::max<int64_t>(capacity, 1), kRowGranule);
  g.v_offset = round_up(g.padded_rows * f.d_qk * 2, 64);
  g.scale_offset = g.v_offset + round_up(g.padded_rows / 2 * f.d_v * 4, 64);
  const int64_t scale_bytes = f.scale_kind == ScaleKind::kFp32 ? g.padded_rows * num_segments(f) * 4 : 0;
  g.bytes = g.scale_offset + round_up(scale_bytes, 64);
  return g;
}

// The tile at `at` for `rows` candidates.
TokenTile tile_at(const FormatTraits& f, const TileGeometry& g, uint8_t* at, int64_t rows) {
  TokenTile tile;
  tile.k_pairs = reinterpret_cast<uint32_t*>(at);
  tile.v_pairs = reinterpret_cast<uint32_t*>(at + g.v_offset);
  tile.scales = f.scale_kind == ScaleKind::kFp32 ? reinterpret_cast<float*>(at + g.scale_offset) : nullptr;
  tile.padded_rows = round_up(std::max<int64_t>(rows, 1), kRowGranule);
  return tile;
}

// Per-thread memory: the attention scratch and state of one head block, plus (when the thread
// dequantizes its own tiles) one candidate tile and the token's compacted candidates.
struct ScratchGeometry {
  int64_t scores_offset = 0, probabilities_offset = 0, vectors_offset = 0, output_offset = 0;
  int64_t tile_offset = 0, candidates_offset = 0, bytes = 0;
};

ScratchGeometry scratch_geometry(const FormatTraits& f, const TileGeometry& own_tile, int64_t max_candidates) {
  const int64_t tile_rows = candidates_per_tile(f);
  ScratchGeometry g;
  g.scores_offset = round_up(int64_t{f.d_qk} / 2 * kMaxHeadBlock * 4, 64);
  g.probabilities_offset = g.scores_offset + tile_rows * kMaxHeadBlock * 4;
  g.vectors_offset = g.probabilities_offset + tile_rows / 2 * kMaxHeadBlock * 4;
  g.output_offset = g.vectors_offset + 3 * kMaxHeadBlock * 4;
  g.tile_offset = g.output_offset + int64_t{f.d_v} * kMaxHeadBlock * 4;
  g.candidates_offset = g.tile_offset + own_tile.bytes;
  g.bytes = g.candidates_offset + round_up(max_candidates * static_cast<int64_t>(sizeof(CandidateRef)), 64);
  return g;
}

// The valid candidates of row t, main list first: returns their number.
int64_t compact_candidates(const AttentionParams& p, int64_t t, CandidateRef* out) {
  int64_t n = 0;
  const CandidateList* lists[2] = {&p.main, &p.extra};
  for (int32_t list = 0; list < 2; ++list) {
    if (lists[list]->topk == 0) continue;
    const int32_t length = lists[list]->row_length(t);
    for (int32_t j = 0; j < length; ++j) {
      const int64_t slot = lists[list]->slot(t, j);
      if (slot >= 0) out[n++] = {static_cast<int32_t>(slot), list};
    }
  }
  return n;
}

// q pairs of one head block, [d_qk / 2][width], zero past the block's real heads.
void pack_queries(const FormatTraits& f, const AttentionParams& p, int64_t t, const HeadBlock& block, uint32_t* out) {
  const int64_t pairs = f.d_qk / 2;
  for (int lane = 0; lane < block.width; ++lane) {
    if (lane >= block.size) {
      for (int64_t i = 0; i < pairs; ++i) out[i * block.width + lane] = 0;
      continue;
    }
    const uint16_t* q = p.q + (t * p.num_heads + block.first + lane) * static_cast<int64_t>(f.d_qk);
    for (int64_t i = 0; i < pairs; ++i) {
      out[i * block.width + lane] = static_cast<uint32_t>(q[2 * i]) | (static_cast<uint32_t>(q[2 * i + 1]) << 16);
    }
  }
}

void write_empty(const FormatTraits& f, const AttentionParams& p, int64_t t, int h, float lse) {
  uint16_t* out = p.out + (t * p.num_heads + h) * static_cast<int64_t>(f.d_v);
  std::fill(out, out + f.d_v, static_cast<uint16_t>(0));
  p.lse[t * p.num_heads + h] = lse;
}

// Normalises one head block's state (sink included) into its rows of out and lse; `job` is null when
// the row has no valid candidate.
void finish_heads(const FormatTraits& f, const AttentionParams& p, int64_t t, const HeadBlock& block,
                  const AttendJob* job) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (int lane = 0; lane < block.size; ++lane) {
    const int h = block.first + lane;
    const double sink = p.attn_sink != nullptr ? p.attn_sink[h] : -kInf;
    if (job == nullptr || sink == kInf) {  // lse is the sink (-inf without one), out is zero
      write_empty(f, p, t, h, static_cast<float>(sink));
      continue;
    }
    const double row_max = job->row_max[lane];
    const double top = std::max(row_max, sink);
    const double kept = std::exp(row_max - top);
    double total = job->row_sum[lane] * kept;
    if (sink > -kInf) total += std::exp(sink - top);
    p.lse[t * p.num_heads + h] = static_cast<float>(top + std::log(total));
    const float factor = static_cast<float>(kept / total);
    uint16_t* out = p.out + (t * p.num_heads + h) * static_cast<int64_t>(f.d_v);
    for (int d = 0; d < f.d_v; ++d) out[d] = float_to_bf16(job->output[int64_t{d} * block.width + lane] * factor);
  }
}

// Everything one call needs, shared by its threads.
struct Call {
  const FormatTraits& f;
  const AttentionParams& p;
  const TileKernels& kernels;
  int64_t valid;
  int64_t max_candidates;
  std::vector<HeadBlock> blocks;
  ScratchGeometry scratch;
  TileGeometry own_tile;

  // Attention of one head block of token t over its `count` candidates. The tile is `shared` (already
  // dequantized) or, when null, dequantized here one candidate tile at a time into the thread's tile.
  void attend(int64_t t, const HeadBlock& block, const CandidateRef* candidates, int64_t count,
              const TokenTile* shared, uint8_t* thread_memory) const {
    if (count == 0) {
      finish_heads(f, p, t, block, nullptr);
      return;
    }
    AttendJob job;
    job.format = &f;
    auto* q_pairs = reinterpret_cast<uint32_t*>(thread_memory);
    pack_queries(f, p, t, block, q_pairs);
    job.q_pairs = q_pairs;
    job.head_block = block.width;
    job.sm_scale = p.sm_scale;
    job.scores = reinterpret_cast<float*>(thread_memory + scratch.scores_offset);
    job.probabilities = reinterpret_cast<uint32_t*>(thread_memory + scratch.probabilities_offset);
    auto* vectors = reinterpret_cast<float*>(thread_memory + scratch.vectors_offset);
    job.alpha = vectors;
    job.row_max = vectors + kMaxHeadBlock;
    job.row_sum = vectors + 2 * kMaxHeadBlock;
    job.output = reinterpret_cast<float*>(thread_memory + scratch.output_offset);
    kernels.start(job);
    const TokenTile own = tile_at(f, own_tile, thread_memory + scratch.tile_offset, 0);
    const int64_t row_words = f.d_qk / 2;
    const int64_t tile_rows = candidates_per_tile(f);
    for (int64_t row0 = 0; row0 < count; row0 += tile_rows) {
      job.rows = std::min(tile_rows, count - row0);
      if (shared != nullptr) {
        job.k_pairs = shared->k_pairs + row0 * row_words;
        job.v_pairs = shared->v_pairs + row0 / 2 * f.d_v;
        job.scales = shared->scales != nullptr ? shared->scales + row0 * num_segments(f) : nullptr;
      } else {
        dequantize(candidates + row0, job.rows, 0, round_up(job.rows, kRowGranule), own);
        job.k_pairs = own.k_pairs;
        job.v_pairs = own.v_pairs;
        job.scales = own.scales;
      }
      kernels.add_tile(job, row0 == 0);
    }
    finish_heads(f, p, t, block, &job);
  }

  void dequantize(const CandidateRef* candidates, int64_t count, int64_t begin, int64_t end,
                  const TokenTile& tile) const {
    DequantizeJob job;
    job.format = &f;
    job.formats[0] = &format_traits(p.main.format);
    job.formats[1] = &format_traits(p.extra.format);
    job.caches[0] = &p.main.cache;
    job.caches[1] = &p.extra.cache;
    job.candidates = candidates;
    job.count = count;
    job.begin = begin;
    job.end = end;
    job.sm_scale = p.sm_scale;
    job.tile = tile;
    kernels.dequantize(job);
  }

  void write_empty_row(int64_t t) const {
    for (int h = 0; h < p.num_heads; ++h) write_empty(f, p, t, h, -std::numeric_limits<float>::infinity());
  }
};

// While alive, the calling thread reads subnormal floats as zero and flushes subnormal results (x86-64
// MXCSR DAZ and FTZ), as the BF16 dot-product instruction always does: so the instruction sets that
// emulate it with FP32 FMAs give its bits exactly. (XLA's CPU threads run this way already.)
class FlushSubnormals {
 public:
#if JSMLA_CPU_X86
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  const unsigned saved_;
#else
  FlushSubnormals() {}  // other CPUs follow IEEE rules for subnormals
#endif
};

// Runs `phases` (each: item count and work(item, thread_index)) on `num_threads` threads, the caller
// included, with a barrier after each phase.
template <typename Phases>
void run_phases(int num_threads, int64_t num_phases, const Phases& phases) {
  std::unique_ptr<std::atomic<int64_t>[]> next_item(new std::atomic<int64_t>[num_phases]);
  for (int64_t i = 0; i < num_phases; ++i) next_item[i].store(0, std::memory_order_relaxed);
  Barrier barrier(num_threads);
  auto worker = [&](int thread_index) {
    const FlushSubnormals flush_subnormals;
    for (int64_t phase = 0; phase < num_phases; ++phase) {
      const int64_t items = phases.items(phase);
      for (int64_t item = next_item[phase].fetch_add(1); item < items; item = next_item[phase].fetch_add(1)) {
        phases.run(phase, item, thread_index);
      }
      if (phase + 1 < num_phases) barrier.arrive_and_wait();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) threads.emplace_back(worker, i);
  worker(0);
  for (auto& thread : threads) thread.join();
}

// One head block per token: each item is a token, whose thread compacts its candidates and
// dequantizes each candidate tile just before attending to it (the tile stays in the core's cache).
struct PerTokenPhases {
  const Call& call;
  uint8_t* thread_memory;
  int64_t items(int64_t) const { return call.p.num_tokens; }
  void run(int64_t, int64_t t, int thread_index) const {
    if (t >= call.valid) {
      call.write_empty_row(t);
      return;
    }
    uint8_t* memory = thread_memory + thread_index * call.scratch.bytes;
    auto* candidates = reinterpret_cast<CandidateRef*>(memory + call.scratch.candidates_offset);
    const int64_t count = compact_candidates(call.p, t, candidates);
    call.attend(t, call.blocks[0], candidates, count, nullptr, memory);
  }
};

// Several head blocks per token: phase 0 compacts every token's candidates; then, per wave of
// tokens, one phase dequantizes their tiles (items: a token and kDequantizeRows rows) and the next
// attends to them (items: a token and a head block).
struct SharedTilePhases {
  const Call& call;
  uint8_t* thread_memory;
  CandidateRef* candidates;  // [T][max_candidates]
  int64_t* counts;           // [T]
  uint8_t* wave_memory;
  TileGeometry tile;
  int64_t wave_tokens;
  int64_t chunks_per_token;

  int64_t wave_size(int64_t wave) const { return std::min(wave_tokens, call.valid - wave * wave_tokens); }
  TokenTile token_tile(int64_t t) const {
    return tile_at(call.f, tile, wave_memory + (t % wave_tokens) * tile.bytes, counts[t]);
  }
  int64_t items(int64_t phase) const {
    if (phase == 0) return call.p.num_tokens;
    const int64_t wave = (phase - 1) / 2;
    return wave_size(wave) * (phase % 2 == 1 ? chunks_per_token : static_cast<int64_t>(call.blocks.size()));
  }
  void run(int64_t phase, int64_t item, int thread_index) const {
    if (phase == 0) {
      if (item >= call.valid) {
        call.write_empty_row(item);
      } else {
        counts[item] = compact_candidates(call.p, item, candidates + item * call.max_candidates);
      }
      return;
    }
    const int64_t first = (phase - 1) / 2 * wave_tokens;
    if (phase % 2 == 1) {
      const int64_t t = first + item / chunks_per_token;
      const TokenTile token = token_tile(t);
      const int64_t begin = item % chunks_per_token * kDequantizeRows;
      if (counts[t] == 0 || begin >= token.padded_rows) return;
      call.dequantize(candidates + t * call.max_candidates, counts[t], begin,
                      std::min(begin + kDequantizeRows, token.padded_rows), token);
      return;
    }
    const int64_t blocks = static_cast<int64_t>(call.blocks.size());
    const int64_t t = first + item / blocks;
    const TokenTile token = token_tile(t);
    call.attend(t, call.blocks[item % blocks], nullptr, counts[t], &token,
                thread_memory + thread_index * call.scratch.bytes);
  }
};

}  // namespace
}  // namespace cpu

const char* instruction_set_name(InstructionSet set) {
  switch (set) {
    case InstructionSet::kAvx2:
      return "avx2";
    case InstructionSet::kAvx512:
      return "avx512";
    case InstructionSet::kAvx512Bf16:
      return "avx512_bf16";
    case InstructionSet::kPortable:
      break;
  }
  return "portable";
}

bool instruction_set_supported(InstructionSet set) {
  const int index = static_cast<int>(set);
  return index >= 0 && index < kNumInstructionSets && cpu::supported_sets().set[index];
}

InstructionSet best_instruction_set() {
  for (int i = kNumInstructionSets - 1; i > 0; --i) {
    if (cpu::supported_sets().set[i]) return static_cast<InstructionSet>(i);
  }
  return InstructionSet::kPortable;
}

std::string cpu_kernel_options_from_environment(CpuKernelOptions* options) {
  if (const char* text = std::getenv("JSMLA_CPU_THREADS"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long threads = std::strtol(text, &end, 10);
    if (*end != '\0' || threads < 1 || threads > 4096) {
      return std::string("JSMLA_CPU_THREADS: expected a thread count in [1, 4096], got '") + text + "'";
    }
    options->num_threads = static_cast<int>(threads);
  }
  if (const char* text = std::getenv("JSMLA_CPU_ISA"); text != nullptr && *text != '\0' &&
                                                        std::strcmp(text, "auto") != 0) {
    std::string supported;
    for (int i = 0; i < kNumInstructionSets; ++i) {
      const auto set = static_cast<InstructionSet>(i);
      if (instruction_set_supported(set)) {
        supported += std::string(supported.empty() ? "" : ", ") + instruction_set_name(set);
      }
    }
    for (int i = 0; i < kNumInstructionSets; ++i) {
      const auto set = static_cast<InstructionSet>(i);
      if (std::strcmp(text, instruction_set_name(set)) != 0) continue;
      if (!instruction_set_supported(set)) {
        return std::string("JSMLA_CPU_ISA: '") + text + "' is not supported by this CPU (supported: " + supported + ")";
      }
      options->instruction_set = set;
      return "";
    }
    return std::string("JSMLA_CPU_ISA: expected auto, portable, avx2, avx512 or avx512_bf16, got '") + text + "'";
  }
  return "";
}

void sparse_mla_cpu(const FormatTraits& f, const AttentionParams& p, const CpuKernelOptions& options) {
  using namespace cpu;
  if (p.num_tokens == 0 || p.num_heads == 0) return;
  auto list_capacity = [](const CandidateList& list) -> int64_t {
    return list.max_candidates > 0 ? std::min(list.topk, list.max_candidates) : list.topk;
  };
  const int64_t max_candidates = list_capacity(p.main) + list_capacity(p.extra);
  const int64_t valid = p.valid_tokens != nullptr ? std::clamp<int64_t>(p.valid_tokens[0], 0, p.num_tokens)
                                                  : p.num_tokens;
  const TileGeometry token_tile = tile_geometry(f, max_candidates);
  const TileGeometry own_tile = tile_geometry(f, candidates_per_tile(f));
  Call call{f, p, tile_kernels(options.instruction_set), valid, max_candidates, head_blocks(p.num_heads),
            scratch_geometry(f, own_tile, max_candidates), own_tile};
  const int64_t num_blocks = static_cast<int64_t>(call.blocks.size());
  const int64_t chunks_per_token = (token_tile.padded_rows + kDequantizeRows - 1) / kDequantizeRows;

  int num_threads = options.num_threads;
  if (num_threads <= 0) {
    const double multiply_adds = static_cast<double>(valid) * p.num_heads * max_candidates * (f.d_qk + f.d_v);
    num_threads = static_cast<int>(std::clamp<double>(multiply_adds / kMultiplyAddsPerThread, 1.0, usable_cores()));
  }
  const int64_t most_items = num_blocks == 1 ? p.num_tokens
                                             : std::max({p.num_tokens, valid * chunks_per_token, valid * num_blocks});
  num_threads = static_cast<int>(std::clamp<int64_t>(num_threads, 1, most_items));

  const int64_t scratch_bytes = num_threads * call.scratch.bytes;
  if (num_blocks == 1) {
    WorkspacePool::Block block = workspace_pool().acquire(static_cast<size_t>(scratch_bytes));
    run_phases(num_threads, 1, PerTokenPhases{call, block.aligned()});
    workspace_pool().release(std::move(block));
    return;
  }
  const int64_t threads_per_block = (num_threads + num_blocks - 1) / num_blocks;
  const int64_t wave_tokens =
      std::clamp<int64_t>(std::max(kWaveBytes / token_tile.bytes, threads_per_block), 1, std::max<int64_t>(valid, 1));
  const int64_t num_waves = (valid + wave_tokens - 1) / wave_tokens;
  const int64_t candidates_bytes =
      round_up(p.num_tokens * std::max<int64_t>(max_candidates, 1) * static_cast<int64_t>(sizeof(CandidateRef)), 64);
  const int64_t counts_bytes = round_up(p.num_tokens * static_cast<int64_t>(sizeof(int64_t)), 64);
  const int64_t wave_bytes = wave_tokens * token_tile.bytes;
  WorkspacePool::Block block =
      workspace_pool().acquire(static_cast<size_t>(scratch_bytes + candidates_bytes + counts_bytes + wave_bytes));
  uint8_t* base = block.aligned();
  const SharedTilePhases phases{call,
                                base,
                                reinterpret_cast<CandidateRef*>(base + scratch_bytes),
                                reinterpret_cast<int64_t*>(base + scratch_bytes + candidates_bytes),
                                base + scratch_bytes + candidates_bytes + counts_bytes,
                                token_tile,
                                wave_tokens,
                                chunks_per_token};
  run_phases(num_threads, 1 + 2 * num_waves, phases);
  workspace_pool().release(std::move(block));
}

}  // namespace jsmla
