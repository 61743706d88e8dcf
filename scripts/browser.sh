#!/usr/bin/env bash
# Debian's Chromium and ChromeDriver, for the dashboard's browser test (tests/dashboard.rs),
# installed from Debian's packages when missing (no browser download at build or run time).
#
#   scripts/browser.sh install   install chromium and chromium-driver if either is missing
#   scripts/browser.sh status    say what is installed (exit 0 even if nothing)
set -euo pipefail

have() { [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; }

case "${1:-install}" in
  install)
    if have; then
      exit 0
    fi
    echo "browser: installing chromium and chromium-driver from Debian's packages"
    if [ "$(id -u)" -eq 0 ]; then sudo=; else sudo=sudo; fi
    t0=$SECONDS
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver >/dev/null
    have || { echo "browser: chromium or chromedriver still missing" >&2; exit 1; }
    echo "browser: installed in $((SECONDS - t0)) s: $(/usr/bin/chromium --version)"
    ;;
  status)
    if have; then /usr/bin/chromium --version; /usr/bin/chromedriver --version; else echo "browser: not installed"; fi
    ;;
  *)
    echo "usage: scripts/browser.sh install|status" >&2
    exit 2
    ;;
esac
