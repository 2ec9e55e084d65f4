// A compile-time diagnostic of where a block's time goes. With JSMLA_PHASE_CLOCKS = 1 (launch_params.h;
// benchmarks/ab_tree.sh NAME=value) one thread of each role of a kernel that marks its phases records
// the SM clock at each mark, and at its end stores a record per block and role into
// SplitKvParams::phase_clocks (when the launch set it): the global timer (ns) at the thread's start
// (the kernel's first statement) and end, the SM clock at its start (the roles of a block compare by
// it), then the clock cycles from its start to each mark (-1: not reached). The standalone
// check's --profile-small prints the records; benchmarks/phase_clocks.py turns them into a table.
// With the knob at 0 (the default) every call below compiles to nothing.
//
// The marks' stores change the kernel they measure slightly (one thread a role, one register or
// local store a mark, one record stored at the end); the numbers are for finding the long phases.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda {

struct PhaseClock {
  static constexpr int kNumbered = 16;         // numbered marks a role records (later ones are dropped)
  // The start marks, after the numbered ones: when a block's valid-token count and lengths have arrived
  // (mark_start), when its coordinates are computed (marked behind the issue of the first loads, so as
  // not to delay them) and when its first index has arrived (mark_after).
  enum StartMark { kCountArrived = 0, kCoordinates = 1, kFirstIndex = 2, kStartMarks = 3 };
  static constexpr int kMarks = kNumbered + kStartMarks;
  static constexpr int kRecord = 3 + kMarks;   // start_ns, end_ns, start clock, the marks
  static constexpr int kRoles = 3;             // records a block stores (roles 0, 1, 2)
#if JSMLA_PHASE_CLOCKS
  bool active;
  long long start;     // set for a recording thread only
  long long start_ns;
  long long at[kMarks];
  JSMLA_DEVICE static long long now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return static_cast<long long>(t);
  }
  JSMLA_DEVICE static long long now_cycles() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
    return static_cast<long long>(t);
  }
  // `active`: this thread records (one thread of each role).
  // Only the recording threads write the record (a local-memory object, `at` being indexed at run time):
  // written by every thread, its initial stores (about 60 KB a 384-thread block) would sit in front of
  // the block's first loads and delay what the first marks measure.
  JSMLA_DEVICE explicit PhaseClock(bool active_thread) : active(active_thread) {
    if (!active) return;
    start = now_cycles();
    start_ns = now_ns();
#pragma unroll
    for (int i = 0; i < kMarks; ++i) at[i] = -1;
  }
  // The clock is read behind a shared-memory load: after a barrier (BAR.SYNC.DEFER_BLOCKING) a warp may
  // issue integer instructions, a clock read among them, before the barrier completes, and a memory
  // access is where it waits (a mark right behind a barrier was seen to precede the other side's arrival).
  JSMLA_DEVICE void mark(int id) {
    if (active && id >= 0 && id < kNumbered) record_at(id);
  }
  // The count-arrived start mark (called right after the branch on the count, which waits for its load).
  JSMLA_DEVICE void mark_start() {
    if (active) record_at(kNumbered + kCountArrived);
  }
  // Start mark `which`, once `dependency` has its value: a branch on it (whose other side sleeps for no
  // time) makes the warp wait for the value before the clock is read.
  JSMLA_DEVICE void mark_after(StartMark which, uint32_t dependency) {
    if (!active) return;
    if (dependency == 0x9e3779b9u) asm volatile("nanosleep.u32 0;");
    record_at(kNumbered + which);
  }
  JSMLA_DEVICE void record_at(int id) {
    asm volatile("{\n .reg .u32 t;\n ld.volatile.shared.u32 t, [%0];\n}\n" ::"r"(0u) : "memory");
    at[id] = now_cycles() - start;
  }
  // Role `role` (< kRoles) of block blockIdx.x stores its record.
  JSMLA_DEVICE void store(const SplitKvParams& p, int role) const {
    if (!active || p.phase_clocks == nullptr) return;
    long long* const record = p.phase_clocks + (static_cast<int64_t>(blockIdx.x) * kRoles + role) * kRecord;
    record[0] = start_ns;
    record[1] = now_ns();
    record[2] = start;
#pragma unroll
    for (int i = 0; i < kMarks; ++i) record[3 + i] = at[i];
  }
#else
  JSMLA_DEVICE explicit PhaseClock(bool) {}
  JSMLA_DEVICE void mark(int) {}
  JSMLA_DEVICE void mark_start() {}
  JSMLA_DEVICE void mark_after(StartMark, uint32_t) {}
  JSMLA_DEVICE void store(const SplitKvParams&, int) const {}
#endif
};

}  // namespace jsmla::cuda
