// scratch.h — per-thread working memory for the attention kernels, reused from call to call.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

namespace heads::kernels {

// At least `floats` floats, 64-byte aligned, contents unspecified. Owned by the calling thread and
// valid until its next call (the kernels take it once per call and split it among their workers).
// Grows to the largest request and keeps it, so repeated calls neither allocate nor fault pages in.
// New memory is NaN-filled; with the environment variable HEADS_SCRATCH_POISON=1 (read once) every
// call NaN-fills the requested floats, so a kernel that reads scratch it has not written in this
// call (stale values from an earlier one) fails its tests deterministically.
float* thread_scratch(int64_t floats);

// Memory for one call, freed when the returned pointer goes: for buffers as large as an output
// (the backward's per-split dQ), which must not stay with the thread after the call. 64-byte
// aligned, contents unspecified; NaN-filled under HEADS_SCRATCH_POISON as above.
struct FreeScratch {
  void operator()(float* p) const { std::free(p); }
};
using CallScratch = std::unique_ptr<float[], FreeScratch>;
CallScratch call_scratch(int64_t floats);

}  // namespace heads::kernels
