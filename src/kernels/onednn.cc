// onednn.cc — oneDNN matmul primitives (onednn.h): created once per call shape and kept, run on
// heads' OpenMP thread count with a per-thread scratchpad.
#include "kernels/onednn.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "heads/error.h"
#include "heads/runtime.h"

namespace heads::kernels {

namespace {

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}


// oneDNN sizes a primitive's parallel work for the OpenMP thread count of the thread creating it
// and keeps that count: primitives are created and run with omp_set_num_threads(n) in force on the
// calling thread, and n is part of their key.
class OmpThreads {
 public:
  explicit OmpThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~OmpThreads() { omp_set_num_threads(saved_); }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int saved_;
};

struct Entry {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};

// Matmul primitives by shape, strides, types and threads, the least recently used dropped past
// kCachedPrimitives. Creating one costs milliseconds (JIT), and a model run over batches of varying
// lengths makes each batch's M a new shape for each kind of GEMM in a layer (5–7 per batch for a
// BERT encoder in int8). Callers hold a shared reference, so dropping an entry never frees a
// primitive in use.
constexpr size_t kCachedPrimitives = 512;
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int, int, bool>;

Key key_of(const MatmulCall& c, bool any_b) {
  return {c.M, c.K, c.N, c.a_rs, c.a_cs, c.b_rs, c.b_cs, c.c_rs, c.bias, c.threads, static_cast<int>(c.types), any_b};
}

// any_b: B's layout left to oneDNN (PackedB).
std::shared_ptr<const Entry> primitive_for(const MatmulCall& call, bool any_b) {
  static std::mutex mu;
  static std::map<Key, std::pair<std::shared_ptr<const Entry>, uint64_t>> cache;  // entry, last use
  static uint64_t clock = 0;
  const Key key = key_of(call, any_b);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) {
    it->second.second = ++clock;
    return it->second.first;
  }
  if (cache.size() >= kCachedPrimitives) {
    auto oldest = cache.begin();
    for (auto e = cache.begin(); e != cache.end(); ++e) {
      if (e->second.second < oldest->second.second) oldest = e;
    }
    cache.erase(oldest);
  }
  const MatmulCall& c = call;
  using dt = dnnl::memory::data_type;
  const bool int8 = c.types == MatmulTypes::U8S8;
  const dt in = c.types == MatmulTypes::F32 ? dt::f32 : int8 ? dt::s8 : dt::bf16;  // B's type
  const dt out = int8 ? dt::s32 : c.types == MatmulTypes::Bf16Out ? dt::bf16 : dt::f32;
  const dnnl::memory::desc src({c.M, c.K}, int8 ? dt::u8 : in, {c.a_rs, c.a_cs});
  const dnnl::memory::desc wei = any_b ? dnnl::memory::desc({c.K, c.N}, in, dnnl::memory::format_tag::any)
                                        : dnnl::memory::desc({c.K, c.N}, in, {c.b_rs, c.b_cs});
  const dnnl::memory::desc dst({c.M, c.N}, out, {c.c_rs, 1});
  const dnnl::memory::desc bias({1, c.N}, dt::f32, {c.N, 1});
  const auto desc = c.bias ? dnnl::matmul::desc(src, wei, bias, dst) : dnnl::matmul::desc(src, wei, dst);
  // oneDNN's library-managed scratchpad is not for concurrent execution unless the library is built
  // with DNNL_ENABLE_CONCURRENT_EXEC (Debian's is not): MHA calls from several Python threads at once
  // gave wrong results. Each call passes its thread's own scratchpad (onednn_matmul).
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(desc, attr, cpu_engine());
  auto entry = std::make_shared<const Entry>(Entry{pd, dnnl::matmul(pd)});
  cache.emplace(key, std::make_pair(entry, ++clock));
  return entry;
}

}  // namespace

struct PackedB::Impl {
  std::mutex mu;
  // B in each layout a primitive asked for (a few at most: oneDNN's choice depends on the shape).
  std::vector<std::pair<dnnl::memory::desc, std::shared_ptr<char>>> layouts;
};

PackedB::PackedB() : impl_(std::make_unique<Impl>()) {}
PackedB::~PackedB() = default;

void onednn_matmul(const MatmulCall& call, const void* a, const void* b, const float* bias, void* c,
                   PackedB* packed) {
  const OmpThreads threads(call.threads);
  const std::shared_ptr<const Entry> entry = primitive_for(call, packed != nullptr);
  const Entry& e = *entry;
  const auto& pd = e.pd;
  dnnl::engine& eng = cpu_engine();
  dnnl::stream stream(eng);
  dnnl::memory src(pd.src_desc(), eng, const_cast<void*>(a));
  std::shared_ptr<char> held;  // B in the primitive's layout, alive until the call returns
  if (packed != nullptr) {
    PackedB::Impl& p = *packed->impl_;
    const dnnl::memory::desc want = pd.weights_desc();
    std::lock_guard<std::mutex> lock(p.mu);
    for (const auto& [desc, data] : p.layouts) {
      if (desc == want) held = data;
    }
    if (!held) {  // made once: B reordered from its plain layout
      using dt = dnnl::memory::data_type;
      const dt in = want.data_type();
      const dnnl::memory::desc plain({call.K, call.N}, in, {call.b_rs, call.b_cs});
      held = std::shared_ptr<char>(static_cast<char*>(std::aligned_alloc(64, (want.get_size() + 63) / 64 * 64)),
                                   [](char* q) { std::free(q); });
      HEADS_CHECK(held != nullptr, "linear: cannot allocate ", want.get_size(), " bytes for a packed weight");
      dnnl::memory from(plain, eng, const_cast<void*>(b)), to(want, eng, held.get());
      dnnl::reorder(from, to).execute(stream, from, to);
      stream.wait();
      p.layouts.emplace_back(want, held);
    }
  }
  dnnl::memory wei(pd.weights_desc(), eng, held ? static_cast<void*>(held.get()) : const_cast<void*>(b));
  dnnl::memory dst(pd.dst_desc(), eng, c);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
  if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(pd.bias_desc(), eng, const_cast<float*>(bias)));
  // This thread's scratchpad, kept across calls (grown to the largest a primitive asked for).
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> scratch;
  thread_local size_t scratch_size = 0;
  const dnnl::memory::desc sd = pd.scratchpad_desc();
  if (sd.get_size() > 0) {
    if (scratch_size < sd.get_size()) {
      const size_t n = (sd.get_size() + 63) / 64 * 64;
      scratch.reset(std::aligned_alloc(64, n));
      HEADS_CHECK(scratch != nullptr, "linear: cannot allocate a ", n, "-byte oneDNN scratchpad");
      scratch_size = n;
    }
    args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(sd, eng, scratch.get()));
  }
  e.prim.execute(stream, args);
  stream.wait();
}

int gemm_threads(int64_t M, int64_t N, int64_t K) {
  return threads_for(2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K),
                     std::max<int64_t>(M, N));
}

}  // namespace heads::kernels
