#!/usr/bin/env bash
# Can a program outside this tree find and link libgossip?
#
#   test_install.sh PART SOURCE_ROOT BUILD_ROOT
#
# PART loopback, ucx, cuda: installs the build into a temporary directory
# (meson install --destdir), then builds README's training loop for that part
# out of tree with nothing but `pkg-config --cflags --libs`, and runs it: the
# loopback and GPU ones as 2 threads, the UCX one as 2 processes through the
# installed gossip-run. The programs are taken from README itself (the block
# after its `<!-- snippet: FILE -->` line) and must equal FILE under examples/.
# PART subproject: a small meson project takes libgossip as a subproject,
# dependency('gossip', fallback: ['gossip', 'gossip_dep']), builds and runs the
# loopback loop.
# Exit 77 (skipped) when the part was not built or cannot run here.
set -euo pipefail

part=$1 src=$(cd "$2" && pwd) build=$(cd "$3" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gossip-install-$part.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*" >&2; exit 1; }

# A sanitizer-instrumented library needs the sanitizer's runtime loaded before
# it, which a program built here with plain `c++` and pkg-config does not do.
# (ldd's whole output first: grep -q in a pipe under pipefail would fail ldd with SIGPIPE.)
# (In the build directory the library has its versioned names only.)
built_lib=$(compgen -G "$build/lib/libgossip.so*[0-9]" | head -n 1 || true)
if [[ $part != subproject && -n $built_lib ]] && grep -qE 'lib(a|t|ub)san' <<<"$(ldd "$built_lib" 2>/dev/null)"; then
  skip "this build is sanitizer-instrumented; out-of-tree programs built with plain c++ cannot load it (the release build runs this test)"
fi

# README's block after "<!-- snippet: $1 -->", checked against the file.
snippet() {
  local file=$1 out=$2
  awk -v marker="<!-- snippet: $file -->" '
    $0 == marker { found = 1; next }
    found == 1 && /^```cpp$/ { found = 2; next }
    found == 2 && /^```$/ { exit }
    found == 2 { print }' "$src/README.md" > "$out"
  [[ -s $out ]] || fail "README.md has no \`<!-- snippet: $file -->\` followed by a \`\`\`cpp block"
  cmp -s "$out" "$src/$file" || { diff -u "$src/$file" "$out" >&2 || true; fail "README.md's snippet differs from $file; copy the file into README"; }
}

# The last run's output has a line matching $1 ($2 names the program).
expect() { grep -q "$1" "$tmp/run.log" || fail "$2: no line matching '$1' in its output"; }

# Runs "$@" with a bound; its output goes to $tmp/run.log and is shown.
run_bounded() {
  local status=0
  timeout --kill-after=5 120 "$@" > "$tmp/run.log" 2>&1 || status=$?
  cat "$tmp/run.log"
  [[ $status -ne 124 && $status -ne 137 ]] || fail "timed out after 120 s: $*"
  return "$status"
}

if [[ $part == subproject ]]; then
  mkdir -p "$tmp/consumer/subprojects"
  ln -s "$src" "$tmp/consumer/subprojects/gossip"
  snippet examples/00_training_loop/loopback.cpp "$tmp/consumer/loopback.cpp"
  cat > "$tmp/consumer/meson.build" <<'EOF'
project('consumer', 'cpp', default_options: ['cpp_std=c++20', 'buildtype=release'])
# The other options at their defaults: as a subproject libgossip builds its
# libraries only (no programs, Python module, examples, benches or tests).
# (The UCX and CUDA libraries are left out here only to keep the test short.)
gossip_dep = dependency('gossip', fallback: ['gossip', 'gossip_dep'],
  default_options: ['ucx=disabled', 'cuda=disabled', 'torch=disabled'])
executable('loopback', 'loopback.cpp', dependencies: gossip_dep)
EOF
  meson setup --force-fallback-for=gossip "$tmp/consumer/build" "$tmp/consumer" > "$tmp/setup.log" 2>&1 || { cat "$tmp/setup.log"; fail "meson setup of the consumer project"; }
  ninja -C "$tmp/consumer/build" > "$tmp/ninja.log" 2>&1 || { cat "$tmp/ninja.log"; fail "building the consumer project"; }
  programs=$(find "$tmp/consumer/build/subprojects" -type f \( -name 'gossip-*' -o -name '*.cpython-*.so' \) -perm -u+x -print)
  [[ -z $programs ]] || fail "as a subproject libgossip built programs of its own: $programs"
  run_bounded "$tmp/consumer/build/loopback" || fail "the consumer program failed"
  expect '^rank 0: b = ' "the consumer program" && expect '^rank 1: b = ' "the consumer program"
  echo "OK: a meson project built and ran the loopback loop with libgossip as a subproject"
  exit 0
fi

dest=$tmp/dest
meson install -C "$build" --destdir "$dest" --no-rebuild --quiet > "$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "meson install --destdir"; }
pc_dir=$(dirname "$(find "$dest" -name gossip.pc -print -quit)")
[[ $pc_dir != . ]] || fail "meson install wrote no gossip.pc"

# The .pc files name the configured prefix; point them at the staged copy.
mkdir "$tmp/pkgconfig"
for pc in "$pc_dir"/*.pc; do
  prefix=$(sed -n 's/^prefix=//p' "$pc")
  sed "s|^prefix=.*|prefix=$dest$prefix|" "$pc" > "$tmp/pkgconfig/$(basename "$pc")"
done
export PKG_CONFIG_PATH=$tmp/pkgconfig
libdir=$(pkg-config --variable=libdir gossip)
export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# The library holds only what a user links: the examples' dataset reader
# (gossip::data, examples/common) is neither in it nor among its headers.
if grep -q '_ZN6gossip4data' <<<"$(nm -D --defined-only "$libdir/libgossip.so")"; then
  fail "the installed libgossip.so defines gossip::data symbols; the dataset reader belongs to examples/common"
fi
[[ ! -e $(pkg-config --variable=includedir gossip)/gossip/data.hpp ]] || fail "gossip/data.hpp was installed; it belongs to examples/common"
# gossip/cuda.hpp declares libgossip_cuda's functions: installed with it only.
if [[ ! -e $pc_dir/gossip-cuda.pc && -e $(pkg-config --variable=includedir gossip)/gossip/cuda.hpp ]]; then
  fail "gossip/cuda.hpp was installed without libgossip_cuda (gossip-cuda.pc); a program including it would not link"
fi
# A versioned SONAME, so that programs record the ABI they were built against.
if command -v readelf > /dev/null; then
  soname=$(readelf -d "$libdir/libgossip.so" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
  [[ $soname =~ ^libgossip\.so\.[0-9] ]] || fail "the installed libgossip.so has SONAME '$soname', not a versioned one (libgossip.so.N)"
fi
# Installed programs, the Python module and the transport libraries carry
# the configured PREFIX/LIBDIR as their RUNPATH (but for prefix /usr), so that
# an install outside the loader's paths works without LD_LIBRARY_PATH.
if command -v readelf > /dev/null; then
  cfg_prefix=$(sed -n 's/^prefix=//p' "$pc_dir/gossip.pc")
  cfg_libdir=$(PKG_CONFIG_PATH=$pc_dir pkg-config --variable=libdir gossip)
  if [[ $cfg_prefix != /usr ]]; then
    while IFS= read -r -d '' elf; do
      runpath=$(readelf -d "$elf" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\].*/\2/p')
      [[ ":$runpath:" == *":$cfg_libdir:"* ]] ||
        fail "the installed ${elf#"$dest"} has RUNPATH '$runpath', without $cfg_libdir: it would need LD_LIBRARY_PATH"
    done < <(find "$dest" -type f \( -path '*/bin/gossip-info' -o -path '*/bin/fashion_mnist' -o -path '*/bin/libtorch_cnn' \
                -o -name 'gossip.cpython-*.so' -o -name 'libgossip_ucx.so.*' -o -name 'libgossip_cuda.so.*' \) -print0)
  fi
fi

# Users' Cflags hold include paths, libgossip's own macros and what the public
# requirements (fmt, Eigen) ask for; nothing of a private one (toml++'s -DTOML_*).
for pc in "$tmp"/pkgconfig/*.pc; do
  name=$(basename "$pc" .pc)
  public=$(pkg-config --print-requires "$name" | awk '$1 !~ /^gossip/ { print $1 }')
  # shellcheck disable=SC2086
  public_flags=" $( [[ -z $public ]] || pkg-config --cflags $public) "
  for flag in $(pkg-config --cflags "$name"); do
    [[ $flag == -I* || $flag == -DGOSSIP_* || $public_flags == *" $flag "* ]] ||
      fail "pkg-config --cflags $name gives '$flag', which comes from none of libgossip's public requirements"
  done
done

# Every installed header of the core library compiles on its own, with only
# what pkg-config gives (the transport, CUDA and torch headers need their own
# .pc files or libraries, and are built through the programs below).
if [[ $part == loopback ]]; then
  includedir=$(pkg-config --variable=includedir gossip)
  find "$includedir/gossip" -name '*.hpp' ! -name cuda.hpp ! -name torch.hpp ! -path '*/transports/ucx/*' -printf '%P\n' | sort > "$tmp/headers"
  [[ -s $tmp/headers ]] || fail "no headers were installed under $includedir/gossip"
  # shellcheck disable=SC2016  # expanded by the inner shell
  xargs -P 2 -I{} sh -c 'printf "#include <gossip/%s>\n" "$1" | c++ -std=c++20 -fsyntax-only -x c++ - $2 > "$3/header-$(echo "$1" | tr / _).log" 2>&1 ||
    { echo "FAIL: the installed header gossip/$1 does not compile on its own:"; head -n 20 "$3/header-$(echo "$1" | tr / _).log"; exit 255; }' \
    _ {} "$(pkg-config --cflags gossip)" "$tmp" < "$tmp/headers" || fail "an installed header does not compile on its own (above)"
  echo "OK: $(wc -l < "$tmp/headers") installed headers compile on their own"
fi

case $part in
  loopback) pc=gossip file=examples/00_training_loop/loopback.cpp ;;
  ucx) pc=gossip-ucx file=examples/00_training_loop/ucx.cpp ;;
  cuda) pc=gossip-cuda file=examples/00_training_loop/cuda.cpp ;;
  *) fail "unknown part '$part' (loopback, ucx, cuda, subproject)" ;;
esac
[[ -f $tmp/pkgconfig/$pc.pc ]] || skip "$pc.pc was not installed: the $part part is not in this build (see the configure summary)"

mkdir "$tmp/out-of-tree"
cd "$tmp/out-of-tree"
snippet "$file" "$part.cpp"
flags=$(pkg-config --cflags --libs "$pc")
echo "c++ -std=c++20 $part.cpp $flags"
# shellcheck disable=SC2086  # the flags are words
c++ -std=c++20 -O1 -o "$part" "$part.cpp" $flags || fail "README's $part loop does not build with pkg-config --cflags --libs $pc"

case $part in
  loopback)
    run_bounded "./$part" || fail "README's loopback loop failed"
    expect '^rank 0: b = ' "the loopback loop" && expect '^rank 1: b = ' "the loopback loop"
    ;;
  ucx)
    gossip_run=$dest$(sed -n 's/^prefix=//p' "$pc_dir/gossip.pc")/bin/gossip-run
    [[ -x $gossip_run ]] || fail "gossip-run was not installed (looked for $gossip_run)"
    status=0
    UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} run_bounded "$gossip_run" -n 2 -- "./$part" || status=$?
    if [[ $status -ne 0 ]] && grep -qi 'no usable\|ucp_init\|UCS_ERR_NO_DEVICE' "$tmp/run.log"; then
      skip "UCX cannot run here (see the output above)"
    fi
    [[ $status -eq 0 ]] || fail "README's UCX loop failed under gossip-run -n 2"
    expect 'rank 0 of 2: b = ' "the UCX loop" && expect 'rank 1 of 2: b = ' "the UCX loop"
    ;;
  cuda)
    status=0
    run_bounded "./$part" || status=$?
    if [[ $status -eq 77 ]] && grep -q 'no usable CUDA GPU here' "$tmp/run.log"; then
      skip "README's GPU loop builds and links, but no GPU can run it here"
    fi
    [[ $status -eq 0 ]] || fail "README's GPU loop failed"
    expect '^rank 0: b = ' "the GPU loop" && expect '^rank 1: b = ' "the GPU loop"
    ;;
esac
echo "OK: README's $part loop built out of tree with pkg-config ($pc) and ran"
