#!/bin/sh
# Builds tools/windows_threads_check.c for Windows with mingw-w64's OpenMP and
# runs it under wine (Debian: apt-get install gcc-mingw-w64-x86-64 wine64).
# Run by hand; not part of .ci/run.
set -e
cd "$(dirname "$0")/.."
out="${TMPDIR:-/tmp}/windows_threads_check.exe"
x86_64-w64-mingw32-gcc -O2 -fopenmp -Wall -Wno-unused-function -Wno-unused-variable -o "$out" tools/windows_threads_check.c \
    -static
WINEDEBUG=-all wine "$out"
