#!/usr/bin/env bash
# Chapter 17's tests on localhost: the logits over 1-4 MPI ranks (1 and 2 threads per rank) equal the
# single-process engine's bits (build/*/tests/mpi_logits), kimik3-mpi run prints what kimik3 run prints,
# and a rank that cannot open its shard, fails a read or dies ends the job with its rank named, a
# non-zero exit and within a time limit. Where mpirun or the MPI programs are missing (no mpicxx: make
# did not build them) it prints SKIPPED and counts 1 skipped. Ranks oversubscribe the cores.
cd "$(dirname "$0")/.." || exit 1
dir=${KIMIK3_MPI_DIR:-build/g++}
bin=${KIMIK3:-$dir/kimik3}
mpi_bin=$dir/kimik3-mpi
mpi_test=$dir/tests/mpi_logits
if ! command -v mpirun >/dev/null 2>&1 || [ ! -x "$mpi_bin" ] || [ ! -x "$mpi_test" ]; then
    echo "SKIPPED: the MPI tests (chapter 17): $(command -v mpirun >/dev/null 2>&1 && echo "mpicxx is missing, so $mpi_bin was not built" || echo "mpirun is not installed") (Debian: apt-get install openmpi-bin libopenmpi-dev)"
    echo "kimik3-tests: mpi 0 passed, 0 failed, 1 skipped"
    exit 0
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpirun="mpirun --oversubscribe --bind-to none"
pass=0
fail=0
tmp=$(mktemp -d /tmp/kimik3-mpi-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# (1) the gate program at every rank count and two thread counts: its own pass/fail counts
for np in 1 2 3 4; do
    for t in 1 2; do
        out=$(timeout 600 $mpirun -np $np "$mpi_test" $t 2>&1)
        rc=$?
        line=$(printf '%s\n' "$out" | grep '^kimik3-tests: ' | tail -n 1)
        p=$(printf '%s' "$line" | sed -nE 's/.* ([0-9]+) passed, ([0-9]+) failed$/\1/p')
        f=$(printf '%s' "$line" | sed -nE 's/.* ([0-9]+) passed, ([0-9]+) failed$/\2/p')
        if [ -z "$p" ] || [ "$rc" != 0 ]; then
            echo "FAILED: mpi_logits at $np ranks, $t threads: exit $rc, output:"; printf '%s\n' "$out" | tail -20
            fail=$((fail + 1))
        else
            [ "$f" != 0 ] && printf '%s\n' "$out" | grep FAILED
            pass=$((pass + p)) fail=$((fail + f))
        fi
    done
done

# expect NAME WANT_RC PATTERN CMD...: CMD's exit code and that stdout+stderr match PATTERN (cli.sh's form)
expect() {
    local name=$1 want=$2 pattern=$3
    shift 3
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    if { [ "$want" = nonzero ] && [ "$rc" != 0 ] && [ "$rc" != 124 ] || [ "$rc" = "$want" ]; } && { [ -z "$pattern" ] || printf '%s' "$out" | grep -qE -- "$pattern"; }; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAILED: $name: exit $rc (want $want), output:"
        printf '%s\n' "$out" | tail -20
    fi
}
# same NAME FILE_A FILE_B: the two outputs are byte for byte equal
same() {
    if cmp -s "$2" "$3"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAILED: $1: $2 and $3 differ"; diff "$2" "$3" | head -5; fi
}

# (2) kimik3-mpi run = kimik3 run: the greedy text, and the logits of every generated step
model=fixtures/little-k3
args=(--raw --prompt "She opened the door and saw" --gen 8 --quiet)
"$bin" run "$model" "${args[@]}" --dump-logits "$tmp/one.npy" > "$tmp/one.txt" 2>/dev/null
for np in 2 3; do
    expect "kimik3-mpi run at $np ranks" 0 "" timeout 300 $mpirun -np $np "$mpi_bin" run "$model" "${args[@]}" --dump-logits "$tmp/np$np.npy"
    timeout 300 $mpirun -np $np "$mpi_bin" run "$model" "${args[@]}" > "$tmp/np$np.stdout" 2>/dev/null
    same "kimik3-mpi run's text at $np ranks" "$tmp/one.txt" "$tmp/np$np.stdout"
    same "kimik3-mpi run's logits at $np ranks" "$tmp/one.npy" "$tmp/np$np.npy"
done

# speculation and sessions under MPI: run --speculate (sampled, at the floor) and a three-turn chat (sampled,
# with drafts, rank 0 reading the lines) print what kimik3 run and kimik3 chat print
spec=(--raw --prompt "She opened the door and saw" --gen 24 --quiet --budget floor --temperature 0.8 --seed 3)
"$bin" run "$model" "${spec[@]}" --dump-logits "$tmp/spec1.npy" > "$tmp/spec1.txt" 2>/dev/null
timeout 300 $mpirun -np 2 "$mpi_bin" run "$model" "${spec[@]}" --speculate 4 --dump-logits "$tmp/spec2.npy" > "$tmp/spec2.txt" 2>/dev/null
same "kimik3-mpi run --speculate 4 at 2 ranks: kimik3 run's sampled text (no drafts)" "$tmp/spec1.txt" "$tmp/spec2.txt"
same "kimik3-mpi run --speculate 4 at 2 ranks: kimik3 run's logits" "$tmp/spec1.npy" "$tmp/spec2.npy"
printf 'Hello there.\nTell me about the door.\n/save %s/chat.k3s\nAnd then?\n' "$tmp" > "$tmp/chat.in"
chat=(--max-new 16 --budget floor --temperature 0.7 --seed 11)
"$bin" chat "$model" "${chat[@]}" < "$tmp/chat.in" > "$tmp/chat1.txt" 2>/dev/null
for np in 2 3; do
    timeout 300 $mpirun -np $np "$mpi_bin" chat "$model" "${chat[@]}" --speculate 4 < "$tmp/chat.in" > "$tmp/chat$np.txt" 2>"$tmp/chat$np.err"
    same "kimik3-mpi chat --speculate 4 at $np ranks: kimik3 chat's three replies" "$tmp/chat1.txt" "$tmp/chat$np.txt"
done
expect "kimik3-mpi chat refuses /save (each rank holds the session) and goes on" 0 "not here: under MPI" cat "$tmp/chat2.err"

# (3) faults: rank 1 of 2 lacks a shard / fails a read / dies; the job ends, naming the rank, in bounded time
mkdir -p "$tmp/broken"
cp "$model"/config.json "$model"/model.safetensors.index.json "$model"/model-00001-of-00002.safetensors "$model"/tiktoken.model "$model"/tokenizer_config.json "$tmp/broken/"
expect "a rank without its shard ends the job, naming rank and file" nonzero "rank 1 of 2: .*model-00002-of-00002.safetensors" \
    timeout 60 $mpirun -np 1 "$mpi_bin" run "$model" "${args[@]}" : -np 1 "$mpi_bin" run "$tmp/broken" "${args[@]}"
expect "a rank whose read fails ends the job, naming rank and cause" nonzero "rank 1 of 2: .*read" \
    timeout 60 $mpirun -np 1 "$mpi_bin" run "$model" "${args[@]}" --budget 40M : -np 1 env KIMIK3_TEST_FAIL_READS_AFTER=40 "$mpi_bin" run "$model" "${args[@]}" --budget 40M
expect "a rank whose disk hangs ends the job: the other rank's watchdog names itself (KIMIK3_MPI_TIMEOUT=5)" nonzero "rank 0 of 2: waited [0-9]+ s in a gather" \
    timeout 90 $mpirun -x KIMIK3_MPI_TIMEOUT=5 -np 1 "$mpi_bin" run "$model" "${args[@]}" --budget 40M : -np 1 env KIMIK3_TEST_STALL_READS_AFTER=40 "$mpi_bin" run "$model" "${args[@]}" --budget 40M
expect "a rank that runs out of memory ends the job, naming rank and cause" nonzero "rank 1 of 2: .*out of memory" \
    timeout 60 $mpirun -np 1 "$mpi_bin" run "$model" "${args[@]}" : -np 1 env KIMIK3_TEST_MEMORY_MB=4 "$mpi_bin" run "$model" "${args[@]}"
expect "a rank killed by a signal ends the job" nonzero "" \
    timeout 60 $mpirun -np 1 "$mpi_bin" run "$model" "${args[@]}" : -np 1 sh -c 'kill -9 $$'
expect "kimik3-mpi cost: the full K3 on 8 machines of 24 GB over 10 GbE under 2 s per token" 0 "" \
    sh -c "'$mpi_bin' cost | awk '\$1 == 8 && \$6 + 0 < 2 && \$6 + 0 > 0 { ok = 1 } END { exit !ok }'"

expect "kimik3-mpi plan: 3 ranks own the little K3's 8 x 32 experts, 85 or 86 each" 0 "" \
    sh -c "'$mpi_bin' plan $model --ranks 3 | awk '\$1 ~ /^[0-2]\$/ { n++; s += \$4; if (\$4 < 85 || \$4 > 86) bad = 1 } END { exit !(n == 3 && s == 256 && !bad) }'"
# each rank's plan (chapter 12's planner on the rank's share): at a large budget every rank holds all of it,
# at its floor it pins nothing, below the floor the rank is named, and the full K3's trunk fits 8 x 24 GB
expect "kimik3-mpi plan --ranks 4 --budget 1T: every rank all resident, 9 of 9 layers and the lm_head pinned" 0 "" \
    sh -c "'$mpi_bin' plan $model --ranks 4 --budget 1T | awk '/^ +rank +resident/ { t = 1; next } t && \$1 ~ /^[0-3]\$/ { n++; if (\$4 == \"9/9\" && \$5 == \"pinned\" && \$NF == \"yes\") ok++ } END { exit !(n == 4 && ok == 4) }'"
expect "kimik3-mpi plan --ranks 4 --budget floor: every rank streams its share" 0 "" \
    sh -c "'$mpi_bin' plan $model --ranks 4 --budget floor | awk '/^ +rank +resident/ { t = 1; next } t && \$1 ~ /^[0-3]\$/ { n++; if (\$4 == \"0/9\" && \$5 == \"streamed\" && \$NF == \"no\") ok++ } END { exit !(n == 4 && ok == 4) }'"
expect "kimik3-mpi plan: a rank's share of the little K3's matrices is about a quarter at 4 ranks" 0 "" \
    sh -c "one=\$('$mpi_bin' plan $model --ranks 1 | awk '\$1 == 0 { print \$2 }'); '$mpi_bin' plan $model --ranks 4 | awk -v one=\$one '\$1 ~ /^[0-3]\$/ { n++; if (\$2 > one / 4 && \$2 < one / 3.5) ok++ } END { exit !(n == 4 && ok == 4) }'"
expect "kimik3-mpi plan below a rank's floor names the rank, exit 3" 3 "rank 0 of 4: budget .* is below the floor" "$mpi_bin" plan "$model" --ranks 4 --budget 1M
expect "kimik3-mpi plan --config K3 --ranks 8 --budget 24G: every rank pins all 93 layers of its share" 0 "" \
    sh -c "'$mpi_bin' plan --config fixtures/k3-release/config.json --ranks 8 --budget 24G | awk '/^ +rank +resident/ { t = 1; next } t && \$1 ~ /^[0-7]\$/ { n++; if (\$4 == \"93/93\" && \$5 == \"pinned\") ok++ } END { exit !(n == 8 && ok == 8) }'"
expect "kimik3-mpi plan without --ranks is refused" 2 "plan takes MODEL_DIR \(or --config CONFIG.json\) and --ranks N" "$mpi_bin" plan "$model"
expect "kimik3-mpi plan of a directory without a model names the file" 2 "config.json" "$mpi_bin" plan "$tmp" --ranks 2

# (4) example 17 prints its transcript at any rank count (make check-examples runs it as one rank)
if [ -x "$dir/examples/17_mpi" ]; then
    timeout 300 $mpirun -np 3 "$dir/examples/17_mpi" > "$tmp/ex17.txt" 2>/dev/null
    same "example 17 at 3 ranks prints its transcript" examples/transcripts/17_mpi.txt "$tmp/ex17.txt"
fi

echo "kimik3-tests: mpi $pass passed, $fail failed"
