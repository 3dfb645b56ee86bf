#!/usr/bin/env bash
# Configures (once) and builds libgossip into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=release
fi
ninja -C build
