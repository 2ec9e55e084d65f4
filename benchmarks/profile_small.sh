#!/usr/bin/env bash
# Where a small-batch decode step's time goes, on a GPU machine: per-kernel device times (ncu) of one
# jitted step for each T:H of $JSMLA_PROFILE_SHAPES (default T = 1 at H = 128 and 16, T = 16 and 32 at
# H = 128), warp-stall sampling of the Hopper split kernels at T = 1 H = 128 (the 64-head tile, and the
# planner's pick: the 16-head tile), the standalone headline timings (split merge launched as a
# programmatic dependent or not) and, when FlashMLA's sources are in $JSMLA_FLASHMLA_SRC (default
# .anchors/flashmla), its kernels for the same shapes. Output: $OUT (default /tmp/jsmla_profile): the
# printed summary (also in summary.md) and the logs, reports and CSVs in logs.tgz (a device call returns
# few files).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/jsmla_profile}
mkdir -p "$out"
exec > >(tee "$out/summary.md") 2>&1  # the printed summary, also kept as a file
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
source "$repo/benchmarks/flashmla_build.sh"
start_flashmla_build
JSMLA_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps "$repo" \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
(cd "$repo" && BUILD=/tmp/jsmla_profile_build SKIP_SANITIZE=1 OUT="$out/check" \
   bash kernels/cuda/tests/build_and_check.sh --headline > "$out/headline.log" 2>&1)
grep -E "us .*TFLOP" "$out/headline.log"
kernel_times() {  # ncu per-kernel device times of a command's last jitted call (caches kept warm)
  ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv "$@" 2>/dev/null
}
cd /tmp
shapes=${JSMLA_PROFILE_SHAPES:-1:128 1:16 16:128 32:128}  # T:H of the step profiles
for shape in $shapes; do
  tokens=${shape%:*} heads=${shape#*:}
  kernel_times python3 "$repo/benchmarks/step_profile.py" --tokens $tokens --heads $heads --steps 4 --once \
    > "$out/step_t${tokens}_h$heads.csv"
  echo "== jitted step, T=$tokens H=$heads"
  python3 "$repo/benchmarks/step_profile.py" --summarize "$out/step_t${tokens}_h$heads.csv" --steps 4 | tail -8
done
# Stall sampling of the split kernel at T = 1 H = 128: the 64-head tile (32 splits), then the planner's
# pick (16 splits of the 16-head tile).
for tile in h64 h16; do
  name=small; [ $tile = h16 ] && name=small_h16
  echo "== split kernel, T=1 H=128, $tile tile (ncu, standalone)"
  ncu --clock-control none --cache-control none -k regex:sparse_mla_hopper --launch-skip 1 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight -o "$out/$name" -f \
    /tmp/jsmla_profile_build/portable_check --profile-small $([ $tile = h16 ] && echo h16) > "$out/ncu_$name.log" 2>&1
  ncu -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt" 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Issued Warp|Memory Throughput|Compute \(SM\)" "$out/${name}_details.txt" | head -8
  ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_src.csv" 2>/dev/null
  python3 "$repo/kernels/cuda/tests/top_stalls.py" "$out/${name}_src.csv" 25
done
if flashmla_ready; then
  for shape in $shapes; do
    tokens=${shape%:*} heads=${shape#*:}
    PYTHONPATH="$flashmla_src" kernel_times python3 "$repo/benchmarks/flashmla_anchor.py" $tokens $heads \
      > "$out/flashmla_t${tokens}_h$heads.csv"
    echo "== FlashMLA decode, T=$tokens H=$heads (last call's kernels, µs)"
    python3 - "$out/flashmla_t${tokens}_h$heads.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
        if r.get("Metric Name") == "gpu__time_duration.sum"]
for r in rows[-3:]:
    scale = 1e-3 if r["Metric Unit"].startswith("n") else 1.0
    print(f'{float(r["Metric Value"].replace(",", "")) * scale:8.2f}  {r["Kernel Name"][:90]}')
PY
  done
else
  echo "FlashMLA not built:"; tail -3 "$out/flashmla_build.log"
fi
# Logs in one archive; the summary stays beside it.
(cd "$out" && find . -type f ! -name summary.md ! -name '*.tgz' -print0 \
   | tar czf logs.tgz --null -T - --remove-files 2>/dev/null)
