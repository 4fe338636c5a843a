#!/bin/sh
# `make images`: build fedcompress's CPU image (docker/Dockerfile) from a clean checkout, on a
# machine that may reach no image registry, only Debian's and PyPI's package indexes.
#
#   docker/build_images.sh            # or: make images
#   BASE_IMAGE=python:3.11-slim IMAGE_TAG=fedcompress:cpu docker/build_images.sh
#
# 1. The base image: BASE_IMAGE if given; else python:3.11-slim when it is present or can be
#    pulled; else a Debian bookworm base (Python 3.11) built here from Debian's packages
#    (debootstrap --variant=minbase, then docker import) as fedcompress-base:bookworm (root and
#    debootstrap needed; DEBIAN_MIRROR to choose the mirror).
# 2. What the build host adds (docker/build/, read by the Dockerfile's first stage only): the
#    CA bundle pip trusts here (PIP_CERT or pip's global.cert), and torch's CPU wheel when one
#    of pip's find-links folders holds it (then TORCH_INDEX is empty: torch is never taken from
#    PyPI, whose torch is the CUDA build); pip's index-url is passed on.
# 3. docker build; prints the time it took and the image's size.
set -eu
cd "$(dirname "$0")/.."
TAG=${IMAGE_TAG:-fedcompress:cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PYTHON:-python3}
started=$(date +%s)

base=${BASE_IMAGE:-}
if [ -z "$base" ]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1 \
            || timeout 90 docker pull -q python:3.11-slim >/dev/null 2>&1; then
        base=python:3.11-slim
    else
        base=fedcompress-base:bookworm
        if ! docker image inspect "$base" >/dev/null 2>&1; then
            echo "no image registry: building $base from Debian's packages ($MIRROR)"
            command -v debootstrap >/dev/null || {
                echo "debootstrap is missing: apt-get install debootstrap (or set BASE_IMAGE)" >&2
                exit 2; }
            root=$(mktemp -d /var/tmp/fedcompress-rootfs.XXXXXX)
            trap 'rm -rf "$root"' EXIT
            debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
                bookworm "$root" "$MIRROR" >/dev/null
            rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
            tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' \
                - "$base" >/dev/null
            rm -rf "$root"
            trap - EXIT
        fi
    fi
fi
echo "base image: $base"

# what the build host adds
find docker/build -mindepth 1 ! -name README.md -exec rm -rf {} +
pip_get() { "$PY" -m pip config get "$1" 2>/dev/null || true; }
cert=${PIP_CERT:-$(pip_get global.cert)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp "$cert" docker/build/ca-certificates.crt
    echo "pip's CA bundle: $cert"
fi
torch_index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
for dir in $(echo "${PIP_FIND_LINKS:-} $(pip_get global.find-links)" | tr ' ' '\n' | sort -u); do
    [ -d "$dir" ] || continue
    for wheel in "$dir"/torch-"$TORCH_VERSION"+cpu-*.whl; do
        [ -f "$wheel" ] || continue
        mkdir -p docker/build/wheels
        cp "$wheel" docker/build/wheels/
        torch_index=
        echo "torch from $wheel"
    done
done
index=${PIP_INDEX_URL:-$(pip_get global.index-url)}
index=${index:-https://pypi.org/simple}

docker build -f docker/Dockerfile -t "$TAG" \
    --build-arg BASE_IMAGE="$base" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg TORCH_INDEX="$torch_index" --build-arg PIP_INDEX_URL="$index" .
find docker/build -mindepth 1 ! -name README.md -exec rm -rf {} +
size=$(docker image inspect -f '{{.Size}}' "$TAG")
echo "built $TAG on $base in $(( $(date +%s) - started )) s; image size $(( size / 1000000 )) MB"
