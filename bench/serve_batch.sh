#!/usr/bin/env bash
# kimik3 serve --max-batch measured through HTTP: aggregate tokens/s of C concurrent curl clients, each
# one completion of G tokens (greedy, ignore_eos, a prompt of its own), against a server with
# --max-batch 1 (the requests queue) and --max-batch 4 (they share each forward step), and the bytes
# read per generated token from GET /kimik3/status (which counts the one warm-up request too).
#   bench/serve_batch.sh [KIMIK3_BIN] [MODEL_DIR] [BUDGET]     (defaults: build/g++/kimik3, fixtures/little-k3, floor)
#   G=64 bench/serve_batch.sh ...                               tokens per client (default 32)
cd "$(dirname "$0")/.." || exit 1
bin=${1:-build/g++/kimik3}
model=${2:-fixtures/little-k3}
budget=${3:-floor}
G=${G:-32}
tmp=$(mktemp -d /tmp/kimik3-serve-batch-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
# measure B C: a server with --max-batch B, C clients at once
measure() {
    "$bin" serve "$model" --port 0 --context 512 --budget "$budget" --max-batch "$1" --queue 16 --quiet >"$tmp/log" 2>&1 &
    local pid=$! port= c
    for _ in $(seq 600); do
        port=$(sed -nE 's|.*listening on http://127\.0\.0\.1:([0-9]+).*|\1|p' "$tmp/log")
        [ -n "$port" ] && break
        kill -0 $pid 2>/dev/null || { cat "$tmp/log"; exit 1; }
        sleep 0.1
    done
    local url=http://127.0.0.1:$port
    curl -s --max-time 120 -o /dev/null -H 'Content-Type: application/json' --data-binary '{"prompt":"warm up","max_tokens":2,"temperature":0}' "$url/v1/completions"
    local t0 clients=()
    t0=$(date +%s%N)
    for c in $(seq "$2"); do
        curl -s --max-time 600 -o "$tmp/reply.$c" -H 'Content-Type: application/json' \
            --data-binary "{\"prompt\":\"The United Nations $c was\",\"max_tokens\":$G,\"temperature\":0,\"ignore_eos\":true}" "$url/v1/completions" &
        clients+=($!)
    done
    wait "${clients[@]}"
    local ms=$((($(date +%s%N) - t0) / 1000000)) n=0
    for c in $(seq "$2"); do n=$((n + $(jq '.usage.completion_tokens' "$tmp/reply.$c"))); done
    local st
    st=$(curl -s --max-time 10 "$url/kimik3/status")
    kill $pid
    wait $pid 2>/dev/null
    printf '%9s %7s %8s %9.3f %10.2f %14s %15s\n' "$1" "$2" "$n" "$(echo "$ms / 1000" | bc -l)" "$(echo "$n * 1000 / $ms" | bc -l)" \
        "$(jq '.reads.trunk_bytes_per_token | floor' <<<"$st")" "$(jq '.reads.expert_bytes_per_token | floor' <<<"$st")"
}
echo "kimik3 serve on $model at budget $budget, $G tokens per client; load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%9s %7s %8s %9s %10s %14s %15s\n' max-batch clients tokens seconds "tokens/s" "trunk B/token" "expert B/token"
measure 1 1
measure 1 4
measure 4 1
measure 4 4
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
