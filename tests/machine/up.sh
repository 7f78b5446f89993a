#!/usr/bin/env bash
# What the system tests need from the machine, brought up idempotently (the README's command 2
# runs this; so does CI, by running that command):
#
#   Debian's Chromium   the real-browser tests (tests/tour/test_browser.py; Playwright drives it)
#   Slurm and munge     a single-node Slurm on loopback (slurm-up.sh)
#   test hosts          node1, node2 in network namespaces, with sshd, Open MPI and a slurmd
#                       each, in Slurm partition `hosts` (hosts-up.sh)
#
#   tests/machine/up.sh          # bring them up (as root; through sudo when there is one)
#   tests/machine/up.sh --down   # stop the daemons and remove the hosts (Chromium stays)
#
# Without root or sudo it changes nothing and says so: the tests that need these skip, and the
# test run's last line names them and this command.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo -E "$0" "$@"
  fi
  echo "machine-up: not root and no sudo: Chromium, Slurm and the test hosts stay as they are;" \
    "the tests that need them will skip. As root: tests/machine/up.sh" >&2
  exit 0
fi

if [ "${1:-}" = "--down" ]; then
  "$here/hosts-up.sh" --down
  "$here/slurm-up.sh" --down
  exit 0
fi

if ! command -v chromium >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
fi
echo "chromium: $(chromium --version 2>/dev/null | head -n1)"
"$here/slurm-up.sh"  # the single-node cluster first: hosts-up.sh adds its nodes to it
"$here/hosts-up.sh"
