#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fuzzes the advisers' command line (scripts/advise: bench_pattern_adviser --advise and
# bench_exchange_adviser --advise) with random and extreme flags: non-numbers, negatives, zero,
# huge values, 1e12, NaN, top_k above the experts, ranks that split no node, unknown flags, and
# valid ones. Every run must end within a few seconds with exit code 0 and a ranking on stdout, or
# exit code 2 and one line on stderr; never a signal, another exit code or a timeout. Prints the
# table of outcomes and returns non-zero when any run broke the rule.
#
#   advise_fuzz.sh BENCH_EXCHANGE_ADVISER BENCH_PATTERN_ADVISER [RUNS=200] [SEED=41]
set -uo pipefail
exchange=$1 pattern=$2 runs=${3:-200}
RANDOM=${4:-41}  # a fixed seed: the same runs every time
limit_s=5

values=(abc "" -100 -1 0 1 2 3 4 7 8 16 32 33 64 999 4096 65536 1e12 nan NaN inf -inf 1.5 0x10 2147483648
        99999999999999999999 " 8" 8x -0)
exchange_flags=(--ranks --tokens --experts --top_k --hidden --bytes --zipf --max_nodes)
pattern_flags=(--ranks --tokens --experts_per_rank --slots_per_rank --micro_batches --top_k --zipf --model_parallel --model)
platforms=(deepep-h800 fastermoe-v100-pcie finemoe-h100 hybridep-a800-16 flexmoe-a100 parm-2080ti-server no-such-platform "")
# The issue's cases and valid runs first, then random ones.
fixed=("x --ranks=abc" "x --tokens=-100" "x --ranks=1e12" "x --experts=0" "x --top_k=999 --experts=32" "x --top_k=33 --experts=32"
       "x --experts=7 --ranks=16" "x --zipf=nan" "x --hidden=inf" "x --max_nodes=9" "x --bogus=1" "x stray" "x --ranks" "x --help"
       "x" "x --ranks=16 --tokens=512" "x --platform=hybridep-a800-16 --ranks=8 --experts=64 --top_k=4 --tokens=256"
       "p --ranks=abc" "p --tokens=-100" "p --ranks=1e12" "p --experts_per_rank=0" "p --top_k=999" "p --top_k=33 --experts_per_rank=2"
       "p --ranks=12" "p --model_parallel=0" "p --model_parallel=3" "p --micro_batches=0" "p --zipf=nan" "p --tokens=100"
       "p --model=foo" "p --bogus" "p" "p --model_parallel=2 --tokens=1024" "p --platform=hybridep-a800-16 --tokens=1024")

declare -A count=()
failures=()
started=$SECONDS
for ((i = 0; i < runs; ++i)); do
  if ((i < ${#fixed[@]})); then
    read -r -a words <<<"${fixed[i]}"
    which=${words[0]}
    args=("${words[@]:1}")
  else
    which=$([[ $((RANDOM % 2)) == 0 ]] && echo x || echo p)
    args=()
    ((RANDOM % 4 == 0)) && args+=("--platform=${platforms[RANDOM % ${#platforms[@]}]}")
    if [[ $which == x ]]; then flags=("${exchange_flags[@]}"); else flags=("${pattern_flags[@]}"); fi
    for ((n = RANDOM % 4; n > 0; --n)); do
      flag=${flags[RANDOM % ${#flags[@]}]}
      case $((RANDOM % 8)) in
        0) args+=("$flag" "${values[RANDOM % ${#values[@]}]}") ;;  # --flag value
        1) args+=("--unknown_$RANDOM=1") ;;
        *) args+=("$flag=${values[RANDOM % ${#values[@]}]}") ;;
      esac
    done
    # Small valid tokens most of the time, so that the valid runs stay short.
    ((RANDOM % 3 == 0)) && args+=("--tokens=$([[ $which == x ]] && echo 128 || echo 1024)")
  fi
  binary=$([[ $which == x ]] && echo "$exchange" || echo "$pattern")
  out=$(mktemp) err=$(mktemp)
  timeout -s KILL "$limit_s" "$binary" --advise "${args[@]}" >"$out" 2>"$err"
  rc=$?
  case $rc in
    0) kind="exit 0"; grep -q -e "use: " -e "usage: " "$out" || kind="exit 0 without a ranking" ;;
    2) kind="exit 2"; [[ $(wc -l <"$err") == 1 ]] || kind="exit 2 without one line on stderr" ;;
    137) kind="timeout" ;;
    *) kind=$((rc > 128 ? 1 : 0)); [[ $kind == 1 ]] && kind="signal $((rc - 128))" || kind="exit $rc" ;;
  esac
  count[$kind]=$((${count[$kind]:-0} + 1))
  if [[ $kind != "exit 0" && $kind != "exit 2" ]]; then
    failures+=("$kind: $(basename "$binary") --advise ${args[*]@Q}: $(head -c 300 "$err" | tr '\n' ' ')")
  fi
  rm -f "$out" "$err"
done

signals=0 other=0
for kind in "${!count[@]}"; do
  case $kind in
    "exit 0" | "exit 2" | timeout) ;;
    signal*) signals=$((signals + count[$kind])) ;;
    *) other=$((other + count[$kind])) ;;
  esac
done
printf '\nadvise fuzz: seed %s, at most %d s a run, %d s in all\n' "${4:-41}" "$limit_s" $((SECONDS - started))
printf '  %6s %8s %8s %8s %9s %7s\n' runs "exit 0" "exit 2" signals timeouts other
printf '  %6d %8d %8d %8d %9d %7d\n' "$runs" "${count["exit 0"]:-0}" "${count["exit 2"]:-0}" "$signals" "${count[timeout]:-0}" "$other"
if ((${#failures[@]} > 0)); then
  printf '\n%d runs broke the rule (exit 0 with a ranking, or exit 2 with one line):\n' "${#failures[@]}"
  printf '  %s\n' "${failures[@]}"
  exit 1
fi
