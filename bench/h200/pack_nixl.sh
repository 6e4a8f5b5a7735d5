#!/usr/bin/env bash
# Repacks the nixl + nixl-cu13 wheels (cp312, 59 MB zipped) as one xz tarball of their unpacked files (about 31 MB)
# in .carry-nixl/, so NIXL fits one device call next to .whl (8.6 MB) and .carry-mooncake (19.7 MB) under the
# 64 MiB that travels. bench/h200/multi_gpu.sh unpacks it into /tmp/site. Run once, on the CPU box, in the repo root:
#
#   bash bench/h200/pack_nixl.sh DIR_WITH_THE_TWO_WHEELS     # e.g. /work/wheels-nixl
set -euo pipefail
wheels=${1:?usage: pack_nixl.sh DIR_WITH_nixl-1.5.1-py3-none-any.whl_AND_nixl_cu13-1.5.1-cp312-*.whl}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.carry-nixl/' "$exclude" 2>/dev/null || echo /.carry-nixl/ >> "$exclude"
site=$(mktemp -d)
for w in "$wheels"/nixl-*.whl "$wheels"/nixl_cu13-*.whl; do python3 -m zipfile -e "$w" "$site"; done
mkdir -p .carry-nixl
tar -C "$site" -cf - . | xz -T2 -6 > .carry-nixl/nixl-site.tar.xz
rm -rf "$site"
ls -l .carry-nixl/nixl-site.tar.xz
