#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The resource check of the data-movement kernels (tests/cuda/kernels_ptx.cu), for every
# architecture given: ptxas must report no spills for any moecomm kernel, and the wide paths of the
# row kernels must copy with 16-byte vector loads and stores (ld.global[.nc].v4 / st.global[.wb].v4).
# Spills listed in known_spills.txt beside this script (architecture, kernel, at most so many bytes
# of spill stores) are reported but pass; any other spill, or a larger one, fails.
# Usage: check_kernels.sh <nvcc> <include dir> <kernels_ptx.cu> <work dir> <arch>...
set -euo pipefail
nvcc=$1 include=$2 source=$3 work=$4
known="$(dirname "${BASH_SOURCE[0]}")/known_spills.txt"
shift 4
mkdir -p "$work"
ptxas="$(dirname "$nvcc")/ptxas"
status=0
for arch in "$@"; do
  ptx="$work/kernels_$arch.ptx"
  "$nvcc" -std=c++17 -ptx -arch="compute_$arch" -I"$include" -DMOECOMM_ENABLE_CUDA=1 "$source" -o "$ptx"
  report=$("$ptxas" -v -arch="sm_$arch" "$ptx" -o /dev/null 2>&1)
  checked=$(awk '/Function properties for .*moecomm/{n++} END{print n+0}' <<<"$report")
  spills=$(awk -v arch="$arch" -v known="$known" '
    BEGIN { while ((getline line < known) > 0) if (line !~ /^#/ && split(line, f, " ") == 3) allowed[f[1] " " f[2]] = f[3] }
    /Function properties for/ { name = $NF }
    /spill stores/ {
      if (name !~ /moecomm/ || $0 ~ / 0 bytes spill stores, 0 bytes spill loads/) next
      stores = $0; sub(/ bytes spill stores.*/, "", stores); sub(/.*, /, "", stores)
      for (k in allowed) { split(k, a, " "); if (a[1] == "sm_" arch && index(name, a[2]) && stores + 0 <= allowed[k] + 0) { print "  known: " name ": " $0 > "/dev/stderr"; next } }
      print "  " name ": " $0
    }' <<<"$report")
  if [ "$checked" -lt 24 ]; then
    echo "sm_$arch: expected at least 24 moecomm kernels in the ptxas report, found $checked"; status=1
  elif [ -n "$spills" ]; then
    echo "sm_$arch: spills in $checked moecomm kernels:"; echo "$spills" | c++filt; status=1
  else
    echo "sm_$arch: $checked moecomm kernels, no spills beyond known_spills.txt"
  fi
  # Wide paths: float with 4 lanes, half/bf16 with 8, of gather and combine.
  not_vector=$(awk '
    /^\.visible \.entry/ { name = $3; wide = (name ~ /(gather|combine|scatter)_rows_kernelI(f|6__half|13__nv_bfloat16)Li(4|8)E/); ld = 0; st = 0 }
    wide && /ld\.global(\.nc)?\.v4\./ { ld = 1 }
    wide && /st\.global(\.wb)?\.v4\./ { st = 1 }
    wide && /^}/ { n++; if (!ld || !st) print name; wide = 0 }
    END { if (n == 0) print "no wide row kernels found" }' "$ptx")
  if [ -n "$not_vector" ]; then
    echo "sm_$arch: wide row kernels without 16-byte vector loads and stores:"; echo "$not_vector" | c++filt; status=1
  else
    echo "sm_$arch: every wide row kernel uses ld.global.v4 and st.global.v4"
  fi
done
exit $status
