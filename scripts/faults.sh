#!/usr/bin/env bash
# nrtxn's fault campaign (issue 14): on the embedded default, SIGKILL and SIGTERM cycles
# under mixed load, corruption of each file of a data dir, a full disk (a small tmpfs,
# as root), an overload and each memory bound; with two nodes on Kafka and MongoDB (test
# servers of its own, installed by scripts/services.sh), the broker, the database and a
# node killed and a node stalled. Each case reconciled (scripts/faults.py says how).
# Everything listens on 127.0.0.1 and is stopped at the end.
#
#   scripts/faults.sh [--quick]
#
# Full: every case at its full size on the release build, and docs/reliability.md's
# campaign section rewritten with the figures. --quick (run by scripts/test.sh, so in
# CI): every case but the overload, smaller, on the debug build the tests use, nothing
# written; it fails on any loss.
# NRTXN_BIN picks the binary; NRTXN_FAULTS_SEED fixes the random choices.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: scripts/faults.sh [--quick]" >&2; exit 2 ;;
esac
target_dir=${CARGO_TARGET_DIR:-target}
if [ -n "${NRTXN_BIN:-}" ]; then
  bin=$NRTXN_BIN
elif [ $quick = 1 ]; then
  cargo build --quiet -p nrtxn
  bin=$target_dir/debug/nrtxn
else
  # nrtxn-bench drives the overload case.
  cargo build --release --quiet -p nrtxn -p nrtxn-bench
  bin=$target_dir/release/nrtxn
fi
if [ $quick = 1 ]; then
  exec python3 scripts/faults.py --bin "$bin" --quick
fi
exec python3 scripts/faults.py --bin "$bin" --markdown docs/reliability.md --command "scripts/faults.sh"
