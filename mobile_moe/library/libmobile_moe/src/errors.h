// The native runner's error types, shared by its headers and runner.cpp.
#pragma once

#include <stdexcept>

namespace mobile_moe::runner {

// Bad input (exit 2) vs. a runtime failure (exit 1), so the Python side can tell the user which it was.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace mobile_moe::runner
