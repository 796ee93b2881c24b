// Which experts an image takes, from what its router (or its whole graph) reported: libmobile_moe's translation of
// the rules mobile_moe/export/bundle_routing.py owns (pick_experts, used_experts).
// tests/device_bench/test_bundle_routing.py builds them alone (bundle_routing.cpp needs only the standard library, no
// ExecuTorch) and holds them equal to the Python rules case by case, ties and float32 margins included. Change a rule
// there first, then here.
#pragma once

#include <set>
#include <vector>

namespace mobile_moe::library {

// The experts one image takes, in the model's order, and each one's gate (a whole graph's: its share of the tokens).
struct RoutedExperts {
  std::vector<int> experts;
  std::vector<float> gates;
};

// bundle_routing.py pick_experts: the k most probable experts (ties: the lower index); with a cache margin, a chosen
// expert not resident gives its place to the most probable resident expert not chosen whose probability is within
// the margin of its own (cache-conditional routing, arXiv 2412.00099; compared in float32). Gates are the chosen
// probabilities, renormalised when the model renormalises. The caller has checked probs holds num_experts values and
// 1 <= k <= num_experts; a corrupt graph can still emit NaN, which would break the sort's ordering, so non-finite
// probabilities are an error.
RoutedExperts pick_experts(const std::vector<float>& probs, int k, bool renormalize,
                          const std::set<int>& resident, float margin);

// bundle_routing.py used_experts: a whole bundle's experts are those that filled token slots for this image in any
// expert set (expert_tokens (1, G, E) summed over the G sets > 0), ascending, each with its share of the image's slots
// as the gate. A count that is negative or not finite can only come from a corrupt graph.
RoutedExperts used_experts(const std::vector<float>& expert_tokens, int num_experts);

}  // namespace mobile_moe::library
