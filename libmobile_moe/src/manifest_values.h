// Checks of single manifest values, each naming where the value sits (a dotted path like graphs.0.inputs.1.shape):
// objects and their keys, exact integers in a range, strings of a length, finite numbers, booleans, lists of a
// length, one of a fixed set of words. A broken rule throws Invalid; read_bundle (bundle_manifest.h) adds the file
// name and turns it into a UsageError. Part of libmobile_moe; header-only, like json_reader.h.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "json_reader.h"

namespace mobile_moe::library {

// A manifest rule broken at `where` (a dotted path like graphs.0.inputs.1.shape); read_bundle adds the file name.
struct Invalid : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] inline void invalid(const std::string& where, const std::string& what) {
  throw Invalid((where.empty() ? std::string("manifest") : where) + ": " + what);
}
// Whether UTF-8 `text` holds a control character (Unicode's category Cc: U+0000..U+001F, U+007F..U+009F), as
// mobile_moe/utils/words.py has_control_character decides it.
inline bool has_control_character(const std::string& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte == 0x7f) return true;
    if (byte == 0xc2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) <= 0x9f) return true;
  }
  return false;
}

inline std::string child(const std::string& where, const std::string& key) {
  return where.empty() ? key : where + "." + key;
}
inline std::string child(const std::string& where, size_t index) { return child(where, std::to_string(index)); }

inline std::string shown(const json::Value& value) {
  if (value.is_number()) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.17g", value.number);
    return value.integer_text && !value.integral ? "an integer beyond 64 bits" : text;
  }
  if (value.is_string()) return "\"" + (value.string.size() > 40 ? value.string.substr(0, 40) + "..." : value.string) + "\"";
  return json::describe(value);
}

inline const json::Value& object_at(const json::Value& object, const std::string& where,
                                    const std::string& key) {
  if (!object.is_object()) invalid(where, "must be an object, not " + json::describe(object));
  if (!object.has(key)) invalid(child(where, key), "is missing");
  return object.at(key);
}
// Absent or null -> nullptr.
inline const json::Value* optional_at(const json::Value& object, const std::string& where,
                                      const std::string& key) {
  if (!object.is_object()) invalid(where, "must be an object, not " + json::describe(object));
  if (!object.has(key) || object.at(key).is_null()) return nullptr;
  return &object.at(key);
}

inline int64_t as_int(const json::Value& value, const std::string& where, int64_t low, int64_t high) {
  if (!value.is_number() || !value.integer_text)
    invalid(where, "must be an integer, not " + shown(value));
  if (!value.integral || value.whole < low || value.whole > high)
    invalid(where, shown(value) + " is out of range (" + std::to_string(low) + ".." + std::to_string(high) + ")");
  return value.whole;
}

inline size_t utf8_length(const std::string& text) {
  size_t count = 0;
  for (char c : text) count += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return count;
}

inline const std::string& as_str(const json::Value& value, const std::string& where, size_t min_chars,
                                 size_t max_chars) {
  if (!value.is_string()) invalid(where, "must be a string, not " + shown(value));
  size_t length = utf8_length(value.string);
  if (length < min_chars || length > max_chars)
    invalid(where, "must be " + std::to_string(min_chars) + " to " + std::to_string(max_chars) + " characters long");
  return value.string;
}

inline double as_finite(const json::Value& value, const std::string& where) {
  if (!value.is_number()) invalid(where, "must be a number, not " + shown(value));
  if (!std::isfinite(value.number)) invalid(where, "must be finite");
  return value.number;
}

inline bool as_bool(const json::Value& value, const std::string& where) {
  if (!value.is_bool()) invalid(where, "must be true or false, not " + shown(value));
  return value.boolean;
}

inline const std::vector<json::Value>& as_array(const json::Value& value, const std::string& where, size_t min_items,
                                                size_t max_items) {
  if (!value.is_array()) invalid(where, "must be a list, not " + shown(value));
  if (value.array.size() < min_items || value.array.size() > max_items)
    invalid(where, "must hold " + std::to_string(min_items) + " to " + std::to_string(max_items) + " items, not " +
                       std::to_string(value.array.size()));
  return value.array;
}

template <size_t N>
const std::string& one_of(const json::Value& value, const std::string& where, const char* const (&choices)[N]) {
  const std::string& text = as_str(value, where, 0, kMaxName);
  for (const char* choice : choices)
    if (text == choice) return text;
  std::string listed;
  for (const char* choice : choices) listed += (listed.empty() ? "" : ", ") + std::string(choice);
  invalid(where, shown(value) + " is not one of " + listed);
}

// The same check, giving the enum those words name (manifest_schema.h: kLayouts[i] is the word for Layout(i)).
template <typename Enum, size_t N>
Enum one_of(const json::Value& value, const std::string& where, const char* const (&choices)[N]) {
  const std::string& text = one_of(value, where, choices);
  size_t index = 0;
  while (text != choices[index]) ++index;  // one_of found it among the choices
  return static_cast<Enum>(index);
}

}  // namespace mobile_moe::library
