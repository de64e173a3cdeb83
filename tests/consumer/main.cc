// A consumer of the installed package: one attention call checked against the reference, and one
// training step of MultiheadAttention (tape, backward, AdamW) as the README shows it.
#include <cmath>
#include <cstdio>

#include <heads/mha.h>
#include <heads/optim.h>
#include <heads/sdpa.h>

int main() {
  heads::Tensor q = heads::Tensor::empty({1, 2, 3, 4}, heads::DType::F32);
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] = std::sin(static_cast<float>(i));
  const heads::Tensor out = heads::sdpa(q, q, q).out;
  const heads::Tensor ref = heads::ref::sdpa_fwd_f64(q, q, q).out;
  double err = 0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    err = std::fmax(err, std::fabs(out.data<float>()[i] - ref.data<double>()[i]));
  }
  std::printf("consumer: max error %.3g\n", err);

  heads::MultiheadAttention mha({.embed_dim = 8, .num_heads = 2, .batch_first = true}, 1);
  const heads::Tensor x = q.reshape({1, 3, 8});
  heads::MhaTape tape;
  auto [y, w] = mha.forward(x, x, x, {.need_weights = false, .tape = &tape});
  const heads::MhaGrads g = mha.backward(tape, y);  // loss = |y|² / 2
  heads::AdamW opt(mha.state_dict(), {.lr = 1e-2});
  const float before = mha.state_dict().front().second.data<float>()[0];
  opt.step(g.params);
  const float after = mha.state_dict().front().second.data<float>()[0];
  std::printf("consumer: one AdamW step moved in_proj_weight[0] by %.3g\n", after - before);
  return err < 1e-5 && g.dquery.shape() == x.shape() && after != before ? 0 : 1;
}
