// A tiny hand-written JSON reader (no dependency): enough to read a bundle's manifest.json.
//
// Why hand-written: the runner must cross-compile for Android with nothing but the NDK and an ExecuTorch build. A
// manifest is untrusted input (a bundle can be copied to a phone by hand), so the reader is strict RFC 8259 and bounded:
// UTF-8 only, no control characters in strings, \uXXXX escapes checked (surrogate pairs joined, lone ones refused),
// the JSON number grammar exactly (no NaN, Infinity, hex, leading '+'), nesting at most kMaxDepth deep and the text at
// most kMaxBytes long. Numbers remember whether they were written as integers (no '.', no exponent) and their exact
// int64 value, so the runner can refuse 1.5, 1e300 and 5000-digit "integers" like the Python schema does.
// Errors throw json::Error (a std::runtime_error) naming the byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "manifest_schema.h"

namespace mobile_moe::json {

constexpr int kMaxDepth = 64;
constexpr size_t kMaxBytes = static_cast<size_t>(library::kMaxManifestBytes);  // the schema's (manifest_schema.h)

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Value {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0.0;
  bool integral = false;      // written as an integer literal that fits in int64 (then `whole` holds it exactly)
  bool integer_text = false;  // written without '.' or exponent (true even when too large for int64)
  int64_t whole = 0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  bool is_null() const { return kind == Kind::Null; }
  bool is_object() const { return kind == Kind::Object; }
  bool is_array() const { return kind == Kind::Array; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Number; }
  bool is_bool() const { return kind == Kind::Bool; }
  bool has(const std::string& key) const { return kind == Kind::Object && object.count(key) > 0; }

  const Value& at(const std::string& key) const;
  const Value& at(size_t index) const;
  const std::string& str() const;
  double num() const;
  // The exact integer; anything else (1.5, 1e300, true, "4", an integer beyond int64) throws.
  int64_t integer() const;
  bool truthy() const { return kind == Kind::Bool ? boolean : (kind == Kind::Number ? number != 0 : false); }
};

// Kind names for messages: "a string", "an integer", ...
std::string describe(const Value& value);

// The text parsed (json_reader.cpp's Parser): the value, or json::Error naming the byte offset.
Value parse(const std::string& text);

}  // namespace mobile_moe::json
