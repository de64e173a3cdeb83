// files.cc — atomic file writes (include/heads/files.h).
#include "heads/files.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>

#include "heads/error.h"

namespace heads {

void write_file_atomically(const std::string& path, const std::string& bytes) {
  std::random_device rd;
  const std::string tmp = path + ".tmp" + std::to_string(rd() % 1000000);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail(path, ": cannot write (", std::strerror(errno), ")");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      out.close();
      std::remove(tmp.c_str());
      fail(path, ": write failed (", std::strerror(errno), ")");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    fail(path, ": cannot rename temporary file into place (", std::strerror(err), ")");
  }
}

}  // namespace heads
