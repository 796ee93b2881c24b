// json_reader.h: the strict, bounded JSON reader.
#include "json_reader.h"

#include <cstdint>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace mobile_moe::json {

const Value& Value::at(const std::string& key) const {
  if (kind != Kind::Object) throw Error("expected an object holding '" + key + "'");
  auto found = object.find(key);
  if (found == object.end()) throw Error("missing key '" + key + "'");
  return found->second;
}

const Value& Value::at(size_t index) const {
  if (kind != Kind::Array || index >= array.size()) throw Error("array index out of range");
  return array[index];
}

const std::string& Value::str() const {
  if (kind != Kind::String) throw Error("expected a string");
  return string;
}

double Value::num() const {
  if (kind != Kind::Number) throw Error("expected a number");
  return number;
}

int64_t Value::integer() const {
  if (kind != Kind::Number || !integral) throw Error("expected an integer");
  return whole;
}

std::string describe(const Value& value) {
  switch (value.kind) {
    case Value::Kind::Null: return "null";
    case Value::Kind::Bool: return value.boolean ? "true" : "false";
    case Value::Kind::Number: return value.integer_text ? "an integer" : "a number";
    case Value::Kind::String: return "a string";
    case Value::Kind::Array: return "an array";
    case Value::Kind::Object: return "an object";
  }
  return "a value";
}

namespace {

class Parser {
 public:
  explicit Parser(const std::string& text) : text_(text) {}

  Value parse() {
    if (text_.size() > kMaxBytes) fail("the text is longer than " + std::to_string(kMaxBytes) + " bytes");
    check_utf8();
    Value value = parse_value(0);
    skip_space();
    if (pos_ != text_.size()) fail("trailing characters after the JSON value");
    return value;
  }

 private:
  const std::string& text_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error("JSON: " + what + " at byte " + std::to_string(pos_));
  }
  uint8_t byte(size_t at) const { return static_cast<uint8_t>(text_[at]); }

  // The whole text must be well-formed UTF-8 (no overlongs, no surrogates, nothing beyond U+10FFFF), as RFC 8259 asks.
  void check_utf8() {
    size_t i = 0, n = text_.size();
    while (i < n) {
      uint8_t c = byte(i);
      if (c < 0x80) {
        ++i;
        continue;
      }
      size_t extra;
      uint32_t code, minimum;
      if ((c & 0xE0) == 0xC0) extra = 1, code = c & 0x1F, minimum = 0x80;
      else if ((c & 0xF0) == 0xE0) extra = 2, code = c & 0x0F, minimum = 0x800;
      else if ((c & 0xF8) == 0xF0) extra = 3, code = c & 0x07, minimum = 0x10000;
      else {
        pos_ = i;
        fail("invalid UTF-8");
      }
      for (size_t j = 1; j <= extra; ++j) {
        if (i + j >= n || (byte(i + j) & 0xC0) != 0x80) {
          pos_ = i;
          fail("invalid UTF-8");
        }
        code = (code << 6) | (byte(i + j) & 0x3F);
      }
      if (code < minimum || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) {
        pos_ = i;
        fail("invalid UTF-8");
      }
      i += extra + 1;
    }
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
  bool digit_at(size_t at) const { return at < text_.size() && text_[at] >= '0' && text_[at] <= '9'; }

  Value parse_value(int depth) {
    if (depth >= kMaxDepth) fail("nested more than " + std::to_string(kMaxDepth) + " levels deep");
    Value value;
    char c = peek();
    if (c == '{') {
      value.kind = Value::Kind::Object;
      ++pos_;
      if (peek() == '}') return ++pos_, value;
      while (true) {
        if (peek() != '"') fail("expected a string key");
        std::string key = parse_string();
        expect(':');
        value.object[key] = parse_value(depth + 1);  // a repeated key keeps the last value, as Python's json does
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
        value.array.push_back(parse_value(depth + 1));
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
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    fail("unexpected character");
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  Value parse_number() {
    size_t start = pos_, at = pos_;
    bool negative = text_[at] == '-';
    if (negative) ++at;
    if (!digit_at(at)) fail("bad number");
    if (text_[at] == '0') ++at;
    else
      while (digit_at(at)) ++at;
    size_t integer_end = at;
    bool fraction = false;
    if (at < text_.size() && text_[at] == '.') {
      ++at;
      if (!digit_at(at)) fail("bad number");
      while (digit_at(at)) ++at;
      fraction = true;
    }
    if (at < text_.size() && (text_[at] == 'e' || text_[at] == 'E')) {
      ++at;
      if (at < text_.size() && (text_[at] == '+' || text_[at] == '-')) ++at;
      if (!digit_at(at)) fail("bad number");
      while (digit_at(at)) ++at;
      fraction = true;
    }
    Value value;
    value.kind = Value::Kind::Number;
    std::string token = text_.substr(start, at - start);
    value.number = std::strtod(token.c_str(), nullptr);  // the grammar is checked: strtod reads the whole token
    value.integer_text = !fraction;
    if (!fraction) {
      // Exact int64, accumulated as a negative number so INT64_MIN fits; too many digits -> not integral.
      int64_t accumulated = 0;
      bool fits = true;
      for (size_t i = negative ? start + 1 : start; i < integer_end; ++i) {
        int digit = text_[i] - '0';
        if (accumulated < (INT64_MIN + digit) / 10) {
          fits = false;
          break;
        }
        accumulated = accumulated * 10 - digit;
      }
      if (fits && !negative && accumulated == INT64_MIN) fits = false;
      value.integral = fits;
      value.whole = fits ? (negative ? accumulated : -accumulated) : 0;
    }
    pos_ = at;
    return value;
  }

  static void append_utf8(std::string& out, uint32_t code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  // Four hex digits after "\u"; anything else is an error (never an exception from a number conversion).
  uint32_t hex4() {
    if (pos_ + 4 > text_.size()) fail("short \\u escape");
    uint32_t code = 0;
    for (int i = 0; i < 4; ++i) {
      char h = text_[pos_ + i];
      int digit = (h >= '0' && h <= '9') ? h - '0'
                  : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                  : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                           : -1;
      if (digit < 0) fail("bad \\u escape (needs four hex digits)");
      code = code * 16 + static_cast<uint32_t>(digit);
    }
    pos_ += 4;
    return code;
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      char c = text_[pos_++];
      if (static_cast<uint8_t>(c) < 0x20) {
        --pos_;
        fail("control character in a string");
      }
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) fail("unterminated escape");
      char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          uint32_t code = hex4();
          if (code >= 0xD800 && code <= 0xDBFF) {  // a high surrogate: a low one must follow
            if (text_.compare(pos_, 2, "\\u") != 0) fail("lone surrogate in a \\u escape");
            pos_ += 2;
            uint32_t low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("lone surrogate in a \\u escape");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          } else if (code >= 0xDC00 && code <= 0xDFFF) {
            fail("lone surrogate in a \\u escape");
          }
          append_utf8(out, code);
          break;
        }
        default:
          --pos_;
          fail(std::string("bad escape \\") + e);
      }
    }
    if (pos_ >= text_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }
};

}  // namespace

Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace mobile_moe::json
