// config_json.h — the JSON files of a model directory (config.json, tokenizer_config.json, ...),
// read with every field checked: an error names the file, the field, what it must be and its value.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

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

}  // namespace heads::models
