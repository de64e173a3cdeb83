// input_ranges_test.cc — the calibration of int8's outlier channels: what a layer records as each
// linear layer's input range equals the column maxima of that input computed again from the
// layer's weights with the public ops; packing with those ranges takes the outlier out.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "heads/encoder.h"
#include "heads/ops.h"
#include "heads/sdpa.h"

namespace heads {
namespace {

using testing::randn;

// max |x| over every dimension but the last, f32 [K].
Tensor columns_absmax(const Tensor& x_in) {
  const Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / K;
  Tensor a = Tensor::zeros({K}, DType::F32);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) a.data<float>()[k] = std::max(a.data<float>()[k], std::fabs(x.data<float>()[m * K + k]));
  }
  return a;
}

TEST(InputRanges, EncoderLayerRecordsEachLinearLayersInput) {
  TransformerEncoderLayerOptions o;
  o.d_model = 24;
  o.nhead = 3;
  o.dim_feedforward = 40;
  o.activation = Activation::Gelu;
  o.batch_first = true;
  o.dropout = 0.0;
  TransformerEncoderLayer layer(o, 7);
  layer.eval();
  {  // heavy-tailed rows in every linear weight: one large weight in every other row
    StateDict sd = layer.state_dict();
    for (const char* name : {"self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight"}) {
      Tensor w = testing::entry(sd, name).clone();
      const int64_t N = w.size(0), K = w.size(1);
      for (int64_t n = 0; n < N; n += 2) w.data<float>()[n * K + (n * 7) % K] *= 25.0f;
      for (auto& [n, t] : sd) {
        if (n == name) t = w;
      }
    }
    layer.load_state_dict(sd);
  }
  Tensor x = randn({2, 9, 24});
  for (int64_t r = 0; r < 18; ++r) x.data<float>()[r * 24 + 5] *= 20.0f;  // an outlier channel
  EncoderLayerTape tape;
  EncoderForwardArgs args;
  args.tape = &tape;
  const Tensor y = layer.forward(x, args);
  InputRanges ranges;
  layer.record_input_ranges(tape, ranges);
  layer.record_input_ranges(tape, ranges);  // merging the same ranges again changes nothing
  ASSERT_EQ(ranges.size(), 4u);

  // The same inputs from the public ops: in-projection, attention, out-projection + norm1, FF.
  const StateDict sd = layer.state_dict();
  const Tensor qkv = linear(x, testing::entry(sd, "self_attn.in_proj_weight"), testing::entry(sd, "self_attn.in_proj_bias"));
  const auto heads_of = [&](int64_t part) { return qkv.slice(2, part * 24, part * 24 + 24).reshape({2, 9, 3, 8}).permute({0, 2, 1, 3}); };
  const Tensor attn = sdpa(heads_of(0), heads_of(1), heads_of(2)).out.permute({0, 2, 1, 3}).reshape({2, 9, 24});
  const Tensor h1 = layer_norm(add(x, linear(attn, testing::entry(sd, "self_attn.out_proj.weight"), testing::entry(sd, "self_attn.out_proj.bias"))),
                               testing::entry(sd, "norm1.weight"), testing::entry(sd, "norm1.bias"), o.layer_norm_eps);
  const Tensor g = activation(linear(h1, testing::entry(sd, "linear1.weight"), testing::entry(sd, "linear1.bias")), Activation::Gelu);
  const std::pair<const char*, Tensor> want[] = {{"self_attn.in_proj_weight", x},
                                                 {"self_attn.out_proj.weight", attn},
                                                 {"linear1.weight", h1},
                                                 {"linear2.weight", g}};
  for (const auto& [name, input] : want) {
    ASSERT_TRUE(ranges.count(name)) << name;
    EXPECT_TRUE(testing::compare(ranges.at(name), columns_absmax(input)).within(1e-5, 1e-6)) << name;
  }
  EXPECT_TRUE(testing::bitwise_equal(ranges.at("self_attn.in_proj_weight"), columns_absmax(x)));

  // Packed with them, the in-projection computes channel 5 in f32; the layer's int8 output stays close.
  TransformerEncoderLayer q = layer.clone();
  q.set_precision(Precision::Int8, ranges);
  const Tensor yq = q.forward(x);
  EXPECT_TRUE(testing::compare(yq, y).within(5e-2, 5e-2));
  const StateDict stored = q.quantized_state_dict();
  const Tensor& channels = testing::entry(stored, "self_attn.in_proj_weight_outlier_channels");
  ASSERT_EQ(channels.numel(), 1);
  EXPECT_EQ(channels.data<int64_t>()[0], 5);
  // Calibrated, only the feed-forward output keeps residual rows (kInt8ModelWidthResidualError for the
  // others); without calibration every weight has them (its heavy rows lose more than kInt8ResidualError).
  const char* const linears[] = {"self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight"};
  TransformerEncoderLayer plain = layer.clone();
  plain.set_precision(Precision::Int8);
  const StateDict plain_stored = plain.quantized_state_dict();
  for (const char* name : linears) {
    const std::string rows = std::string(name) + "_residual_rows";
    EXPECT_NE(testing::find_entry(plain_stored, rows), nullptr) << name;
    EXPECT_EQ(testing::find_entry(stored, rows) != nullptr, std::string(name) == "linear2.weight") << name;
  }
  // A layer loaded from that state dict runs the same bits.
  TransformerEncoderLayer back(o, 8);
  back.eval();
  back.load_state_dict(stored);
  EXPECT_TRUE(testing::bitwise_equal(back.forward(x), yq));
}

}  // namespace
}  // namespace heads
