#!/bin/bash
# 10 M entries, spread, one run each: segidx (then its start, and a start with every index
# deleted), sqlite-sorted and fjall-ingest. Appends to results/raw-2026-11-26-10m.txt.
set -e
cd "$(dirname "$0")"
OUT=results/raw-2026-11-26-10m.txt
T='proc_elapsed_s=%e maxrss_kb=%M'
run() { { /usr/bin/time -f "$T" "$@" ; } 2>&1 | grep -v "^rebuilding index" | tr '\n' ' '; echo; }
echo "# segidx spread 10M" >> $OUT
run ./target/release/viewbench segidx spread 10000000 stores/segidx10m 42 >> $OUT
echo "# start at 10M (sealed indexes mapped, active segment read back)" >> $OUT
run ./target/release/viewbench reopen segidx stores/segidx10m >> $OUT
echo "# every .idx deleted (a restore without indexes): all rebuilt from the log" >> $OUT
ls stores/segidx10m/*.log | wc -l | sed 's/^/segments=/' >> $OUT
rm -f stores/segidx10m/*.idx stores/segidx10m/*.owed
run ./target/release/viewbench reopen segidx stores/segidx10m >> $OUT
echo "# start again after the rebuild" >> $OUT
run ./target/release/viewbench reopen segidx stores/segidx10m >> $OUT
du -sb stores/segidx10m | sed 's/^/du_total_bytes=/' >> $OUT
rm -rf stores/segidx10m
for c in sqlite-sorted fjall-ingest; do
  echo "# $c spread 10M" >> $OUT
  run ./target/release/viewbench $c spread 10000000 stores/${c}10m 42 >> $OUT
  rm -rf stores/${c}10m
done
echo done >> $OUT
