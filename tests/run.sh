#!/usr/bin/env bash
# Runs test binaries one after another and prints, as the very last line, "N passed, N failed, N skipped"
# (test cases, summed over all binaries; "skipped" counts the kernel checks a binary could not run on this
# machine, tests/main.cpp). A binary that dies without printing its count line (a crash, a sanitizer
# abort) adds one failure named after it. A script that prints "P passed, F failed" without a skipped
# count adds 0 skipped. KIMIK3_RUNNER, when set, is a command that runs each binary (make test-aarch64:
# qemu-aarch64). KIMIK3_TEST_ARGS, when set, is given to every binary as its arguments, split at spaces and
# never globbed (make test-aarch64-ci: a doctest filter, -tc=...). Each binary's line says how long it ran.
# Usage: tests/run.sh BIN [BIN...]
set -u
read -r -a test_args <<< "${KIMIK3_TEST_ARGS:-}"
passed=0
failed=0
skipped=0
for bin in "$@"; do
    name=$(basename "$bin")
    t0=$(date +%s.%N)
    out=$(${KIMIK3_RUNNER:-} "$bin" "${test_args[@]}" 2>&1)
    rc=$?
    took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f s", b - a }')
    printf '%s\n' "$out" | grep -v '^kimik3-tests: '
    line=$(printf '%s\n' "$out" | grep '^kimik3-tests: ' | tail -n 1)
    if [ -z "$line" ]; then
        echo "$name: exited with status $rc before reporting its results ($took): counted as 1 failed"
        failed=$((failed + 1))
        continue
    fi
    counts=$(printf '%s\n' "$line" | sed -E 's/.* ([0-9]+) passed, ([0-9]+) failed(, ([0-9]+) skipped)?$/\1 \2 \4/')
    read -r p f s <<< "$counts"
    s=${s:-0}
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "$name: exited with status $rc although every case passed: counted as 1 failed"
        f=1
    fi
    echo "$name: $p passed, $f failed, $s skipped ($took)"
    passed=$((passed + p))
    failed=$((failed + f))
    skipped=$((skipped + s))
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
