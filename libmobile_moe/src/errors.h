// libmobile_moe's error types, shared by its headers (and its tests' tool, tests/internal_checks.cpp).
#pragma once

#include <stdexcept>

namespace mobile_moe::library {

// Bad input (exit 2) vs. a runtime failure (exit 1), so the Python side can tell the user which it was.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A bundle whose graph ExecuTorch cannot load (a program or data file it refuses, a signature other than the
// manifest's, a file it cannot open): bad input, as a UsageError (the runner's exit 2), and the C API's MM_BAD_BUNDLE.
struct BundleError : UsageError {
  using UsageError::UsageError;
};

}  // namespace mobile_moe::library
