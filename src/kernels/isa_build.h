// isa_build.h — what every ISA build of the kernels includes before its target pragma:
// the standard headers the -inl.h kernel files use (they are included inside a namespace, so they
// cannot include them themselves), the kernel table, per-thread scratch and the vector layers'
// shared constants. Included first by each src/kernels/isa_<isa>.cc.
#pragma once

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/scratch.h"
#include "kernels/sdpa_split.h"
#include "kernels/simd/common.h"

// Vector arguments of the lambdas inside the kernels never cross an ABI boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
