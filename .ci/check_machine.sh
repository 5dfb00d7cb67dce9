#!/usr/bin/env bash
# What `make install` / `make test` assume of the machine, each checked with one message that
# names the fix. `check_machine.sh install`: Python >= 3.11 with venv (Debian: python3-venv).
# `check_machine.sh test`: procps (ps, pgrep: the tests read processes), root (the Slurm
# minicluster's network namespaces and daemons, the second user of the security tests) and a
# Debian release whose slurm-wlm .ci/install_slurm.sh installs (bookworm: Slurm 22.05).
set -uo pipefail

fail() { echo "check_machine: $1" >&2; echo "  fix: $2" >&2; exit 1; }

check_install() {
    command -v python3 >/dev/null || fail "no python3 on PATH" "install Python >= 3.11 (Debian: apt-get install python3 python3-venv)"
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || fail "python3 is $(python3 -V 2>&1), rlhpc needs >= 3.11" "install Python 3.11 or newer and put it first on PATH"
    python3 -c 'import ensurepip, venv' 2>/dev/null \
        || fail "python3 cannot create a virtual environment (no ensurepip/venv)" "apt-get install python3-venv (Debian, Ubuntu)"
}

check_test() {
    for tool in ps pgrep; do
        command -v "$tool" >/dev/null || fail "no $tool: the tests read the machine's processes with it" "apt-get install procps"
    done
    if [ "${RLHPC_SKIP_SLURM:-0}" = "1" ] && [ "${CI:-}" != "true" ]; then
        return  # no minicluster wanted here (CI refuses the skip: tests/support/ci_skips.py)
    fi
    [ "$(id -u)" -eq 0 ] || fail "make test runs a Slurm cluster in network namespaces and a second user: it needs root" \
        "run it as root (a container or VM is fine), or outside CI set RLHPC_SKIP_SLURM=1 to leave the Slurm tests out"
    if ! command -v slurmctld >/dev/null; then
        . /etc/os-release 2>/dev/null || true
        [ "${ID:-}" = "debian" ] && [ "${VERSION_CODENAME:-}" = "bookworm" ] || fail \
            "the minicluster is set up from Debian bookworm's slurm-wlm (Slurm 22.05); this machine is ${PRETTY_NAME:-of unknown release}" \
            "run the tests on Debian 12 (bookworm), e.g. in a debian:bookworm container, or install Slurm 22.05 and munge yourself"
    fi
}

case "${1:-}" in
    install) check_install ;;
    test) check_install; check_test ;;
    *) echo "usage: $0 install|test" >&2; exit 2 ;;
esac
