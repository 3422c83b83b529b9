#!/usr/bin/env bash
# Tests of kimik3 serve: the OpenAI protocol with curl (the same tokens as kimik3 run, every refusal with
# its status and error object, state reuse, a disconnect, the queue limit, the API key, a failed weight
# read), then a real client (the openai npm package) and a real browser (headless chromium on the page).
# Everything talks to 127.0.0.1 only, on ports the OS picks (--port 0); every curl has --max-time, and
# every server started here is killed on exit. Each check counts as one test case; a check that cannot
# run here (no npm registry, no chromium) prints SKIPPED and is not counted as passed.
# The binary comes from $KIMIK3 (the Makefile passes the one it built); the model from $KIMIK3_SERVE_MODEL.
cd "$(dirname "$0")/.." || exit 1
bin=${KIMIK3:-build/g++/kimik3}
model=${KIMIK3_SERVE_MODEL:-fixtures/tiny-k3}
name=$(basename "$model")
pass=0
fail=0
tmp=$(mktemp -d /tmp/kimik3-serve-XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

for tool in curl jq; do
    command -v $tool >/dev/null || { echo "FAILED: serve.sh needs $tool (make deps installs it)"; echo "kimik3-tests: serve.sh 0 passed, 1 failed"; exit 1; }
done

ok() { pass=$((pass + 1)); }
bad() {
    fail=$((fail + 1))
    echo "FAILED: $*"
}
# check NAME CONDITION...: one test case
check() {
    local what=$1
    shift
    if "$@" >/dev/null; then ok; else bad "$what"; fi
}
same() { [ "$1" = "$2" ] || { echo "  got:  $1" >&2; echo "  want: $2" >&2; return 1; }; }

# start NAME ARGS...: kimik3 serve on a port the OS picks; waits (at most 60 s) until it listens and sets
# URL and SPID. The log is $tmp/NAME.log.
start() {
    local log=$tmp/$1.log
    shift
    KIMIK3_TEST_FAIL_SERVE_READS=${FAIL_READS:-} "$bin" serve "$model" --port 0 "$@" >"$log" 2>&1 &
    SPID=$!
    pids+=("$SPID")
    URL=
    for _ in $(seq 600); do
        local port
        port=$(sed -nE 's|.*listening on http://127\.0\.0\.1:([0-9]+).*|\1|p' "$log")
        if [ -n "$port" ]; then URL=http://127.0.0.1:$port; return 0; fi
        kill -0 "$SPID" 2>/dev/null || break
        sleep 0.1
    done
    echo "server did not start:"
    cat "$log"
    return 1
}

# post URL PATH JSON [curl args...]: prints the status; the body goes to $tmp/body, headers to $tmp/headers
post() {
    local url=$1 path=$2 body=$3
    shift 3
    curl -s --max-time 60 -o "$tmp/body" -D "$tmp/headers" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary "$body" "$@" "$url$path"
}
get() { curl -s --max-time 20 -o "$tmp/body" -D "$tmp/headers" -w '%{http_code}' "${@:2}" "$1"; }
# stream URL PATH JSON: the data lines of a server-sent event stream, one per line, into $tmp/events
stream() { curl -s -N --max-time 60 -H 'Content-Type: application/json' --data-binary "$3" "$1$2" | sed -n 's/^data: //p' >"$tmp/events"; }

# expect_error NAME STATUS CODE PATH BODY [curl args]: the status, and an OpenAI error object with that code
expect_error() {
    local what=$1 status=$2 code=$3 path=$4 body=$5
    shift 5
    local got
    got=$(post "$URL" "$path" "$body" "$@")
    if [ "$got" = "$status" ] && jq -e --arg c "$code" '.error.code == $c and (.error.message | length > 0) and (.error.type | length > 0)' "$tmp/body" >/dev/null 2>&1; then
        ok
    else
        bad "$what: status $got (want $status), body $(head -c 300 "$tmp/body")"
    fi
}

# ---- the same tokens as kimik3 run ------------------------------------------------------------------------
run_ids() { "$bin" run "$model" --quiet --out "$tmp/run.json" "$@" >/dev/null 2>&1 && jq -c '.generated_ids' "$tmp/run.json"; }
run_prompt() { jq -c '.prompt_ids' "$tmp/run.json"; }
greedy_run=$(run_ids --prompt "Hello, tiny K3" --gen 12)
greedy_prompt=$(run_prompt)
sampled_run=$(run_ids --prompt "Tell me about experts." --gen 16 --temperature 0.9 --top-p 0.95 --seed 42)
[ -n "$greedy_run" ] && [ -n "$sampled_run" ] || bad "kimik3 run did not give ids to compare with"

start main --context 256 --max-body 64K --quiet || { echo "kimik3-tests: serve.sh $pass passed, $((fail + 1)) failed"; exit 1; }
msg() { jq -nc --arg t "$1" '[{role: "user", content: $t}]'; }
# the reply stub that usage.prompt_tokens leaves out: <|open|>response<|sep|> (3 ids in K3's vocabulary)
stub=$(( $("$bin" tokenize "$model" response 2>/dev/null | tr ',' '\n' | wc -l) + 2 ))

st=$(post "$URL" /v1/chat/completions "{\"model\":\"$name\",\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":12,\"temperature\":0,\"thinking\":false,\"kimik3\":{}}")
check "chat, not streamed: 200" same "$st" 200
cp "$tmp/body" "$tmp/greedy.json"
check "chat, not streamed: the prompt is run's (render_chat)" same "$(jq -c '.kimik3.prompt_ids' "$tmp/greedy.json")" "$greedy_prompt"
check "chat, not streamed, greedy: the same ids as kimik3 run" same "$(jq -c '.kimik3.ids' "$tmp/greedy.json")" "$greedy_run"
check "chat: object, model, one choice with an assistant message" jq -e '.object == "chat.completion" and .model == "'"$name"'" and (.choices | length) == 1 and .choices[0].message.role == "assistant" and (.choices[0].message.content | type) == "string" and (.id | startswith("chatcmpl-"))' "$tmp/greedy.json"
check "chat: usage counts the prompt (less the reply stub, as Moonshot) and every drawn token" jq -e --argjson stub "$stub" '.usage.prompt_tokens == (.kimik3.prompt_ids | length) - $stub and .usage.completion_tokens == (.kimik3.ids | length) and .usage.total_tokens == .usage.prompt_tokens + .usage.completion_tokens' "$tmp/greedy.json"
# finish_reason: stop when the last id is <|end_of_msg|> or [EOS], else length (12 tokens drawn)
last=$(jq '.kimik3.ids[-1]' "$tmp/greedy.json")
last_name=$("$bin" detokenize "$model" "$last" 2>/dev/null)
want_finish=length
case "$last_name" in "<|end_of_msg|>" | "[EOS]") want_finish=stop ;; esac
check "chat: finish_reason is $want_finish" same "$(jq -r '.choices[0].finish_reason' "$tmp/greedy.json")" "$want_finish"
check "chat: no reasoning_content unless thinking is on" jq -e '.choices[0].message | has("reasoning_content") | not' "$tmp/greedy.json"
st=$(post "$URL" /v1/chat/completions "{\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":12,\"temperature\":0,\"thinking\":false}")
check "chat: without the kimik3 field, no extension data" jq -e 'has("kimik3") | not' "$tmp/body"
check "chat: the same content again (greedy, state reused or not)" same "$(jq -c '.choices[0].message.content' "$tmp/body")" "$(jq -c '.choices[0].message.content' "$tmp/greedy.json")"

stream "$URL" /v1/chat/completions "{\"messages\":$(msg "Tell me about experts."),\"max_tokens\":16,\"temperature\":0.9,\"top_p\":0.95,\"seed\":42,\"thinking\":false,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"kimik3\":{}}"
check "chat, streamed, sampled (seed 42): the same ids as kimik3 run" same "$(grep -v '^\[DONE\]' "$tmp/events" | jq -sc '[.[] | .kimik3.token // empty]')" "$sampled_run"
check "chat, streamed: ends with [DONE]" same "$(tail -n 1 "$tmp/events")" "[DONE]"
check "chat, streamed: one chunk per token, the first with the role, one finish_reason, then usage" \
    jq -se --argjson want "$sampled_run" '([.[] | select(.kimik3.token != null)] | length) == ($want | length) and .[0].choices[0].delta.role == "assistant" and (map(select((.choices | length) > 0 and .choices[0].finish_reason != null)) | length) == 1 and .[-1].usage.completion_tokens == ($want | length) and (.[-1].choices | length) == 0 and all(.[]; .object == "chat.completion.chunk")' \
    <(grep -v '^\[DONE\]' "$tmp/events")
streamed_text=$(grep -v '^\[DONE\]' "$tmp/events" | jq -sr '[.[] | .choices[0].delta.content // empty] | join("")')
post "$URL" /v1/chat/completions "{\"messages\":$(msg "Tell me about experts."),\"max_tokens\":16,\"temperature\":0.9,\"top_p\":0.95,\"seed\":42,\"thinking\":false}" >/dev/null
check "chat: streamed and not streamed give the same text" same "$(jq -r '.choices[0].message.content' "$tmp/body")" "$streamed_text"

# a stop sequence: a piece of the greedy reply's text; the reply ends just before its first occurrence
text=$(jq -r '.choices[0].message.content' "$tmp/greedy.json")
if [ ${#text} -ge 6 ]; then
    stop=${text:2:3}
    before=${text%%"$stop"*}
    post "$URL" /v1/chat/completions "$(jq -nc --arg s "$stop" --argjson m "$(msg "Hello, tiny K3")" '{messages: $m, max_tokens: 12, temperature: 0, thinking: false, stop: [$s]}')" >/dev/null
    check "chat: a stop sequence cuts the reply before it, finish_reason stop" \
        jq -e --arg b "$before" '.choices[0].message.content == $b and .choices[0].finish_reason == "stop"' "$tmp/body"
else
    bad "the greedy reply is too short to pick a stop sequence from ('$text')"
fi

# raw completions
st=$(post "$URL" /v1/completions '{"prompt":"Once upon a time","max_tokens":5,"temperature":0,"kimik3":{}}')
raw_run=$(run_ids --prompt "Once upon a time" --raw --gen 5)
check "completions: 200, text_completion, the same ids as kimik3 run --raw" \
    jq -e --argjson want "$raw_run" '.object == "text_completion" and (.choices[0].text | type) == "string" and .kimik3.ids == $want' "$tmp/body"

# thinking: reasoning_content is present (the tiny model's reply lands wherever its tokens say)
post "$URL" /v1/chat/completions "{\"messages\":$(msg "Think first."),\"max_tokens\":8,\"temperature\":0,\"thinking\":{\"type\":\"enabled\"},\"kimik3\":{}}" >/dev/null
think_run=$(run_ids --prompt "Think first." --think --gen 8)
check "chat with thinking: reasoning_content, and run --think's ids" jq -e --argjson want "$think_run" '(.choices[0].message.reasoning_content | type) == "string" and .kimik3.ids == $want' "$tmp/body"

# ---- the K3 API contract: thinking on by default; tools, tool_choice, response_format rendered ----------------
post "$URL" /v1/chat/completions "{\"messages\":$(msg "Think first."),\"max_tokens\":8,\"temperature\":0,\"kimik3\":{}}" >/dev/null
check "chat: thinking is on unless turned off (K3's default): the same ids as with thinking enabled" \
    jq -e --argjson want "$think_run" '(.choices[0].message.reasoning_content | type) == "string" and .kimik3.ids == $want' "$tmp/body"
# ---- the other endpoints ---------------------------------------------------------------------------------
check "GET /v1/models lists the model" sh -c "[ \"\$(curl -s --max-time 10 '$URL/v1/models' | jq -r '.object + \" \" + .data[0].id + \" \" + .data[0].object')\" = 'list $name model' ]"
check "GET /v1/models/$name" same "$(get "$URL/v1/models/$name")" 200
check "GET /health" sh -c "curl -s --max-time 10 '$URL/health' | jq -e '.status == \"ok\"' >/dev/null"
check "GET / is the page" sh -c "curl -s --max-time 10 '$URL/' | grep -q '<title>kimik3</title>'"
check "GET /kimik3/info: the model's shape" sh -c "curl -s --max-time 10 '$URL/kimik3/info' | jq -e '(.layers | length) > 0 and .num_experts > 0' >/dev/null"

# ---- every refusal: its status and an error object --------------------------------------------------------
expect_error "malformed JSON" 400 invalid_json /v1/chat/completions '{"messages": [}'
expect_error "a body that is not an object" 400 invalid_type /v1/chat/completions '[1, 2]'
expect_error "messages of the wrong type" 400 invalid_type /v1/chat/completions '{"messages": "hi"}'
expect_error "a message that is not an object" 400 invalid_type /v1/chat/completions '{"messages": ["hi"]}'
expect_error "a message without a role" 400 invalid_type /v1/chat/completions '{"messages": [{"content": "hi"}]}'
expect_error "an unknown role" 400 invalid_value /v1/chat/completions '{"messages": [{"role": "wizard", "content": "hi"}]}'
expect_error "content of the wrong type" 400 invalid_type /v1/chat/completions '{"messages": [{"role": "user", "content": 5}]}'
expect_error "max_tokens as a string" 400 invalid_type /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}'
expect_error "temperature as a string" 400 invalid_type /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}'
expect_error "temperature out of range" 400 decimal_above_max_value /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "temperature": 7}'
expect_error "stream as a number" 400 invalid_type /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "stream": 1}'
expect_error "stop of the wrong type" 400 invalid_type /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}'
expect_error "an unknown model: 404" 404 model_not_found /v1/chat/completions '{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}'
expect_error "no messages" 400 missing_required_parameter /v1/chat/completions '{"model": "'"$name"'"}'
expect_error "empty messages" 400 empty_array /v1/chat/completions '{"messages": []}'
expect_error "max_tokens 0" 400 integer_below_min_value /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}'
expect_error "max_tokens negative" 400 integer_below_min_value /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}'
expect_error "max_tokens beyond the context" 400 context_length_exceeded /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 250}'
long=$(printf 'word %.0s' $(seq 300))
expect_error "a prompt over the context" 400 context_length_exceeded /v1/chat/completions "{\"messages\": $(msg "$long")}"
big=$(head -c 100000 /dev/zero | tr '\0' 'a')
expect_error "a body over --max-body: 413" 413 request_too_large /v1/chat/completions "{\"messages\": $(msg "$big")}"
expect_error "n = 2 is refused, not ignored" 400 unsupported_value /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "n": 2}'
expect_error "a tool without its function" 400 missing_required_parameter /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}'
expect_error "tool_choice required without tools" 400 invalid_value /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}'
expect_error "a named tool_choice (K3 has no rendering for it)" 400 unsupported_value /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "f"}}}'
expect_error "a tool result without tool_call_id" 400 missing_required_parameter /v1/chat/completions '{"messages": [{"role": "tool", "content": "r"}, {"role": "user", "content": "hi"}]}'
expect_error "response_format json_schema without a schema" 400 missing_required_parameter /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}'
expect_error "reasoning_effort medium (K3: low, high, max)" 400 invalid_value /v1/chat/completions '{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "medium"}'
expect_error "completions without a prompt" 400 missing_required_parameter /v1/completions '{"max_tokens": 3}'
expect_error "completions: a token id outside the vocabulary" 400 invalid_value /v1/completions '{"prompt": [1, 2, 99999]}'
expect_error "an unknown endpoint: 404" 404 not_found /v1/embeddings '{"input": "hi"}'
check "the server is still up after every refusal" same "$(get "$URL/health")" 200

# ---- state reuse -----------------------------------------------------------------------------------------
post "$URL" /v1/chat/completions "{\"messages\":$(msg "Tell me a story."),\"max_tokens\":8,\"temperature\":0,\"thinking\":false,\"kimik3\":{}}" >/dev/null
cp "$tmp/body" "$tmp/r1.json"
check "reuse: a new conversation reuses nothing" jq -e '.usage.prompt_tokens_details.cached_tokens == 0' "$tmp/r1.json"
two=$(jq -nc '[{role: "user", content: "Tell me a story."}, {role: "assistant", content: "Once there was a tiny model."}, {role: "user", content: "And then?"}]')
post "$URL" /v1/chat/completions "{\"messages\":$two,\"max_tokens\":8,\"temperature\":0,\"thinking\":false,\"kimik3\":{}}" >/dev/null
cp "$tmp/body" "$tmp/r2.json"
check "reuse: the second turn reuses the first prompt (the KDA states kept at its end)" \
    jq -e --slurpfile r1 "$tmp/r1.json" '.usage.prompt_tokens_details.cached_tokens == ($r1[0].kimik3.prompt_ids | length)' "$tmp/r2.json"
r2_prompt=$(jq -r '.kimik3.prompt_ids | map(tostring) | join(",")' "$tmp/r2.json")
check "reuse: the second turn's ids = kimik3 run over its whole prompt" same "$(jq -c '.kimik3.ids' "$tmp/r2.json")" "$(run_ids --ids "$r2_prompt" --gen 8)"
r3_prompt=$(jq -c '.kimik3.prompt_ids + .kimik3.ids' "$tmp/r2.json")
post "$URL" /v1/completions "{\"prompt\":$r3_prompt,\"max_tokens\":6,\"temperature\":0,\"kimik3\":{}}" >/dev/null
cp "$tmp/body" "$tmp/r3.json"
check "reuse: a prompt that extends the live session reuses all of it (prompt + reply but the last token)" \
    jq -e --slurpfile r2 "$tmp/r2.json" '.usage.prompt_tokens_details.cached_tokens == ($r2[0].kimik3.prompt_ids | length) + $r2[0].usage.completion_tokens - 1' "$tmp/r3.json"
check "reuse: ... and its ids = kimik3 run over the whole sequence" same "$(jq -c '.kimik3.ids' "$tmp/r3.json")" \
    "$(run_ids --ids "$(echo "$r3_prompt" | jq -r 'map(tostring) | join(",")')" --gen 6)"

# ---- the trace: the engine's per-step state ---------------------------------------------------------------
post "$URL" /v1/chat/completions "{\"messages\":$(msg "Show me the experts."),\"max_tokens\":4,\"temperature\":0,\"thinking\":false,\"kimik3\":{\"trace\":true}}" >/dev/null
k=$(jq '.experts_per_token' <(curl -s --max-time 10 "$URL/kimik3/info"))
E=$(jq '.num_experts' <(curl -s --max-time 10 "$URL/kimik3/info"))
check "trace: every token has every layer; each MoE layer K distinct experts with weights, each mix sums to 1" \
    jq -e --argjson k "$k" --argjson E "$E" '(.kimik3.tokens | length) == (.kimik3.ids | length) and all(.kimik3.tokens[];
      (.step.layers | length) > 0 and all(.step.layers[]; (.experts == null or ((.experts | length) == $k and (.experts | unique | length) == $k and all(.experts[]; . >= 0 and . < $E) and (.weights | length) == $k))
        and ((.mlp_mix | add) - 1 | fabs) < 1e-4 and ((.attn_mix | length) == 0 or ((.attn_mix | add) - 1 | fabs) < 1e-4)))' "$tmp/body"
check "trace: the first step fed the prompt, later steps one token" \
    jq -e '.kimik3.tokens[0].step.tokens_fed == ((.kimik3.prompt_ids | length) - .usage.prompt_tokens_details.cached_tokens) and all(.kimik3.tokens[1:][]; .step.tokens_fed == 1)' "$tmp/body"

# ---- a client that disconnects stops its generation; the next request is served -------------------------
curl -s -N --max-time 60 -H 'Content-Type: application/json' \
    --data-binary "{\"thinking\":false,\"messages\":$(msg "Go on and on."),\"max_tokens\":190,\"temperature\":1,\"seed\":3,\"ignore_eos\":true,\"stream\":true,\"kimik3\":{\"trace\":true}}" \
    "$URL/v1/chat/completions" | head -c 600 >/dev/null
freed=0
for _ in $(seq 100); do
    if curl -s --max-time 5 "$URL/health" | jq -e '.busy == false' >/dev/null 2>&1; then freed=1; break; fi
    sleep 0.05
done
check "disconnect: the server is free again within 5 s" same "$freed" 1
check "disconnect: the next request is served" same "$(post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "hi"),\"max_tokens\":2}")" 200
kill "$SPID"
wait "$SPID" 2>/dev/null
check "disconnect: the generation stopped early (server log)" grep -qE "the client left after [0-9]+ of 190 tokens" "$tmp/main.log"

# ---- --speculate N: the same replies, bit for bit, in fewer steps (as kimik3 run --speculate) ---------------
start spec --context 256 --quiet --speculate 4 || bad "the --speculate server did not start"
post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":12,\"temperature\":0,\"kimik3\":{}}" >/dev/null
check "serve --speculate 4, greedy: the same ids as kimik3 run" same "$(jq -c '.kimik3.ids' "$tmp/body")" "$greedy_run"
check "serve --speculate 4, greedy: the same content as without --speculate" same "$(jq -c '.choices[0].message.content' "$tmp/body")" "$(jq -c '.choices[0].message.content' "$tmp/greedy.json")"
stream "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "Tell me about experts."),\"max_tokens\":16,\"temperature\":0.9,\"top_p\":0.95,\"seed\":42,\"stream\":true,\"kimik3\":{}}"
check "serve --speculate 4, streamed, sampled (seed 42): the same ids as kimik3 run" same "$(grep -v '^\[DONE\]' "$tmp/events" | jq -sc '[.[] | .kimik3.token // empty]')" "$sampled_run"
check "serve --speculate 4, streamed: the same text as without --speculate" same "$(grep -v '^\[DONE\]' "$tmp/events" | jq -sr '[.[] | .choices[0].delta.content // empty] | join("")')" "$streamed_text"
kill "$SPID"
wait "$SPID" 2>/dev/null
# the little K3 repeats what it read, so its drafts are accepted: verify steps that keep several tokens
served_model=$model
model=fixtures/little-k3
un="The United Nations system is the most important part of the United Nations. The United Nations system"
little_run=$(run_ids --raw --prompt "$un" --gen 32)
start spec-little --context 256 --quiet --speculate 8 || bad "the little --speculate server did not start"
post "$URL" /v1/completions "$(jq -nc --arg p "$un" '{prompt: $p, max_tokens: 32, temperature: 0, kimik3: {trace: true}}')" >/dev/null
check "serve --speculate 8 on the little K3: the same ids as kimik3 run without it" jq -e --argjson want "$little_run" '.kimik3.ids == $want' "$tmp/body"
check "serve --speculate 8 on the little K3: drafts accepted (fewer steps than tokens, a step fed more than one)" \
    jq -e '([.kimik3.tokens[].step.index] | unique | length) < (.kimik3.ids | length) and any(.kimik3.tokens[1:][]; .step.tokens_fed > 1)' "$tmp/body"
kill "$SPID"
wait "$SPID" 2>/dev/null
model=$served_model
usage_error() { local out; out=$("$bin" serve "$model" --port 0 "$@" 2>&1 </dev/null); [ $? -eq 2 ] && grep -q -- "$USAGE_WANT" <<<"$out"; }
USAGE_WANT="--speculate must be at least 1" check "serve --speculate 0 is a usage error (exit 2)" usage_error --speculate 0
USAGE_WANT="--speculate: 33 is more than 32" check "serve --speculate 33 is a usage error (exit 2)" usage_error --speculate 33

# ---- --max-batch N: concurrent requests in one forward step each, every reply the one it gets alone ----------
# Each request's reply, less what names the reply (id, created) and what depends on the server's history
# (cached_tokens, timings): the choices, the ids and the usage, per chunk when streamed.
whole_of() { jq -cS '{choices, ids: .kimik3.ids, usage: (.usage | del(.prompt_tokens_details))}' "$1"; }
stream_of() { { grep -v '^\[DONE\]' "$1" | jq -cS '{choices, token: .kimik3.token, piece: .kimik3.piece, error, usage: (.usage // null | if . then del(.prompt_tokens_details) else . end)}'; tail -n 1 "$1"; } | md5sum; }
batch_req=(
    "{\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":24,\"temperature\":0,\"thinking\":false,\"kimik3\":{}}"
    "{\"messages\":$(msg "Tell me about experts."),\"max_tokens\":40,\"temperature\":0.9,\"top_p\":0.95,\"seed\":42,\"thinking\":false,\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"kimik3\":{}}"
    "{\"prompt\":\"Once upon a time\",\"max_tokens\":60,\"temperature\":0.7,\"seed\":7,\"ignore_eos\":true,\"kimik3\":{}}"
    "{\"messages\":$(msg "Think first."),\"max_tokens\":80,\"temperature\":1.2,\"seed\":5,\"ignore_eos\":true,\"stream\":true,\"kimik3\":{}}"
    "{\"messages\":$(msg "Tell me a story."),\"max_tokens\":30,\"temperature\":0.8,\"seed\":9,\"thinking\":false,\"stop\":[\"e \"],\"stream\":true,\"kimik3\":{}}"
    "{\"messages\":$(msg "A longer question, with a few more words in it, to make a longer prompt than the others."),\"max_tokens\":50,\"temperature\":0.5,\"seed\":11,\"thinking\":false,\"top_k\":20,\"kimik3\":{}}"
)
# batch_one URL I OUT: request I, its normalized reply into OUT
batch_one() {
    local body=${batch_req[$2]}
    if [[ $body == *'"stream":true'* ]]; then
        curl -s -N --max-time 120 -H 'Content-Type: application/json' --data-binary "$body" "$1/v1/$( [[ $body == *'"prompt"'* ]] && echo completions || echo chat/completions)" | sed -n 's/^data: //p' >"$3.raw"
        stream_of "$3.raw" >"$3"
    else
        curl -s --max-time 120 -o "$3.raw" -H 'Content-Type: application/json' --data-binary "$body" "$1/v1/$( [[ $body == *'"prompt"'* ]] && echo completions || echo chat/completions)"
        whole_of "$3.raw" >"$3"
    fi
}
start batch-ref --context 512 --quiet || bad "the --max-batch 1 server did not start"
for i in "${!batch_req[@]}"; do batch_one "$URL" "$i" "$tmp/alone.$i"; done
check "serve --max-batch 1: /kimik3/status says one conversation per step" sh -c "curl -s --max-time 10 '$URL/kimik3/status' | jq -e '.max_batch == 1 and .active == 0 and (.reads.generated_tokens <= .reads.steps)' >/dev/null"
kill "$SPID"
wait "$SPID" 2>/dev/null
start batch --context 512 --budget floor --max-batch 4 --queue 8 || bad "the --max-batch 4 server did not start"
clients=()
for i in "${!batch_req[@]}"; do
    (sleep "0.$((i * 15))"; batch_one "$URL" "$i" "$tmp/batched.$i") &
    clients+=($!)
    if [ "$i" = 1 ]; then  # a client that leaves mid-way: its generation stops, the others go on
        curl -s -N --max-time 60 -H 'Content-Type: application/json' --data-binary "{\"thinking\":false,\"messages\":$(msg "Go on and on."),\"max_tokens\":400,\"temperature\":1,\"seed\":3,\"ignore_eos\":true,\"stream\":true}" "$URL/v1/chat/completions" | head -c 3000 >/dev/null &
        clients+=($!)
    fi
done
most=0 shared=0
alive() { for p in "${clients[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
while alive; do
    n=$(curl -s --max-time 5 "$URL/kimik3/status" | jq '[.conversations[] | select(.batched and .state != "queued")] | length' 2>/dev/null)
    [ -n "$n" ] && [ "$n" -gt "$most" ] && most=$n
    sleep 0.05
done
wait "${clients[@]}" 2>/dev/null
for i in "${!batch_req[@]}"; do
    check "serve --max-batch 4: concurrent request $i gets the bytes it gets alone" same "$(cat "$tmp/batched.$i")" "$(cat "$tmp/alone.$i")"
done
check "serve --max-batch 4: the status page saw several conversations in one batch (at most $most)" sh -c "[ $most -ge 2 ] && [ $most -le 4 ]"
check "serve --max-batch 4: the steps generated more tokens than there were steps (one read for several)" \
    sh -c "curl -s --max-time 10 '$URL/kimik3/status' | jq -e '.max_batch == 4 and .reads.generated_tokens > .reads.steps and .reads.trunk_bytes_per_token < .reads.trunk_bytes_per_step' >/dev/null"
check "serve --max-batch 4: the client that left stopped its generation (server log)" grep -qE "the client left after [0-9]+ of 400 tokens" "$tmp/batch.log"
check "serve --max-batch 4: idle again, and serves the next request" sh -c "curl -s --max-time 10 '$URL/health' | jq -e '.busy == false and .queued == 0' >/dev/null && [ \"\$(curl -s --max-time 30 -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' --data-binary '{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2}' '$URL/v1/chat/completions')\" = 200 ]"
batch_one "$URL" 0 "$tmp/again.0"
check "serve --max-batch 4: a request alone, on a session other conversations used, the same bytes" same "$(cat "$tmp/again.0")" "$(cat "$tmp/alone.0")"
ext=$(jq -c '.kimik3.prompt_ids + .kimik3.ids' "$tmp/again.0.raw")
post "$URL" /v1/completions "{\"prompt\":$ext,\"max_tokens\":6,\"temperature\":0,\"kimik3\":{}}" >/dev/null
check "serve --max-batch 4: a prompt that extends a conversation reuses its session (prompt + reply but the last token)" \
    jq -e --slurpfile a "$tmp/again.0.raw" '.usage.prompt_tokens_details.cached_tokens == ($a[0].kimik3.prompt_ids | length) + $a[0].usage.completion_tokens - 1' "$tmp/body"
check "serve --max-batch 4: ... and its ids = kimik3 run over the whole sequence" same "$(jq -c '.kimik3.ids' "$tmp/body")" \
    "$(run_ids --ids "$(echo "$ext" | jq -r 'map(tostring) | join(",")')" --gen 6)"
kill "$SPID"
wait "$SPID" 2>/dev/null
# the same clients at once against --max-batch 4 --speculate 4: each request drafts and verifies in the shared steps
start batch-spec --context 512 --budget floor --max-batch 4 --queue 8 --speculate 4 || bad "the --max-batch 4 --speculate 4 server did not start"
clients=()
for i in "${!batch_req[@]}"; do
    (sleep "0.$((i * 15))"; batch_one "$URL" "$i" "$tmp/spec.$i") &
    clients+=($!)
done
wait "${clients[@]}" 2>/dev/null
for i in "${!batch_req[@]}"; do
    check "serve --max-batch 4 --speculate 4: concurrent request $i gets the bytes it gets alone" same "$(cat "$tmp/spec.$i")" "$(cat "$tmp/alone.$i")"
done
check "serve --max-batch 4 --speculate 4: the start line says each request verifies its own drafts" grep -q "each verifies its own --speculate drafts" "$tmp/batch-spec.log"
kill "$SPID"
wait "$SPID" 2>/dev/null
# N requests generate and the queue is full: 503, as with one
start batch-queue --context 8192 --max-batch 2 --queue 0 --quiet || bad "the --max-batch 2 --queue 0 server did not start"
long_req="{\"thinking\":false,\"messages\":$(msg "Keep going."),\"max_tokens\":8000,\"temperature\":1,\"ignore_eos\":true,\"stream\":true}"
curl -s -N --max-time 60 -H 'Content-Type: application/json' --data-binary "$long_req" "$URL/v1/chat/completions" >/dev/null &
c1=$!
curl -s -N --max-time 60 -H 'Content-Type: application/json' --data-binary "$long_req" "$URL/v1/chat/completions" >/dev/null &
c2=$!
for _ in $(seq 200); do curl -s --max-time 5 "$URL/kimik3/status" | jq -e '.active == 2' >/dev/null 2>&1 && break; sleep 0.05; done
st=$(post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "me too"),\"max_tokens\":2}")
check "serve --max-batch 2 --queue 0: two generating, a third is refused with 503" sh -c "[ '$st' = 503 ] && jq -e '.error.code == \"server_overloaded\"' '$tmp/body' >/dev/null"
kill $c1 $c2 2>/dev/null
wait $c1 $c2 2>/dev/null
kill "$SPID"
wait "$SPID" 2>/dev/null
# a failed weight read in a batch's step: its requests end with an error event, the next is served right
floor2=$("$bin" plan "$model" --budget 1 --context 128 --max-batch 2 2>&1 | sed -nE 's/.*floor of .* \(([0-9]+) bytes\).*/\1/p')
FAIL_READS=1000:1 start batch-fail --context 128 --budget "$floor2" --max-batch 2 --quiet || bad "the failing --max-batch 2 server did not start"
stream "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":12,\"temperature\":0,\"stream\":true,\"kimik3\":{}}"
check "serve --max-batch 2, a failed read: tokens, then an error event naming the read, no [DONE]" \
    sh -c "grep -q '\"weight_read_failed\"' '$tmp/events' && ! grep -q '^\[DONE\]' '$tmp/events' && [ \$(grep -c '\"token\"' '$tmp/events') -ge 1 ]"
post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":12,\"temperature\":0,\"kimik3\":{}}" >/dev/null
check "serve --max-batch 2, a failed read: the next request is served with kimik3 run's ids" same "$(jq -c '.kimik3.ids' "$tmp/body")" "$greedy_run"
kill "$SPID"
wait "$SPID" 2>/dev/null
# --max-batch past what --budget holds: refused at start (exit 3) with what each conversation takes
floor1=$("$bin" plan "$model" --budget 1 --context 128 2>&1 | sed -nE 's/.*floor of .* \(([0-9]+) bytes\).*/\1/p')
out=$("$bin" serve "$model" --port 0 --context 128 --budget "$floor1" --max-batch 64 2>&1 </dev/null)
code=$?
check "serve --max-batch 64 at the floor of one conversation: exit 3, the sizes per conversation" \
    sh -c "[ $code = 3 ] && printf '%s' \"\$1\" | grep -q '64 conversations' && printf '%s' \"\$1\" | grep -qE 'carried state [0-9.]+ [kMG]?B \+ MLA cache [0-9.]+ [kMG]?B per conversation'" _ "$out"
USAGE_WANT="--max-batch" check "serve --max-batch 0 is a usage error (exit 2)" usage_error --max-batch 0

# ---- one at a time: a bounded queue, then 503 with Retry-After --------------------------------------------
start queue --context 8192 --queue 1 || bad "the queue server did not start"
# the K3 API contract with tools (under the tiny vocabulary a tool prompt is ~500 ids: this server has room)
tools='[{"type": "function", "function": {"name": "get_weather", "description": "Get the weather of a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]'
st=$(post "$URL" /v1/chat/completions "{\"messages\":[{\"role\":\"system\",\"content\":\"\",\"tools\":$tools},{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],\"tool_choice\":\"required\",\"response_format\":{\"type\":\"json_object\"},\"max_tokens\":4,\"temperature\":0,\"thinking\":false,\"kimik3\":{}}")
check "chat with dynamic tools, tool_choice required, json_object: 200" same "$st" 200
prompt_text=$("$bin" detokenize "$model" "$(jq -r '.kimik3.prompt_ids | map(tostring) | join(",")' "$tmp/body")" 2>/dev/null)
check "... the prompt holds the encoder's tool-declare, tool-choice and response-format messages" sh -c \
    "printf '%s' \"\$1\" | grep -q 'type=\"tool-declare\"<|sep|>## New Tools Available' && printf '%s' \"\$1\" | grep -q 'tool_choice=required' && printf '%s' \"\$1\" | grep -q 'response_format=json_object'" _ "$prompt_text"
history='[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]'
st=$(post "$URL" /v1/chat/completions "{\"messages\":$history,\"tools\":$tools,\"max_tokens\":2,\"temperature\":0,\"thinking\":false,\"kimik3\":{}}")
prompt_text=$("$bin" detokenize "$model" "$(jq -r '.kimik3.prompt_ids | map(tostring) | join(",")' "$tmp/body")" 2>/dev/null)
check "a tool call and its result render as the encoder's call and tool message" sh -c \
    "printf '%s' \"\$1\" | grep -q '<|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument' && printf '%s' \"\$1\" | grep -q 'message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>18 C'" _ "$prompt_text"

# ignore_eos: a model with random weights draws an end-of-turn token within ~150 tokens, too soon for a queue
long_req="{\"thinking\":false,\"messages\":$(msg "Keep going."),\"max_tokens\":8000,\"temperature\":1,\"ignore_eos\":true,\"stream\":true}"
post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "Keep going."),\"max_tokens\":300,\"temperature\":1,\"seed\":2,\"ignore_eos\":true}" >/dev/null
check "ignore_eos: a reply that would end at once (seed 2 stops after 3 tokens) runs to max_tokens" \
    jq -e '.usage.completion_tokens == 300 and .choices[0].finish_reason == "length"' "$tmp/body"
curl -s -N --max-time 60 -H 'Content-Type: application/json' --data-binary "$long_req" "$URL/v1/chat/completions" >/dev/null &
c1=$!
wait_health() {
    for _ in $(seq 200); do
        curl -s --max-time 5 "$URL/health" | jq -e "$1" >/dev/null 2>&1 && return 0
        sleep 0.05
    done
    return 1
}
wait_health '.busy == true'
curl -s -N --max-time 60 -H 'Content-Type: application/json' --data-binary "$long_req" "$URL/v1/chat/completions" >/dev/null &
c2=$!
if wait_health '.queued == 1'; then
    st=$(post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "me too"),\"max_tokens\":2}")
    check "queue full: 503 with an error object" sh -c "[ '$st' = 503 ] && jq -e '.error.code == \"server_overloaded\"' '$tmp/body' >/dev/null"
    check "queue full: Retry-After" grep -qiE '^Retry-After: [0-9]+' "$tmp/headers"
else
    bad "queue: the second request never queued (the first ended too soon?)"
fi
kill $c1 $c2 2>/dev/null
wait $c1 $c2 2>/dev/null
check "queue: both clients gone, the server is idle again" wait_health '.busy == false and .queued == 0'
check "queue: and serves the next request" same "$(post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "hi"),\"max_tokens\":2}")" 200
# a client of a reply that is not streamed gives up after a second: its generation stops too
curl -s --max-time 1 -o /dev/null -H 'Content-Type: application/json' --data-binary "${long_req/\"stream\":true/\"stream\":false}" "$URL/v1/chat/completions"
check "disconnect, not streamed: the server is idle again within 10 s" wait_health '.busy == false'
check "disconnect, not streamed: the generation stopped early (server log)" grep -qE "the client left after [0-9]+ of 8000 tokens" "$tmp/queue.log"
kill "$SPID"

# ---- --api-key ---------------------------------------------------------------------------------------------
start key --context 64 --api-key sekrit-key || bad "the key server did not start"
check "api key: no key, 401" sh -c "[ \"\$(curl -s --max-time 10 -o '$tmp/body' -w '%{http_code}' '$URL/v1/models')\" = 401 ] && jq -e '.error.code == \"invalid_api_key\"' '$tmp/body' >/dev/null"
check "api key: a wrong key, 401" same "$(post "$URL" /v1/chat/completions '{"thinking":false,"messages":[{"role":"user","content":"hi"}],"max_tokens":2}' -H 'Authorization: Bearer nope')" 401
check "api key: the right key, 200" same "$(post "$URL" /v1/chat/completions '{"thinking":false,"messages":[{"role":"user","content":"hi"}],"max_tokens":2}' -H 'Authorization: Bearer sekrit-key')" 200
check "api key: /health and the page need none" sh -c "[ \"\$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' '$URL/health')\$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' '$URL/')\" = 200200 ]"
kill "$SPID"

# ---- a failed weight read ends that request with an error event; the server goes on ------------------------
# at the floor every step reads the trunk: read 1001 fails after the first tokens of the first request
floor=$("$bin" plan "$model" --budget 1 --context 128 2>&1 | sed -nE 's/.*floor of .* \(([0-9]+) bytes\).*/\1/p')
FAIL_READS=1000:1 start fail --context 128 --budget "$floor" || bad "the failing server did not start"
stream "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":12,\"temperature\":0,\"stream\":true,\"kimik3\":{}}"
check "failed read: tokens, then an error event naming the read, no [DONE]" \
    sh -c "grep -q '\"weight_read_failed\"' '$tmp/events' && ! grep -q '^\[DONE\]' '$tmp/events' && [ \$(grep -c '\"token\"' '$tmp/events') -ge 1 ]"
post "$URL" /v1/chat/completions "{\"thinking\":false,\"messages\":$(msg "Hello, tiny K3"),\"max_tokens\":12,\"temperature\":0,\"kimik3\":{}}" >/dev/null
check "failed read: the next request is served with kimik3 run's ids" same "$(jq -c '.kimik3.ids' "$tmp/body")" "$greedy_run"
kill "$SPID"

# ---- hostile clients: every request bounded before it is parsed; no request crashes the server ------------
start guard --context 4096 --max-body 64K --header-time 2 || bad "the guard server did not start"
port=${URL##*:}
deep_stop=$(head -c 30000 /dev/zero | tr '\0' '[')$(head -c 30000 /dev/zero | tr '\0' ']')
printf '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stop":%s}' "$deep_stop" > "$tmp/deep.json"
st=$(curl -s --max-time 20 -o "$tmp/body" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary @"$tmp/deep.json" "$URL/v1/chat/completions")
check "a stop nested 30,000 deep is a 400, not a crash (was: exit 139 at 100,000)" sh -c "[ '$st' = 400 ] && jq -e '.error.code == \"invalid_json\"' '$tmp/body' >/dev/null"
check "... and the server is up" same "$(get "$URL/health")" 200
head -c 200000 /dev/zero | tr '\0' 'a' > "$tmp/big.txt"
st=$(curl -s --max-time 20 -o "$tmp/body" -w '%{http_code}' -H 'Content-Type: application/json' -H 'Transfer-Encoding: chunked' --data-binary @"$tmp/big.txt" "$URL/v1/chat/completions")
check "a chunked body over --max-body is a 413 (was: no limit; 1 GB took 5.96 GB)" sh -c "[ '$st' = 413 ] && jq -e '.error.code == \"request_too_large\"' '$tmp/body' >/dev/null"
st=$(curl -s --max-time 20 -o "$tmp/body" -w '%{http_code}' -H 'Content-Type: text/plain' --data-binary '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}' "$URL/v1/chat/completions")
check "a text/plain body (a web page's simple cross-site post) is refused: 415 (was: 200)" sh -c "[ '$st' = 415 ] && jq -e '.error.code == \"unsupported_media_type\"' '$tmp/body' >/dev/null"
st=$(curl -s --max-time 20 -o "$tmp/body" -w '%{http_code}' --data-binary '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}' "$URL/v1/chat/completions")
check "... and so is a form post (curl's default type)" same "$st" 415
expect_error "a body from another origin is refused: 403" 403 origin_not_allowed /v1/chat/completions \
    '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}' -H 'Origin: http://evil.example'
expect_error "a Host that is not the server (DNS rebinding) is refused: 421" 421 host_not_allowed /v1/chat/completions \
    '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}' -H "Host: evil.example:$port"
check "the page's own origin is accepted" same "$(post "$URL" /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}' -H "Origin: $URL")" 200
expect_error "a wrong type in a nested field is a 400 naming it (was: 500, the library's text)" 400 invalid_type /v1/chat/completions \
    '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"response_format":{"type":5}}'
check "... the field named" jq -e '.error.param == "response_format.type"' "$tmp/body"
printf '{"messages": "%s' "$(head -c 60000 /dev/zero | tr '\0' 'x')" > "$tmp/invalid.json"
st=$(curl -s --max-time 20 -o "$tmp/body" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary @"$tmp/invalid.json" "$URL/v1/chat/completions")
check "an invalid body is not echoed back whole (was: 1 MB in the reply and the log)" sh -c "[ '$st' = 400 ] && [ \$(wc -c < '$tmp/body') -lt 1000 ]"
expect_error "token id 2^64 - 1 is named as such (was: '-1')" 400 invalid_value /v1/completions '{"prompt":[1,18446744073709551615]}'
check "... 18446744073709551615 in the message" jq -e '.error.message | contains("18446744073709551615")' "$tmp/body"
range="bytes=0-$(printf ',0-%.0s' $(seq 2699))"
check "a Range of 2,700 ranges on / gets the page once (was: 46 MB)" sh -c "[ \$(curl -s --max-time 20 -H 'Range: $range' '$URL/' | wc -c) -lt 100000 ]"
many=(); for i in $(seq 70); do many+=(-H "X-Field-$i: y"); done
check "70 header fields: 431, before anything else is done" same "$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' "${many[@]}" "$URL/health")" 431
# two pipelined requests on one connection: two answers (was: the second dropped)
exec 5<>"/dev/tcp/127.0.0.1/$port"
printf 'GET /health HTTP/1.1\r\nHost: 127.0.0.1:%s\r\n\r\nGET /health HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nConnection: close\r\n\r\n' "$port" "$port" >&5
check "pipelined requests are all answered" same "$(timeout 10 cat <&5 | grep -c '^HTTP/1.1 200')" 2
exec 5<&-
# 12 clients that send one header line a second: the others are served at once, and they are cut
slow=()
for i in $(seq 12); do exec {fd}<>"/dev/tcp/127.0.0.1/$port"; printf 'GET /health HTTP/1.1\r\n' >&$fd; slow+=("$fd"); done
t0=$(date +%s%N)
st=$(get "$URL/health")
ms=$((($(date +%s%N) - t0) / 1000000))
check "12 slow clients hold nobody else up (was: every client blocked): /health in ${ms} ms" sh -c "[ '$st' = 200 ] && [ $ms -lt 2000 ]"
for fd in "${slow[@]}"; do printf 'X-Slow: 1\r\n' >&$fd 2>/dev/null; done
sleep 2.5
cut=0
for fd in "${slow[@]}"; do timeout 2 cat <&$fd >/dev/null 2>&1 && cut=$((cut + 1)); exec {fd}<&-; done
check "... and each loses its connection at --header-time (2 s)" same "$cut" 12
# another client's disconnect, from another address with the same source port, leaves a reply alone
lport=$((40000 + RANDOM % 20000))
curl -s --max-time 120 --local-port "$lport" -o "$tmp/long.json" -H 'Content-Type: application/json' \
    --data-binary "{\"messages\":$(msg "Go on."),\"max_tokens\":1500,\"ignore_eos\":true,\"temperature\":0}" "$URL/v1/chat/completions" &
cl=$!
sleep 1
curl -s --max-time 1 --interface 127.0.0.2 --local-port "$lport" -o /dev/null -H 'Content-Type: application/json' \
    --data-binary "{\"messages\":$(msg "me"),\"max_tokens\":1500,\"ignore_eos\":true}" "$URL/v1/chat/completions"
wait $cl
check "a same-port client from another address leaving does not cut a reply (was: 865 of 3,000, as 200 'length')" \
    jq -e '.usage.completion_tokens == 1500 and .choices[0].finish_reason == "length"' "$tmp/long.json"
# SIGTERM during a reply: reported as the shutdown it is (was: a normal finish, finish_reason length)
curl -s --max-time 60 -o "$tmp/cut.json" -H 'Content-Type: application/json' \
    --data-binary "{\"messages\":$(msg "Go on."),\"max_tokens\":3000,\"ignore_eos\":true}" "$URL/v1/chat/completions" &
cl=$!
sleep 1
kill -TERM "$SPID"
wait $cl
wait "$SPID" 2>/dev/null
check "SIGTERM during a reply: 503 server_shutdown" jq -e '.error.code == "server_shutdown"' "$tmp/cut.json"
# the API key: never empty; from a file or the environment
check "serve --api-key '' is refused at start (was: authentication off)" sh -c "'$bin' serve '$model' --port 0 --api-key '' >/dev/null 2>&1; [ \$? = 2 ]"
check "KIMIK3_API_KEY='' is refused at start" sh -c "KIMIK3_API_KEY= '$bin' serve '$model' --port 0 >/dev/null 2>&1; [ \$? = 2 ]"
printf 'file-key\n' > "$tmp/key"
start keyfile --context 64 --api-key-file "$tmp/key" || bad "the key-file server did not start"
check "--api-key-file: no key, 401; the file's key, 200" sh -c "[ \"\$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' '$URL/v1/models')\$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer file-key' '$URL/v1/models')\" = 401200 ]"
kill "$SPID"
KIMIK3_API_KEY=env-key start envkey --context 64 || bad "the env-key server did not start"
check "KIMIK3_API_KEY: the key from the environment" same "$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer env-key' "$URL/v1/models")" 200
kill "$SPID"

# ---- usage errors --------------------------------------------------------------------------------------------
check "serve --help" sh -c "'$bin' serve --help | grep -q 'usage: kimik3 serve MODEL_DIR'"
check "serve: a port past 65535 is a usage error" sh -c "'$bin' serve '$model' --port 70000 >/dev/null 2>&1; [ \$? = 2 ]"
check "serve: an unknown option is a usage error" sh -c "'$bin' serve '$model' --bogus >/dev/null 2>&1; [ \$? = 2 ]"

# The two checks below need node, an npm package and chromium: `make test-serve` installs them and sets
# KIMIK3_SERVE_CLIENTS=1; `make test` (which must not need npm) skips them and says so.
if [ "${KIMIK3_SERVE_CLIENTS:-0}" != 1 ]; then
    echo "SKIPPED: the openai client and browser tests (they need node, npm and chromium: make test-serve runs them)"
else
# ---- a real client: the official openai npm package -----------------------------------------------------------
start client --context 1024 --quiet || bad "the client server did not start"
npm_dir=build/serve-npm
if [ ! -d $npm_dir/node_modules/openai ] && command -v npm >/dev/null; then
    timeout 180 npm install --prefix $npm_dir --no-package-lock --no-save --no-audit --no-fund --loglevel=error openai@6.30.1 >"$tmp/npm.log" 2>&1
fi
if ! command -v node >/dev/null; then
    echo "SKIPPED: the openai client test: node is not installed"
elif [ ! -d $npm_dir/node_modules/openai ]; then
    echo "SKIPPED: the openai client test: npm could not install openai ($(tail -n 1 "$tmp/npm.log" 2>/dev/null))"
else
    if out=$(NODE_PATH=$npm_dir/node_modules timeout 60 node tests/serve_client.mjs "$URL" "$name" "$npm_dir" 2>&1); then ok; else bad "the openai client: $out"; fi
    printf '%s\n' "$out" | sed 's/^/  /'
fi

# ---- a real browser: headless chromium loads the page, sends a message, waits for the reply and the heat map --
chromium=$(command -v chromium || command -v chromium-browser)
if [ -z "$chromium" ]; then
    echo "SKIPPED: the browser test: chromium is not installed (make deps installs it)"
elif ! command -v node >/dev/null; then
    echo "SKIPPED: the browser test: node is not installed"
else
    mkdir -p build
    if out=$(timeout 90 node tests/serve_browser.mjs "$URL" "$chromium" build/serve-page.png 2>&1); then ok; else bad "the browser: $out"; fi
    printf '%s\n' "$out" | sed 's/^/  /'
fi
fi

echo "kimik3-tests: serve.sh $pass passed, $fail failed"
