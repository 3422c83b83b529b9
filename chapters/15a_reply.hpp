// kimik3 chapter 15, APPENDIX: reading a reply by token id -- its text, never its markup.
// ====================================================================================================
//
// APPENDIX TO CHAPTER 15 (included by it; read it after 15.7, a chat turn)
//   A reply is drawn one id at a time inside the assistant message that the generation prompt opened
//   (chapter 15's XTML layout). Some ids are markup: <|open|>, <|close|> and <|sep|> are special ids, so
//   markup is decided by id, never by matching strings (a user or a model that writes the characters
//   "<|close|>" as text writes text). The text between <|open|> (or <|close|>) and <|sep|> is a tag name
//   with attributes; only the bodies of the think block (reasoning) and the response block (content) are
//   text to show. chat, run and serve all show a reply through this reader, and chapter 15's close_reply
//   uses the tags it keeps to close a reply that was cut short.
//
// CONTRACT
//   1. push(id) returns the text that id adds, in complete UTF-8 characters (a character split across
//      ids waits for its last byte; finish() gives what is held back, invalid bytes as U+FFFD).
//   2. The open tags are a stack that starts as the generation prompt left it: message, then think
//      (thinking on) or response. An open tag pushes its name; a close tag pops back to the innermost tag
//      of its name (a close tag that matches nothing changes nothing). Text shows only while the
//      innermost tag is think or response.
//   3. close() gives the ids that close the reply from where it stands: <|sep|> when inside a tag,
//      <|close|>TAG<|sep|> for every open tag (innermost first; an empty response block first when only
//      a think block was written, since every assistant message has one), then <|end_of_msg|>.
//   4. Not chat (a raw completion): every id is text, specials by name.
//
// USES     chapter 14 (Tokenizer, Utf8Stream)     TEST   make test-15 (15.7, 15.9)
// ====================================================================================================
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "14_tokenizer.hpp"

namespace kimik3 {

class ReplyReader {
  public:
    struct Delta {
        std::string content, reasoning;
    };
    ReplyReader(const Tokenizer& tok, bool chat, bool thinking) : tok_(tok), chat_(chat), response_seen_(!thinking) {
        if (!chat) return;
        open_ = tok.special_id("<|open|>"), close_ = tok.special_id("<|close|>"), sep_ = tok.special_id("<|sep|>");
        stack_ = {"message", thinking ? "think" : "response"};
    }
    Delta push(std::uint32_t id) {
        Delta d;
        if (chat_ && (id == open_ || id == close_)) {
            mode_ = id == open_ ? in_open : in_close, tag_.clear();
            flush(d);
        } else if (chat_ && id == sep_ && mode_ != text) {
            end_tag();
        } else if (mode_ != text) {
            tag_ += bytes(id);
        } else if (!chat_ || inside("response")) {
            d.content = content_.push(bytes(id));
        } else if (inside("think")) {
            d.reasoning = reasoning_.push(bytes(id));
        }
        return d;
    }
    Delta finish() {
        Delta d;
        flush(d);
        return d;
    }
    bool closed() const { return stack_.empty(); }  // the message itself was closed
    std::vector<std::uint32_t> close() {            // contract 3; the reader ends closed
        std::vector<std::uint32_t> out;
        auto special = [&](const char* name) { out.push_back(tok_.special_id(name)); };
        auto tag = [&](const char* marker, const std::string& name) {
            special(marker);
            const std::vector<std::uint32_t> t = tok_.encode(name);
            out.insert(out.end(), t.begin(), t.end());
            special("<|sep|>");
        };
        if (mode_ != text) special("<|sep|>"), end_tag();
        for (; !stack_.empty(); stack_.pop_back()) {
            if (stack_.size() == 1 && !response_seen_) tag("<|open|>", "response"), tag("<|close|>", "response"), response_seen_ = true;
            tag("<|close|>", stack_.back());
        }
        special("<|end_of_msg|>");
        return out;
    }

  private:
    std::string bytes(std::uint32_t id) const { return id < tok_.vocab_size() ? std::string(tok_.token_bytes(id)) : std::string(); }
    bool inside(const char* name) const { return !stack_.empty() && stack_.back() == name; }
    void flush(Delta& d) { d.content += content_.finish(), d.reasoning += reasoning_.finish(); }
    void end_tag() {  // contract 2
        const std::string name = tag_.substr(0, tag_.find(' '));
        if (mode_ == in_open) stack_.push_back(name), response_seen_ = response_seen_ || name == "response";
        else if (const auto it = std::find(stack_.rbegin(), stack_.rend(), name); it != stack_.rend()) stack_.erase(std::next(it).base(), stack_.end());
        mode_ = text, tag_.clear();
    }
    const Tokenizer& tok_;
    bool chat_, response_seen_;
    std::uint32_t open_ = 0, close_ = 0, sep_ = 0;
    enum { text, in_open, in_close } mode_ = text;
    std::string tag_;                 // the tag being read, between <|open|> or <|close|> and <|sep|>
    std::vector<std::string> stack_;  // the open tags, outermost first
    Utf8Stream content_, reasoning_;
};

}  // namespace kimik3
