#!/usr/bin/env bash
# Makes an A/B tree for benchmarks/ab_kernels.sh: the files of a git revision under .ab/<name> (a folder
# the checkout ignores), with the defaults of compile-time knobs (`#define NAME value` lines of the CUDA
# sources) replaced, so that one branch yields several variants.
#
#   bash benchmarks/ab_tree.sh base main
#   bash benchmarks/ab_tree.sh s192 uneven-consumers JSMLA_HOPPER_SCORER_COLUMNS=192
#   bash benchmarks/ab_kernels.sh .ab/base .ab/s192          # then carry .ab to the GPU
#   AB_CHECK_FROM=main bash benchmarks/ab_tree.sh pre e050020
#       # an older revision's kernels with main's standalone check (kernels/cuda/tests/portable_check.cu),
#       # so that every tree of a comparison takes the same modes and flags
#
# Every NAME must be defined exactly once under kernels/ in that revision (else it stops).
set -euo pipefail
name=${1:?usage: ab_tree.sh <name> <revision> [NAME=value ...]}
revision=${2:?usage: ab_tree.sh <name> <revision> [NAME=value ...]}
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
tree="$repo/.ab/$name"
rm -rf "$tree"
mkdir -p "$tree"
git -C "$repo" archive "$revision" | tar x -C "$tree"
if [ -n "${AB_CHECK_FROM:-}" ]; then
  check=kernels/cuda/tests/portable_check.cu
  git -C "$repo" show "$AB_CHECK_FROM:$check" > "$tree/$check"
  echo "$name: $check from $AB_CHECK_FROM ($(git -C "$repo" rev-parse --short "$AB_CHECK_FROM"))"
fi
for setting in "$@"; do
  knob=${setting%%=*}
  value=${setting#*=}
  mapfile -t files < <(grep -rlE "^#define $knob " "$tree/kernels" || true)
  if [ "${#files[@]}" -ne 1 ] || [ "$(grep -cE "^#define $knob " "${files[0]}")" -ne 1 ]; then
    echo "ab_tree.sh: $knob is not defined exactly once under kernels/ in $revision" >&2
    exit 1
  fi
  sed -i -E "s|^#define $knob .*|#define $knob $value|" "${files[0]}"
  echo "$name: $knob = $value (${files[0]#"$tree"/})"
done
echo "$name: $revision ($(git -C "$repo" rev-parse --short "$revision")) in .ab/$name"
