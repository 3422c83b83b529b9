#!/usr/bin/env bash
# The hostile-inputs suite: for each class of broken or malicious input the engine once mishandled (a
# crash, a hang, memory exhaustion, a raw library message, silent garbage), one generated case asserting
# its exit code and message. Every command runs with a hang guard (timeout) and a memory cap (ulimit -v;
# on a sanitizer build, KIMIK3_SANITIZED=1, ASan's hard_rss_limit_mb instead). Each check counts as one
# test case. The inputs are generated here from fixtures/tiny-k3 with shell tools only.
cd "$(dirname "$0")/.." || exit 1
export LC_ALL=C
bin=${KIMIK3:-build/g++/kimik3}
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")  # absolute: some cases run from another directory
pass=0
fail=0
tmp=$(mktemp -d /tmp/kimik3-hostile-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
tiny=$(pwd)/fixtures/tiny-k3
prompt=431,319,265,110,323,149,160,457,343,92,389,328
mem_kb=4000000  # 4 GB: far above what any refusal here may take
if [ -n "${KIMIK3_SANITIZED:-}" ]; then
    export ASAN_OPTIONS="hard_rss_limit_mb=4000:exitcode=86${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
fi

# bounded CMD...: runs CMD with the hang guard and the memory cap
bounded() {
    if [ -n "${KIMIK3_SANITIZED:-}" ]; then timeout 120 "$@"; else (ulimit -v $mem_kb; timeout 60 "$@"); fi
}
# expect NAME WANT_RC PATTERN CMD...: exit code and a pattern of stdout+stderr (saved in $tmp/last.out)
expect() {
    local name=$1 want=$2 pattern=$3
    shift 3
    local rc
    bounded "$@" > "$tmp/last.out" 2>&1
    rc=$?
    if [ "$rc" = "$want" ] && { [ -z "$pattern" ] || grep -qE -- "$pattern" "$tmp/last.out"; }; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAILED: $name: exit $rc (want $want), output:"
        head -c 2000 "$tmp/last.out" | head -20
    fi
}
not_grep() { ! grep -qE -- "$1" "$2"; }
check() {  # check NAME CONDITION...: one more case from a shell condition
    local name=$1
    shift
    if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAILED: $name"; fi
}

# model NAME: a copy of the tiny K3 made of symlinks; own FILE replaces one by a real copy to edit
model() { mkdir -p "$tmp/$1" && for f in "$tiny"/*; do ln -sf "$f" "$tmp/$1/"; done && echo "$tmp/$1"; }
own() { rm -f "$1/$2" && cp "$tiny/$2" "$1/$2"; }
u64le() {  # the 8 bytes of a little-endian u64
    local n=$1 i s=
    for i in 0 1 2 3 4 5 6 7; do s="$s\\x$(printf '%02x' $(((n >> (8 * i)) & 255)))"; done
    printf "$s"
}
header_len() { od -An -tu8 -N8 "$1" | tr -d ' '; }
# sed_script EXPR: EXPR as a sed script file (an argument of 200 kB would pass the kernel's 128 kB limit)
sed_script() { printf '%s\n' "$1" > "$tmp/script.sed" && echo "$tmp/script.sed"; }
# rewrite_header SRC DST SED_EXPR [odd]: the shard with its JSON header edited by sed, padded with spaces
# to a multiple of 8 (or to 8k+1 with "odd": the data section then starts at an odd offset)
rewrite_header() {
    local n head len
    n=$(header_len "$1")
    head=$(tail -c +9 "$1" | head -c "$n" | sed -e 's/ *$//' -f "$(sed_script "$3")")
    len=${#head}
    if [ "${4:-}" = odd ]; then len=$(((len + 7) / 8 * 8 + 1)); else len=$(((len + 7) / 8 * 8)); fi
    { u64le "$len"; printf '%s' "$head"; printf "%$((len - ${#head}))s" ""; tail -c +$((9 + n)) "$1"; } > "$2"
}
# tensor_at SHARD NAME: the absolute file offset of a tensor's first byte
tensor_at() {
    local n begin
    n=$(header_len "$1")
    begin=$(head -c $((8 + n)) "$1" | grep -a -o "\"$2\":{[^}]*}" | sed -E 's/.*"data_offsets":\[([0-9]+),.*/\1/')
    echo $((8 + n + begin))
}
poke() { printf "$3" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none; }  # poke FILE OFFSET BYTES
deep=$(head -c 100000 /dev/zero | tr '\0' '[')$(head -c 100000 /dev/zero | tr '\0' ']')
s2=model-00002-of-00002.safetensors
s1=model-00001-of-00002.safetensors

# ---- 1. nesting: 100,000-deep arrays (was: exit 139, the stack overflowed printing the value) -------------
d=$(model deep_field); own "$d" config.json
sed -i -f "$(sed_script "s/\"hidden_size\": 128/\"hidden_size\": $deep/")" "$d/config.json"
expect "a 100,000-deep config field is refused" 2 "config.json: text_config.hidden_size\[0\].*nested more than 64 levels deep" "$bin" inspect "$d"
d=$(model deep_list); own "$d" config.json
sed -i -f "$(sed_script "0,/\"kda_layers\": \[/s//\"kda_layers\": [$deep,/")" "$d/config.json"
expect "a 100,000-deep layer-list element is refused" 2 "kda_layers\[0\].*nested more than 64 levels deep" "$bin" inspect "$d"
d=$(model deep_shape); rm "$d/$s2"
rewrite_header "$tiny/$s2" "$d/$s2" "s/\"shape\":\[512,128\]/\"shape\":$deep/"
expect "a 100,000-deep shape in a header is refused" 2 "$s2: language_model.lm_head.weight.shape\[0\].*nested more than 64" "$bin" inspect "$d"
d=$(model deep_offsets); rm "$d/$s2"
rewrite_header "$tiny/$s2" "$d/$s2" "s/\"data_offsets\":\[2124480,2255552\]/\"data_offsets\":[$deep,1]/"
expect "100,000-deep data_offsets are refused" 2 "nested more than 64 levels deep" "$bin" inspect "$d"

# ---- 2. a 100,000-entry header parses in one linear pass (was: 186-732 s) ----------------------------------
d="$tmp/wide"; mkdir -p "$d"; cp "$tiny/config.json" "$d/"
head=$(awk 'BEGIN { printf "{"; for (i = 0; i < 100000; i++) printf "%s\"t%d\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[%d,%d]}", i ? "," : "", i, i, i + 1; printf "}" }')
len=$(((${#head} + 7) / 8 * 8))
{ u64le "$len"; printf '%s' "$head"; printf "%$((len - ${#head}))s" ""; head -c 100000 /dev/zero; } > "$d/model.safetensors"
expect "a 100,000-tensor header is read (then refused by binding: nothing the config expects is there)" 2 \
    "the checkpoint does not match its config" "$bin" inspect "$d"

# ---- 3. sizes and counts capped; only regular files (was: 23 s, 3.4 GB and an 889 MB message; hangs) ------
d=$(model layers); own "$d" config.json
sed -i 's/"num_hidden_layers": 13/"num_hidden_layers": 100000000/' "$d/config.json"
expect "num_hidden_layers 1e8 is refused at once" 2 "num_hidden_layers: 100000000 is more than 1024" "$bin" inspect "$d"
check "... with a short message" [ "$(wc -c < "$tmp/last.out")" -lt 2000 ]
d=$(model big_config); own "$d" config.json
truncate -s 20M "$d/config.json"  # 20 MB (sparse): refused by size before a byte is read
expect "a 20 MB config.json is refused by size" 2 "is 20971520 bytes, more than the 16777216 a config.json may hold" "$bin" inspect "$d"
d=$(model zero); ln -sf /dev/zero "$d/config.json"
expect "config.json -> /dev/zero is refused" 2 "config.json: is a character device, not a regular file" "$bin" inspect "$d"
d=$(model urandom); ln -sf /dev/urandom "$d/config.json"
expect "config.json -> /dev/urandom is refused" 2 "is a character device, not a regular file" "$bin" inspect "$d"
d=$(model fifo_config); rm "$d/config.json"; mkfifo "$d/config.json"
expect "a FIFO as config.json is refused, no hang" 2 "config.json: is a FIFO \(named pipe\), not a regular file" "$bin" inspect "$d"
d=$(model fifo_shard); rm "$d/$s2"; mkfifo "$d/$s2"
expect "a FIFO as a shard is refused, no hang" 2 "$s2: is a FIFO" "$bin" inspect "$d"
d=$(model fifo_tok); rm "$d/tiktoken.model"; mkfifo "$d/tiktoken.model"
expect "a FIFO as tiktoken.model is refused, no hang" 2 "tiktoken.model: is a FIFO" "$bin" tokenize "$d" hi

# ---- 4. session files validated completely; the chat carries on (was: std::bad_alloc, exit 1) -------------
printf 'Hello!\n/save %s\n/quit\n' "$tmp/good.session" | bounded "$bin" chat "$tiny" --max-new 4 > /dev/null 2>&1
{ head -c 20 "$tmp/good.session"; u64le 4294967296; } > "$tmp/huge.session"
expect "a session claiming 2^32 tokens is refused, the chat goes on" 0 "not loaded: .*the history holds 4294967296 tokens, more than this chat's context of 4096" \
    sh -c "printf '/load $tmp/huge.session\n/quit\n' | '$bin' chat '$tiny'"
n=$(od -An -tu8 -j20 -N8 "$tmp/good.session" | tr -d ' ')                # tokens of history
m=$(od -An -tu8 -j$((28 + 8 * n)) -N8 "$tmp/good.session" | tr -d ' ')   # pending tokens
cp "$tmp/good.session" "$tmp/nan.session"
poke "$tmp/nan.session" $((36 + 8 * (n + m) + 24)) '\x00\x00\xc0\x7f'  # the first KDA layer's conv history[0] = NaN
expect "a NaN in a saved KDA state is refused (by the checksum; the NaN check itself: test 15.8)" 0 "not loaded: .*damaged: its checksum does not match" \
    sh -c "printf '/load $tmp/nan.session\n/quit\n' | '$bin' chat '$tiny'"
# one flipped bit in the middle of a state (was: loaded silently, garbage replies)
cp "$tmp/good.session" "$tmp/flip.session"
at=$(( $(wc -c < "$tmp/good.session") / 2 ))
byte=$(od -An -tu1 -j$at -N1 "$tmp/good.session" | tr -d ' ')
poke "$tmp/flip.session" $at "$(printf '\\x%02x' $((byte ^ 4)))"
expect "a session with one bit flipped is refused" 0 "not loaded: .*damaged: its checksum does not match" \
    sh -c "printf '/load $tmp/flip.session\n/quit\n' | '$bin' chat '$tiny'"
# a session of the tiny K3 loaded into the same model with top-2 routing (was: loaded, though the help said refused)
d=$(model top2); own "$d" config.json; sed -i 's/"num_experts_per_token": 4/"num_experts_per_token": 2/' "$d/config.json"
expect "a session from another model of the same shape (top-2 routing) is refused" 0 "not loaded: .*made for another model of the same shape" \
    sh -c "printf '/load $tmp/good.session\n/quit\n' | '$bin' chat '$d'"
# /save never touches the user's own NAME.tmp, leaves no temporary file, and writes through a symlink
mkdir -p "$tmp/links" && echo "the user's" > "$tmp/links/s.session.tmp" && echo old > "$tmp/links/real.session" && ln -s real.session "$tmp/links/link.session"
printf 'Hello!\n/save %s\n/save %s\n/quit\n' "$tmp/links/s.session" "$tmp/links/link.session" | bounded "$bin" chat "$tiny" --max-new 2 > /dev/null 2>&1
check "/save leaves the user's NAME.tmp alone" [ "$(cat "$tmp/links/s.session.tmp")" = "the user's" ]
check "/save leaves no temporary file" [ -z "$(ls "$tmp/links" | grep '\.tmp\.')" ]
check "/save through a symlink writes its target, the link stays" sh -c "[ -L '$tmp/links/link.session' ] && cmp -s '$tmp/links/real.session' '$tmp/links/s.session'"
{ cat "$tmp/good.session"; printf 'xx'; } > "$tmp/trailing.session"
expect "trailing bytes after a session are refused" 0 "not loaded: .*trailing bytes" sh -c "printf '/load $tmp/trailing.session\n/quit\n' | '$bin' chat '$tiny'"
mkdir -p "$tmp/save/adir"
expect "/save onto a directory is refused" 0 "not saved: .*adir: is a directory" sh -c "cd '$tmp/save' && printf '/save adir\n/save \n/quit\n' | '$bin' chat '$tiny'"
check "... and leaves no NAME.tmp behind" [ ! -e "$tmp/save/adir.tmp" ] && [ ! -e "$tmp/save/.tmp" ]

# ---- 5. non-finite weights: the run fails naming the step, or the tensor is refused (was: ids 0,0,0, exit 0)
d=$(model nan_head); own "$d" "$s2"
poke "$d/$s2" "$(tensor_at "$d/$s2" language_model.lm_head.weight)" '\xc0\x7f'  # lm_head row 0, element 0: NaN
expect "a NaN in lm_head fails the run at its first step" 1 "step 0: the logits at position 11 are not finite \(logit 0 is nan\)" \
    "$bin" run "$d" --ids $prompt --gen 4 --quiet
expect "... and in teacher forcing" 1 "step 0: the logits at position 0 are not finite" "$bin" run "$d" --ids $prompt --gen 0 --quiet
d=$(model nan_norm); own "$d" "$s2"
poke "$d/$s2" "$(tensor_at "$d/$s2" language_model.model.norm.weight)" '\x80\x7f'  # model.norm[0] = +Inf: refused at load
expect "an Inf in the final norm is refused at load" 2 "tensor 'language_model.model.norm.weight': element 0 is not finite" "$bin" run "$d" --ids 1,2 --gen 2
d=$(model inf_bias); own "$d" "$s1"
poke "$d/$s1" "$(tensor_at "$d/$s1" language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias)" '\x00\x00\x80\x7f'
expect "an Inf router bias is refused at load" 2 "e_score_correction_bias': element 0 is not finite" "$bin" run "$d" --ids 1,2 --gen 2

# ---- 6. the tokenizer against the model (was: <|reserved_token_N|> printed, exit 0; a failure mid-run) ----
d=$(model tok_cut); rm "$d/tiktoken.model"; head -n 470 "$tiny/tiktoken.model" > "$d/tiktoken.model"
expect "a tiktoken.model cut at a line boundary is refused" 2 "first special token has id 480, but tiktoken.model ends at rank 469.*cut short" \
    "$bin" detokenize "$d" 470,471
d=$(model tok_few); rm "$d/tokenizer_config.json"
printf '{"added_tokens_decoder": {"480": {"content": "[BOS]"}, "481": {"content": "[EOS]"}, "482": {"content": "<|end_of_msg|>"},
 "483": {"content": "<|open|>"}, "484": {"content": "<|close|>"}, "485": {"content": "<|sep|>"}}}' > "$d/tokenizer_config.json"
expect "a tokenizer with fewer ids than the model's vocabulary is refused before the run" 2 \
    "the tokenizer has 486 ids \(480 BPE ranks \+ 6 special tokens\), the model's vocab_size is 512" "$bin" run "$d" --prompt hi --gen 2

# ---- 7. undefined behaviour: a valid checkpoint whose data sections start at odd offsets runs the same ----
d=$(model odd); rm "$d/$s1" "$d/$s2"
rewrite_header "$tiny/$s1" "$d/$s1" "" odd
rewrite_header "$tiny/$s2" "$d/$s2" "" odd
check "the odd-offset shards really start their data at odd offsets" [ $(($(header_len "$d/$s1") % 2)) = 1 ]
want=$(bounded "$bin" run "$tiny" --ids $prompt --gen 6 --quiet 2>/dev/null)
got=$(bounded "$bin" run "$d" --ids $prompt --gen 6 --quiet 2>"$tmp/odd.err")
check "an odd data offset gives the same tokens (a misaligned load would abort a sanitizer build): '$got'" [ -n "$want" ] && [ "$got" = "$want" ]
got=$(bounded "$bin" run "$d" --ids $prompt --gen 6 --quiet --budget floor --context 32 2>"$tmp/odd.err")
check "... and at the floor, where matrices stream through the ring: '$got'" [ "$got" = "$want" ]
d=$(model group); own "$d" config.json
sed -i 's/"group_size": 32/"group_size": 1e300/' "$d/config.json"
expect "group_size 1e300 is refused (no double -> int conversion)" 2 "group_size 32 \(MXFP4\)" "$bin" inspect "$d"

# ---- 8. exit codes and messages: a refused input is exit 2 naming the file and field -----------------------
d=$(model loop_index); rm "$d/model.safetensors.index.json"; ln -s loop "$d/loop2"; ln -s loop2 "$d/loop"
ln -s loop "$d/model.safetensors.index.json"
expect "a symlink loop as the index" 2 "model.safetensors.index.json: cannot open: Too many levels of symbolic links" "$bin" inspect "$d"
d=$(model loop_shard); rm "$d/$s2"; ln -s a "$d/b"; ln -s b "$d/a"; ln -s a "$d/$s2"
expect "a symlink loop as a shard" 2 "$s2: cannot open: Too many levels of symbolic links" "$bin" inspect "$d"
d=$(model dir_index); rm "$d/model.safetensors.index.json"; mkdir "$d/model.safetensors.index.json"
expect "an index that is a directory" 2 "model.safetensors.index.json: is a directory, not a regular file" "$bin" inspect "$d"
d=$(model dot_shard); own "$d" model.safetensors.index.json
sed -i 's/"language_model.lm_head.weight": "[^"]*"/"language_model.lm_head.weight": "."/' "$d/model.safetensors.index.json"
expect "a weight_map entry of '.'" 2 "weight_map\['language_model.lm_head.weight'\] = \".\" is not a plain file name" "$bin" inspect "$d"
d=$(model e400); own "$d" config.json
sed -i 's/"rms_norm_eps": 1e-05/"rms_norm_eps": 1e400/' "$d/config.json"
expect "1e400 in a config" 2 "config.json: byte [0-9]+: the number \"1e400\" is out of range" "$bin" inspect "$d"
d=$(model e400h); rm "$d/$s2"
rewrite_header "$tiny/$s2" "$d/$s2" 's/"shape":\[512,128\]/"shape":[1e400,128]/'
expect "1e400 in a header" 2 "$s2: byte [0-9]+: the number \"1e400\" is out of range" "$bin" inspect "$d"
d=$(model bos); own "$d" tokenizer_config.json
sed -i 's/"bos_token": "\[BOS\]"/"bos_token": {"content": 5}/' "$d/tokenizer_config.json"
expect "bos_token {\"content\": 5}" 2 "tokenizer_config.json: 'bos_token' = \{\"content\":5\} is neither a string" "$bin" tokenize "$d" hi
expect "--prompt-file DIR" 2 "$tmp: is a directory, not a regular file" "$bin" run "$tiny" --prompt-file "$tmp" --gen 2

# ---- 9. nonsense that used to be accepted --------------------------------------------------------------------
for edit in 's/"rms_norm_eps": 1e-05/"rms_norm_eps": 1e300/|rms_norm_eps: 1e\+300 does not fit a 32-bit float' \
            's/"activation_situ_beta": 4.0/"activation_situ_beta": 0/|activation_situ_beta: must be positive' \
            's/"routed_scaling_factor": 1.0/"routed_scaling_factor": -1/|routed_scaling_factor: must be positive' \
            's/"num_shared_experts": 1/"num_shared_experts": 0/|num_shared_experts: 0 \(a MoE without shared experts\) is an option'; do
    d=$(model nonsense); own "$d" config.json
    sed -i "${edit%%|*}" "$d/config.json"
    expect "refused: ${edit#*|}" 2 "${edit#*|}" "$bin" inspect "$d"
    rm -rf "$d"
done
d=$(model dup); rm "$d/$s2"
rewrite_header "$tiny/$s2" "$d/$s2" 's/"language_model.lm_head.weight":{"dtype":"BF16"/&,"dtype":"F32"/'
expect "a field given twice in a tensor entry" 2 "key 'dtype' appears twice in the object language_model.lm_head.weight" "$bin" inspect "$d"
d=$(model nul); rm "$d/$s2"
n=$(header_len "$tiny/$s2")
{ u64le "$n"; tail -c +9 "$tiny/$s2" | head -c "$n" | sed 's/ *$//' | tr -d '\n' > "$tmp/h.json"; cat "$tmp/h.json"
  head -c $((n - $(wc -c < "$tmp/h.json"))) /dev/zero; tail -c +$((9 + n)) "$tiny/$s2"; } > "$d/$s2"
expect "a header padded with NUL bytes" 2 "$s2: byte [0-9]+ is a NUL byte" "$bin" inspect "$d"
expect "--threads 0" 2 "--threads: must be at least 1" "$bin" run "$tiny" --ids 1 --threads 0
expect "--threads 2^32 + 1" 2 "--threads: 4294967297 is more than 4096" "$bin" run "$tiny" --ids 1 --threads 4294967297
for opt in --out --dump-logits --trace-experts; do
    expect "$opt into a missing folder fails before any weight is read" 2 "$opt: cannot write '$tmp/none/x': No such file or directory" \
        "$bin" run "$tiny" --ids 1,2 --gen 2 $opt "$tmp/none/x"
    check "... without a plan shown" not_grep "plan for a budget" "$tmp/last.out"
done
# ---- 10. output files are never silently wrong (was: a symlink or device replaced by a regular file) ----------
mkdir -p "$tmp/outs" && echo old > "$tmp/outs/real.json" && ln -s real.json "$tmp/outs/link.json" && echo "the user's" > "$tmp/outs/o.json.tmp"
expect "--out through a symlink" 0 "" "$bin" run "$tiny" --ids 1,2 --gen 2 --quiet --out "$tmp/outs/link.json"
check "... writes its target, the link stays a link" sh -c "[ -L '$tmp/outs/link.json' ] && jq -e '.generated_ids | length == 2' '$tmp/outs/real.json' >/dev/null"
expect "--out next to the user's own NAME.tmp" 0 "" "$bin" run "$tiny" --ids 1,2 --gen 2 --quiet --out "$tmp/outs/o.json"
check "... leaves it alone, and no temporary file" sh -c "[ \"\$(cat '$tmp/outs/o.json.tmp')\" = \"the user's\" ] && ! ls '$tmp/outs' | grep -q '\\.tmp\\.'"
bounded "$bin" run "$tiny" --ids 1,2 --gen 2 --quiet --out /dev/stdout > "$tmp/outs/stdout.txt" 2>/dev/null
check "--out /dev/stdout prints the ids, then the JSON, into what stdout is" sh -c "head -n 1 '$tmp/outs/stdout.txt' | grep -qE '^[0-9]+,[0-9]+\$' && tail -n +2 '$tmp/outs/stdout.txt' | jq -e '.generated_ids | length == 2' >/dev/null"
check "... and /dev/stdout is still a device" [ -c /dev/null ] && [ ! -f /dev/stdout ]
ln -s "$tmp/outs/nowhere.json" "$tmp/outs/dangling.json"
expect "--out through a dangling symlink is refused before any weight is read" 2 "--out: cannot write '$tmp/outs/dangling.json': is a symbolic link to a file that does not exist" \
    "$bin" run "$tiny" --ids 1,2 --gen 2 --out "$tmp/outs/dangling.json"
expect "--dump-logits /dev/null is written as the device" 0 "" "$bin" run "$tiny" --ids 1,2 --gen 2 --quiet --dump-logits /dev/null
check "... which stays a device" [ -c /dev/null ]
blk=$(find /dev -maxdepth 1 -type b 2>/dev/null | head -n 1)
if [ -n "$blk" ]; then
    expect "--out onto a block device is refused" 2 "is a block device: refused" "$bin" run "$tiny" --ids 1,2 --gen 2 --out "$blk"
else
    echo "SKIPPED: --out onto a block device (no block device in /dev here)"
fi

# ---- 10. the text path ------------------------------------------------------------------------------------
check "detokenize writes a NUL byte and what follows it" [ "$(bounded "$bin" detokenize "$tiny" 97,0,98 | od -An -c | tr -d ' \n')" = 'a\0b\n' ]
expect "tokenize: '-' is text" 0 "^45$" "$bin" tokenize "$tiny" -
expect "tokenize --stdin reads standard input" 0 "^45$" sh -c "printf '%s' - | '$bin' tokenize '$tiny' --stdin"
expect "tokenize --text takes a text that looks like an option" 0 "^45,45,258,108,112$" "$bin" tokenize "$tiny" --text --help
expect "--think-effort must be one of the template's values" 2 "--think-effort: 'extreme' is not one of low, high, max, none" \
    "$bin" run "$tiny" --prompt hi --think --think-effort extreme
prompt_len() { bounded "$bin" run "$tiny" --prompt hi --gen 1 --quiet --out "$tmp/p.json" "$@" > /dev/null 2>&1; tr -d ' \n' < "$tmp/p.json" | grep -o '"prompt_ids":\[[0-9,]*\]' | tr -cd , | wc -c; }
with=$(prompt_len --think); without=$(prompt_len --think --think-effort none)
check "--think opens with the template's thinking-effort message ($with prompt ids; $without with --think-effort none)" [ "$with" -gt $((without + 30)) ]

echo "kimik3-tests: hostile.sh $pass passed, $fail failed"
