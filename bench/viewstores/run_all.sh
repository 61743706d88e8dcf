#!/bin/bash
# Runs every candidate x mix $ROUNDS times (default 3), rotating the candidates' order each
# round; one benchmark process at a time. CANDS picks the candidates (default: the first
# study's three), OUT the raw results file.
set -e
cd "$(dirname "$0")"
N=${N:-2000000}
OUT=${OUT:-results/raw.txt}
ROUNDS=${ROUNDS:-3}
read -r -a cands <<< "${CANDS:-sqlite fjall redb}"
nc=${#cands[@]}
for round in $(seq 1 "$ROUNDS"); do
  for mix in hot spread soldout; do
    for k in $(seq 0 $((nc - 1))); do
      c=${cands[$(( (k + round - 1) % nc ))]}
      line=$( { /usr/bin/time -f "proc_elapsed_s=%e maxrss_kb=%M" ./target/release/viewbench "$c" $mix "$N" "stores/$c" 42 ; } 2>&1 | tr '\n' ' ')
      echo "round=$round $line" >> "$OUT"
      rm -rf "stores/$c"
    done
  done
done
