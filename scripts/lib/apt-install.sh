# shellcheck shell=bash
# Sourced by scripts/install-podman.sh and scripts/install-prometheus.sh: Debian packages installed with
# apt-get, as root or through sudo, quiet unless something fails (then apt's own output says why).

# apt_install [--no-service-starts] WHAT HINT PACKAGE...
#
#   Installs PACKAGEs (--no-install-recommends). WHAT names them in the error without root or sudo,
#   HINT is the error where there is no apt-get (what to install by hand). --no-service-starts forbids
#   the packages' postinst to start services (policy-rc.d exit 101) unless a policy exists already.
apt_install() {
  local no_starts=false
  if [[ "$1" == --no-service-starts ]]; then
    no_starts=true
    shift
  fi
  local what=$1 hint=$2
  shift 2
  if ! command -v apt-get >/dev/null; then
    echo "$hint" >&2
    exit 1
  fi
  apt_sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "installing $what needs root (or sudo)" >&2; exit 1; }
    apt_sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt_log=$(mktemp)
  apt_quiet "${apt_sudo[@]}" apt-get update -qq
  if $no_starts && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | "${apt_sudo[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${apt_sudo[@]}" chmod +x /usr/sbin/policy-rc.d
    trap '"${apt_sudo[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt_quiet "${apt_sudo[@]}" apt-get install -y -qq --no-install-recommends "$@"
  rm -f "$apt_log"
}

# Runs a command with its output in $apt_log, shown (and the script ended) only if it fails.
apt_quiet() { "$@" >"$apt_log" 2>&1 || { cat "$apt_log" >&2; rm -f "$apt_log"; exit 1; }; }
