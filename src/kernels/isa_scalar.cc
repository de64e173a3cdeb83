// isa_scalar.cc — the portable kernels: plain C++ over an 8-lane array type, no intrinsics.
#include "kernels/isa_build.h"

namespace heads::kernels::scalar {
constexpr Isa kIsa = Isa::Scalar;
#include "kernels/simd/vec_scalar-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::scalar
