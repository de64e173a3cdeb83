// Int8 state dicts of the modules and `heads quantize` model directories (heads/quantize.h): what is
// stored loads back as the same int8 model, bit for bit; f16 / bf16 files hold the rounded weights;
// broken files are clear errors that change nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "common/testing.h"
#include "heads/bert.h"
#include "heads/encoder.h"
#include "heads/mha.h"
#include "heads/quantize.h"
#include "heads/safetensors.h"
#include "heads/sentence_encoder.h"

namespace heads {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::randn;

StateDict replaced(StateDict sd, const std::string& name, const Tensor& t) {
  for (auto& [n, v] : sd) {
    if (n == name) v = t;
  }
  return sd;
}

StateDict without(const StateDict& sd, const std::string& name) {
  StateDict out;
  for (const auto& [n, t] : sd) {
    if (n != name) out.emplace_back(n, t);
  }
  return out;
}

// A scratch directory removed at the end of the test.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("heads_quantize_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() { fs::remove_all(path); }
};

TEST(Quantize, ModulesSaveAndLoadTheirInt8Weights) {
  MultiheadAttentionOptions cross;  // separate q/k/v weights (kdim, vdim) and bias_kv
  cross.embed_dim = 24;
  cross.num_heads = 3;
  cross.kdim = 10;
  cross.vdim = 7;
  cross.add_bias_kv = true;
  cross.batch_first = true;
  MultiheadAttentionOptions self;
  self.embed_dim = 20;
  self.num_heads = 4;
  self.batch_first = true;
  for (const auto& o : {self, cross}) {
    MultiheadAttention m(o, 11);
    m.eval();
    m.set_precision(Precision::Int8);
    const Tensor q = randn({2, 7, o.embed_dim});
    const Tensor k = randn({2, 5, o.kdim > 0 ? o.kdim : o.embed_dim});
    const Tensor v = randn({2, 5, o.vdim > 0 ? o.vdim : o.embed_dim});
    const Tensor want = m.forward(q, k, v).first;
    const StateDict qsd = m.quantized_state_dict();
    int int8 = 0;
    for (const auto& [n, t] : qsd) {
      if (t.dtype() != DType::I8) continue;
      ++int8;
      const Tensor* s = testing::find_entry(qsd, n + "_scale");
      ASSERT_NE(s, nullptr) << n;
      EXPECT_EQ(s->shape(), Shape({t.size(0)})) << n;
    }
    EXPECT_EQ(int8, o.kdim > 0 ? 4 : 2);  // q, k, v, out_proj, or in_proj and out_proj
    MultiheadAttention fresh(o, 12);       // f32, other weights
    fresh.eval();
    fresh.load_state_dict(qsd);
    EXPECT_EQ(fresh.precision(), Precision::Int8);
    EXPECT_TRUE(testing::bitwise_equal(fresh.forward(q, k, v).first, want));
    // Its f32 parameters are the stored values: f32 forwards of both agree exactly too.
    m.set_precision(Precision::F32);
    MultiheadAttention deq(o, 13);
    deq.eval();
    deq.load_state_dict(fresh.state_dict());
    EXPECT_EQ(deq.precision(), Precision::F32);
    EXPECT_FALSE(testing::bitwise_equal(deq.forward(q, k, v).first, m.forward(q, k, v).first));
    fresh.set_precision(Precision::F32);
    EXPECT_TRUE(testing::bitwise_equal(deq.forward(q, k, v).first, fresh.forward(q, k, v).first));
    const auto e = testing::compare(deq.forward(q, k, v).first, m.forward(q, k, v).first);
    EXPECT_LT(e.max_abs, 2e-2 * e.max_ref);  // int8 steps of the weights: well under 1%
  }

  // A partial load into a module holding stored int8 weights keeps them as stored. These use half of
  // the int8 range (steps of twice the scale): quantizing their values again would change them.
  {
    MultiheadAttention src(self, 14);
    src.set_precision(Precision::Int8);
    StateDict stored;
    for (const auto& [n, t] : src.quantized_state_dict()) {
      Tensor v = t.clone();
      if (n == "in_proj_weight") {
        auto* q = static_cast<int8_t*>(v.raw_data());
        for (int64_t e = 0; e < v.numel(); ++e) q[e] = static_cast<int8_t>(q[e] / 2);
      } else if (n == "in_proj_weight_scale") {
        for (int64_t e = 0; e < v.numel(); ++e) v.data<float>()[e] *= 2.0f;
      }
      stored.emplace_back(n, v);
    }
    MultiheadAttention m(self, 15);
    m.eval();
    m.load_state_dict(stored);
    const Tensor q = randn({2, 5, self.embed_dim});
    const Tensor want = m.forward(q, q, q).first;
    ASSERT_EQ(m.state_dict()[3].first, "out_proj.bias");
    m.load_state_dict({{"out_proj.bias", m.state_dict()[3].second.clone()}}, false);
    EXPECT_TRUE(testing::bitwise_equal(m.forward(q, q, q).first, want));
    MultiheadAttention again(self, 16);  // what quantizing those values gives: not the same
    again.eval();
    again.load_state_dict(m.state_dict());
    again.set_precision(Precision::Int8);
    EXPECT_FALSE(testing::bitwise_equal(again.forward(q, q, q).first, want));
  }

  // Encoder: saved to a file and loaded into an f32 encoder of other weights.
  TransformerEncoderLayerOptions lo;
  lo.d_model = 32;
  lo.nhead = 4;
  lo.dim_feedforward = 48;
  lo.dropout = 0.0;
  lo.batch_first = true;
  TransformerEncoder enc(lo, 2, true, 21);
  enc.eval();
  enc.set_precision(Precision::Int8);
  const Tensor x = randn({3, 9, 32});
  const Tensor want = enc.forward(x);
  ScratchDir dir("encoder");
  const std::string path = (dir.path / "enc.safetensors").string();
  enc.save(path);
  const SafeTensors file = SafeTensors::open(path);
  EXPECT_EQ(file.get("layers.1.linear2.weight").dtype(), DType::I8);
  EXPECT_EQ(file.get("layers.0.self_attn.in_proj_weight_scale").shape(), Shape({96}));
  TransformerEncoder other(lo, 2, true, 22);
  other.eval();
  other.load(path);
  EXPECT_EQ(other.precision(), Precision::Int8);
  EXPECT_EQ(other.layer(0).self_attn().precision(), Precision::Int8);
  EXPECT_TRUE(testing::bitwise_equal(other.forward(x), want));
  // A broken file: the error names the file and the tensor's full name.
  const std::string broken_path = (dir.path / "broken.safetensors").string();
  save_safetensors(broken_path, without(enc.quantized_state_dict(), "layers.1.self_attn.in_proj_weight_scale"));
  const std::string error = testing::error_of([&] { other.load(broken_path); });
  EXPECT_THAT(error, HasSubstr("layers.1.: self_attn.: MultiheadAttention::load_state_dict: \"in_proj_weight\" is int8"));
  EXPECT_THAT(error, HasSubstr(broken_path));
  // ... and changes nothing: layer 0, loaded first, keeps its weights and precision too.
  TransformerEncoder f32enc(lo, 2, true, 23);
  f32enc.eval();
  const Tensor before = f32enc.forward(x);
  const StateDict views = f32enc.state_dict();  // share the encoder's storage
  EXPECT_THROW(f32enc.load(broken_path), Error);
  EXPECT_EQ(f32enc.precision(), Precision::F32);
  EXPECT_EQ(f32enc.layer(0).precision(), Precision::F32);
  EXPECT_TRUE(testing::bitwise_equal(f32enc.forward(x), before));
  StateDict wrong_norm = enc.state_dict();
  for (auto& [n, t] : wrong_norm) {
    if (n == "norm.weight") t = randn({31});
  }
  EXPECT_THAT(testing::error_of([&] { f32enc.load_state_dict(wrong_norm); }), HasSubstr("\"norm.weight\": expected"));
  EXPECT_TRUE(testing::bitwise_equal(f32enc.forward(x), before));
  // A good load writes into the same storage: views taken before see the new values.
  f32enc.load_state_dict(enc.state_dict());
  EXPECT_TRUE(testing::bitwise_equal(views[0].second, enc.state_dict()[0].second));

  // One int8 weight switches the whole layer: the others are quantized from what it holds.
  TransformerEncoderLayer layer(lo, 31);
  layer.eval();
  TransformerEncoderLayer source(lo, 32);
  source.set_precision(Precision::Int8);
  StateDict part;
  for (const auto& [n, t] : source.quantized_state_dict()) {
    if (n.rfind("linear1.", 0) == 0) part.emplace_back(n, t);
  }
  layer.load_state_dict(part, false);
  EXPECT_EQ(layer.precision(), Precision::Int8);
  EXPECT_EQ(layer.self_attn().precision(), Precision::Int8);
}

TEST(Quantize, BrokenInt8StateDictsAreErrorsThatChangeNothing) {
  MultiheadAttentionOptions o;
  o.embed_dim = 16;
  o.num_heads = 2;
  MultiheadAttention src(o, 41);
  src.set_precision(Precision::Int8);
  const StateDict good = src.quantized_state_dict();
  MultiheadAttention m(o, 42);
  m.eval();
  const Tensor x = randn({5, 2, 16});
  const Tensor before = m.forward(x, x, x).first;
  const auto check = [&](const StateDict& sd, const std::string& what) {
    EXPECT_THAT(testing::error_of([&] { m.load_state_dict(sd); }), HasSubstr(what));
    EXPECT_EQ(m.precision(), Precision::F32);
    EXPECT_TRUE(testing::bitwise_equal(m.forward(x, x, x).first, before));
  };
  check(without(good, "in_proj_weight_scale"), "\"in_proj_weight\" is int8 [48, 16] but its scales");
  check(replaced(good, "out_proj.weight_scale", randn({15})), "\"out_proj.weight_scale\": expected f32 [16]");
  check(replaced(good, "out_proj.weight_scale", randn({16}).to(DType::F64)), "expected f32 [16]");
  Tensor neg_copy = Tensor::empty({16}, DType::F32);
  neg_copy.copy_from(*testing::find_entry(good, "out_proj.weight_scale"));
  neg_copy.data<float>()[3] = -1.0f;
  check(replaced(good, "out_proj.weight_scale", neg_copy), "scale 3 must be finite and positive");
  neg_copy.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  check(replaced(good, "out_proj.weight_scale", neg_copy), "scale 3 must be finite and positive");
  check(replaced(good, "in_proj_bias", Tensor::zeros({48}, DType::I8)), "\"in_proj_bias\": expected a floating dtype");
  const Tensor short_w = Tensor::zeros({48, 15}, DType::I8);
  check(replaced(good, "in_proj_weight", short_w), "\"in_proj_weight\": expected shape [48, 16], got [48, 15]");
  StateDict extra = good;
  extra.emplace_back("in_proj_bias_scale", randn({48}));
  check(extra, "unexpected tensor \"in_proj_bias_scale\"");
  m.load_state_dict(good);  // and the good one loads
  EXPECT_EQ(m.precision(), Precision::Int8);
}

TEST(Quantize, ModelDirectoriesLoadAsStored) {
  const std::string model = testing::model_dir();
  ScratchDir dir("model");
  const fs::path q8 = dir.path / "int8", q16 = dir.path / "f16", qb = dir.path / "bf16";
  const QuantizeResult r = quantize_model_dir(model, q8.string(), StorageDtype::Int8);
  EXPECT_EQ(r.converted, 36);  // 6 layers × q, k, v, attention out, intermediate, output
  // The embeddings (47.8 of 90.9 MB) stay f32; the linear weights (43.1 MB) become int8, with a second
  // int8 term on the rows past kInt8ResidualError (a third of the weights): 62.6 MB.
  EXPECT_LT(r.bytes_out, r.bytes_in * 7 / 10);
  for (const char* f : {"config.json", "vocab.txt", "tokenizer_config.json", "1_Pooling/config.json", "modules.json"}) {
    EXPECT_TRUE(fs::exists(q8 / f)) << f;
  }
  const SafeTensors file = SafeTensors::open((q8 / "model.safetensors").string());
  EXPECT_EQ(file.get("encoder.layer.3.intermediate.dense.weight").dtype(), DType::I8);
  EXPECT_EQ(file.get("encoder.layer.3.intermediate.dense.weight_scale").shape(), Shape({1536}));
  EXPECT_EQ(file.get("embeddings.word_embeddings.weight").dtype(), DType::F32);
  EXPECT_EQ(file.metadata().at("heads.dtype"), "int8");

  const std::vector<std::string> texts = {"A man is playing a guitar.", "Int8 weights, loaded as they are stored!",
                                          "x"};
  const SentenceEncoder stored = SentenceEncoder::load(q8.string());
  EXPECT_EQ(stored.precision(), Precision::Int8);
  const Tensor at_load = SentenceEncoder::load(model, Precision::Int8).encode(texts);
  EXPECT_TRUE(testing::bitwise_equal(stored.encode(texts), at_load));
  const SentenceEncoder deq = SentenceEncoder::load(q8.string(), Precision::F32);
  EXPECT_EQ(deq.precision(), Precision::F32);
  const Tensor f32 = SentenceEncoder::load(model).encode(texts);
  const Tensor e = deq.encode(texts);
  for (int64_t i = 0; i < e.size(0); ++i) {
    const double c = testing::dot(e.slice(0, i, i + 1), f32.slice(0, i, i + 1));
    EXPECT_GT(c, 0.998) << i;
    EXPECT_LT(c, 1.0 - 1e-7) << i;  // the weights did change
  }

  // f16 / bf16: the model is the original with every weight rounded once, widened exactly on load.
  quantize_model_dir(model, q16.string(), StorageDtype::F16);
  quantize_model_dir(model, qb.string(), StorageDtype::BF16);
  const auto tensors = load_safetensors(model + "/model.safetensors");
  for (const auto& [dt, out] : {std::pair{DType::F16, q16}, {DType::BF16, qb}}) {
    const SafeTensors half = SafeTensors::open((out / "model.safetensors").string());
    for (const auto& [n, t] : tensors) {
      const Tensor h = half.get(n);
      ASSERT_EQ(h.dtype(), is_floating(t.dtype()) ? dt : t.dtype()) << n;
      if (is_floating(t.dtype())) EXPECT_TRUE(testing::bitwise_equal(h, t.to(dt))) << n;
    }
    const Tensor emb = SentenceEncoder::load(out.string()).encode(texts);
    for (int64_t i = 0; i < emb.size(0); ++i) {
      const double c = testing::dot(emb.slice(0, i, i + 1), f32.slice(0, i, i + 1));
      EXPECT_GT(c, dt == DType::F16 ? 0.99999 : 0.9995) << dtype_name(dt) << " " << i;
    }
  }
  // A directory of links to the model's files, with a sentence-transformers Dense module's weights in
  // a subdirectory: int8 copies them as they are, f16 converts them; "out/" is "out".
  const fs::path linked = dir.path / "linked";
  fs::create_directories(linked / "2_Dense");
  for (const auto& e : fs::directory_iterator(model)) {
    if (e.is_regular_file()) fs::create_symlink(e.path(), linked / e.path().filename());
  }
  fs::create_directory_symlink(fs::path(model) / "1_Pooling", linked / "1_Pooling");
  save_safetensors((linked / "2_Dense" / "model.safetensors").string(), {{"linear.weight", randn({4, 8})}});
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir(linked.string(), (dir.path / "l8").string(), StorageDtype::Int8); }),
              HasSubstr("1_Pooling: a symbolic link to a directory"));
  EXPECT_FALSE(fs::exists(dir.path / "l8"));
  fs::remove(linked / "1_Pooling");
  fs::copy(fs::path(model) / "1_Pooling", linked / "1_Pooling");
  quantize_model_dir(linked.string(), (dir.path / "l8").string() + "/", StorageDtype::Int8);
  quantize_model_dir(linked.string(), (dir.path / "l16").string(), StorageDtype::F16);
  EXPECT_EQ(SafeTensors::open((dir.path / "l8" / "2_Dense" / "model.safetensors").string()).get("linear.weight").dtype(),
            DType::F32);
  EXPECT_EQ(SafeTensors::open((dir.path / "l16" / "2_Dense" / "model.safetensors").string()).get("linear.weight").dtype(),
            DType::F16);
  EXPECT_TRUE(fs::is_regular_file(dir.path / "l8" / "1_Pooling" / "config.json"));
  EXPECT_TRUE(testing::bitwise_equal(SentenceEncoder::load((dir.path / "l8").string()).encode(texts), at_load));
  // A relative output path inside the model directory is caught too.
  const fs::path cwd = fs::current_path();
  fs::current_path(linked);
  const std::string inside = testing::error_of([&] { quantize_model_dir(".", "q", StorageDtype::F16); });
  fs::current_path(cwd);
  EXPECT_THAT(inside, HasSubstr("or inside it"));
  EXPECT_FALSE(fs::exists(linked / "q"));
  // No temporary directory left behind.
  for (const auto& e : fs::directory_iterator(dir.path)) EXPECT_EQ(e.path().string().find(".partial"), std::string::npos);
}

TEST(Quantize, BrokenDirectoriesAndFilesAreClearErrors) {
  const std::string model = testing::model_dir();
  ScratchDir dir("errors");
  const fs::path q8 = dir.path / "int8";
  quantize_model_dir(model, q8.string(), StorageDtype::Int8);
  // Input and output directories.
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir(model, q8.string(), StorageDtype::Int8); }),
              HasSubstr("exists and is not an empty directory"));
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir(q8.string(), (q8 / "sub").string(), StorageDtype::F16); }),
              HasSubstr("or inside it"));
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir(q8.string(), (dir.path / "again").string(), StorageDtype::Int8); }),
              HasSubstr(".weight\" is already int8"));
  EXPECT_FALSE(fs::exists(dir.path / "again"));
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir((dir.path / "none").string(), (dir.path / "o").string(),
                                                         StorageDtype::Int8); }),
              HasSubstr("model directory not found"));
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir(model, (dir.path / "no" / "o").string(), StorageDtype::F16); }),
              HasSubstr("its parent directory"));
  EXPECT_FALSE(fs::exists(dir.path / "no"));
  // An output given as a link to an empty directory: written there, the link left as it is.
  fs::create_directory(dir.path / "target");
  fs::create_directory_symlink(dir.path / "target", dir.path / "link");
  quantize_model_dir(model, (dir.path / "link").string(), StorageDtype::F16);
  EXPECT_TRUE(fs::is_symlink(dir.path / "link"));
  EXPECT_TRUE(fs::exists(dir.path / "target" / "model.safetensors"));
  EXPECT_THROW(storage_dtype_from_name("int4"), Error);

  // A non-BERT checkpoint has no int8 form; a value past f16's range has no f16 form.
  const fs::path other = dir.path / "other";
  fs::create_directories(other);
  save_safetensors((other / "model.safetensors").string(),
                   {{"h.0.mlp.c_fc.weight", randn({4, 8})}, {"big", Tensor::from_vector(std::vector<float>{1e6f, 2.0f}, {2})}});
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir(other.string(), (dir.path / "o1").string(), StorageDtype::Int8); }),
              HasSubstr("no BERT linear weights"));
  EXPECT_THAT(testing::error_of([&] { quantize_model_dir(other.string(), (dir.path / "o2").string(), StorageDtype::F16); }),
              HasSubstr("tensor \"big\": value 1e+06 at flat index 0 is past f16's range"));
  quantize_model_dir(other.string(), (dir.path / "o3").string(), StorageDtype::BF16);  // bf16 has the range
  EXPECT_FALSE(fs::exists(dir.path / "o1"));
  EXPECT_FALSE(fs::exists(dir.path / "o2"));

  // Broken int8 files: each names the tensor.
  const auto stored = load_safetensors((q8 / "model.safetensors").string());
  const std::string w = "encoder.layer.2.output.dense.weight";
  const auto broken = [&](const std::vector<std::pair<std::string, Tensor>>& tensors) {
    save_safetensors((q8 / "model.safetensors").string(), tensors);
    return testing::error_of([&] { BertModel::load(q8.string()); });
  };
  std::vector<std::pair<std::string, Tensor>> t = stored;
  t.erase(std::remove_if(t.begin(), t.end(), [&](const auto& p) { return p.first == w + "_scale"; }), t.end());
  EXPECT_THAT(broken(t), HasSubstr("\"" + w + "\" is int8 [384, 1536] but its scales \"" + w + "_scale\" are missing"));
  t = stored;
  for (auto& [n, v] : t) {
    if (n == w + "_scale") v = randn({383});
  }
  EXPECT_THAT(broken(t), HasSubstr("\"" + w + "_scale\": expected f32 [384]"));
  t = stored;
  for (auto& [n, v] : t) {
    if (n == w) v = Tensor::zeros({384, 1535}, DType::I8);
  }
  EXPECT_THAT(broken(t), HasSubstr("tensor \"" + w + "\": expected shape [384, 1536], got [384, 1535]"));
  t = stored;
  // A floating key between int8 query and value: not one projection.
  for (auto& [n, v] : t) {
    if (n == "encoder.layer.1.attention.self.key.weight") {
      Tensor f = Tensor::empty(v.shape(), DType::F32);
      for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] = 0.01f;
      v = f;
    }
  }
  EXPECT_THAT(broken(t), HasSubstr("int8 and floating weights mixed"));
  t = stored;
  for (auto& [n, v] : t) {
    if (n == w + "_scale") {
      Tensor s = Tensor::empty(v.shape(), DType::F32);
      s.copy_from(v);
      s.data<float>()[7] = 0.0f;
      v = s;
    }
  }
  EXPECT_THAT(broken(t), HasSubstr("\"" + w + "\": scale 7 must be finite and positive, got 0"));
  // The residual term: its three tensors together, rows increasing.
  ASSERT_TRUE(std::any_of(stored.begin(), stored.end(), [&](const auto& p) { return p.first == w + "_residual_rows"; }));
  t = stored;
  t.erase(std::remove_if(t.begin(), t.end(), [&](const auto& p) { return p.first == w + "_residual_scale"; }), t.end());
  EXPECT_THAT(broken(t), HasSubstr("its residual term needs \"" + w + "_residual\", \"" + w + "_residual_scale\" and \"" +
                                   w + "_residual_rows\" together (2 of 3 present)"));
  t = stored;
  for (auto& [n, v] : t) {
    if (n == w + "_residual_rows") {
      Tensor r = v.clone();
      std::swap(r.data<int64_t>()[0], r.data<int64_t>()[1]);
      v = r;
    }
  }
  EXPECT_THAT(broken(t), HasSubstr("residual row 1 is"));
  t = stored;
  for (auto& [n, v] : t) {
    if (n == w + "_residual") v = Tensor::zeros({v.size(0) + 1, v.size(1)}, DType::I8);
  }
  EXPECT_THAT(broken(t), HasSubstr("residual data: expected i8"));
}

// Heavy rows' residual term survives slicing (rows) and stacking (cat_rows) and the stored form.
TEST(Quantize, ResidualRowsSliceStackAndStore) {
  Tensor W = randn({40, 96}, 0.05);
  for (int64_t n = 0; n < 40; n += 3) W.data<float>()[n * 96 + n] = 3.0f;  // heavy rows
  const PackedLinear w(W, Precision::Int8);
  ASSERT_TRUE(w.residual_rows().defined());
  EXPECT_GE(w.residual_rows().numel(), 10);
  const Tensor x = randn({5, 96});
  const Tensor y = linear(x, w);
  // Integer sums give the same bits for any set of rows; the f32 route's GEMM may sum in another
  // order for another width (e.g. one row: a dot product), within f32 rounding.
  const bool integer = linear_gemm_route(Precision::Int8) != "f32";
  double mag = 0;  // the largest sum of |products| of an output: f32 sums are within (K + 3)·2^-24 of it
  {
    const Tensor d = dequantize(w);
    for (int64_t m = 0; m < 5; ++m) {
      for (int64_t n = 0; n < 40; ++n) {
        double a = 0;
        for (int64_t k = 0; k < 96; ++k) a += std::fabs(x.data<float>()[m * 96 + k] * d.data<float>()[n * 96 + k]);
        mag = std::max(mag, a);
      }
    }
  }
  for (auto [n0, n1] : {std::pair<int64_t, int64_t>{0, 40}, {3, 17}, {16, 40}, {1, 2}, {2, 3}}) {
    const Tensor part = linear(x, w.rows(n0, n1));
    if (integer) {
      EXPECT_TRUE(testing::bitwise_equal(part, y.slice(1, n0, n1))) << n0 << ".." << n1;
    } else {
      EXPECT_TRUE(testing::compare(part, y.slice(1, n0, n1)).within(0, 2 * 99 * 6e-8 * mag)) << n0 << ".." << n1;
    }
    EXPECT_TRUE(testing::bitwise_equal(dequantize(w.rows(n0, n1)), dequantize(w).slice(0, n0, n1)));
  }
  const PackedLinear stacked = cat_rows({w.rows(0, 13), w.rows(13, 14), w.rows(14, 40)});
  EXPECT_TRUE(testing::bitwise_equal(dequantize(stacked), dequantize(w)));
  EXPECT_TRUE(testing::bitwise_equal(linear(x, stacked), y));
  // On a heavy row the residual term cuts the weight error by orders of magnitude.
  const Tensor d = dequantize(w);
  const PackedLinear one = PackedLinear::from_int8(w.data(), w.scales(), "one term");
  const Tensor d1 = dequantize(one);
  double e = 0, e1 = 0;
  for (int64_t k = 0; k < 96; ++k) {
    e += std::pow(d.data<float>()[k] - W.data<float>()[k], 2);
    e1 += std::pow(d1.data<float>()[k] - W.data<float>()[k], 2);
  }
  EXPECT_LT(e, e1 * 1e-3);
  // Stored and read back: the same weight.
  const auto tensors = int8_tensors("w", w);
  EXPECT_EQ(tensors.size(), 5u);
  const auto get = [&](const std::string& n) -> const Tensor* {
    for (const auto& [tn, t] : tensors) {
      if (tn == n) return &t;
    }
    return nullptr;
  };
  EXPECT_TRUE(testing::bitwise_equal(linear(x, int8_from_tensors("w", get, "test")), y));
}

// A packed weight owns its memory: the caller's buffer (e.g. a Python array) may change or go away.
TEST(Quantize, PackedWeightsOwnTheirMemory) {
  for (Precision p : {Precision::F32, Precision::BF16, Precision::Int8}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      Tensor w = randn({6, 5}).to(dt);
      const PackedLinear packed(w, p);
      const Tensor before = dequantize(packed);
      std::memset(w.raw_data(), 0x7f, static_cast<size_t>(w.numel()) * dtype_size(dt));
      EXPECT_TRUE(testing::bitwise_equal(dequantize(packed), before)) << precision_name(p) << " " << dtype_name(dt);
    }
  }
  const PackedLinear q(randn({6, 5}), Precision::Int8);
  Tensor data = q.data().clone(), scales = q.scales().clone();
  const PackedLinear stored = PackedLinear::from_int8(data, scales, "w");
  std::memset(data.raw_data(), 0, 30);
  scales.data<float>()[0] = 1e9f;
  EXPECT_TRUE(testing::bitwise_equal(dequantize(stored), dequantize(q)));
}

}  // namespace
}  // namespace heads
