#!/usr/bin/env bash
# Builds the images of compose/docker-compose.yml without pulling from any container registry:
#   tandem-base:bookworm  Debian bookworm minbase + python3 (3.11), python3-venv, ca-certificates,
#                         made with debootstrap from the host's Debian mirror and `docker import`ed;
#                         built once (skipped while the image exists; --rebuild-base forces it).
#   tandem:latest         compose/Dockerfile on top of it: a build stage installs the project into a
#                         venv (CPU torch from the wheel staged here, the rest from PyPI) and fetches
#                         the default model; the final stage holds the venv and the model, no compiler.
# Needs a running Docker daemon and, for the base image, debootstrap (root). Usage:
#   compose/build.sh [--rebuild-base] [--no-cache]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

BASE=tandem-base:bookworm
IMAGE=${TANDEM_IMAGE:-tandem:latest}
TORCH=${TANDEM_TORCH:-torch==2.13.0+cpu}
REBUILD_BASE=0
BUILD_ARGS=()
for arg in "$@"; do
  case "$arg" in
    --rebuild-base) REBUILD_BASE=1 ;;
    --no-cache) BUILD_ARGS+=(--no-cache) ;;
    *) echo "usage: $0 [--rebuild-base] [--no-cache]" >&2; exit 2 ;;
  esac
done

log() { echo "build.sh: $*" >&2; }

# The first Debian mirror of the host's apt sources (deb822 or one-line format).
debian_mirror() {
  local m
  m=$(grep -hs -E '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
      | grep -o -E 'https?://[^ ]*/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ')
  echo "${m:-http://deb.debian.org/debian}"
}

build_base() {
  command -v debootstrap >/dev/null || { log "debootstrap is missing (apt-get install debootstrap)"; exit 1; }
  local dir mirror
  dir=$(mktemp -d /var/tmp/tandem-base.XXXXXX)
  trap 'rm -rf "$dir"' RETURN
  mirror=$(debian_mirror)
  log "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$dir/rootfs" "$mirror" >"$dir/debootstrap.log" 2>&1 \
    || { tail -n 20 "$dir/debootstrap.log" >&2; exit 1; }
  # what an image does not need: apt's package lists and caches, docs, man pages
  rm -rf "$dir"/rootfs/var/lib/apt/lists/* "$dir"/rootfs/var/cache/apt/*.bin "$dir"/rootfs/var/cache/apt/archives/*.deb \
         "$dir"/rootfs/usr/share/doc/* "$dir"/rootfs/usr/share/man/* "$dir"/rootfs/usr/share/info/*
  tar -C "$dir/rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  log "imported $BASE ($(docker image inspect -f '{{.Size}}' "$BASE" | numfmt --to=iec))"
}

export DOCKER_BUILDKIT=0   # the classic builder: no buildx needed, and RUN may use --network host
start=$(date +%s)
if [ "$REBUILD_BASE" = 1 ] || ! docker image inspect "$BASE" >/dev/null 2>&1; then
  build_base
else
  log "$BASE exists (--rebuild-base to make it again)"
fi

# What the Dockerfile takes from the host, staged in .docker-build/ (gitignored):
#   ca-certificates.crt  the CA bundle pip trusts here (pip config `cert`), so pip in the build
#                        reaches the package index the way the host does
#   wheels/              the CPU torch wheel (PyPI's Linux torch is the CUDA build: several GB)
#   constraints.txt      the versions of the project's dependencies installed in ./.venv, where there is
#                        one, so the image runs what the tests here ran against
STAGE=$ROOT/.docker-build
mkdir -p "$STAGE/wheels"
CERT=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
CERT=${CERT:-/etc/ssl/certs/ca-certificates.crt}
cp "$CERT" "$STAGE/ca-certificates.crt"
if ! ls "$STAGE"/wheels/torch-*.whl >/dev/null 2>&1; then
  # the CPU build carries a +cpu local version; PyPI has only the CUDA build of that release, so
  # pip finds it where the host keeps wheels (pip config find-links) or fails here
  log "pip download $TORCH into $STAGE/wheels"
  PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 "$TORCH" -d "$STAGE/wheels" \
    || { log "no $TORCH wheel for Python 3.11 found (set TANDEM_TORCH to another CPU build)"; exit 1; }
fi
if [ -x .venv/bin/python ] && .venv/bin/python -c "import importlib.metadata as m; m.distribution('tandem-serve')" 2>/dev/null; then
  # only the project's own dependency closure (not the test tools), so that installing something
  # else into .venv does not invalidate the image's dependency layer
  .venv/bin/python - >"$STAGE/constraints.txt.new" <<'PY'
import importlib.metadata as md
import re

from packaging.requirements import Requirement

pins, todo = {}, ["tandem-serve"]
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in pins:
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    pins[name] = dist.version
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
for name, version in sorted(pins.items()):
    if name not in ("tandem-serve", "torch", "triton"):  # torch: the staged wheel; triton: removed
        print(f"{name}=={version}")
PY
else
  : >"$STAGE/constraints.txt.new"
fi
# rewritten only when it changes: docker's cache compares the file's contents, but keep it tidy
cmp -s "$STAGE/constraints.txt.new" "$STAGE/constraints.txt" 2>/dev/null \
  && rm "$STAGE/constraints.txt.new" || mv "$STAGE/constraints.txt.new" "$STAGE/constraints.txt"

log "docker build $IMAGE"
previous=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
docker build --network host "${BUILD_ARGS[@]}" -f compose/Dockerfile -t "$IMAGE" .
# the image this one replaces, now untagged (its parents stay: they are the build cache)
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$IMAGE")" ]; then
  docker rmi --no-prune "$previous" >/dev/null 2>&1 || true
fi
log "$IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec), built in $(( $(date +%s) - start ))s"
