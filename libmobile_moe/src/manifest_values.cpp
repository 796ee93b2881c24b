// manifest_values.h: checks of single manifest values, each naming where the value sits.
#include "manifest_values.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "json_reader.h"

namespace mobile_moe::library {

[[noreturn]] void invalid(const std::string& where, const std::string& what) {
  throw Invalid((where.empty() ? std::string("manifest") : where) + ": " + what);
}

bool has_control_character(const std::string& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte == 0x7f) return true;
    if (byte == 0xc2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) <= 0x9f) return true;
  }
  return false;
}

std::string child(const std::string& where, const std::string& key) {
  return where.empty() ? key : where + "." + key;
}

std::string child(const std::string& where, size_t index) { return child(where, std::to_string(index)); }

std::string shown(const json::Value& value) {
  if (value.is_number()) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.17g", value.number);
    return value.integer_text && !value.integral ? "an integer beyond 64 bits" : text;
  }
  if (value.is_string()) return "\"" + (value.string.size() > 40 ? value.string.substr(0, 40) + "..." : value.string) + "\"";
  return json::describe(value);
}

const json::Value& object_at(const json::Value& object, const std::string& where,
                             const std::string& key) {
  if (!object.is_object()) invalid(where, "must be an object, not " + json::describe(object));
  if (!object.has(key)) invalid(child(where, key), "is missing");
  return object.at(key);
}

const json::Value* optional_at(const json::Value& object, const std::string& where,
                               const std::string& key) {
  if (!object.is_object()) invalid(where, "must be an object, not " + json::describe(object));
  if (!object.has(key) || object.at(key).is_null()) return nullptr;
  return &object.at(key);
}

int64_t as_int(const json::Value& value, const std::string& where, int64_t low, int64_t high) {
  if (!value.is_number() || !value.integer_text)
    invalid(where, "must be an integer, not " + shown(value));
  if (!value.integral || value.whole < low || value.whole > high)
    invalid(where, shown(value) + " is out of range (" + std::to_string(low) + ".." + std::to_string(high) + ")");
  return value.whole;
}

size_t utf8_length(const std::string& text) {
  size_t count = 0;
  for (char c : text) count += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return count;
}

const std::string& as_str(const json::Value& value, const std::string& where, size_t min_chars,
                          size_t max_chars) {
  if (!value.is_string()) invalid(where, "must be a string, not " + shown(value));
  size_t length = utf8_length(value.string);
  if (length < min_chars || length > max_chars)
    invalid(where, "must be " + std::to_string(min_chars) + " to " + std::to_string(max_chars) + " characters long");
  return value.string;
}

double as_finite(const json::Value& value, const std::string& where) {
  if (!value.is_number()) invalid(where, "must be a number, not " + shown(value));
  if (!std::isfinite(value.number)) invalid(where, "must be finite");
  return value.number;
}

bool as_bool(const json::Value& value, const std::string& where) {
  if (!value.is_bool()) invalid(where, "must be true or false, not " + shown(value));
  return value.boolean;
}

const std::vector<json::Value>& as_array(const json::Value& value, const std::string& where, size_t min_items,
                                         size_t max_items) {
  if (!value.is_array()) invalid(where, "must be a list, not " + shown(value));
  if (value.array.size() < min_items || value.array.size() > max_items)
    invalid(where, "must hold " + std::to_string(min_items) + " to " + std::to_string(max_items) + " items, not " +
                       std::to_string(value.array.size()));
  return value.array;
}

}  // namespace mobile_moe::library
