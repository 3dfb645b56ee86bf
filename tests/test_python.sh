#!/usr/bin/env bash
# The Python module's tests (tests/python, pytest) with the Debian interpreter.
#
#   test_python.sh SOURCE_ROOT MODULE_DIR [WHY_NOT_BUILT]
#
# MODULE_DIR holds the built module `gossip`; WHY_NOT_BUILT, when given, is why
# the build has none. Exit 77 (skipped, with the reason) when the module, torch
# or pytest is missing, or when the build is sanitizer-instrumented (the
# interpreter cannot load such a module without the sanitizer's runtime first).
set -euo pipefail
src=$1 module_dir=$2 why_not=${3:-}
python=/usr/bin/python3
skip() { echo "SKIP: $*"; exit 77; }

[[ -z $why_not ]] || skip "the Python module was not built: $why_not"
[[ -x $python ]] || skip "$python not found (apt-get install python3)"
compgen -G "$module_dir/gossip*.so" > /dev/null || skip "no module gossip*.so in $module_dir"
if grep -qE 'lib(a|t|ub)san' <<<"$(ldd "$module_dir"/gossip*.so 2>/dev/null)"; then  # not a pipe: grep -q would SIGPIPE ldd
  skip "this build is sanitizer-instrumented; $python cannot load its module (the release build runs this test)"
fi
$python -c 'import torch' 2>/dev/null || skip "torch is not importable by $python (apt-get install python3-torch)"
$python -c 'import pytest' 2>/dev/null || skip "pytest is not importable by $python (apt-get install python3-pytest)"

export PYTHONPATH=$module_dir${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
exec $python -m pytest -v -p no:cacheprovider "$src/tests/python"
