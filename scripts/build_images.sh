#!/usr/bin/env bash
# Build kvtier's container images from this checkout with whichever engine is here:
# docker (with a running daemon), podman or buildah (first that works; KVTIER_ENGINE picks).
#
#   scripts/build_images.sh            # the CPU image: kvtier:0.1.0 (and kvtier:latest)
#   scripts/build_images.sh cuda       # the CUDA image: kvtier:0.1.0-cuda (needs the CUDA base)
#   scripts/build_images.sh cpu cuda   # both
#
# Environment:
#   KVTIER_ENGINE     docker | podman | buildah (default: the first that works)
#   KVTIER_IMAGE      image name without tag (default: kvtier)
#   KVTIER_TAG        tag (default: the version in pyproject.toml, also tagged latest)
#   BASE_IMAGE        base of the CPU image (default in the Dockerfile: debian:bookworm-slim)
#   CUDA_BASE_IMAGE   base of the CUDA image (default in Dockerfile.cuda: an nvidia/cuda runtime)
#   CUPY_PACKAGE      CuPy wheel of the CUDA image (default: cupy-cuda12x>=13; cupy-cuda13x on CUDA 13)
#   PIP_CERT          a CA bundle pip needs behind a TLS-intercepting proxy: passed as the
#                     build secret `pip_cert`, never stored in the image
#   KVTIER_BUILD_ARGS extra arguments for the engine's build command (e.g. "--network host")
# Prints each image's size at the end. deploy/images/README.md says what each image holds.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cpu)
for t in "${targets[@]}"; do
  case "$t" in cpu|cuda) ;; *) echo "usage: $0 [cpu] [cuda]" >&2; exit 2 ;; esac
done

engine_works() {
  case "$1" in
    docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
    podman) command -v podman >/dev/null && podman info >/dev/null 2>&1 ;;
    buildah) command -v buildah >/dev/null && buildah info >/dev/null 2>&1 ;;
    *) return 1 ;;
  esac
}
engine=${KVTIER_ENGINE:-}
if [ -z "$engine" ]; then
  for e in docker podman buildah; do
    if engine_works "$e"; then engine=$e; break; fi
  done
fi
if [ -z "$engine" ] || ! engine_works "$engine"; then
  echo "no working container engine (tried ${KVTIER_ENGINE:-docker, podman, buildah});" \
       "install one, e.g. apt-get install -y podman buildah" >&2
  exit 1
fi

image=${KVTIER_IMAGE:-kvtier}
version=$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)
tag=${KVTIER_TAG:-$version}

build() {  # build <dockerfile> <tag> [extra args...]
  local file=$1 ref=$2; shift 2
  local args=(-f "$file" -t "$ref" "$@")
  if [ -n "${PIP_CERT:-}" ] && [ -s "$PIP_CERT" ]; then
    args+=(--secret "id=pip_cert,src=$PIP_CERT")
  fi
  # shellcheck disable=SC2206
  [ -z "${KVTIER_BUILD_ARGS:-}" ] || args+=(${KVTIER_BUILD_ARGS})
  echo "+ $engine build ${args[*]} ." >&2
  case "$engine" in
    docker) DOCKER_BUILDKIT=1 docker build "${args[@]}" . ;;
    # The docker format keeps HEALTHCHECK (the OCI image format has no field for it).
    podman) podman build --format docker "${args[@]}" . ;;
    buildah) buildah bud --format docker "${args[@]}" . ;;
  esac
}

size_of() {
  case "$engine" in
    docker) docker image inspect --format '{{.Size}}' "$1" ;;
    podman) podman image inspect --format '{{.Size}}' "$1" ;;
    buildah) buildah inspect --type image --format '{{.Docker.Size}}' "$1" 2>/dev/null \
               || podman image inspect --format '{{.Size}}' "$1" ;;
  esac
}

built=()
for t in "${targets[@]}"; do
  if [ "$t" = cpu ]; then
    extra=()
    [ -z "${BASE_IMAGE:-}" ] || extra+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
    build deploy/images/Dockerfile "$image:$tag" ${extra[@]+"${extra[@]}"}
    if [ -z "${KVTIER_TAG:-}" ]; then  # the release tag is also :latest; a chosen tag is not
      case "$engine" in
        docker) docker tag "$image:$tag" "$image:latest" ;;
        podman) podman tag "$image:$tag" "$image:latest" ;;
        buildah) buildah tag "$image:$tag" "$image:latest" ;;
      esac
    fi
    built+=("$image:$tag")
  else
    extra=()
    [ -z "${CUDA_BASE_IMAGE:-}" ] || extra+=(--build-arg "CUDA_BASE_IMAGE=$CUDA_BASE_IMAGE")
    [ -z "${CUPY_PACKAGE:-}" ] || extra+=(--build-arg "CUPY_PACKAGE=$CUPY_PACKAGE")
    build deploy/images/Dockerfile.cuda "$image:$tag-cuda" ${extra[@]+"${extra[@]}"}
    built+=("$image:$tag-cuda")
  fi
done

for ref in "${built[@]}"; do
  bytes=$(size_of "$ref" || echo 0)
  printf '%s\t%s MB\n' "$ref" "$(( bytes / 1000000 ))"
done
