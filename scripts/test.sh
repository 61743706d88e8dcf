#!/usr/bin/env bash
# The whole test suite: starts the test servers (scripts/services.sh), installs the
# browser of the dashboard's test (scripts/browser.sh), runs every test
# with them, then the fault campaign's quick version, and stops the servers whatever the
# outcome. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Chromium and ChromeDriver for the dashboard's browser test.
scripts/browser.sh install
scripts/services.sh start
trap 'scripts/services.sh stop' EXIT
export NRTXN_TEST_MONGO_URI="mongodb://127.0.0.1:${NRTXN_MONGO_PORT:-27018}/?directConnection=true"
export NRTXN_TEST_KAFKA_BROKERS="127.0.0.1:${NRTXN_KAFKA_PORT:-19092}"
export NRTXN_TEST_PYTHON="$PWD/.services/venv/bin/python"
export NRTXN_REQUIRE_SERVICES=1
cargo test --workspace "$@"
# The fault campaign's quick version (SIGKILL and SIGTERM cycles, corruption of each
# file), on the debug build the tests just made; it fails on any loss. Skipped when a
# test filter was given.
if [ $# -eq 0 ]; then
  scripts/faults.sh --quick
fi
