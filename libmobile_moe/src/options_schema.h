// Generated from mobile_moe/library/options.py, the one table of mm_options, by
//   python -m mobile_moe.library.options --cpp-header > libmobile_moe/src/options_schema.h
// Do not edit: change the table and regenerate (tests/library/test_options_contract.py compares the two).
#pragma once

namespace mobile_moe::library {

// A numeric option of mm_options: its name (the field's), default and inclusive bounds.
template <typename Value>
struct NumericOption {
  const char* name;
  Value default_value, low, high;
};

inline constexpr NumericOption<int> kOptionThreads{"threads", 1, 0, 1024};
inline constexpr NumericOption<int> kOptionCacheExperts{"cache_experts", -1, -1, 4096};
inline constexpr NumericOption<int> kOptionParkExperts{"park_experts", -1, -1, 4096};
inline constexpr NumericOption<float> kOptionCacheMargin{"cache_margin", 0.0f, 0.0f, 1.0f};
inline constexpr const char* kOptionWeightCacheDir = "weight_cache_dir";
inline constexpr NumericOption<int> kOptionWeightCacheLimitMib{"weight_cache_limit_mib", 1024, 1, 16777216};
inline constexpr NumericOption<int> kOptionPrefetch{"prefetch", 1, 0, 1};

}  // namespace mobile_moe::library
