// scratch.h — per-thread working memory for the attention kernels, reused from call to call.
#pragma once

#include <cstdint>

namespace heads::kernels {

// At least `floats` floats, 64-byte aligned, contents unspecified. Owned by the calling thread and
// valid until its next call (the kernels take it once per call and split it among their workers).
// Grows to the largest request and keeps it, so repeated calls neither allocate nor fault pages in.
// New memory is NaN-filled; with the environment variable HEADS_SCRATCH_POISON=1 (read once) every
// call NaN-fills the requested floats, so a kernel that reads scratch it has not written in this
// call (stale values from an earlier one) fails its tests deterministically.
float* thread_scratch(int64_t floats);

}  // namespace heads::kernels
