#!/usr/bin/env bash
# Edge0's quantized matmul in this tree against the same kernel at another commit, in one
# process (tools/qmm_vs.cpp): each shape's calls alternate between the two builds.
#
#   tools/qmm_vs.sh REV [N K THREADS]...
#   tools/qmm_vs.sh HEAD~1 512 2048 1 512 2048 2 2048 512 1 2048 512 2
#
# Without shapes: the gate / up projection (512 x 2048) and the down projection (2048 x 512)
# of the bench's 35B-shaped experts on 1 and 2 threads.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rev="${1:?usage: tools/qmm_vs.sh REV [N K THREADS]...}"
shift
csrc="src/edge0/backend/mlx/kernels/csrc"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# the other commit's kernel, its namespace renamed so both link into one program
git -C "$root" show "$rev:$csrc/qmm.h" | sed 's/\bnamespace edge0\b/namespace edge0_other/' > "$work/qmm_other.h"
git -C "$root" show "$rev:$csrc/qmm.cpp" |
  sed 's/\bnamespace edge0\b/namespace edge0_other/; s/\bedge0::/edge0_other::/g; s/"qmm.h"/"qmm_other.h"/' > "$work/qmm_other.cpp"
g++ -O2 -std=c++17 -iquote "$root/$csrc" -iquote "$work" "$root/tools/qmm_vs.cpp" "$root/$csrc/qmm.cpp" \
  "$work/qmm_other.cpp" -o "$work/qmm_vs" -lpthread
[ $# -gt 0 ] || set -- 512 2048 1 512 2048 2 2048 512 1 2048 512 2
while [ $# -ge 3 ]; do
  "$work/qmm_vs" "$1" "$2" "$3"
  shift 3
done
