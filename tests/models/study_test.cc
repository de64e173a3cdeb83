// study_test.cc — the `heads study` tasks are what heads/study.h says, and training on them learns
// what the attention mechanism can reach: softmax attention copies at distance L/2, a window
// shorter than that cannot.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "common/testing.h"
#include "heads/study.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

TEST(Study, CopyTaskSequences) {
  StudyConfig c;
  c.task = StudyTask::Copy;
  c.seq_len = 20;  // m = 9: x(9) SEP x(9) SEP
  c.vocab = 5;
  std::mt19937_64 gen(1);
  const StudyBatch b = make_study_batch(c, 6, gen);
  ASSERT_EQ(b.ids.shape(), (Shape{6, 20}));
  EXPECT_EQ(study_vocab_size(c), 6);
  for (int64_t n = 0; n < 6; ++n) {
    const int64_t* s = b.ids.data<int64_t>() + n * 20;
    const int64_t* t = b.targets.data<int64_t>() + n * 20;
    EXPECT_EQ(s[9], 5);
    EXPECT_EQ(s[19], 5);
    for (int64_t i = 0; i < 9; ++i) {
      EXPECT_GE(s[i], 0);
      EXPECT_LT(s[i], 5);
      EXPECT_EQ(s[10 + i], s[i]);
    }
    for (int64_t p = 0; p < 20; ++p) {
      if (p >= 9 && p < 18) {
        EXPECT_EQ(t[p], s[p + 1]) << p;
      } else {
        EXPECT_EQ(t[p], -100) << p;
      }
    }
  }
}

TEST(Study, RecallTaskSequences) {
  StudyConfig c;
  c.task = StudyTask::Recall;
  c.seq_len = 64;  // Q = 4 queries, P = 28 pairs, K = 28 keys, values 8
  c.vocab = 8;
  std::mt19937_64 gen(2);
  const StudyBatch b = make_study_batch(c, 5, gen);
  EXPECT_EQ(study_vocab_size(c), 28 + 8 + 1);
  for (int64_t n = 0; n < 5; ++n) {
    const int64_t* s = b.ids.data<int64_t>() + n * 64;
    const int64_t* t = b.targets.data<int64_t>() + n * 64;
    std::set<int64_t> keys;
    for (int64_t i = 0; i < 28; ++i) {
      EXPECT_LT(s[2 * i], 28);
      EXPECT_GE(s[2 * i + 1], 28);
      EXPECT_LT(s[2 * i + 1], 36);
      keys.insert(s[2 * i]);
    }
    EXPECT_EQ(keys.size(), 28u) << "keys are distinct";
    int64_t scored = 0;
    for (int64_t q = 0; q < 4; ++q) {
      const int64_t p = 56 + 2 * q;
      int64_t value = -1;
      for (int64_t i = 0; i < 28; ++i) value = s[2 * i] == s[p] ? s[2 * i + 1] : value;
      EXPECT_EQ(s[p + 1], value) << "a query's value is its key's";
      EXPECT_EQ(t[p], value);
    }
    for (int64_t p = 0; p < 64; ++p) scored += t[p] != -100;
    EXPECT_EQ(scored, 4);
  }
}

TEST(Study, SoftmaxLearnsToCopyAWindowCannot) {
  StudyConfig c;
  c.seq_len = 32;  // copies 15 positions back
  c.vocab = 8;
  c.d_model = 32;
  c.nhead = 2;
  c.dim_feedforward = 64;
  c.batch = 16;
  c.steps = 150;
  c.warmup = 15;
  c.eval_size = 64;
  c.seed = 3;
  const StudyResult full = run_study(c);
  EXPECT_GE(full.token_accuracy, 0.95) << "softmax attention reaches every earlier position";
  EXPECT_EQ(full.curve_accuracy.size(), full.curve_seconds.size());
  EXPECT_GT(full.infer_samples_per_s, 0);
  c.attention.window = 4;
  const StudyResult local = run_study(c);
  EXPECT_LE(local.token_accuracy, 0.5) << "a 4-key window cannot see 15 positions back";
  EXPECT_EQ(local.parameters, full.parameters);
}

TEST(Study, BadConfigsAreClearErrors) {
  StudyConfig c;
  c.seq_len = 8;
  EXPECT_THAT(error_of([&] { run_study(c); }), HasSubstr("study: seq_len must be in [16, 2^20], got 8"));
  EXPECT_THAT(error_of([] { study_task_from_name("sort"); }), HasSubstr("task must be \"copy\" or \"recall\""));
}

}  // namespace
}  // namespace heads
