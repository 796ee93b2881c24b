// Runs the native runner's expert_choice.h on cases read from stdin, for tests/device_bench/test_expert_choice.py.
// One case per line; floats in C's hexadecimal notation (%a), so nothing is rounded on the way in or out:
//   pick K RENORMALIZE MARGIN N P_1 .. P_N R RESIDENT_1 .. RESIDENT_R
//   used E N COUNT_1 .. COUNT_N
// One answer per line: "ok M EXPERT_1 .. EXPERT_M GATE_1 .. GATE_M", or "error" when the function refused the case.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "expert_choice.h"

using mobile_moe::runner::ExpertChoice;

namespace {

float read_float(std::istream& in) {
  std::string word;
  in >> word;
  return std::strtof(word.c_str(), nullptr);
}

std::vector<float> read_floats(std::istream& in) {
  size_t count = 0;
  in >> count;
  std::vector<float> values(count);
  for (auto& value : values) value = read_float(in);
  return values;
}

ExpertChoice answer(std::istream& in) {
  std::string rule;
  in >> rule;
  if (rule == "used") {
    int num_experts = 0;
    in >> num_experts;
    return mobile_moe::runner::used_experts(read_floats(in), num_experts);
  }
  int k = 0, renormalize = 0;
  in >> k >> renormalize;
  const float margin = read_float(in);
  const std::vector<float> probs = read_floats(in);
  size_t count = 0;
  in >> count;
  std::set<int> resident;
  for (int expert = 0; count > 0 && in >> expert; --count) resident.insert(expert);
  return mobile_moe::runner::pick_experts(probs, k, renormalize != 0, resident, margin);
}

}  // namespace

int main() {
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    try {
      const ExpertChoice choice = answer(in);
      std::printf("ok %zu", choice.experts.size());
      for (int expert : choice.experts) std::printf(" %d", expert);
      for (float gate : choice.gates) std::printf(" %a", static_cast<double>(gate));
      std::printf("\n");
    } catch (const std::exception&) {
      std::printf("error\n");
    }
  }
  return 0;
}
