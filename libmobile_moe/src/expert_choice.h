// Which experts an image takes, from what its router (or its whole graph) reported: libmobile_moe's translation of
// the rules mobile_moe/expert_choice.py owns (pick_experts, used_experts). tests/device_bench/test_expert_choice.py
// builds these functions alone (no ExecuTorch: this header needs only the standard library) and holds them equal to
// the Python rules case by case, ties and float32 margins included. Change a rule there first, then here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace mobile_moe::library {

struct ExpertChoice {
  std::vector<int> experts;
  std::vector<float> gates;
};

// expert_choice.py pick_experts: the k most probable experts (ties: the lower index); with a cache margin, a chosen
// expert not resident gives its place to the most probable resident expert not chosen whose probability is within
// the margin of its own (cache-conditional routing, arXiv 2412.00099; compared in float32). Gates are the chosen
// probabilities, renormalised when the model renormalises. The caller has checked probs holds num_experts values and
// 1 <= k <= num_experts; a corrupt graph can still emit NaN, which would break the sort's ordering, so non-finite
// probabilities are an error.
inline ExpertChoice pick_experts(const std::vector<float>& probs, int k, bool renormalize,
                                 const std::set<int>& resident, float margin) {
  if (k < 1 || static_cast<std::size_t>(k) > probs.size())
    throw std::logic_error("top_k " + std::to_string(k) + " with " + std::to_string(probs.size()) + " experts");
  for (float p : probs)
    if (!std::isfinite(p)) throw std::runtime_error("the router produced a non-finite probability (a corrupt graph?)");
  std::vector<int> order(probs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return probs[a] > probs[b]; });
  std::vector<int> chosen(order.begin(), order.begin() + k);
  for (int slot = 0; margin > 0 && slot < k; ++slot) {
    if (resident.count(chosen[slot])) continue;
    const float floor = probs[chosen[slot]] - margin;
    for (int expert : order) {
      if (resident.count(expert) && std::find(chosen.begin(), chosen.end(), expert) == chosen.end() &&
          probs[expert] >= floor) {
        chosen[slot] = expert;
        break;
      }
    }
  }
  ExpertChoice choice{chosen, {}};
  float total = 0;
  for (int expert : chosen) {
    choice.gates.push_back(probs[expert]);
    total += probs[expert];
  }
  if (renormalize && total > 0)
    for (auto& gate : choice.gates) gate /= total;
  return choice;
}

// expert_choice.py used_experts: a whole bundle's experts are those that filled token slots for this image in any
// expert set (expert_tokens (1, G, E) summed over the G sets > 0), ascending, each with its share of the image's slots
// as the gate. A count that is negative or not finite can only come from a corrupt graph.
inline ExpertChoice used_experts(const std::vector<float>& expert_tokens, int num_experts) {
  if (num_experts < 1 || expert_tokens.size() % static_cast<std::size_t>(num_experts) != 0)
    throw std::logic_error("expert_tokens holds " + std::to_string(expert_tokens.size()) + " values for " +
                           std::to_string(num_experts) + " experts");
  std::vector<double> counts(static_cast<std::size_t>(num_experts), 0.0);
  double total = 0;
  for (std::size_t i = 0; i < expert_tokens.size(); ++i) {
    float count = expert_tokens[i];
    if (!std::isfinite(count) || count < 0)
      throw std::runtime_error(
          "the whole graph reported a negative or non-finite expert token count (a corrupt graph?)");
    counts[i % counts.size()] += count;
    total += count;
  }
  ExpertChoice choice;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] <= 0) continue;
    choice.experts.push_back(static_cast<int>(e));
    choice.gates.push_back(static_cast<float>(counts[e] / total));
  }
  return choice;
}

}  // namespace mobile_moe::library
