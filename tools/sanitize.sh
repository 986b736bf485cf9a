#!/usr/bin/env bash
# Build the extension with AddressSanitizer + UndefinedBehaviorSanitizer and
# run the whole test suite under it. Prints the number of sanitizer reports
# and exits non-zero unless it is 0 and the suite passed.
#
#   bash tools/sanitize.sh                 # whole suite
#   bash tools/sanitize.sh -k hostile      # extra arguments go to pytest
#   SANITIZE_DEBUG=1 bash tools/sanitize.sh   # also Cython bounds checks, -O1 -g
#   KEEP=1 bash tools/sanitize.sh          # keep the build directory
#
# The build happens in a throwaway copy of the working tree (never touches the
# in-place build of this checkout). Python itself is not instrumented, so the
# ASan runtime is LD_PRELOADed; leak detection is off (CPython keeps
# allocations alive at exit on purpose, which LeakSanitizer would report), and
# impossible allocations (the huge-shape tests ask for TiBs) return NULL, so
# NumPy raises MemoryError as it does without ASan.
# Linux + GCC or Clang only.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
CC=${CC:-gcc}

libasan=$("$CC" -print-file-name=libasan.so)
if [ ! -e "$libasan" ] || [ "$libasan" = libasan.so ]; then
    echo "sanitize.sh: $CC has no libasan.so (install libasan / gcc)" >&2
    exit 2
fi
libasan=$(readlink -f "$libasan")
# C++ extensions loaded later (matplotlib's ft2font, via pybind11) throw
# exceptions; ASan's __cxa_throw interceptor needs the real one resolved at
# start-up, so libstdc++ is preloaded right after the ASan runtime.
libstdcxx=$(readlink -f "$("$CC" -print-file-name=libstdc++.so)")
[ -e "$libstdcxx" ] && libasan="$libasan:$libstdcxx"

work=$(mktemp -d /tmp/cposembed-sanitize.XXXXXX)
if [ "${KEEP:-0}" != 1 ]; then trap 'rm -rf "$work"' EXIT; fi
logs="$work/logs"
mkdir -p "$logs"

# Copy tracked + untracked (not ignored) files: what you are about to commit.
# Outside a git checkout, copy everything but build output.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf - | tar -xf - -C "$work"
else
    tar --exclude=./build --exclude='*.so' --exclude='./src_c/*.c' --exclude=.git \
        --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -xf - -C "$work"
fi

echo "sanitize.sh: building in $work with -fsanitize=address,undefined" >&2
(
    cd "$work"
    export CC CPOSEMBED_SANITIZE=address,undefined
    if [ "${SANITIZE_DEBUG:-0}" = 1 ]; then export CPOSEMBED_DEBUG=1; fi
    "$PYTHON" setup.py -q build_ext --inplace >"$logs/build.log" 2>&1 \
        || { cat "$logs/build.log" >&2; exit 2; }
)
if ! nm -D "$work"/cposembed/_core*.so | grep __asan_ >/dev/null; then
    echo "sanitize.sh: the extension is not instrumented" >&2
    exit 2
fi

# The suite must import this build, not an installed (e.g. editable) copy.
imported=$(cd "$work" && LD_PRELOAD="$libasan" ASAN_OPTIONS=detect_leaks=0 \
    "$PYTHON" -c 'import cposembed._core as k; print(k.__file__)')
case "$imported" in
    "$work"/*) ;;
    *) echo "sanitize.sh: tests would import $imported, not the sanitized build" >&2; exit 2 ;;
esac

# Canary: a deliberate read past the end of a block the extension
# allocated (its pool of output buffers) must be caught, or this run could
# not catch anything. The kernels cannot be made to misread through the
# checked entries, so the read is a memmove, which ASan intercepts.
(
    cd "$work"
    LD_PRELOAD="$libasan" ASAN_OPTIONS="detect_leaks=0:log_path=$logs/canary" \
        "$PYTHON" -c 'import ctypes
import numpy as np
from cposembed import _blocks
blk = _blocks.block(64)
src = np.frombuffer(blk, np.uint8).ctypes.data
dst = ctypes.create_string_buffer(128)
ctypes.memmove(dst, src, 128)' >/dev/null 2>&1
) || true
if grep -qs 'ERROR: AddressSanitizer' "$logs"/canary.*; then
    echo "sanitize.sh: canary caught (ASan reports a deliberate overflow)" >&2
else
    echo "sanitize.sh: a deliberate out-of-bounds read went unnoticed" >&2
    exit 2
fi
rm -f "$logs"/canary.*

start=$(date +%s)
set +e
(
    cd "$work"
    export LD_PRELOAD="$libasan${LD_PRELOAD:+:$LD_PRELOAD}"
    export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1:log_path=$logs/asan"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=0:log_path=$logs/ubsan"
    export PYTHONFAULTHANDLER=1
    "$PYTHON" -m pytest -q -p no:cacheprovider tests "$@"
)
status=$?
set -e
elapsed=$(( $(date +%s) - start ))

# A report is an ASan "ERROR:" or a UBSan "runtime error:". The "failed to
# allocate" WARNINGs from the huge-shape tests (allocator_may_return_null) are
# expected: NumPy turns the NULL into MemoryError.
reports=0
for f in "$logs"/asan.* "$logs"/ubsan.*; do
    [ -e "$f" ] || continue
    n=$(grep -cE '^==[0-9]+==ERROR|runtime error:' "$f" || true)
    reports=$((reports + n))
    if [ "$n" -gt 0 ]; then
        echo "---- $f" >&2
        head -80 "$f" >&2
    fi
done
echo "sanitize.sh: pytest exit status $status, ${elapsed}s, sanitizer reports: $reports"
if [ "$reports" -ne 0 ] || [ "$status" -ne 0 ]; then exit 1; fi
