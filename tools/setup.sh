#!/usr/bin/env bash
# Installs the Debian packages libgossip builds and runs with (`setup.sh fuzz`:
# also clang for the fuzzers). Idempotent: when everything is present it only
# checks and returns.
set -euo pipefail

packages=(
  meson ninja-build pkg-config cmake g++
  libeigen3-dev libfmt-dev doctest-dev libtomlplusplus-dev nlohmann-json3-dev libcli11-dev zlib1g-dev
  libucx-dev ucx-utils dpdk dpdk-dev libdpdk-dev iproute2 ethtool
  dataset-fashion-mnist python3-matplotlib
  python3-dev pybind11-dev python3-torch libtorch-dev python3-pytest
)
# `setup.sh fuzz`: also clang and its runtimes (libFuzzer, sanitizers) for
# tools/fuzz.sh; the default build does not need them.
case "${1:-}" in
  "") ;;
  fuzz) packages+=(clang libclang-rt-dev) ;;
  -h|--help) sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; echo "usage: bash tools/setup.sh [fuzz]"; exit 0 ;;
  *) echo "tools/setup.sh: unknown argument '$1' (usage: bash tools/setup.sh [fuzz])" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: not root and no sudo; install as root: apt-get install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
