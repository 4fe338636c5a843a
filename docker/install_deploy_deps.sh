#!/bin/sh
# `make deploy-deps` (and so `make deploy-test`): what the deployment test needs on a Debian
# machine, installed with apt as root (sudo otherwise) only where it is missing, as `make browser`
# does for chromium:
#   * the Docker engine: Debian's docker.io (dockerd, containerd, runc);
#   * debootstrap: the base image where no image registry is reachable (docker/build_images.sh);
#   * Compose v2 (`docker compose`): in Debian bookworm only Compose v1 (docker-compose 1.29)
#     is packaged, so the next release's (trixie) docker-compose 2.x package is downloaded into
#     a temporary apt state (this machine's sources and lists are left as they are) and installed
#     alone with dpkg; it depends on libc6 (>= 2.34) only, which bookworm has (2.36). It puts
#     the plugin in /usr/libexec/docker/cli-plugins, where the docker CLI looks.
# Nothing is upgraded; an installed package is left as it is. FEDCOMPRESS_NO_DEPLOY_DEPS=1 skips
# the installs (a machine set up by hand).
set -eu
[ -n "${FEDCOMPRESS_NO_DEPLOY_DEPS:-}" ] && exit 0
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
COMPOSE_SUITE=${COMPOSE_SUITE:-trixie}
apt_install() {
    echo "installing $* (apt-get) for make deploy-test"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >/dev/null || { echo "error: cannot install $* with apt-get" >&2; exit 1; }
}
missing=
command -v dockerd >/dev/null 2>&1 || missing="$missing docker.io"
command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
[ -z "$missing" ] || apt_install $missing
command -v docker >/dev/null 2>&1 || apt_install docker-cli
if docker compose version >/dev/null 2>&1; then
    exit 0
fi
echo "installing Compose v2: $COMPOSE_SUITE's docker-compose package (dpkg) for make deploy-test"
state=$(mktemp -d /var/tmp/fedcompress-apt.XXXXXX)
trap 'rm -rf "$state"' EXIT
mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $COMPOSE_SUITE main" \
    > "$state/sources.list"
opts="-o Dir::Etc::SourceList=$state/sources.list -o Dir::Etc::SourceParts=/dev/null
      -o Dir::State::Lists=$state/lists -o Dir::Cache=$state/cache -o APT::Sandbox::User=root"
# shellcheck disable=SC2086
apt-get $opts update -qq
# shellcheck disable=SC2086
version=$(apt-cache $opts show docker-compose | sed -n 's/^Version: //p' | sort -V | tail -1)
case "$version" in
    2.*) ;;
    *) echo "error: $COMPOSE_SUITE's docker-compose is ${version:-missing}, not Compose v2" >&2
       exit 1 ;;
esac
# shellcheck disable=SC2086
(cd "$state" && apt-get $opts download "docker-compose=$version" >/dev/null)
$SUDO dpkg -i "$state"/docker-compose_*.deb >/dev/null
docker compose version
