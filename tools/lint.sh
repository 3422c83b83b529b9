#!/bin/sh
# make lint: the rules of the course that a machine can check, each failure as FILE:LINE: what is wrong.
#   1. a header in chapters/ holds at most 600 lines (a longer one is a lesson and an appendix NNa_topic.hpp);
#   2. no #if, #ifdef or #ifndef inside a function body (a whole function may be guarded at the top level;
#      one dispatch point per kernel family picks the ISA, never a branch of the preprocessor in a body);
#   3. no unused function: every function defined in chapters/ is used somewhere in chapters/, examples/,
#      tests/ or bench/ (a name that appears only where it is defined is dead code).
# POSIX sh and awk only (no Python, no compiler): comments, string and character literals are blanked
# first, then a brace-depth scanner tells function bodies from namespaces, classes and initializers.
# Exit code 0 when clean, 1 with the list otherwise.
cd "$(dirname "$0")/.." || exit 2
max_lines=600
status=0
out=$(mktemp /tmp/kimik3-lint-XXXXXX) || exit 2
trap 'rm -f "$out"' EXIT

# ---- 1. header length ---------------------------------------------------------------------------------
for f in chapters/*.hpp; do
    n=$(wc -l < "$f")
    [ "$n" -gt $max_lines ] && echo "$f:$((max_lines + 1)): $n lines, more than $max_lines: split it into the lesson and an appendix (chapters/NNa_topic.hpp)" >> "$out"
done

# ---- 2 and 3: one awk pass over the sources ------------------------------------------------------------
# Every file is read once. Files under chapters/ and examples/ are scanned for #if inside a function body
# (rule 2); functions defined in chapters/ are collected (rule 3); every identifier of every file is counted,
# so that a chapter function whose name occurs only at its definitions is reported.
sources=$(ls chapters/*.hpp chapters/*.inc examples/*.cpp examples/cli/*.hpp tests/*.cpp tests/*.hpp tests/fuzz/*.cpp \
    tests/fuzz/*.hpp bench/*.cpp bench/*.hpp 2>/dev/null)
# Functions that code outside this repository calls by name: the SAX interface nlohmann::json::sax_parse
# calls on chapter 01a's JsonBuilder.
external="null boolean number_integer number_unsigned number_float string binary start_object end_object start_array end_array key parse_error"
# shellcheck disable=SC2086
awk -v out="$out" -v external="$external" '
# blank(s): the line with comments and literals replaced by spaces (state carries across lines: in_comment)
function blank(s,    r, i, c, n, q) {
    r = ""; n = length(s); i = 1
    while (i <= n) {
        c = substr(s, i, 1)
        if (in_comment) {
            if (c == "*" && substr(s, i + 1, 1) == "/") { in_comment = 0; r = r "  "; i += 2; continue }
            r = r " "; i++; continue
        }
        if (c == "/" && substr(s, i + 1, 1) == "/") { while (i <= n) { r = r " "; i++ } break }
        if (c == "/" && substr(s, i + 1, 1) == "*") { in_comment = 1; r = r "  "; i += 2; continue }
        # a character literal, unless the quote separates digits (1'"'"'000)
        if (c == "\"" || (c == "'"'"'" && substr(s, i - 1, 1) !~ /[0-9A-Za-z_]/)) {
            q = c; r = r q; i++
            while (i <= n && substr(s, i, 1) != q) {
                if (substr(s, i, 1) == "\\") { r = r " "; i++ }
                r = r " "; i++
            }
            if (i <= n) { r = r q; i++ }
            continue
        }
        r = r c; i++
    }
    return r
}
# The name a statement defines when a function body opens after it: the identifier before the first "("
# outside template angle brackets, when it is snake_case and no keyword.
function defined_name(stmt,    i, c, depth, j, name) {
    depth = 0
    for (i = 1; i <= length(stmt); i++) {
        c = substr(stmt, i, 1)
        if (c == "<") depth++
        else if (c == ">" && depth > 0) depth--
        else if (c == "(" && depth == 0) {
            j = i - 1
            while (j > 0 && substr(stmt, j, 1) == " ") j--
            name = ""
            while (j > 0 && substr(stmt, j, 1) ~ /[A-Za-z0-9_]/) { name = substr(stmt, j, 1) name; j-- }
            if (name ~ /^[a-z_][a-z0-9_]*$/ && name !~ /^(if|for|while|switch|return|sizeof|alignof|decltype|catch|operator|static_assert|noexcept|requires|__attribute__|alignas)$/)
                return name
            return ""
        }
    }
    return ""
}
# Is the "{" after this statement a function body? Its statement ends with ")" and qualifiers, or is a
# constructor initializer list; a namespace, class, struct, union, enum or an initializer ("= {") is not.
function opens_body(stmt,    k) {
    for (k = 0; k < 4; k++) gsub(/<[^<>]*>/, "", stmt)      # template arguments and parameters
    if (stmt ~ /\][ ]*(mutable)?[ ]*$/) return 1              # a lambda without parameters: [&] {
    if (stmt ~ /(^|[^A-Za-z0-9_])(namespace|class|struct|union|enum)([^A-Za-z0-9_]|$)/ && stmt !~ /\)[ ]*(const|noexcept|override|final)?[ ]*$/) return 0
    if (stmt ~ /(=|return|,|\(|\[)[ ]*$/ || stmt ~ /^[ ]*$/) return 0
    if (stmt ~ /\)[ A-Za-z0-9_:&*,>-]*$/) return 1             # f(...) const noexcept override -> T
    if (stmt ~ /\)[ ]*:[^:]/ || stmt ~ /^[ ]*:[^:]/) return 1  # Type(...) : member_(x), other{y}
    if (stmt ~ /(^|[^A-Za-z0-9_])(else|do|try)[ ]*$/) return 1
    return 0
}
FNR == 1 {
    in_comment = 0; sp = 0; stmt = ""; fn_depth = 0; cont = 0
    scan = FILENAME ~ /^(chapters|examples)\//
    chapter = FILENAME ~ /^chapters\//
}
{
    raw = $0
    line = blank(raw)
    # identifiers of this line, counted over every file (rule 3)
    rest = line
    while (match(rest, /[A-Za-z_][A-Za-z0-9_]*/)) { count[substr(rest, RSTART, RLENGTH)]++; rest = substr(rest, RSTART + RLENGTH) }
    if (cont) { cont = line ~ /\\[ \t]*$/; next }  # the continuation of a preprocessor line
    if (line ~ /^[ \t]*#/) {
        cont = line ~ /\\[ \t]*$/
        if (scan && fn_depth > 0 && line ~ /^[ \t]*#[ \t]*(if|ifdef|ifndef)([^A-Za-z0-9_]|$)/)
            printf "%s:%d: preprocessor conditional inside the body of %s(): select the path in one dispatch function, or guard the whole function\n", FILENAME, FNR, (fn_name[sp] != "" ? fn_name[sp] : "a function") >> out
        next
    }
    n = length(line)
    for (i = 1; i <= n; i++) {
        c = substr(line, i, 1)
        if (c == "{") {
            if (fn_depth == 0 && stmt ~ /\)[ ]*:[^:]/ && stmt ~ /[A-Za-z0-9_>][ ]*$/) {  # member_{x} in an initializer list
                sp++; is_fn[sp] = 0; init[sp] = 1; saved[sp] = stmt; fn_name[sp] = ""
                continue
            }
            body = fn_depth > 0 || opens_body(stmt)
            sp++
            init[sp] = 0
            is_fn[sp] = body
            if (body && fn_depth == 0) {  # a function defined at namespace or class scope
                fn_name[sp] = defined_name(stmt)
                if (chapter && fn_name[sp] != "") { defs[fn_name[sp]]++; where[fn_name[sp]] = where[fn_name[sp]] "" (where[fn_name[sp]] == "" ? FILENAME ":" FNR : "") }
            } else fn_name[sp] = (sp > 1 ? fn_name[sp - 1] : "")
            if (body) fn_depth++
            stmt = ""
        } else if (c == "}") {
            if (sp > 0 && init[sp]) { stmt = saved[sp] "{}"; sp--; continue }
            if (sp > 0) { if (is_fn[sp]) fn_depth--; sp-- }
            stmt = ""
        } else if (c == ";") {
            stmt = ""
        } else {
            stmt = stmt (c == "\t" ? " " : c)
        }
    }
    stmt = stmt " "
}
END {
    n = split(external, ext, " ")
    for (i = 1; i <= n; i++) called_outside[ext[i]] = 1
    for (name in defs)
        if (count[name] <= defs[name] && !(name in called_outside))
            printf "%s: function %s() is defined here and used nowhere in chapters/, examples/, tests/ or bench/\n", where[name], name >> out
}
' $sources

if [ -s "$out" ]; then
    sort -t: -k1,1 -k2,2n "$out"
    echo "lint: $(wc -l < "$out") problem(s)"
    status=1
else
    echo "lint: clean (headers <= $max_lines lines, no #if in a function body, no unused function)"
fi
exit $status
