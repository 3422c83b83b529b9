#!/usr/bin/env bash
# One test: every generator in tools/ is the one that made the committed fixtures.
# `make fixtures` records the sha256 of each generator and input in tools/ (*.py, *.mjs, *.txt) in
# fixtures/generators.sha256; if one is
# edited (or added) without regenerating, this fails and says which file.
cd "$(dirname "$0")/.." || exit 1
fail=0
if ! out=$(sha256sum --quiet -c fixtures/generators.sha256 2>&1); then
    printf '%s\n' "$out"
    fail=1
fi
for f in tools/*.py tools/*.mjs tools/*.txt; do
    grep -q "  $f\$" fixtures/generators.sha256 || { echo "$f is not recorded in fixtures/generators.sha256"; fail=1; }
done
if [ $fail = 0 ]; then
    echo "kimik3-tests: fixtures_fresh 1 passed, 0 failed"
else
    echo "fixtures are stale: run 'make fixtures' (needs Debian's python3-torch) and commit the result"
    echo "kimik3-tests: fixtures_fresh 0 passed, 1 failed"
fi
