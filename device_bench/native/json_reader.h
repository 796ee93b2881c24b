// A tiny hand-written JSON reader (no dependency): enough to read a bundle's manifest.json.
//
// Why hand-written: the runner must cross-compile for Android with nothing but the NDK and an ExecuTorch build, and a
// manifest is small, trusted-format JSON written by export/. Supports objects, arrays, strings (with \uXXXX escapes
// for the BMP), numbers, true/false/null. Errors throw std::runtime_error with the byte offset.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mobile_moe::json {

struct Value {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0.0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  bool is_null() const { return kind == Kind::Null; }
  bool has(const std::string& key) const { return kind == Kind::Object && object.count(key) > 0; }

  const Value& at(const std::string& key) const {
    if (kind != Kind::Object) throw std::runtime_error("expected an object holding '" + key + "'");
    auto found = object.find(key);
    if (found == object.end()) throw std::runtime_error("missing key '" + key + "'");
    return found->second;
  }
  const Value& at(size_t index) const {
    if (kind != Kind::Array || index >= array.size()) throw std::runtime_error("array index out of range");
    return array[index];
  }
  const std::string& str() const {
    if (kind != Kind::String) throw std::runtime_error("expected a string");
    return string;
  }
  double num() const {
    if (kind != Kind::Number) throw std::runtime_error("expected a number");
    return number;
  }
  int64_t integer() const { return static_cast<int64_t>(num()); }
  bool truthy() const { return kind == Kind::Bool ? boolean : (kind == Kind::Number ? number != 0 : false); }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : text_(text) {}

  Value parse() {
    Value value = parse_value();
    skip_space();
    if (pos_ != text_.size()) fail("trailing characters after the JSON value");
    return value;
  }

 private:
  const std::string& text_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at byte " + std::to_string(pos_));
  }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\r' ||
                                   text_[pos_] == '\t'))
      ++pos_;
  }
  char peek() {
    skip_space();
    if (pos_ >= text_.size()) fail("unexpected end of input");
    return text_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  bool consume_literal(const char* literal) {
    size_t n = std::char_traits<char>::length(literal);
    if (text_.compare(pos_, n, literal) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }

  Value parse_value() {
    Value value;
    char c = peek();
    if (c == '{') {
      value.kind = Value::Kind::Object;
      ++pos_;
      if (peek() == '}') return ++pos_, value;
      while (true) {
        std::string key = parse_string();
        expect(':');
        value.object[key] = parse_value();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return value;
      }
    }
    if (c == '[') {
      value.kind = Value::Kind::Array;
      ++pos_;
      if (peek() == ']') return ++pos_, value;
      while (true) {
        value.array.push_back(parse_value());
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return value;
      }
    }
    if (c == '"') {
      value.kind = Value::Kind::String;
      value.string = parse_string();
      return value;
    }
    if (consume_literal("true")) {
      value.kind = Value::Kind::Bool;
      value.boolean = true;
      return value;
    }
    if (consume_literal("false")) {
      value.kind = Value::Kind::Bool;
      return value;
    }
    if (consume_literal("null")) return value;
    if (c == '-' || (c >= '0' && c <= '9')) {
      const char* start = text_.c_str() + pos_;
      char* end = nullptr;
      value.kind = Value::Kind::Number;
      value.number = std::strtod(start, &end);
      if (end == start) fail("bad number");
      pos_ += static_cast<size_t>(end - start);
      return value;
    }
    fail("unexpected character");
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      char c = text_[pos_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) fail("unterminated escape");
      char e = text_[pos_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (pos_ + 4 > text_.size()) fail("short \\u escape");
          append_utf8(out, static_cast<unsigned>(std::stoul(text_.substr(pos_, 4), nullptr, 16)));
          pos_ += 4;
          break;
        }
        default: out += e;  // \" \\ \/
      }
    }
    if (pos_ >= text_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace mobile_moe::json
