#!/usr/bin/env bash
# Install what tools/minicluster.py (and the @pytest.mark.slurm tests) need on Debian
# bookworm: Slurm 22.05 (slurmctld, slurmd, clients), munge, iproute2 for network
# namespaces, util-linux for nsenter/unshare. Idempotent: installs only what is missing.
set -euo pipefail

if [ "${RLHPC_SKIP_SLURM:-0}" = "1" ] && [ "${CI:-}" != "true" ]; then
    echo "install_slurm: RLHPC_SKIP_SLURM=1: no minicluster, nothing to install"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

PACKAGES=(slurm-wlm munge iproute2 util-linux mount hostname libc-bin bubblewrap)  # bubblewrap: the sandbox (tests/integration/test_sandbox.py)
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

# The munge package creates the key in its postinst; make sure one exists anyway.
if ! $SUDO test -f /etc/munge/munge.key; then
    echo "install_slurm: creating /etc/munge/munge.key"
    $SUDO mungekey --create --keyfile=/etc/munge/munge.key
    $SUDO chown munge:munge /etc/munge/munge.key
    $SUDO chmod 0400 /etc/munge/munge.key
fi

# The minicluster starts its own munged/slurmctld/slurmd; no system service is needed.
for bin in slurmctld slurmd munged sinfo srun sbatch scontrol ip nsenter unshare; do
    command -v "$bin" >/dev/null || { echo "install_slurm: $bin still missing" >&2; exit 1; }
done
echo "install_slurm: ok ($(slurmctld -V))"
