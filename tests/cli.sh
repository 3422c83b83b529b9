#!/usr/bin/env bash
# Tests of the command-line program: exit codes, messages, --help. Each check counts as one test case.
# The binary comes from $KIMIK3 (the Makefile passes the one it built).
cd "$(dirname "$0")/.." || exit 1
bin=${KIMIK3:-build/g++/kimik3}
pass=0
fail=0
tmp=$(mktemp -d /tmp/kimik3-cli-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# expect NAME WANT_RC PATTERN CMD...: runs CMD, checks its exit code and that stdout+stderr match PATTERN.
expect() {
    local name=$1 want=$2 pattern=$3
    shift 3
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    if [ "$rc" = "$want" ] && printf '%s' "$out" | grep -qE -- "$pattern"; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAILED: $name: exit $rc (want $want), output:"
        printf '%s\n' "$out" | head -20
    fi
}

expect "inspect prints the schedule" 0 "attention KKKMKKKMKKKMM" "$bin" inspect fixtures/tiny-k3
expect "inspect prints the census" 0 "routed experts .* 192 x 6,528 B, 192 stored contiguously" "$bin" inspect fixtures/tiny-k3
expect "no command: usage, exit 2" 2 "usage: kimik3 COMMAND" "$bin"
expect "--help: exit 0" 0 "commands:" "$bin" --help
expect "inspect --help" 0 "usage: kimik3 inspect MODEL_DIR" "$bin" inspect --help
expect "unknown command" 2 "unknown command 'bogus'" "$bin" bogus
expect "inspect without a directory" 2 "inspect takes one MODEL_DIR" "$bin" inspect
expect "inspect of a directory without a model" 2 "config.json: cannot open" "$bin" inspect "$tmp"

mkdir -p "$tmp/refused"
cp fixtures/tiny-k3/*.safetensors fixtures/tiny-k3/model.safetensors.index.json "$tmp/refused/"
sed 's/"hidden_act": "situ"/"hidden_act": "silu"/' fixtures/tiny-k3/config.json > "$tmp/refused/config.json"
expect "a refused config exits 2 naming the field" 2 'text_config.hidden_act: "silu" is not supported' "$bin" inspect "$tmp/refused"

mkdir -p "$tmp/broken"
cp fixtures/tiny-k3/config.json fixtures/tiny-k3/model.safetensors.index.json "$tmp/broken/"
cp fixtures/tiny-k3/model-00001-of-00002.safetensors "$tmp/broken/"
head -c 100000 fixtures/tiny-k3/model-00002-of-00002.safetensors > "$tmp/broken/model-00002-of-00002.safetensors"
expect "a truncated shard exits 2 naming the file" 2 "model-00002-of-00002.safetensors.*(ends past the data section|runs past the end)" "$bin" inspect "$tmp/broken"

echo "kimik3-tests: cli.sh $pass passed, $fail failed"
