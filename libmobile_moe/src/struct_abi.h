// How the C API's sized structs cross the ABI (mobile_moe.h: "structs carry their size"): an app's struct read field
// by whole field as far as its struct_size reaches, and a library-filled struct written as far as the app's does.
// Shared by mobile_moe_api.cpp (mm_options, mm_stage_times) and measure_api.cpp (mobile_moe_measure.h's structs).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <initializer_list>

namespace mobile_moe::library {

// A struct_size beyond any struct a header will have: an app's struct never initialised, its size field garbage.
constexpr size_t kMaxStructSize = size_t{1} << 16;

// The app's struct over `into` (the defaults), whole fields only (`ends`: where each field after struct_size ends): a
// size that ends inside a field (never one a header had) leaves that field as it was.
template <typename Struct>
void copy_whole_fields(Struct* into, const Struct& from, size_t struct_size, std::initializer_list<size_t> ends) {
  size_t whole = 0;
  for (size_t end : ends)
    if (end <= struct_size) whole = end;
  std::memcpy(static_cast<void*>(into), &from, std::min(whole, sizeof(Struct)));
}

// The first `struct_size` bytes of `out` from `full`, its size field set to them: what an app's sizeof holds.
template <typename Struct>
void copy_out(Struct* out, Struct full, size_t struct_size) {
  full.struct_size = std::min(struct_size, sizeof(Struct));
  std::memcpy(static_cast<void*>(out), &full, full.struct_size);
}

}  // namespace mobile_moe::library
