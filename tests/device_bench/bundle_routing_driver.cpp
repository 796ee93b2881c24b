// Runs libmobile_moe's bundle_routing.cpp on cases read from stdin, for tests/device_bench/test_bundle_routing.py.
// One case per line; floats in C's hexadecimal notation (%a), so nothing is rounded on the way in or out:
//   pick K RENORMALIZE MARGIN N P_1 .. P_N R RESIDENT_1 .. RESIDENT_R
//   used E N COUNT_1 .. COUNT_N
// One answer per line: "ok M EXPERT_1 .. EXPERT_M GATE_1 .. GATE_M", "error" when the function refused the case, or
// "bad" when the line itself does not follow this format (the test's own mistake, never an answer).
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bundle_routing.h"

using mobile_moe::library::RoutedExperts;

namespace {

struct BadLine {};

float read_float(std::istream& in) {
  std::string word;
  char* end = nullptr;
  if (!(in >> word)) throw BadLine{};
  const float value = std::strtof(word.c_str(), &end);
  if (end != word.c_str() + word.size()) throw BadLine{};
  return value;
}

std::vector<float> read_floats(std::istream& in) {
  size_t count = 0;
  if (!(in >> count)) throw BadLine{};
  std::vector<float> values(count);
  for (auto& value : values) value = read_float(in);
  return values;
}

// The case's arguments, read to the end of the line; then the rule's answer.
RoutedExperts answer(std::istream& in) {
  std::string rule, rest;
  in >> rule;
  if (rule == "used") {
    int num_experts = 0;
    if (!(in >> num_experts)) throw BadLine{};
    const std::vector<float> slots = read_floats(in);
    if (in >> rest) throw BadLine{};
    return mobile_moe::library::used_experts(slots, num_experts);
  }
  int k = 0, renormalize = 0;
  if (rule != "pick" || !(in >> k >> renormalize)) throw BadLine{};
  const float margin = read_float(in);
  const std::vector<float> probs = read_floats(in);
  size_t count = 0;
  if (!(in >> count)) throw BadLine{};
  std::set<int> resident;
  for (int expert = 0; count > 0; --count) {
    if (!(in >> expert)) throw BadLine{};
    resident.insert(expert);
  }
  if (in >> rest) throw BadLine{};
  return mobile_moe::library::pick_experts(probs, k, renormalize != 0, resident, margin);
}

}  // namespace

int main() {
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    try {
      const RoutedExperts choice = answer(in);
      std::printf("ok %zu", choice.experts.size());
      for (int expert : choice.experts) std::printf(" %d", expert);
      for (float gate : choice.gates) std::printf(" %a", static_cast<double>(gate));
      std::printf("\n");
    } catch (const BadLine&) {
      std::printf("bad\n");
    } catch (const std::exception&) {
      std::printf("error\n");
    }
  }
  return 0;
}
