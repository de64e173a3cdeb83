// unfused-inl.h — unfused(x), for the vector layers (vec_<isa>-inl.h include it, inside their ISA's
// namespace and target, so that its vector types are that ISA's).
//
// x as it was computed: the compiler cannot fuse the operation that produced it into the one that
// uses it. Under -ffp-contract=fast (GCC's default) a multiply and an add or subtract, vector
// intrinsics included, may become one fused multiply-add, which rounds once instead of twice; the
// kernels whose results are defined bit for bit (int8 weights) pass their products through this.
template <class T>
HEADS_INLINE T unfused(T x) {
#if defined(__x86_64__) || defined(__i386__)
#ifdef HEADS_AVX512_ON_AVX2
  constexpr bool in_memory = std::is_class_v<T> || sizeof(T) > 32;  // no 64-byte registers there
#else
  constexpr bool in_memory = std::is_class_v<T>;
#endif
  if constexpr (in_memory) {
    asm("" : "+m"(x));
  } else {
    asm("" : "+x"(x));
  }
#else
  asm("" : "+m"(x));
#endif
  return x;
}
