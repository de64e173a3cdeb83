// mha_variants.h — MultiheadAttention's variants (linear attention, windows, block-sparse, head gates,
// head_dim and kdim/vdim) as the forward's (mha_variants_test.cc) and the backward's
// (mha_variants_bwd_test.cc) tests build them.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/testing.h"
#include "heads/mha.h"

namespace heads::testing {

inline MultiheadAttention make(MultiheadAttentionOptions o, uint64_t seed = 7) {
  MultiheadAttention m(o, seed);
  for (auto& [name, t] : m.state_dict()) t.copy_from(randn(t.shape(), 0.4));  // biases too
  return m;
}

struct Case {
  std::string name;
  std::function<void(MultiheadAttentionOptions&)> set;
};

inline std::vector<Case> cases() {
  return {
      {"linear elu", [](MultiheadAttentionOptions& o) { o.variant.kind = AttentionKind::Linear; }},
      {"linear relu + gates(mean)",
       [](MultiheadAttentionOptions& o) {
         o.variant.kind = AttentionKind::Linear, o.variant.feature_map = FeatureMap::Relu;
         o.variant.head_gate = HeadGate::MeanPool;
       }},
      {"window 2", [](MultiheadAttentionOptions& o) { o.variant.window = 2; }},
      {"sparse 3/2", [](MultiheadAttentionOptions& o) { o.variant.sparse_block = 3, o.variant.sparse_stride = 2; }},
      {"gates(first)", [](MultiheadAttentionOptions& o) { o.variant.head_gate = HeadGate::FirstToken; }},
      {"head_dim 5 + window 1 + gates(mean)",
       [](MultiheadAttentionOptions& o) {
         o.head_dim = 5, o.variant.window = 1, o.variant.head_gate = HeadGate::MeanPool;
       }},
      {"head_dim 3, kdim/vdim", [](MultiheadAttentionOptions& o) { o.head_dim = 3, o.kdim = 7, o.vdim = 9; }},
  };
}

inline MultiheadAttentionOptions base() {
  MultiheadAttentionOptions o;
  o.embed_dim = 12;
  o.num_heads = 3;
  return o;
}

}  // namespace heads::testing
