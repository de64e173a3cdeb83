// config_json.h — the JSON files of a model directory (config.json, tokenizer_config.json, ...),
// read with every field checked: an error names the file, the field, what it must be and its value.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "heads/ops.h"

namespace heads::models {

// The file at `p`, which must hold an object (or, with `array`, an array); a missing file is an
// error when `required`, else it reads as empty.
nlohmann::json read_json(const std::filesystem::path& p, bool required, bool array = false);

// Field `key` of `j` (read from `file`), or `fallback` when absent; present but of the wrong type or
// outside [lo, hi] is an error.
int64_t json_int(const nlohmann::json& j, const char* key, int64_t fallback, const std::filesystem::path& file,
                 int64_t lo, int64_t hi);
double json_real(const nlohmann::json& j, const char* key, double fallback, const std::filesystem::path& file,
                 double lo, double hi);
bool json_bool(const nlohmann::json& j, const char* key, bool fallback, const std::filesystem::path& file);
std::string json_string(const nlohmann::json& j, const char* key, const std::string& fallback,
                        const std::filesystem::path& file);

// The tokens a model directory's texts are cut to, as sentence-transformers reads it: its
// sentence_bert_config.json's max_seq_length, else tokenizer_config.json's model_max_length
// (transformers writes about 1e30 for "no limit"), capped at the `positions` the encoder holds.
int64_t max_sequence_length(const std::filesystem::path& dir, int64_t positions);

// RoPE settings from the object `j` (a config.json or part of one): rope_parameters (transformers 5)
// or rope_theta + rope_scaling (4.x); rope_type default, linear or llama3, anything else an error.
RopeOptions read_rope(const nlohmann::json& j, const std::filesystem::path& file);

}  // namespace heads::models
