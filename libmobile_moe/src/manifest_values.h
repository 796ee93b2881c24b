// Checks of single manifest values, each naming where the value sits (a dotted path like graphs.0.inputs.1.shape):
// objects and their keys, exact integers in a range, strings of a length, finite numbers, booleans, lists of a
// length, one of a fixed set of words. A broken rule throws Invalid; read_bundle (bundle_manifest.h) adds the file
// name and turns it into a UsageError. Part of libmobile_moe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "manifest_schema.h"

namespace mobile_moe::json {
struct Value;
}  // namespace mobile_moe::json

namespace mobile_moe::library {

// A manifest rule broken at `where` (a dotted path like graphs.0.inputs.1.shape); read_bundle adds the file name.
struct Invalid : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void invalid(const std::string& where, const std::string& what);
// Whether UTF-8 `text` holds a control character (Unicode's category Cc: U+0000..U+001F, U+007F..U+009F), as
// mobile_moe/utils/words.py has_control_character decides it.
bool has_control_character(const std::string& text);

std::string child(const std::string& where, const std::string& key);
std::string child(const std::string& where, size_t index);

std::string shown(const json::Value& value);

const json::Value& object_at(const json::Value& object, const std::string& where,
                             const std::string& key);
// Absent or null -> nullptr.
const json::Value* optional_at(const json::Value& object, const std::string& where,
                               const std::string& key);

int64_t as_int(const json::Value& value, const std::string& where, int64_t low, int64_t high);

size_t utf8_length(const std::string& text);

const std::string& as_str(const json::Value& value, const std::string& where, size_t min_chars,
                          size_t max_chars);

double as_finite(const json::Value& value, const std::string& where);

bool as_bool(const json::Value& value, const std::string& where);

const std::vector<json::Value>& as_array(const json::Value& value, const std::string& where, size_t min_items,
                                         size_t max_items);

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
