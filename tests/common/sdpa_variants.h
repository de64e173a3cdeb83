// sdpa_variants.h — the score modifiers' variants (sliding windows, softcap, ALiBi, T5 bias, sinks,
// head masks, and their combinations) and the shapes they run on, shared by the forward's
// (sdpa_variants_test.cc) and the backward's (sdpa_variants_bwd_test.cc) tests.
#pragma once

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "heads/sdpa.h"

namespace heads::testing {


// One variant: the options it sets on top of a plain call (H query heads).
struct Variant {
  std::string name;
  std::function<void(SdpaOptions&, int64_t H, int64_t Lq, int64_t Lk)> set;
};

inline std::vector<Variant> variants() {
  return {
      {"window(3,-1)", [](SdpaOptions& o, int64_t, int64_t, int64_t) { o.window_left = 3; }},
      {"window(-1,2)", [](SdpaOptions& o, int64_t, int64_t, int64_t) { o.window_right = 2; }},
      {"window(5,0)", [](SdpaOptions& o, int64_t, int64_t, int64_t) { o.window_left = 5, o.window_right = 0; }},
      {"sliding 4 + causal", [](SdpaOptions& o, int64_t, int64_t, int64_t) { o.window_left = 3, o.is_causal = true; }},
      {"sliding 40 + causal-br",
       [](SdpaOptions& o, int64_t, int64_t, int64_t) {
         o.window_left = 39, o.is_causal = true, o.causal_align = CausalAlign::BottomRight;
       }},
      {"window(0,0)", [](SdpaOptions& o, int64_t, int64_t, int64_t) { o.window_left = 0, o.window_right = 0; }},
      {"softcap 2", [](SdpaOptions& o, int64_t, int64_t, int64_t) { o.softcap = 2.0; }},
      {"softcap 30 + causal", [](SdpaOptions& o, int64_t, int64_t, int64_t) { o.softcap = 30.0, o.is_causal = true; }},
      {"alibi", [](SdpaOptions& o, int64_t H, int64_t, int64_t) { o.alibi_slopes = alibi_slopes(H); }},
      {"alibi random + causal-br",
       [](SdpaOptions& o, int64_t H, int64_t, int64_t) {
         o.alibi_slopes = randn({H}, 0.05), o.is_causal = true, o.causal_align = CausalAlign::BottomRight;
       }},
      {"t5 bidirectional",
       [](SdpaOptions& o, int64_t H, int64_t, int64_t) {
         o.relative_attention_bias = randn({32, H}), o.relative_attention_max_distance = 20, o.scale = 1.0;
       }},
      {"t5 causal",
       [](SdpaOptions& o, int64_t H, int64_t, int64_t) {
         o.relative_attention_bias = randn({16, H}), o.relative_attention_bidirectional = false;
         o.relative_attention_max_distance = 40, o.is_causal = true;
       }},
      {"sinks", [](SdpaOptions& o, int64_t H, int64_t, int64_t) { o.sinks = randn({H}, 2.0); }},
      {"sinks + window(2,0)",
       [](SdpaOptions& o, int64_t H, int64_t, int64_t) { o.sinks = randn({H}, 2.0), o.window_left = 2, o.window_right = 0; }},
      {"everything",
       [](SdpaOptions& o, int64_t H, int64_t, int64_t) {
         o.window_left = 9, o.window_right = 4, o.softcap = 5.0, o.alibi_slopes = alibi_slopes(H);
         o.relative_attention_bias = randn({8, H}), o.sinks = randn({H});
         o.attn_mask = testing::rand_bool({1, 1, 1, 1}, 1.0);
       }},
      {"everything + float mask + dropout",
       [](SdpaOptions& o, int64_t H, int64_t Lq, int64_t Lk) {
         o.window_left = 6, o.is_causal = true, o.softcap = 3.0, o.relative_attention_bias = randn({8, H});
         o.sinks = randn({H}), o.dropout_p = 0.25, o.dropout_seed = 77;
         o.attn_mask = randn({1, H, Lq, Lk});
       }},
      {"per-row bool mask + softcap + t5 + sinks",
       [](SdpaOptions& o, int64_t H, int64_t Lq, int64_t Lk) {
         o.attn_mask = testing::rand_bool({Lq, Lk}, 0.7), o.softcap = 4.0, o.relative_attention_bias = randn({16, H});
         o.sinks = randn({H});
       }},
      {"head_mask [H]", [](SdpaOptions& o, int64_t H, int64_t, int64_t) { o.head_mask = testing::rand_bool({H}, 0.5); }},
      {"head_mask [H] + sinks + causal",
       [](SdpaOptions& o, int64_t H, int64_t, int64_t) {
         o.head_mask = testing::rand_bool({H}, 0.6), o.sinks = randn({H}), o.is_causal = true;
       }},
      {"float mask [Lq, Lk] + alibi + window",
       [](SdpaOptions& o, int64_t H, int64_t Lq, int64_t Lk) {
         o.attn_mask = randn({Lq, Lk}), o.alibi_slopes = alibi_slopes(H), o.window_left = 20, o.window_right = 5;
       }},
  };
}

struct Shape4 {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
  bool forward = true, backward = true;  // which of the two tests below runs it
};

inline std::vector<Shape4> shapes() {
  return {{1, 1, 1, 1, 1, 8, 8},     {2, 4, 2, 1, 700, 16, 16},  {1, 3, 3, 3, 129, 17, 9},
          {2, 2, 1, 7, 7, 5, 5},     {1, 4, 4, 129, 129, 64, 64}, {1, 2, 2, 129, 33, 63, 66},
          {1, 2, 1, 33, 200, 32, 32}, {1, 2, 1, 150, 600, 24, 20},  // the backward cuts its keys
          // the forward sweeps the keys with several query tiles at once (a head's K and V past 256 KB,
          // tiles enough to group on 2 threads): a size for that rule, which the backward does not have
          {1, 4, 2, 300, 1500, 24, 20, true, false},
          // its backward counterpart: GQA, several query tiles, the keys cut into splits (4 of 275)
          {1, 4, 2, 150, 1100, 24, 20, false, true},
          {1, 2, 1, 20, 2100, 24, 20}};  // few query tiles against long keys: the forward cuts the keys
}

// A tensor of NaN: the gradients' buffers for sdpa_backward_out, which must write every element.
inline Tensor nan_filled(const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::fill(t.data<float>(), t.data<float>() + t.numel(), std::numeric_limits<float>::quiet_NaN());
  return t;
}

}  // namespace heads::testing
