// files.h — writing output files so that a failure never leaves a half-written one.
#pragma once

#include <string>

namespace heads {

// Writes `bytes` to `path` through a temporary file in the same directory renamed at the end: on
// any error (named with the path and the system's reason) `path` is left as it was.
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace heads
