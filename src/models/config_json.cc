// config_json.cc — checked fields of a model directory's JSON files.
#include "config_json.h"

#include <fstream>

#include "checkpoint.h"
#include "heads/error.h"

namespace heads::models {

namespace fs = std::filesystem;

namespace {

// Typed fields of a config object: the field `key`, or null when it is absent (the caller's fallback);
// a field that fails `ok` is an error naming the file, the field, what it must be and its value.
template <class Ok>
const nlohmann::json* json_field(const nlohmann::json& j, const char* key, const fs::path& file, Ok ok,
                                 const std::string& must) {
  if (!j.contains(key)) return nullptr;
  const nlohmann::json& v = j.at(key);
  HEADS_CHECK(ok(v), file.string(), ": \"", key, "\" must be ", must, ", got ", v.dump());
  return &v;
}

}  // namespace

nlohmann::json read_json(const fs::path& p, bool required, bool array) {
  // Only a regular file (or a link to one) is read: opening a FIFO would wait for a writer forever.
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  HEADS_CHECK(!fs::exists(st) || fs::is_regular_file(st), p.string(), ": not a regular file");
  std::ifstream in(p);
  if (!in) {
    HEADS_CHECK(!required, p.string(), ": cannot open");
    return array ? nlohmann::json::array() : nlohmann::json::object();
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(p.string(), ": not valid JSON: ", e.what());
  }
  HEADS_CHECK(array ? j.is_array() : j.is_object(), p.string(), ": expected a JSON ", array ? "array" : "object",
              ", got ", j.type_name());
  return j;
}

int64_t json_int(const nlohmann::json& j, const char* key, int64_t fallback, const fs::path& file, int64_t lo,
                 int64_t hi) {
  const auto in_range = [&](const nlohmann::json& v) {
    if (v.is_number_unsigned()) return v.get<uint64_t>() <= static_cast<uint64_t>(hi) && static_cast<int64_t>(v.get<uint64_t>()) >= lo;
    return v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  };
  const std::string must = "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  const nlohmann::json* v = json_field(j, key, file, in_range, must);
  // A fallback outside the range marks a field without a default: it must be there.
  HEADS_CHECK(v != nullptr || (fallback >= lo && fallback <= hi), file.string(), ": \"", key,
              "\" is missing (", must, "; no default)");
  return v == nullptr ? fallback : v->is_number_unsigned() ? static_cast<int64_t>(v->get<uint64_t>()) : v->get<int64_t>();
}

double json_real(const nlohmann::json& j, const char* key, double fallback, const fs::path& file, double lo,
                 double hi) {
  const auto in_range = [&](const nlohmann::json& v) { return v.is_number() && v.get<double>() >= lo && v.get<double>() <= hi; };
  const std::string must = "a number in [" + detail::concat(lo, ", ", hi) + "]";
  const nlohmann::json* v = json_field(j, key, file, in_range, must);
  HEADS_CHECK(v != nullptr || (fallback >= lo && fallback <= hi), file.string(), ": \"", key, "\" is missing (", must,
              "; no default)");
  return v == nullptr ? fallback : v->get<double>();
}

bool json_bool(const nlohmann::json& j, const char* key, bool fallback, const fs::path& file) {
  const nlohmann::json* v = json_field(j, key, file, [](const nlohmann::json& x) { return x.is_boolean(); }, "true or false");
  return v == nullptr ? fallback : v->get<bool>();
}

std::string json_string(const nlohmann::json& j, const char* key, const std::string& fallback, const fs::path& file) {
  const nlohmann::json* v = json_field(j, key, file, [](const nlohmann::json& x) { return x.is_string(); }, "a string");
  return v == nullptr ? fallback : v->get<std::string>();
}

int64_t max_sequence_length(const fs::path& d, int64_t positions) {
  const fs::path sbp = d / "sentence_bert_config.json";
  const nlohmann::json sb = read_json(sbp, false);
  if (sb.contains("max_seq_length")) {
    return std::min(json_int(sb, "max_seq_length", positions, sbp, 2, int64_t{1} << 24), positions);
  }
  const fs::path tcp = d / "tokenizer_config.json";
  const nlohmann::json tc = read_json(tcp, false);
  if (tc.contains("model_max_length") && !tc.at("model_max_length").is_null()) {
    const nlohmann::json& v = tc.at("model_max_length");
    HEADS_CHECK(v.is_number() && v.get<double>() >= 2, tcp.string(),
                ": \"model_max_length\" must be a number of at least 2, got ", v.dump());
    if (v.get<double>() < static_cast<double>(positions)) return static_cast<int64_t>(v.get<double>());
  }
  return positions;
}

RopeOptions read_rope(const nlohmann::json& j, const fs::path& file) {
  constexpr int64_t kMaxPositions = int64_t{1} << 24;
  RopeOptions r;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {  // either, even the one not read
    HEADS_CHECK(!j.contains(key) || j.at(key).is_object(), file.string(), ": \"", key, "\" must be an object, got ",
                j.contains(key) ? j.at(key).type_name() : "");
  }
  nlohmann::json p = j.contains("rope_parameters") ? without_nulls(j.at("rope_parameters"))
                     : j.contains("rope_scaling")  ? without_nulls(j.at("rope_scaling"))
                                                   : nlohmann::json::object();
  const char* where = j.contains("rope_parameters") ? "rope_parameters" : "rope_scaling";
  HEADS_CHECK(p.is_object(), file.string(), ": \"", where, "\" must be an object");
  r.theta = json_real(p, "rope_theta", json_real(j, "rope_theta", 10000.0, file, 1e-6, 1e30), file, 1e-6, 1e30);
  std::string type = json_string(p, "rope_type", json_string(p, "type", "default", file), file);
  if (type == "default") {
    r.scaling = RopeOptions::Scaling::None;
  } else if (type == "linear") {
    r.scaling = RopeOptions::Scaling::Linear;
    r.factor = json_real(p, "factor", 1.0, file, 1e-6, 1e6);
  } else if (type == "llama3") {
    r.scaling = RopeOptions::Scaling::Llama3;
    r.factor = json_real(p, "factor", 8.0, file, 1e-6, 1e6);
    r.low_freq_factor = json_real(p, "low_freq_factor", 1.0, file, 1e-6, 1e6);
    r.high_freq_factor = json_real(p, "high_freq_factor", 4.0, file, 1e-6, 1e6);
    r.original_max_position = json_int(p, "original_max_position_embeddings", 8192, file, 1, kMaxPositions);
  } else {
    fail(file.string(), ": \"", where, "\": rope_type \"", type,
         "\" is not supported (default, linear, llama3)");
  }
  const double partial = json_real(p, "partial_rotary_factor", json_real(j, "partial_rotary_factor", 1.0, file, 0, 1),
                                   file, 0, 1);
  HEADS_CHECK(partial == 1.0, file.string(), ": \"partial_rotary_factor\" ", partial, " is not supported (1.0)");
  return r;
}

}  // namespace heads::models
