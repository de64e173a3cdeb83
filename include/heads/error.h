// error.h — the one exception type of heads, and the checks that build its messages.
//
// Every error a caller can cause (bad shapes, dtypes, malformed files) is a heads::Error whose
// message names the operation or argument, the expectation and the offending shapes or values:
//   sdpa: key: expected head dim 64 to match query [2, 12, 128, 64], got [2, 12, 128, 80]
// The Python module turns it into ValueError; the CLI prints it as one line and exits 1.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace heads {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

// Streams every argument into one string; vectors of integers print as shapes "[2, 7, 64]".
inline void append(std::ostringstream& os, const std::vector<int64_t>& v) {
  os << '[';
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << ']';
}
template <class T>
void append(std::ostringstream& os, const T& x) {
  os << x;
}
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (append(os, args), ...);
  return os.str();
}

}  // namespace detail

// Throws heads::Error with the concatenation of the arguments.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(detail::concat(args...));
}

}  // namespace heads

// HEADS_CHECK(cond, parts...): user-facing validation; the message is the concatenated parts.
#define HEADS_CHECK(cond, ...)              \
  do {                                      \
    if (!(cond)) ::heads::fail(__VA_ARGS__); \
  } while (0)

// HEADS_DCHECK(cond): internal invariant, checked in debug builds only, reported with file:line.
#ifndef NDEBUG
#define HEADS_DCHECK(cond)                                                                  \
  do {                                                                                      \
    if (!(cond)) ::heads::fail("internal invariant failed: ", #cond, " at ", __FILE__, ":", \
                               __LINE__);                                                   \
  } while (0)
#else
#define HEADS_DCHECK(cond) \
  do {                     \
  } while (0)
#endif
