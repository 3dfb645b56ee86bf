#!/usr/bin/env bash
# Configures (once) and builds libgossip into build/.
set -euo pipefail
if [ $# -gt 0 ]; then
  echo "tools/build.sh takes no arguments (it configures build/ once and builds it; for other options run meson and ninja yourself)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
bash tools/setup.sh
if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=release
fi
ninja -C build
