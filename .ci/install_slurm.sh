#!/usr/bin/env bash
# Every Debian package the tests need, in one place (Debian bookworm): for tools/minicluster.py
# (and the @pytest.mark.slurm tests) Slurm 22.05 (slurmctld, slurmd, clients), munge, iproute2
# for network namespaces, util-linux for nsenter/unshare; for the sandbox that runs model-written
# code (tests/integration/test_sandbox.py) bubblewrap. Idempotent: installs only what is missing.
# RLHPC_SKIP_SLURM=1 (outside CI) leaves out the Slurm set only: the sandbox tests still run.
set -euo pipefail

PACKAGES=(bubblewrap)
BINARIES=(bwrap)
if [ "${RLHPC_SKIP_SLURM:-0}" = "1" ] && [ "${CI:-}" != "true" ]; then
    echo "install_slurm: RLHPC_SKIP_SLURM=1: no minicluster, its packages left out"
else
    PACKAGES+=(slurm-wlm munge iproute2 util-linux mount hostname libc-bin)
    BINARIES+=(slurmctld slurmd munged sinfo srun sbatch scontrol ip nsenter unshare)
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -gt 0 ]; then
    echo "install_slurm: installing ${missing[*]}"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "install_slurm: ${PACKAGES[*]} already installed"
fi

if [[ " ${PACKAGES[*]} " == *" munge "* ]] && ! $SUDO test -f /etc/munge/munge.key; then
    # The munge package creates the key in its postinst; make sure one exists anyway.
    echo "install_slurm: creating /etc/munge/munge.key"
    $SUDO mungekey --create --keyfile=/etc/munge/munge.key
    $SUDO chown munge:munge /etc/munge/munge.key
    $SUDO chmod 0400 /etc/munge/munge.key
fi

# The minicluster starts its own munged/slurmctld/slurmd; no system service is needed.
for bin in "${BINARIES[@]}"; do
    command -v "$bin" >/dev/null || { echo "install_slurm: $bin still missing" >&2; exit 1; }
done
if command -v slurmctld >/dev/null; then echo "install_slurm: ok ($(slurmctld -V))"; else echo "install_slurm: ok"; fi
