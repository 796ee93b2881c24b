// A minimal JSON writer: the runner prints exactly one JSON object on stdout, built with this.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace mobile_moe::json {

class Writer {
 public:
  Writer& begin_object() { return open('{'); }
  Writer& end_object() { return close('}'); }
  Writer& begin_array() { return open('['); }
  Writer& end_array() { return close(']'); }

  Writer& key(const std::string& name) {
    comma();
    quote(name);
    out_ << ':';
    after_key_ = true;
    return *this;
  }
  Writer& value(const std::string& text) {
    comma();
    quote(text);
    return *this;
  }
  Writer& value(const char* text) { return value(std::string(text)); }
  Writer& value(bool flag) {
    comma();
    out_ << (flag ? "true" : "false");
    return *this;
  }
  Writer& value(int64_t number) {
    comma();
    out_ << number;
    return *this;
  }
  Writer& value(int number) { return value(static_cast<int64_t>(number)); }
  Writer& value(size_t number) { return value(static_cast<int64_t>(number)); }
  Writer& value(double number) {
    comma();
    if (!std::isfinite(number)) {
      out_ << "null";  // JSON has no NaN/inf
    } else {
      char buffer[32];
      std::snprintf(buffer, sizeof(buffer), "%.9g", number);
      out_ << buffer;
    }
    return *this;
  }
  Writer& null() {
    comma();
    out_ << "null";
    return *this;
  }
  template <typename T>
  Writer& array(const std::vector<T>& values) {
    begin_array();
    for (const auto& v : values) value(v);
    return end_array();
  }

  std::string str() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::vector<bool> has_item_;  // per open container: has it an item already (so the next one needs a comma)
  bool after_key_ = false;

  void comma() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (!has_item_.empty()) {
      if (has_item_.back()) out_ << ',';
      has_item_.back() = true;
    }
  }
  Writer& open(char c) {
    comma();
    out_ << c;
    has_item_.push_back(false);
    return *this;
  }
  Writer& close(char c) {
    out_ << c;
    has_item_.pop_back();
    return *this;
  }
  void quote(const std::string& text) {
    out_ << '"';
    for (unsigned char c : text) {
      if (c == '"' || c == '\\') {
        out_ << '\\' << c;
      } else if (c < 0x20) {
        char buffer[8];
        std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
        out_ << buffer;
      } else {
        out_ << c;
      }
    }
    out_ << '"';
  }
};

}  // namespace mobile_moe::json
