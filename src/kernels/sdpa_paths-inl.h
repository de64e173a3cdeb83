// sdpa_paths-inl.h — the SDPA entry points of one ISA build: the forward picks the tiled kernel or
// the decode kernel by shape (and the bf16 kernel for bf16); the backward is sdpa_bwd-inl.h.
// Included by kernels/isa_table-inl.h inside namespace heads::kernels::<isa>.

#include "kernels/sdpa_flash_fwd-inl.h"
#include "kernels/sdpa_decode-inl.h"
#include "kernels/gemm-inl.h"
#ifdef HEADS_AMX
#include "kernels/sdpa_amx-inl.h"  // before the backward, which takes its tile pieces
#endif
#include "kernels/sdpa_bwd-inl.h"
#ifdef HEADS_NATIVE_BF16
#include "kernels/sdpa_flash_bf16-inl.h"
#endif

// Up to this many query rows per head, a queries-on-lanes tile would leave most lanes idle:
// the decode kernel reads K and V once per key/value head instead. Not under set_batch_invariant:
// the two kernels sum in different orders, and a sequence's Lq (its padded length) depends on
// the batch it comes in, so the tiled kernel takes every shape then (slower for few queries).
constexpr int64_t kMaxDecodeLq = 4;

inline bool decode_kernel_for(const SdpaProblem& pb) { return pb.Lq <= kMaxDecodeLq && !batch_invariant(); }

inline void sdpa_fwd_f32(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& out, const Tensor& lse, const Tensor& weights) {
  if (decode_kernel_for(pb)) {
    sdpa_decode<float>(pb, q, k, v, out, lse, weights);
  } else {
    sdpa_tiled_f32(pb, q, k, v, out, lse, weights);
  }
}

// q (and out) f32 or bf16 with k, v stored in another of f32, bf16 and int8 (a KV cache).
template <class T>
inline bool sdpa_decode_kv_as(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, const Tensor& weights) {
  switch (k.dtype()) {
    case DType::F32: sdpa_decode<T, float>(pb, q, k, v, out, lse, weights); return true;
    case DType::BF16: sdpa_decode<T, uint16_t>(pb, q, k, v, out, lse, weights); return true;
    case DType::I8: sdpa_decode<T, int8_t>(pb, q, k, v, out, lse, weights); return true;
    default: return false;
  }
}

inline bool sdpa_decode_kv(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& out, const Tensor& lse, const Tensor& weights) {
  if (!decode_kernel_for(pb)) return false;
  return q.dtype() == DType::BF16 ? sdpa_decode_kv_as<uint16_t>(pb, q, k, v, out, lse, weights)
                                  : sdpa_decode_kv_as<float>(pb, q, k, v, out, lse, weights);
}

// bf16 q, k, v and out (f32 accumulation). The tiled part widens bf16 to f32 as it reads;
// isa_avx512bf16.cc replaces it with vdpbf16ps kernels where they pay (bf16_dot_pays()),
// isa_amx.cc with AMX tiles.
inline void sdpa_fwd_bf16(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse, const Tensor& weights) {
  if (decode_kernel_for(pb)) {
    sdpa_decode<uint16_t>(pb, q, k, v, out, lse, weights);
  } else {
#if defined(HEADS_AMX)
    amx::sdpa_fwd(pb, q, k, v, out, lse, weights);
#elif defined(HEADS_NATIVE_BF16)
    if (bf16_dot_pays()) {
      sdpa_tiled_bf16_dot(pb, q, k, v, out, lse, weights);
    } else {
      sdpa_tiled_bf16_widen(pb, q, k, v, out, lse, weights);
    }
#else
    sdpa_tiled_bf16_widen(pb, q, k, v, out, lse, weights);
#endif
  }
}
