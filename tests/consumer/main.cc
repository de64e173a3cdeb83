// A consumer of the installed package: one attention call, checked against the reference.
#include <cmath>
#include <cstdio>

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
  return err < 1e-5 ? 0 : 1;
}
