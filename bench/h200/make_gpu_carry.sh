#!/usr/bin/env bash
# Rebuilds .carry-gpu (git-ignored) for bench/h200/serve_smoke.sh: a trimmed, stripped Ray 2.60.0 (cp312)
# as a tar.xz that unpacks into a site dir, the cp312 wheels `tandem serve` needs beyond the GPU image, and a
# redis-server (Debian 12's, with the shared libraries it links besides glibc/libstdc++/libgcc_s).
# Inputs: RAY_WHL (the 79 MB manylinux wheel), $REPO/.whl/*.whl, network to PyPI and Debian for the rest.
set -eu
RAY_WHL=${RAY_WHL:-/tmp/raywhl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-$REPO/.carry-gpu}
WORK=$(mktemp -d)
PY=$REPO/.venv/bin/python
mkdir -p "$DEST/wheels"

# --- Ray: unzip, drop what a local `ray.init` / actors / placement groups never load, strip the ELF files ---
mkdir "$WORK/ray" && (cd "$WORK/ray" && unzip -q "$RAY_WHL")
R="$WORK/ray/ray"
rm -rf "$R/jars" \
       "$R/dashboard/client" \
       "$R/rllib" "$R/tune" "$R/train" "$R/serve" "$R/data" "$R/air" "$R/llm"
find "$WORK/ray" -name __pycache__ -prune -exec rm -rf {} +
find "$WORK/ray" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -print0 \
  | while IFS= read -r -d '' f; do
      if file -b "$f" | grep -q '^ELF'; then strip --strip-unneeded "$f"; fi
    done
(cd "$WORK/ray" && tar -cf - ray ray-2.60.0.dist-info) | xz -T0 -9e > "$DEST/ray-2.60.0-cp312-trim.tar.xz"

# --- wheels: the ones already fetched, and what the GPU image lacks besides (cp312, manylinux x86_64) ---
cp $REPO/.whl/grpcio-1.85.3-*.whl $REPO/.whl/protobuf-7.36.2-*.whl $REPO/.whl/redis-8.1.0-*.whl \
   $REPO/.whl/starlette-1.10.0-*.whl $REPO/.whl/uvicorn-0.55.0-*.whl "$DEST/wheels/"
DL="$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $DEST/wheels"
$DL grpcio-health-checking==1.85.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1

# --- redis-server: Debian 12's binary (redis-server is redis-check-rdb under another name: keep that name) ---
mkdir "$WORK/deb" "$WORK/redis" "$WORK/redis/lib"
(cd "$WORK/deb" && apt-get download -q redis-server redis-tools >/dev/null 2>&1 && for d in *.deb; do dpkg -x "$d" x; done)
cp "$WORK/deb/x/usr/bin/redis-check-rdb" "$WORK/redis/lib/redis-server"
cp "$WORK/deb/x/usr/bin/redis-cli" "$WORK/redis/lib/redis-cli"
for lib in $(ldd "$WORK/redis/lib/redis-server" | awk '$3 ~ /^\// {print $3}'); do
  case "$(basename "$lib")" in libc.so.*|libm.so.*|ld-linux*|libstdc++.so.*|libgcc_s.so.*) ;; *) cp -L "$lib" "$WORK/redis/lib/";; esac
done
(cd "$WORK/redis" && tar -cf - lib) | xz -T0 -9e > "$DEST/redis-7.0.15-deb12.tar.xz"  # unpacks as lib/
rm -rf "$WORK"
du -sh "$DEST"; ls -la "$DEST" "$DEST/wheels"
