// bind_decoder.cc — decoder models (CausalLM), the KV cache and the decoder ops (RoPE, RMSNorm).
#include "convert.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "heads/causal_lm.h"
#include "heads/kv_cache.h"
#include "heads/linear_attention.h"
#include "heads/ops.h"
#include "heads/precision.h"
#include "heads/t5.h"

namespace heads::py {

using namespace nb::literals;

namespace {

DType cache_dtype(const std::string& s, const char* name = "dtype") {
  HEADS_CHECK(s == "f32" || s == "float32" || s == "bf16" || s == "bfloat16" || s == "int8",
              name, ": expected 'f32', 'bf16' or 'int8', got '", s, "'");
  return s == "f32" || s == "float32" ? DType::F32 : s == "int8" ? DType::I8 : DType::BF16;
}

RopeOptions rope_options(double theta, bool interleaved, int64_t rotary_dim, const std::string& scaling, double factor,
                         double low, double high, int64_t original) {
  RopeOptions o;
  o.theta = theta;
  o.interleaved = interleaved;
  o.rotary_dim = rotary_dim;
  HEADS_CHECK(scaling == "default" || scaling == "linear" || scaling == "llama3",
              "rope: scaling must be 'default', 'linear' or 'llama3', got '", scaling, "'");
  o.scaling = scaling == "linear"   ? RopeOptions::Scaling::Linear
              : scaling == "llama3" ? RopeOptions::Scaling::Llama3
                                    : RopeOptions::Scaling::None;
  o.factor = factor;
  o.low_freq_factor = low;
  o.high_freq_factor = high;
  o.original_max_position = original;
  return o;
}

// The cache for this call (other threads' calls on it finish first), waited for without the GIL.
std::unique_lock<std::mutex> hold(const heads::KVCache& c) {
  nb::gil_scoped_release release;
  return c.hold();
}

// An int8 cache's key or value scales of one layer (KVCache::key_scales / value_scales) as an
// array; None for other dtypes.
template <Tensor (heads::KVCache::*Get)(int64_t) const>
nb::object scales_of(const heads::KVCache& c, int64_t layer, bool torch_out) {
  const auto held = hold(c);
  const Tensor s = (c.*Get)(layer);
  return s.defined() ? to_array(s, torch_out) : nb::none();
}

}  // namespace

void bind_decoder(nb::module_& m) {
  nb::class_<heads::KVCache>(m, "KVCache")
      .def("__init__",
           [](heads::KVCache* self, int64_t layers, int64_t batch, int64_t kv_heads, int64_t head_dim,
              const std::string& dtype, int64_t capacity) {
             new (self) heads::KVCache(layers, batch, kv_heads, head_dim, cache_dtype(dtype), capacity);
           },
           "num_layers"_a, "batch"_a, "kv_heads"_a, "head_dim"_a, "dtype"_a = "f32", "capacity"_a = 0)
      .def("__len__",
           [](const heads::KVCache& c) {
             const auto held = hold(c);
             return c.length();
           })
      .def_prop_ro("num_layers", &heads::KVCache::num_layers)
      .def_prop_ro("batch", &heads::KVCache::batch)
      .def_prop_ro("capacity", &heads::KVCache::capacity)
      .def_prop_ro("dtype",
                   [](const heads::KVCache& c) { return c.dtype() == DType::I8 ? std::string("int8") : std::string(dtype_name(c.dtype())); })
      .def("length",
           [](const heads::KVCache& c, int64_t layer) {
             const auto held = hold(c);
             return c.length(layer);
           },
           "layer"_a)
      .def("append",
           [](heads::KVCache& c, int64_t layer, const InArray& k, const InArray& v, bool torch_out) {
             const auto held = hold(c);
             const auto [K, V] = c.append(layer, view_of(k, "key"), view_of(v, "value"));
             return nb::make_tuple(to_array(K, torch_out), to_array(V, torch_out));
           },
           "layer"_a, "key"_a, "value"_a, "torch_out"_a = false)
      .def("keys",
           [](const heads::KVCache& c, int64_t layer, bool t) {
             const auto held = hold(c);
             return to_array(c.keys(layer), t);
           },
           "layer"_a, "torch_out"_a = false)
      .def("values",
           [](const heads::KVCache& c, int64_t layer, bool t) {
             const auto held = hold(c);
             return to_array(c.values(layer), t);
           },
           "layer"_a, "torch_out"_a = false)
      .def("key_scales", &scales_of<&heads::KVCache::key_scales>, "layer"_a, "torch_out"_a = false)
      .def("value_scales", &scales_of<&heads::KVCache::value_scales>, "layer"_a, "torch_out"_a = false)
      .def("truncate",
           [](heads::KVCache& c, int64_t length) {
             const auto held = hold(c);
             c.truncate(length);
           },
           "length"_a)
      .def("reorder",
           [](heads::KVCache& c, const std::vector<int64_t>& index) {
             const auto held = hold(c);
             c.reorder(index);
           },
           "index"_a);

  nb::class_<heads::CausalLM>(m, "CausalLM")
      .def_static("load", &heads::CausalLM::load, "model_dir"_a)
      .def_prop_ro("model_type", [](const heads::CausalLM& lm) { return lm.config().model_type; })
      .def_prop_ro("num_layers", [](const heads::CausalLM& lm) { return lm.config().num_layers; })
      .def_prop_ro("vocab_size", [](const heads::CausalLM& lm) { return lm.config().vocab_size; })
      .def_prop_ro("dtype", [](const heads::CausalLM& lm) { return heads::precision_name(lm.precision()); })
      .def("set_precision",
           [](heads::CausalLM& lm, const std::string& p, double activation_error) {
             const heads::Precision precision = heads::precision_from_name(p);
             nb::gil_scoped_release release;  // int8 calibrates: a forward of the model
             lm.set_precision(precision, activation_error);
           },
           "dtype"_a, "activation_error"_a = 0.0)
      .def("new_cache",
           [](const heads::CausalLM& lm, int64_t batch, const std::string& dtype, int64_t capacity) {
             return lm.new_cache(batch, cache_dtype(dtype), capacity);
           },
           "batch"_a = 1, "dtype"_a = "f32", "capacity"_a = 0)
      .def("forward",
           [](const heads::CausalLM& lm, const InArray& ids, heads::KVCache* cache, bool last_only, bool torch_out) {
             const heads::Tensor t = view_of(ids, "input_ids").to(DType::I64);
             heads::Tensor out;
             {
               nb::gil_scoped_release release;
               out = lm.forward(t.dim() == 1 ? t.unsqueeze(0) : t, cache, last_only);
             }
             return to_array(t.dim() == 1 ? out.squeeze(0) : out, torch_out);
           },
           "input_ids"_a, "cache"_a = nb::none(), "last_only"_a = false, "torch_out"_a = false)
      .def("generate",
           [](const heads::CausalLM& lm, const std::vector<int64_t>& prompt, int64_t max_new_tokens,
              int64_t eos_token_id, const std::string& dtype) {
             nb::gil_scoped_release release;
             return lm.generate(prompt, max_new_tokens, eos_token_id, cache_dtype(dtype, "cache_dtype"));
           },
           "prompt"_a, "max_new_tokens"_a, "eos_token_id"_a = -1, "cache_dtype"_a = "f32")
      .def_static("eos_token_id", &heads::CausalLM::eos_token_id, "model_dir"_a);

  nb::class_<heads::T5Encoder>(m, "T5Encoder")
      .def_static("load", &heads::T5Encoder::load, "model_dir"_a)
      .def("forward",
           [](const heads::T5Encoder& e, const InArray& ids, const std::optional<InArray>& mask, bool torch_out) {
             const heads::Tensor t = view_of(ids, "input_ids").to(DType::I64);
             heads::Tensor mk = opt_view(mask, "attention_mask");
             heads::Tensor out;
             {
               nb::gil_scoped_release release;
               out = e.forward(t, mk);
             }
             return to_array(out, torch_out);
           },
           "input_ids"_a, "attention_mask"_a = nb::none(), "torch_out"_a = false);

  nb::class_<heads::LinearAttentionState>(m, "LinearAttentionState")
      .def("__init__",
           [](heads::LinearAttentionState* self, int64_t batch, int64_t heads_, int64_t head_dim, int64_t value_dim,
              const std::string& fm, double eps) {
             new (self) heads::LinearAttentionState(batch, heads_, head_dim, value_dim, heads::feature_map_from_name(fm),
                                                    eps);
           },
           "batch"_a, "heads"_a, "head_dim"_a, "value_dim"_a, "feature_map"_a = "elu", "eps"_a = 1e-6)
      .def("step",
           [](heads::LinearAttentionState& st, const InArray& q, const InArray& k, const InArray& v, bool torch_out) {
             return to_array(st.step(view_of(q, "query"), view_of(k, "key"), view_of(v, "value")), torch_out);
           },
           "query"_a, "key"_a, "value"_a, "torch_out"_a = false)
      .def("__len__", &heads::LinearAttentionState::length);

  m.def("rope",
        [](const InArray& x, int64_t offset, double theta, bool interleaved, int64_t rotary_dim,
           const std::string& scaling, double factor, double low, double high, int64_t original, bool inverse,
           bool torch_out) {
          const heads::Tensor t = view_of(x, "x");
          heads::Tensor y = t.dtype() == DType::BF16 ? t.clone() : t.to(DType::F32).clone();
          rope_(y, offset, rope_options(theta, interleaved, rotary_dim, scaling, factor, low, high, original), inverse);
          return to_array(y, torch_out);
        },
        "x"_a, "position_offset"_a = 0, "theta"_a = 10000.0, "interleaved"_a = false, "rotary_dim"_a = 0,
        "scaling"_a = "default", "factor"_a = 1.0, "low_freq_factor"_a = 1.0, "high_freq_factor"_a = 4.0,
        "original_max_position"_a = 8192, "inverse"_a = false, "torch_out"_a = false);
  m.def("rms_norm",
        [](const InArray& x, const InArray& w, double eps, bool unit_offset, bool torch_out) {
          return to_array(rms_norm(view_of(x, "x"), view_of(w, "weight"), eps, unit_offset), torch_out);
        },
        "x"_a, "weight"_a, "eps"_a = 1e-6, "unit_offset"_a = false, "torch_out"_a = false);
}

}  // namespace heads::py
