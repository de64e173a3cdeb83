// quantize.cc — a model directory written again with smaller weights (include/heads/quantize.h).
#include "heads/quantize.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config_json.h"
#include "heads/bert.h"
#include "heads/error.h"
#include "heads/precision.h"
#include "heads/safetensors.h"

namespace heads {

namespace fs = std::filesystem;

namespace {

constexpr float kF16Max = 65504.0f;

// Weights in formats this tool does not rewrite: not copied (the output would hold stale weights).
bool other_weights(const fs::path& rel) {
  const std::string top = rel.begin()->string();
  if (top == "onnx" || top == "openvino" || top == ".git") return true;  // .git/lfs holds the original weights
  const std::string ext = rel.extension().string();
  for (const char* e : {".bin", ".h5", ".msgpack", ".ot", ".onnx", ".onnx_data", ".pt", ".pth", ".ckpt", ".gguf"}) {
    if (ext == e) return true;
  }
  return false;
}

// A BERT (or MPNet) encoder's linear weight (the int8 ones), with or without the "bert." / "mpnet." prefix.
bool bert_linear_weight(const std::string& name) {
  static const std::regex re(
      R"(^(bert\.|mpnet\.)?encoder\.layer\.[0-9]+\.(attention\.self\.(query|key|value)|attention\.output\.dense|)"
      R"(attention\.attn\.(q|k|v|o)|intermediate\.dense|output\.dense)\.weight$)");
  return std::regex_match(name, re);
}

// The int8 weights of the BERT encoder in `dir` as BertModel::set_precision(Int8) makes them
// (calibrated: the activations' outlier channels in f32), by tensor name without the "bert." / "mpnet." prefix.
std::map<std::string, PackedLinear> bert_int8_weights(const fs::path& dir) {
  BertModel m = BertModel::load(dir.string());
  m.set_precision(Precision::Int8);
  std::map<std::string, PackedLinear> out;
  const int64_t E = m.config().hidden_size;
  for (size_t i = 0; i < m.layers().size(); ++i) {
    const StateDict sd = m.layers()[i].quantized_state_dict();
    const auto get = [&](const std::string& n) -> const Tensor* {
      for (const auto& [name, t] : sd) {
        if (name == n) return &t;
      }
      return nullptr;
    };
    const auto packed = [&](const std::string& n) { return int8_from_tensors(n, get, "quantize"); };
    const std::string p = "encoder.layer." + std::to_string(i) + ".";
    const PackedLinear in = packed("self_attn.in_proj_weight");
    const bool mpnet = m.config().model_type == "mpnet";  // its attention's names (bert.cc)
    out.emplace(p + (mpnet ? "attention.attn.q.weight" : "attention.self.query.weight"), in.rows(0, E));
    out.emplace(p + (mpnet ? "attention.attn.k.weight" : "attention.self.key.weight"), in.rows(E, 2 * E));
    out.emplace(p + (mpnet ? "attention.attn.v.weight" : "attention.self.value.weight"), in.rows(2 * E, 3 * E));
    out.emplace(p + (mpnet ? "attention.attn.o.weight" : "attention.output.dense.weight"),
                packed("self_attn.out_proj.weight"));
    out.emplace(p + "intermediate.dense.weight", packed("linear1.weight"));
    out.emplace(p + "output.dense.weight", packed("linear2.weight"));
  }
  return out;
}

// One safetensors file converted; returns the bytes written. int8 (the BERT encoder's linear
// weights) takes its weights from `int8` (bert_int8_weights).
uint64_t convert_file(const fs::path& in, const fs::path& out, StorageDtype dtype, QuantizeResult& r,
                      const std::map<std::string, PackedLinear>& int8 = {}) {
  const SafeTensors file = SafeTensors::open(in.string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  int64_t converted = 0;
  for (const std::string& name : file.names()) {
    HEADS_CHECK(!file.contains(name + "_scale") || file.get(name).dtype() != DType::I8, file.label(), ": tensor \"",
                name, "\" is already int8");
    const Tensor t = file.get(name);
    if (!is_floating(t.dtype())) {
      tensors.emplace_back(name, t);
      continue;
    }
    if (dtype == StorageDtype::Int8) {
      if (!bert_linear_weight(name)) {
        tensors.emplace_back(name, t);
        continue;
      }
      const size_t dot = name.find('.');
      const bool prefixed = name.rfind("bert.", 0) == 0 || name.rfind("mpnet.", 0) == 0;
      const auto q = int8.find(prefixed ? name.substr(dot + 1) : name);
      HEADS_CHECK(q != int8.end(), file.label(), ": tensor \"", name, "\": not a weight of the BERT encoder loaded from ",
                  in.parent_path().string());
      for (auto& t : int8_tensors(name, q->second)) tensors.push_back(std::move(t));
      ++converted;
      continue;
    }
    const DType to = dtype == StorageDtype::BF16 ? DType::BF16 : DType::F16;
    if (t.dtype() == to) {
      tensors.emplace_back(name, t);
      continue;
    }
    const Tensor f = t.to(DType::F32).contiguous();
    if (to == DType::F16) {
      for (int64_t i = 0; i < f.numel(); ++i) {
        const float v = f.data<float>()[i];
        HEADS_CHECK(!std::isfinite(v) || std::fabs(v) <= kF16Max, file.label(), ": tensor \"", name, "\": value ", v,
                    " at flat index ", i, " is past f16's range (±65504); use --dtype bf16");
      }
    }
    tensors.emplace_back(name, f.to(to));
    ++converted;
  }
  HEADS_CHECK(dtype != StorageDtype::Int8 || converted > 0, file.label(),
              ": no BERT linear weights (encoder.layer.<i>.attention.self.query.weight, ...): int8 files are written "
              "for BERT encoders; --dtype bf16 or f16 works for any model");
  std::map<std::string, std::string> meta = file.metadata();
  meta.emplace("format", "pt");
  meta["heads.dtype"] = storage_dtype_name(dtype);
  if (dtype == StorageDtype::Int8) {
    meta["heads.int8"] =
        "linear weights: <name> I8 [out, in], <name>_scale F32 [out]; weight = int8 * scale per row, plus on the rows "
        "<name>_residual_rows I64 [r]: <name>_residual I8 [r, in] * <name>_residual_scale F32 [r]; the columns "
        "<name>_outlier_channels I64 [o] (zero in the int8 weight) are <name>_outlier_weight F32 [out, o]; "
        "<name>_activation_error F64 [1]: activation rows losing more get a second int8 term";
  }
  save_safetensors(out.string(), tensors, meta);
  r.tensors += static_cast<int64_t>(tensors.size());
  r.converted += converted;
  r.bytes_in += fs::file_size(in);
  return fs::file_size(out);
}

}  // namespace

std::string storage_dtype_name(StorageDtype d) {
  switch (d) {
    case StorageDtype::Int8: return "int8";
    case StorageDtype::BF16: return "bf16";
    case StorageDtype::F16: return "f16";
  }
  return "?";
}

StorageDtype storage_dtype_from_name(const std::string& name) {
  for (StorageDtype d : {StorageDtype::Int8, StorageDtype::BF16, StorageDtype::F16}) {
    if (storage_dtype_name(d) == name) return d;
  }
  fail("quantize: dtype must be int8, bf16 or f16, got \"", name, "\"");
}

namespace {

QuantizeResult quantize_dir(const std::string& model_dir, const std::string& out_dir, StorageDtype dtype) {
  const fs::path src(model_dir), dst(out_dir);
  HEADS_CHECK(!model_dir.empty() && fs::is_directory(src), model_dir, ": model directory not found");
  HEADS_CHECK(!out_dir.empty(), "quantize: the output directory is empty; pass one");
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    HEADS_CHECK(fs::is_directory(dst) && fs::is_empty(dst), out_dir, ": exists and is not an empty directory");
  }
  // Absolute, resolved, without a trailing separator ("out/" is "out").
  const auto resolved = [](const fs::path& p) {
    fs::path a = fs::weakly_canonical(fs::absolute(p));
    return a.has_filename() ? a : a.parent_path();
  };
  const fs::path src_abs = resolved(src), dst_abs = resolved(dst);
  const auto [a, b] = std::mismatch(src_abs.begin(), src_abs.end(), dst_abs.begin(), dst_abs.end());
  HEADS_CHECK(a != src_abs.end(), out_dir, ": is ", model_dir, " or inside it; write the output elsewhere");
  HEADS_CHECK(fs::is_directory(dst_abs.parent_path()), out_dir, ": its parent directory ",
              dst_abs.parent_path().string(), " does not exist");

  std::vector<fs::path> weights;
  for (const auto& e : fs::directory_iterator(src)) {
    if (e.is_regular_file() && e.path().extension() == ".safetensors") weights.push_back(e.path().filename());
  }
  std::sort(weights.begin(), weights.end());
  HEADS_CHECK(!weights.empty(), model_dir, ": no .safetensors weights",
              fs::exists(src / "pytorch_model.bin")
                  ? " (the directory has pytorch_model.bin: convert it once with `python3 -m heads.convert " + model_dir +
                        "`)"
                  : std::string());
  if (dtype == StorageDtype::Int8) {
    HEADS_CHECK(weights.size() == 1 && weights[0] == "model.safetensors", model_dir,
                ": int8 files are written from one model.safetensors (a BERT encoder); found ", weights.size(),
                " safetensors file(s)");
  }

  const fs::path tmp = dst_abs.parent_path() / (dst_abs.filename().string() + ".partial-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp);
  QuantizeResult r;
  try {
    // int8: the encoder loaded and calibrated first (a directory that does not load fails here).
    std::map<std::string, PackedLinear> int8;
    if (dtype == StorageDtype::Int8) {
      const std::vector<std::string> names = SafeTensors::open((src / weights[0]).string()).names();
      HEADS_CHECK(std::any_of(names.begin(), names.end(), bert_linear_weight), (src / weights[0]).string(),
                  ": no BERT linear weights (encoder.layer.<i>.attention.self.query.weight, ...): int8 files are "
                  "written for BERT encoders; --dtype bf16 or f16 works for any model");
      int8 = bert_int8_weights(src);
    }
    for (const fs::path& w : weights) r.bytes_out += convert_file(src / w, tmp / w, dtype, r, int8);
    const uint64_t shard_bytes = r.bytes_out;  // what model.safetensors.index.json counts
    // Everything else but other weight formats: safetensors files in subdirectories (e.g. a
    // sentence-transformers Dense module) converted to bf16 / f16 or copied as they are for int8,
    // the shard index with its new total size.
    for (auto it = fs::recursive_directory_iterator(src); it != fs::recursive_directory_iterator(); ++it) {
      const fs::path rel = it->path().lexically_relative(src);  // not fs::relative: it resolves links
      if (it->is_directory()) {
        HEADS_CHECK(!it->is_symlink() || other_weights(rel), it->path().string(),
                    ": a symbolic link to a directory; copy the model directory without links first");
        if (other_weights(rel)) {
          it.disable_recursion_pending();
        } else {
          fs::create_directories(tmp / rel);
        }
        continue;
      }
      if (!it->is_regular_file() || other_weights(rel)) continue;
      if (rel.extension() == ".safetensors") {
        if (!rel.has_parent_path()) continue;  // converted above
        if (dtype == StorageDtype::Int8) {
          fs::copy_file(it->path(), tmp / rel, fs::copy_options::overwrite_existing);
        } else {
          r.bytes_out += convert_file(it->path(), tmp / rel, dtype, r);
        }
        continue;
      }
      if (rel == "model.safetensors.index.json") {
        nlohmann::json index = models::read_json(it->path(), true);  // a regular file holding an object
        if (index.contains("metadata") && index["metadata"].is_object()) index["metadata"]["total_size"] = shard_bytes;
        std::ofstream out(tmp / rel);
        out << index.dump(2) << "\n";
        HEADS_CHECK(out.good(), (tmp / rel).string(), ": write failed");
        continue;
      }
      fs::copy_file(it->path(), tmp / rel, fs::copy_options::overwrite_existing);
    }
    // An int8 directory must load: the check a user would make next, before anything is in place.
    if (dtype == StorageDtype::Int8) (void)BertModel::load(tmp.string());
    // The path checked above (a link to an empty directory: its target, which the link then shows).
    if (fs::exists(dst_abs)) fs::remove(dst_abs);  // empty (checked above)
    fs::rename(tmp, dst_abs);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return r;
}

}  // namespace

QuantizeResult quantize_model_dir(const std::string& model_dir, const std::string& out_dir, StorageDtype dtype) {
  try {
    return quantize_dir(model_dir, out_dir, dtype);
  } catch (const fs::filesystem_error& e) {  // as heads::Error, naming the paths
    fail("quantize ", model_dir, " -> ", out_dir, ": ", e.what());
  }
}

}  // namespace heads
