// The C++ CPU kernel: full sparse-MLA semantics on the CPU. Each token's valid candidates are
// dequantized once into a BF16 tile shared by all heads; head blocks then run register-blocked dot
// products over it (S = Q·Kᵀ, online softmax per candidate tile, O = P·V) with FP32 accumulation.
// The instruction set is chosen at run time; results do not depend on the thread count or the batch.
#pragma once

#include <string>

#include "../common/params.h"

namespace jsmla {

// Instruction sets the kernel has code for, in order of preference (the last supported one wins).
enum class InstructionSet : int {
  kPortable = 0,    // plain C++ (any CPU)
  kAvx2 = 1,        // AVX2 + FMA, BF16 pair products emulated with FP32 FMAs
  kAvx512 = 2,      // AVX-512 F/BW, BF16 pair products emulated with FP32 FMAs
  kAvx512Bf16 = 3,  // AVX-512 with the BF16 dot-product instruction
};
inline constexpr int kNumInstructionSets = 4;

const char* instruction_set_name(InstructionSet set);
bool instruction_set_supported(InstructionSet set);
InstructionSet best_instruction_set();

struct CpuKernelOptions {
  int num_threads = 0;  // 0: as many as the work needs, up to the cores this process may run on
  InstructionSet instruction_set = best_instruction_set();
};

// Reads JSMLA_CPU_THREADS (a positive thread count) and JSMLA_CPU_ISA (auto, portable, avx2, avx512,
// avx512_bf16) into `options`. Returns an error message naming the variable, or "" when both are
// absent or valid.
std::string cpu_kernel_options_from_environment(CpuKernelOptions* options);

// Computes out/lse for every row of `p`.
void sparse_mla_cpu(const FormatTraits& f, const AttentionParams& p, const CpuKernelOptions& options);

}  // namespace jsmla
