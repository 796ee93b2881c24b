// bundle_routing.h: the rules of which experts an image takes, as mobile_moe/export/bundle_routing.py owns them.
#include "bundle_routing.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace mobile_moe::library {

RoutedExperts pick_experts(const std::vector<float>& probs, int k, bool renormalize,
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
  RoutedExperts choice{chosen, {}};
  float total = 0;
  for (int expert : chosen) {
    choice.gates.push_back(probs[expert]);
    total += probs[expert];
  }
  if (renormalize && total > 0)
    for (auto& gate : choice.gates) gate /= total;
  return choice;
}

RoutedExperts used_experts(const std::vector<float>& expert_tokens, int num_experts) {
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
  RoutedExperts choice;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] <= 0) continue;
    choice.experts.push_back(static_cast<int>(e));
    choice.gates.push_back(static_cast<float>(counts[e] / total));
  }
  return choice;
}

}  // namespace mobile_moe::library
