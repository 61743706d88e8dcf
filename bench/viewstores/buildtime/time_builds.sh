#!/bin/bash
# clean offline release build of one-crate projects; prints wall seconds
cd "$(dirname "$0")"
for c in rusqlite fjall redb; do
  ( cd $c && cp ../../Cargo.lock .  && rm -rf target && s=$(date +%s.%N) && CARGO_TARGET_DIR=target cargo build --release --offline -q 2>&1 | tail -3; e=$(date +%s.%N); echo "$c clean_release_build_s=$(echo "$e - $s" | bc) crates=$(grep -c "^name" Cargo.lock) ok=$(ls target/release/bt-$c >/dev/null && echo yes)" )
done
