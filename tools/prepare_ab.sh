#!/bin/bash
# Prepare a device call that measures the working tree against an earlier revision in one run
# (tools/device_check.sh ab): REV's tree as .device/old.tar.gz, its kernels and the working
# tree's built into build/cubins (nvcc here, no GPU needed; file names carry a digest of each
# module's source, so both trees find theirs in one folder) and packed as .device/cubins.tar.xz
# (~3 MB where the folder is ~33: the carry stays under the device tool's 64 MiB).
# Usage, from the repository root with the dev venv active: tools/prepare_ab.sh REV [ARCH]
set -euo pipefail
rev=${1:?usage: tools/prepare_ab.sh REV [sm_90]}
arch=${2:-sm_90}
git rev-parse --verify --quiet "$rev^{commit}" > /dev/null || { echo "no commit $rev" >&2; exit 2; }
mkdir -p .device
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive --format=tar.gz -o .device/old.tar.gz "$rev"
git archive "$rev" src/strata/backends/cuda | tar -x -C "$tmp"
python tools/precompile_cubins.py --out build/cubins --arch "$arch"
python tools/precompile_cubins.py --out build/cubins --arch "$arch" --keep \
    --kernel-dir "$tmp/src/strata/backends/cuda" --pack .device/cubins.tar.xz
rm -rf .device/cubins .device/cubins_old  # unpacked on the device from the tarball
git rev-parse --short "$rev" > .device/old.rev
echo "ready: working tree against $(cat .device/old.rev); carry .device, run tools/device_check.sh ab"
