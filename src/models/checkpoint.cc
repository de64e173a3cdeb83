// checkpoint.cc — src/models/checkpoint.h.
#include "checkpoint.h"

#include <algorithm>

#include "config_json.h"
#include "heads/error.h"

namespace heads::models {

namespace fs = std::filesystem;

Checkpoint::Checkpoint(const fs::path& dir) {
  const fs::path one = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(one)) {
    files_.push_back(std::make_unique<SafeTensors>(SafeTensors::open(one.string())));
    for (const auto& n : files_.back()->names()) where_[n] = 0;
    return;
  }
  HEADS_CHECK(fs::exists(index), dir.string(), ": neither model.safetensors nor model.safetensors.index.json found",
              fs::exists(dir / "pytorch_model.bin")
                  ? " (the directory has pytorch_model.bin: convert it once with `python3 -m heads.convert " +
                        dir.string() + "`)"
                  : std::string());
  const nlohmann::json j = read_json(index, true);
  HEADS_CHECK(j.contains("weight_map") && j.at("weight_map").is_object(), index.string(),
              ": \"weight_map\" must be an object of tensor name -> shard file");
  std::map<std::string, size_t> shard;
  for (const auto& [name, file] : j.at("weight_map").items()) {
    HEADS_CHECK(file.is_string(), index.string(), ": weight_map[\"", name, "\"] must be a file name");
    const std::string f = file.get<std::string>();
    HEADS_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..", index.string(), ": shard \"",
                f, "\" must be a file in the model directory");
    if (!shard.count(f)) {
      shard[f] = files_.size();
      files_.push_back(std::make_unique<SafeTensors>(SafeTensors::open((dir / f).string())));
    }
    where_[name] = shard[f];
  }
}

bool Checkpoint::has(const std::string& n) const {
  const auto it = where_.find(n);
  return it != where_.end() && files_[it->second]->contains(n);
}

Tensor Checkpoint::get(const std::string& n, const Shape& shape) const {
  HEADS_CHECK(has(n), files_.empty() ? std::string("checkpoint") : files_.front()->label(), ": tensor \"", n,
              "\" missing");
  const SafeTensors& f = *files_[where_.at(n)];
  const Tensor t = f.get(n);
  HEADS_CHECK(t.shape() == shape, f.label(), ": tensor \"", n, "\": expected shape ", shape, ", got ", t.shape());
  HEADS_CHECK(is_floating(t.dtype()), f.label(), ": tensor \"", n, "\": expected a floating dtype, got ",
              dtype_name(t.dtype()));
  return t.to(DType::F32).contiguous();
}

Tensor cat_rows(const std::vector<Tensor>& parts) {
  std::vector<Tensor> live;
  for (const Tensor& p : parts) {
    if (p.defined()) live.push_back(p);
  }
  if (live.empty()) return Tensor();
  int64_t rows = 0;
  for (const auto& p : live) rows += p.size(0);
  Shape s = live[0].shape();
  s[0] = rows;
  const bool same = std::all_of(live.begin(), live.end(), [&](const Tensor& p) { return p.dtype() == live[0].dtype(); });
  Tensor out = Tensor::empty(s, same && !is_floating(live[0].dtype()) ? live[0].dtype() : DType::F32);
  int64_t at = 0;
  for (const auto& p : live) {
    out.slice(0, at, at + p.size(0)).copy_from(p);
    at += p.size(0);
  }
  return out;
}

nlohmann::json without_nulls(const nlohmann::json& j) {
  if (!j.is_object()) return j;  // the caller's type check names it ("rope_scaling": 5)
  nlohmann::json c = nlohmann::json::object();
  for (const auto& [k, v] : j.items()) {
    if (!v.is_null()) c[k] = v;
  }
  return c;
}

}  // namespace heads::models
