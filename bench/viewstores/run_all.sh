#!/bin/bash
# Runs every candidate x mix 3 times, alternating candidate order per round; one process at a time.
set -e
cd "$(dirname "$0")"
N=${N:-2000000}
OUT=${OUT:-results/raw.txt}
cands=(sqlite fjall redb)
for round in 1 2 3; do
  for mix in hot spread soldout; do
    for k in 0 1 2; do
      c=${cands[$(( (k + round - 1) % 3 ))]}
      line=$( { /usr/bin/time -f "proc_elapsed_s=%e maxrss_kb=%M" ./target/release/viewbench $c $mix $N stores/$c 42 ; } 2>&1 | tr '\n' ' ')
      echo "round=$round $line" >> "$OUT"
      rm -rf stores/$c
    done
  done
done
