#!/usr/bin/env bash
# Where the Hopper kernels' time goes at the headline shape (dsv3_2, T = 128, H = 128, topk = 2048),
# beside FlashMLA's SM90 decode kernel on the same shape, on a GPU machine: ncu speed-of-light, compute
# and memory workload (shared-memory wavefronts), warp-state and instruction statistics of our split
# kernel (decode, one split) and prefill kernel (`portable_check --profile`) and of FlashMLA's
# `flash_fwd_splitkv_mla_fp8_sparse_kernel` (`benchmarks/flashmla_anchor.py 128 128`, when its sources
# are in $JSMLA_FLASHMLA_SRC, default .anchors/flashmla), then the hottest SASS lines by stall reason of
# each. The standalone headline timings come first (every case checked). Output: $OUT (default
# /tmp/jsmla_profile_hopper); a side-by-side summary is printed last.
#
# JSMLA_PROFILE_SHAPE=bf16 profiles the BF16 kernel (bf16_576 prefill, T = 128, H = 128: `portable_check
# --profile-bf16`) beside FlashMLA's BF16 sparse prefill `sparse_attn_fwd_kernel` on the same shape
# (`flashmla_anchor.py 128 128 prefill`); h16 profiles the 16-head portable tile instead (dsv3_2 T = 128 H = 16, 1 split:
# the first launch of `portable_check --h16`, after that mode's timings), h16h the Hopper family's
# 16-head tile on the same case, beside FlashMLA's kernel on the same shape (its heads padded to 64:
# `flashmla_anchor.py 128 16`); dots3 the `dots3_swa` cluster tile (T = 128, H = 128 prefill over its
# 513-candidate window: the first Hopper launch of `portable_check --dots3`, after that mode's timings;
# its two blocks are one cluster each), and `dsv3_2`'s 64-head tile over 513 candidates (the mode's
# last case) as "flashmla"'s column: no FlashMLA kernel serves these rows.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/jsmla_profile_hopper}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
source "$repo/benchmarks/flashmla_build.sh"
start_flashmla_build
build=${JSMLA_PROFILE_BUILD:-/tmp/jsmla_profile_hopper_build}  # JSMLA_PROFILE_BUILD: another tree profiled in the same session
# what is profiled: (check mode, our kernel's regex, launches to skip and to profile, FlashMLA's heads)
case "${JSMLA_PROFILE_SHAPE:-h128}" in
  h128) check_mode=--headline; ours="sparse_mla_hopper 0 4 $build/portable_check --profile"; flash_heads=128 ;;
  h16) check_mode=--h16; ours="sparse_mla_portable 0 1 $build/portable_check --h16"; flash_heads=16 ;;
  h16h) check_mode=--h16; ours="sparse_mla_hopper_h16 0 1 $build/portable_check --h16"; flash_heads=16 ;;
  bf16) check_mode=--profile-bf16; ours="sparse_mla_hopper 0 1 $build/portable_check --profile-bf16"
        flash_heads="128 prefill" ;;
  dots3) check_mode=--dots3; ours="sparse_mla_hopper 0 1 $build/portable_check --dots3"; flash_heads="" ;;
  *) echo "JSMLA_PROFILE_SHAPE: h128, h16, h16h, bf16 or dots3"; exit 2 ;;
esac
(cd "$repo" && BUILD=$build SKIP_SANITIZE=1 OUT="$out/check" \
   bash kernels/cuda/tests/build_and_check.sh "$check_mode" > "$out/headline.log" 2>&1)
grep -E "us .*TFLOP" "$out/headline.log"

sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
  --section WarpStateStats --section SourceCounters --section InstructionStats --section LaunchStats
  --section SchedulerStats --section Occupancy"
profile() {  # name, kernel regex, launches to skip, launches to profile, command...
  local name=$1 regex=$2 skip=$3 count=$4
  shift 4
  ncu --clock-control none $sections -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    -o "$out/$name" -f "$@" > "$out/ncu_$name.log" 2>&1 || { echo "$name: ncu failed"; tail -5 "$out/ncu_$name.log"; return; }
  ncu -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt" 2>&1
  ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_src.csv" 2>/dev/null
  echo "== hottest SASS lines: $name"
  python3 "$repo/kernels/cuda/tests/top_stalls.py" "$out/${name}_src.csv" 15 | tail -17
}
# h128: decode (1 split), then prefill, each run twice (determinism); h16: the first decode launch
# shellcheck disable=SC2086
profile ours $ours
if [ -z "$flash_heads" ]; then
  # dots3: the reference is our dsv3_2 kernel on 513 candidates, the first launch of --dots3's last
  # Hopper case; each of the 4 dots3_swa Hopper cases before it launches 125 times (2 checked, 3 warm-up,
  # 15 timed batches of 8: portable_check.cu, run_case).
  profile flashmla "sparse_mla_hopper" $((4 * 125)) 1 "$build/portable_check" --dots3
elif flashmla_ready; then
  flash_kernel=flash_fwd_splitkv_mla_fp8_sparse
  [ "${JSMLA_PROFILE_SHAPE:-h128}" = bf16 ] && flash_kernel=sparse_attn_fwd_kernel
  # shellcheck disable=SC2086  # $flash_heads is the head count, and "prefill" for the bf16 shape
  (cd /tmp && export PYTHONPATH="$flashmla_src" && profile flashmla $flash_kernel 2 1 \
     python3 "$repo/benchmarks/flashmla_anchor.py" 128 $flash_heads)
else
  echo "FlashMLA not built:"; tail -3 "$out/flashmla_build.log" 2>/dev/null
fi

python3 - "$out" <<'EOF'
import os, re, sys
out = sys.argv[1]
wanted = ["Duration", "Elapsed Cycles", "Compute (SM) Throughput", "Memory Throughput", "Executed Ipc Active",
          "Issue Slots Busy", "Warp Cycles Per Issued Instruction", "Executed Instructions", "Registers Per Thread",
          "Dynamic Shared Memory Per Block", "Threads", "DRAM Throughput", "L1/TEX Cache Throughput",
          "Achieved Occupancy", "Eligible Warps Per Scheduler", "No Eligible"]
def kernels(path):
    """[(kernel header, {metric: value})] from an ncu details page."""
    found, current = [], None
    for line in open(path, errors="replace"):
        if re.match(r"^\s{2}\S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line):
            current = (line.strip()[:70], {})
            found.append(current)
        elif current is not None:
            m = re.match(r"^\s{4}(\S.*?)\s{2,}(\S+)\s+([\d.,]+)\s*$", line)
            if m and m.group(1) in wanted and m.group(1) not in current[1]:
                current[1][m.group(1)] = f"{m.group(3)} {m.group(2)}"
            elif "Shared" in line and "Wavefronts" not in line and re.search(r"\d", line) and len(line) < 200:
                current[1].setdefault("shared rows", []).append(re.sub(r"\s+", " ", line.strip()))
    return found
for name in ("ours", "flashmla"):
    path = os.path.join(out, f"{name}_details.txt")
    if not os.path.exists(path):
        continue
    for header, metrics in kernels(path):
        print(f"== {name}: {header}")
        for key in wanted:
            if key in metrics:
                print(f"   {key:38s} {metrics[key]}")
        for row in metrics.get("shared rows", [])[:6]:
            print(f"   {row[:150]}")
EOF
for name in ours flashmla; do  # ncu's warp-state rules: the main stall reason of each kernel, in its words
  [ -f "$out/${name}_details.txt" ] && { echo "== $name stalls"; grep -A2 "cycles being stalled" "$out/${name}_details.txt" | head -9; }
done
# Everything in one archive beside the reports, so that every file comes back from a device call.
(cd "$out" && tar czf profile.tgz --remove-files ./*.txt ./*.csv ./*.log check 2>/dev/null)
