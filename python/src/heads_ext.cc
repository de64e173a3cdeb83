// heads_ext.cc — the nanobind extension `heads._heads`: array conversion and thin bindings.
//
// Arrays arrive through DLPack (numpy, torch, ...) and become heads::Tensor views without a
// copy; results leave as numpy arrays that own the result tensor's storage. heads::Error
// becomes ValueError. The computation runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>

#include "heads/encoder.h"
#include "heads/error.h"
#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/optim.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"
#include "heads/sentence_encoder.h"
#include "heads/tokenizer.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using InArray = nb::ndarray<nb::ro, nb::device::cpu>;

heads::DType to_dtype(const nb::dlpack::dtype& dt, const char* name) {
  using nb::dlpack::dtype_code;
  const auto code = static_cast<dtype_code>(dt.code);
  if (dt.lanes == 1) {
    if (code == dtype_code::Float && dt.bits == 32) return heads::DType::F32;
    if (code == dtype_code::Float && dt.bits == 64) return heads::DType::F64;
    if (code == dtype_code::Float && dt.bits == 16) return heads::DType::F16;
    if (code == dtype_code::Bfloat && dt.bits == 16) return heads::DType::BF16;
    if (code == dtype_code::Bool && dt.bits == 8) return heads::DType::Bool;
    if (code == dtype_code::UInt && dt.bits == 8) return heads::DType::U8;
    if (code == dtype_code::Int && dt.bits == 64) return heads::DType::I64;
  }
  heads::fail(name, ": unsupported array dtype (code ", static_cast<int>(dt.code), ", ",
              static_cast<int>(dt.bits), " bits); use float32, float64, float16, bfloat16, bool, "
              "uint8 or int64");
}

// A view of the array's memory (the caller keeps the array alive while the view is used).
heads::Tensor view_of(const InArray& a, const char* name) {
  heads::Shape shape(a.ndim()), strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = static_cast<int64_t>(a.shape(i));
    strides[i] = static_cast<int64_t>(a.stride(i));
  }
  return heads::Tensor::from_blob(const_cast<void*>(a.data()), shape, strides,
                                  to_dtype(a.dtype(), name));
}

heads::Tensor opt_view(const std::optional<InArray>& a, const char* name) {
  return a ? view_of(*a, name) : heads::Tensor();
}

nb::dlpack::dtype dl_dtype(heads::DType dt) {
  switch (dt) {
    case heads::DType::F32: return nb::dtype<float>();
    case heads::DType::F64: return nb::dtype<double>();
    case heads::DType::Bool: return nb::dtype<bool>();
    case heads::DType::U8: return nb::dtype<uint8_t>();
    case heads::DType::I64: return nb::dtype<int64_t>();
    case heads::DType::F16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case heads::DType::BF16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  return nb::dtype<float>();
}

// A numpy array (or torch tensor) owning (a reference to) the tensor's storage; no copy.
nb::object to_array(const heads::Tensor& t, bool torch) {
  if (!t.defined()) return nb::none();
  auto* keep = new heads::Tensor(t);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<heads::Tensor*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
  if (torch) {
    return nb::ndarray<nb::pytorch>(t.raw_data(), shape.size(), shape.data(), owner, strides.data(),
                                    dl_dtype(t.dtype()))
        .cast();
  }
  HEADS_CHECK(t.dtype() != heads::DType::BF16,
              "numpy has no bfloat16: pass torch tensors for bf16 attention");
  return nb::ndarray<nb::numpy>(t.raw_data(), shape.size(), shape.data(), owner, strides.data(),
                                dl_dtype(t.dtype()))
      .cast();
}

nb::object to_numpy(const heads::Tensor& t) { return to_array(t, false); }

// torch-style leading batch dims: [L, D] -> [1, 1, L, D], [X, L, D] -> [1, X, L, D].
heads::Tensor to_4d(heads::Tensor t, const char* name) {
  HEADS_CHECK(t.dim() >= 2 && t.dim() <= 4, "sdpa: ", name, ": expected 2-D to 4-D [..., L, E], got ",
              t.shape());
  while (t.dim() < 4) t = t.unsqueeze(0);
  return t;
}

nb::object sdpa(const InArray& query, const InArray& key, const InArray& value,
                const std::optional<InArray>& attn_mask, double dropout_p, bool is_causal,
                std::optional<double> scale, bool enable_gqa, bool need_weights,
                std::optional<uint64_t> seed, bool torch_out, bool causal_lower_right) {
  const heads::Tensor q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  const int64_t rank = q.dim();
  HEADS_CHECK(k.dim() == rank && v.dim() == rank, "sdpa: query ", q.shape(), ", key ", k.shape(),
              " and value ", v.shape(), " must have the same rank");
  heads::SdpaOptions o;
  o.attn_mask = opt_view(attn_mask, "attn_mask");
  o.is_causal = is_causal;
  o.causal_align = causal_lower_right ? heads::CausalAlign::BottomRight : heads::CausalAlign::TopLeft;
  o.scale = scale;
  o.dropout_p = dropout_p;
  o.dropout_seed = seed;
  o.enable_gqa = enable_gqa;
  o.need_weights = need_weights;
  heads::SdpaResult r;
  {
    nb::gil_scoped_release release;
    r = heads::sdpa(to_4d(q, "query"), to_4d(k, "key"), to_4d(v, "value"), o);
  }
  // Back to the caller's rank.
  heads::Tensor out = r.out, w = r.weights;
  while (out.dim() > rank) {
    out = out.squeeze(0);
    if (w.defined()) w = w.squeeze(0);
  }
  if (!need_weights) return to_array(out, torch_out);
  return nb::make_tuple(to_array(out, torch_out), to_array(w, torch_out));
}

}  // namespace

heads::TransformerEncoderLayerOptions layer_options(int64_t d_model, int64_t nhead, int64_t dim_feedforward,
                                                    double dropout, const std::string& activation,
                                                    double layer_norm_eps, bool batch_first,
                                                    bool norm_first, bool bias) {
  heads::TransformerEncoderLayerOptions o;
  o.d_model = d_model;
  o.nhead = nhead;
  o.dim_feedforward = dim_feedforward;
  o.dropout = dropout;
  o.activation = heads::activation_from_name(activation);
  o.layer_norm_eps = layer_norm_eps;
  o.batch_first = batch_first;
  o.norm_first = norm_first;
  o.bias = bias;
  return o;
}

nb::dict to_dict(const heads::StateDict& sd, bool torch = false) {
  nb::dict d;
  for (const auto& [name, t] : sd) d[name.c_str()] = to_array(t, torch);
  return d;
}

heads::StateDict from_items(const std::vector<std::pair<std::string, InArray>>& items) {
  heads::StateDict sd;
  for (const auto& [name, a] : items) sd.emplace_back(name, view_of(a, name.c_str()));
  return sd;
}

// train/state_dict/load_state_dict, shared by the module classes.
template <class Module, class Class>
void bind_module_state(Class& cls) {
  cls.def("_set_training", &Module::train, "mode"_a)
      .def("state_dict", [](const Module& s) { return to_dict(s.state_dict()); })
      .def("load_state_dict",
           [](Module& s, const std::vector<std::pair<std::string, InArray>>& items, bool strict) {
             s.load_state_dict(from_items(items), strict);
           },
           "items"_a, "strict"_a = true);
}

// (dsrc, {name: gradient}) for the encoder modules' backward.
template <class Module, class Tape>
nb::tuple module_backward(const Module& s, const Tape& tape, const InArray& dout, bool torch_out) {
  const heads::Tensor d = view_of(dout, "grad_output");
  heads::EncoderGrads g;
  {
    nb::gil_scoped_release release;
    g = s.backward(tape, d);
  }
  return nb::make_tuple(to_array(g.dsrc, torch_out), to_dict(g.params, torch_out));
}

NB_MODULE(_heads, m) {
  m.doc() = "heads: multi-head attention for CPUs (native core)";
  // Autograd graphs still alive at interpreter exit (heads.torch) hold tapes and modules that
  // torch frees after nanobind's shutdown check; that is not a leak worth a report.
  nb::set_leak_warnings(false);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const heads::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("set_num_threads", &heads::set_num_threads, "n"_a);
  m.def("get_num_threads", &heads::get_num_threads);
  m.def("manual_seed", &heads::manual_seed, "seed"_a);
  m.def("sdpa", &sdpa, "query"_a, "key"_a, "value"_a, "attn_mask"_a = nb::none(),
        "dropout_p"_a = 0.0, "is_causal"_a = false, "scale"_a = nb::none(),
        "enable_gqa"_a = false, "need_weights"_a = false, "seed"_a = nb::none(),
        "torch_out"_a = false, "causal_lower_right"_a = false);

  nb::class_<heads::MhaTape>(m, "MhaTape").def(nb::init<>()).def_prop_ro("defined", &heads::MhaTape::defined);
  nb::class_<heads::EncoderLayerTape>(m, "EncoderLayerTape")
      .def(nb::init<>())
      .def_prop_ro("defined", &heads::EncoderLayerTape::defined);
  nb::class_<heads::EncoderTape>(m, "EncoderTape").def(nb::init<>()).def_prop_ro("defined", &heads::EncoderTape::defined);

  nb::class_<heads::MultiheadAttention>(m, "MultiheadAttention")
      .def("__init__",
           [](heads::MultiheadAttention* self, int64_t embed_dim, int64_t num_heads, double dropout,
              bool bias, bool add_bias_kv, bool add_zero_attn, std::optional<int64_t> kdim,
              std::optional<int64_t> vdim, bool batch_first, std::optional<uint64_t> seed) {
             heads::MultiheadAttentionOptions o;
             o.embed_dim = embed_dim;
             o.num_heads = num_heads;
             o.dropout = dropout;
             o.bias = bias;
             o.add_bias_kv = add_bias_kv;
             o.add_zero_attn = add_zero_attn;
             o.kdim = kdim.value_or(0);
             o.vdim = vdim.value_or(0);
             HEADS_CHECK(!kdim || *kdim > 0, "MultiheadAttention: kdim must be positive, got ", *kdim);
             HEADS_CHECK(!vdim || *vdim > 0, "MultiheadAttention: vdim must be positive, got ", *vdim);
             o.batch_first = batch_first;
             new (self) heads::MultiheadAttention(o, seed);
           },
           "embed_dim"_a, "num_heads"_a, "dropout"_a = 0.0, "bias"_a = true,
           "add_bias_kv"_a = false, "add_zero_attn"_a = false, "kdim"_a = nb::none(),
           "vdim"_a = nb::none(), "batch_first"_a = false, "seed"_a = nb::none())
      .def_prop_ro("embed_dim", [](const heads::MultiheadAttention& s) { return s.options().embed_dim; })
      .def_prop_ro("num_heads", [](const heads::MultiheadAttention& s) { return s.options().num_heads; })
      .def_prop_ro("kdim", [](const heads::MultiheadAttention& s) { return s.options().kdim; })
      .def_prop_ro("vdim", [](const heads::MultiheadAttention& s) { return s.options().vdim; })
      .def_prop_ro("dropout", [](const heads::MultiheadAttention& s) { return s.options().dropout; })
      .def_prop_ro("batch_first", [](const heads::MultiheadAttention& s) { return s.options().batch_first; })
      .def_prop_ro("training", &heads::MultiheadAttention::training)
      .def("_set_training", &heads::MultiheadAttention::train, "mode"_a)
      .def("state_dict",
           [](const heads::MultiheadAttention& s) {
             nb::dict d;
             for (const auto& [name, t] : s.state_dict()) d[name.c_str()] = to_numpy(t);
             return d;
           })
      .def("load_state_dict",
           [](heads::MultiheadAttention& s, const std::vector<std::pair<std::string, InArray>>& items,
              bool strict) {
             heads::StateDict sd;
             for (const auto& [name, a] : items) sd.emplace_back(name, view_of(a, name.c_str()));
             s.load_state_dict(sd, strict);
           },
           "items"_a, "strict"_a = true)
      .def("load", &heads::MultiheadAttention::load, "path"_a, "strict"_a = true)
      .def("save", &heads::MultiheadAttention::save, "path"_a)
      .def("forward",
           [](const heads::MultiheadAttention& s, const InArray& query, const InArray& key,
              const InArray& value, const std::optional<InArray>& key_padding_mask,
              bool need_weights, const std::optional<InArray>& attn_mask,
              bool average_attn_weights, bool is_causal, bool torch_out, heads::MhaTape* tape) {
             heads::MhaForwardArgs a;
             a.tape = tape;
             a.key_padding_mask = opt_view(key_padding_mask, "key_padding_mask");
             a.attn_mask = opt_view(attn_mask, "attn_mask");
             a.need_weights = need_weights;
             a.average_attn_weights = average_attn_weights;
             a.is_causal = is_causal;
             const heads::Tensor q = view_of(query, "query");
             const heads::Tensor k = view_of(key, "key"), v = view_of(value, "value");
             std::pair<heads::Tensor, heads::Tensor> r;
             {
               nb::gil_scoped_release release;
               r = s.forward(q, k, v, a);
             }
             return nb::make_tuple(to_array(r.first, torch_out), to_array(r.second, torch_out));
           },
           "query"_a, "key"_a, "value"_a, "key_padding_mask"_a = nb::none(),
           "need_weights"_a = true, "attn_mask"_a = nb::none(), "average_attn_weights"_a = true,
           "is_causal"_a = false, "torch_out"_a = false, "tape"_a = nb::none())
      .def("backward",
           [](const heads::MultiheadAttention& s, const heads::MhaTape& tape, const InArray& dout, bool torch_out) {
             const heads::Tensor d = view_of(dout, "grad_output");
             heads::MhaGrads g;
             {
               nb::gil_scoped_release release;
               g = s.backward(tape, d);
             }
             return nb::make_tuple(to_array(g.dquery, torch_out), to_array(g.dkey, torch_out),
                                   to_array(g.dvalue, torch_out), to_dict(g.params, torch_out));
           },
           "tape"_a, "grad_output"_a, "torch_out"_a = false);

  auto layer_cls = nb::class_<heads::TransformerEncoderLayer>(m, "TransformerEncoderLayer");
  bind_module_state<heads::TransformerEncoderLayer>(layer_cls);
  layer_cls
      .def("__init__",
           [](heads::TransformerEncoderLayer* self, int64_t d_model, int64_t nhead, int64_t dim_feedforward,
              double dropout, const std::string& activation, double layer_norm_eps, bool batch_first,
              bool norm_first, bool bias, std::optional<uint64_t> seed) {
             new (self) heads::TransformerEncoderLayer(
                 layer_options(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                               batch_first, norm_first, bias),
                 seed);
           },
           "d_model"_a, "nhead"_a, "dim_feedforward"_a = 2048, "dropout"_a = 0.1,
           "activation"_a = "relu", "layer_norm_eps"_a = 1e-5, "batch_first"_a = false,
           "norm_first"_a = false, "bias"_a = true, "seed"_a = nb::none())
      .def_prop_ro("training", &heads::TransformerEncoderLayer::training)
      .def("forward",
           [](const heads::TransformerEncoderLayer& s, const InArray& src, const std::optional<InArray>& src_mask,
              const std::optional<InArray>& src_key_padding_mask, bool is_causal, bool torch_out,
              heads::EncoderLayerTape* tape) {
             heads::EncoderForwardArgs a;
             a.tape = tape;
             a.src_mask = opt_view(src_mask, "src_mask");
             a.src_key_padding_mask = opt_view(src_key_padding_mask, "src_key_padding_mask");
             a.is_causal = is_causal;
             const heads::Tensor x = view_of(src, "src");
             heads::Tensor out;
             {
               nb::gil_scoped_release release;
               out = s.forward(x, a);
             }
             return to_array(out, torch_out);
           },
           "src"_a, "src_mask"_a = nb::none(), "src_key_padding_mask"_a = nb::none(),
           "is_causal"_a = false, "torch_out"_a = false, "tape"_a = nb::none())
      .def("backward", &module_backward<heads::TransformerEncoderLayer, heads::EncoderLayerTape>,
           "tape"_a, "grad_output"_a, "torch_out"_a = false);

  auto enc_cls = nb::class_<heads::TransformerEncoder>(m, "TransformerEncoder");
  bind_module_state<heads::TransformerEncoder>(enc_cls);
  enc_cls
      .def("__init__",
           [](heads::TransformerEncoder* self, int64_t d_model, int64_t nhead, int64_t dim_feedforward,
              double dropout, const std::string& activation, double layer_norm_eps, bool batch_first,
              bool norm_first, bool bias, int64_t num_layers, bool final_norm, std::optional<uint64_t> seed) {
             new (self) heads::TransformerEncoder(
                 layer_options(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                               batch_first, norm_first, bias),
                 num_layers, final_norm, seed);
           },
           "d_model"_a, "nhead"_a, "dim_feedforward"_a, "dropout"_a, "activation"_a,
           "layer_norm_eps"_a, "batch_first"_a, "norm_first"_a, "bias"_a, "num_layers"_a,
           "final_norm"_a, "seed"_a = nb::none())
      .def("forward",
           [](const heads::TransformerEncoder& s, const InArray& src, const std::optional<InArray>& mask,
              const std::optional<InArray>& src_key_padding_mask, bool is_causal, bool torch_out,
              heads::EncoderTape* tape) {
             const heads::Tensor x = view_of(src, "src");
             const heads::Tensor mk = opt_view(mask, "mask");
             const heads::Tensor kp = opt_view(src_key_padding_mask, "src_key_padding_mask");
             heads::Tensor out;
             {
               nb::gil_scoped_release release;
               out = s.forward(x, mk, kp, is_causal, nullptr, tape);
             }
             return to_array(out, torch_out);
           },
           "src"_a, "mask"_a = nb::none(), "src_key_padding_mask"_a = nb::none(),
           "is_causal"_a = false, "torch_out"_a = false, "tape"_a = nb::none())
      .def("backward", &module_backward<heads::TransformerEncoder, heads::EncoderTape>,
           "tape"_a, "grad_output"_a, "torch_out"_a = false);

  nb::class_<heads::WordPieceTokenizer>(m, "WordPieceTokenizer")
      .def_static("from_vocab_file", &heads::WordPieceTokenizer::from_vocab_file, "path"_a,
                  "lowercase"_a = true)
      .def("encode",
           [](const heads::WordPieceTokenizer& t, nb::bytes text, int64_t max_length) {
             return t.encode(std::string_view(text.c_str(), text.size()), max_length).ids;
           },
           "text"_a, "max_length"_a = 0)
      .def("pre_tokenize",
           [](const heads::WordPieceTokenizer& t, nb::bytes text) {
             return t.pre_tokenize(std::string_view(text.c_str(), text.size()));
           },
           "text"_a)
      .def("token", &heads::WordPieceTokenizer::token, "id"_a)
      .def_prop_ro("vocab_size", &heads::WordPieceTokenizer::vocab_size);

  nb::class_<heads::SentenceEncoder>(m, "SentenceEncoder")
      .def_static("load", &heads::SentenceEncoder::load, "model_dir"_a = "")
      .def("encode",
           [](const heads::SentenceEncoder& s, const std::vector<std::string>& texts, int64_t batch_size) {
             heads::Tensor out;
             int64_t truncated = 0;
             {
               nb::gil_scoped_release release;
               out = s.encode(texts, batch_size, {}, &truncated);
             }
             return nb::make_tuple(to_numpy(out), truncated);
           },
           "texts"_a, "batch_size"_a = 32)
      .def("tokenize", [](const heads::SentenceEncoder& s, const std::string& text) { return s.tokenize(text); },
           "text"_a)
      .def("attention",
           [](const heads::SentenceEncoder& s, const std::string& text) {
             const auto a = s.attention(text);
             nb::list layers;
             for (const auto& t : a.layers) layers.append(to_numpy(t));
             return nb::make_tuple(a.tokens, layers);
           },
           "text"_a)
      .def("hidden_states",
           [](const heads::SentenceEncoder& s, const std::vector<std::vector<int64_t>>& ids) {
             heads::Tensor out;
             {
               nb::gil_scoped_release release;
               out = s.bert().forward(ids);
             }
             return to_numpy(out);
           },
           "ids"_a)
      .def_prop_ro("dim", &heads::SentenceEncoder::dim)
      .def_prop_ro("max_seq_length", &heads::SentenceEncoder::max_seq_length)
      .def_prop_ro("model_dir", &heads::SentenceEncoder::model_dir);

  // Training support for heads.torch: forward keeping (out, lse, seed), and the backward.
  m.def("sdpa_train_forward",
        [](const InArray& query, const InArray& key, const InArray& value, const std::optional<InArray>& attn_mask,
           double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, bool causal_lower_right) {
          heads::SdpaOptions o;
          o.attn_mask = opt_view(attn_mask, "attn_mask");
          o.dropout_p = dropout_p;
          o.is_causal = is_causal;
          o.causal_align = causal_lower_right ? heads::CausalAlign::BottomRight : heads::CausalAlign::TopLeft;
          o.scale = scale;
          o.enable_gqa = enable_gqa;
          const heads::Tensor q = to_4d(view_of(query, "query"), "query");
          const heads::Tensor k = to_4d(view_of(key, "key"), "key");
          const heads::Tensor v = to_4d(view_of(value, "value"), "value");
          heads::SdpaResult r;
          {
            nb::gil_scoped_release release;
            r = heads::sdpa(q, k, v, o);
          }
          return nb::make_tuple(to_array(r.out, true), to_array(r.lse, true), r.dropout_seed);
        },
        "query"_a, "key"_a, "value"_a, "attn_mask"_a = nb::none(), "dropout_p"_a = 0.0,
        "is_causal"_a = false, "scale"_a = nb::none(), "enable_gqa"_a = false, "causal_lower_right"_a = false);
  m.def("sdpa_train_backward",
        [](const InArray& dout, const InArray& query, const InArray& key, const InArray& value,
           const InArray& out, const InArray& lse, uint64_t seed, const std::optional<InArray>& attn_mask,
           double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, bool mask_grad,
           bool causal_lower_right) {
          heads::SdpaOptions o;
          o.attn_mask = opt_view(attn_mask, "attn_mask");
          o.dropout_p = dropout_p;
          o.is_causal = is_causal;
          o.causal_align = causal_lower_right ? heads::CausalAlign::BottomRight : heads::CausalAlign::TopLeft;
          o.scale = scale;
          o.enable_gqa = enable_gqa;
          heads::SdpaResult f;
          f.out = to_4d(view_of(out, "out"), "out");
          f.lse = view_of(lse, "lse");
          f.dropout_seed = seed;
          const heads::Tensor q = to_4d(view_of(query, "query"), "query");
          const heads::Tensor k = to_4d(view_of(key, "key"), "key");
          const heads::Tensor v = to_4d(view_of(value, "value"), "value");
          const heads::Tensor g = to_4d(view_of(dout, "dout"), "dout");
          heads::SdpaGrads r;
          {
            nb::gil_scoped_release release;
            r = heads::sdpa_backward(g, q, k, v, f, o, mask_grad);
          }
          return nb::make_tuple(to_array(r.dq, true), to_array(r.dk, true), to_array(r.dv, true),
                                to_array(r.dmask, true));
        },
        "dout"_a, "query"_a, "key"_a, "value"_a, "out"_a, "lse"_a, "seed"_a, "attn_mask"_a = nb::none(),
        "dropout_p"_a = 0.0, "is_causal"_a = false, "scale"_a = nb::none(), "enable_gqa"_a = false,
        "mask_grad"_a = false, "causal_lower_right"_a = false);

  // Backward passes of the functional ops (numpy in / numpy out), for training code and tests.
  m.def("linear_backward",
        [](const InArray& dy, const InArray& x, const InArray& w, bool has_bias) {
          const auto g = heads::linear_backward(view_of(dy, "dy"), view_of(x, "x"), view_of(w, "weight"), has_bias);
          return nb::make_tuple(to_numpy(g.dx), to_numpy(g.dweight), to_numpy(g.dbias));
        },
        "dy"_a, "x"_a, "weight"_a, "has_bias"_a = true);
  m.def("layer_norm_backward",
        [](const InArray& dy, const InArray& x, const std::optional<InArray>& w, const std::optional<InArray>& b,
           double eps) {
          const auto g = heads::layer_norm_backward(view_of(dy, "dy"), view_of(x, "x"), opt_view(w, "weight"),
                                                    opt_view(b, "bias"), eps);
          return nb::make_tuple(to_numpy(g.dx), to_numpy(g.dweight), to_numpy(g.dbias));
        },
        "dy"_a, "x"_a, "weight"_a = nb::none(), "bias"_a = nb::none(), "eps"_a = 1e-5);
  m.def("activation_backward",
        [](const InArray& dy, const InArray& x, const std::string& act) {
          return to_numpy(heads::activation_backward(view_of(dy, "dy"), view_of(x, "x"), heads::activation_from_name(act)));
        },
        "dy"_a, "x"_a, "activation"_a);
  m.def("embedding", [](const InArray& w, const InArray& ids) {
          return to_numpy(heads::embedding(view_of(w, "weight"), view_of(ids, "ids")));
        },
        "weight"_a, "ids"_a);
  m.def("embedding_backward",
        [](const InArray& dy, const InArray& ids, int64_t n) {
          return to_numpy(heads::embedding_backward(view_of(dy, "dy"), view_of(ids, "ids"), n));
        },
        "dy"_a, "ids"_a, "num_embeddings"_a);
  m.def("cross_entropy",
        [](const InArray& logits, const InArray& target, int64_t ignore_index) {
          return heads::cross_entropy(view_of(logits, "logits"), view_of(target, "target"), ignore_index);
        },
        "logits"_a, "target"_a, "ignore_index"_a = -100);
  m.def("cross_entropy_backward",
        [](const InArray& logits, const InArray& target, int64_t ignore_index, double dloss) {
          return to_numpy(heads::cross_entropy_backward(view_of(logits, "logits"), view_of(target, "target"),
                                                        ignore_index, dloss));
        },
        "logits"_a, "target"_a, "ignore_index"_a = -100, "dloss"_a = 1.0);

  // AdamW over arrays that share memory with the parameters (the Python wrapper keeps them alive).
  nb::class_<heads::AdamW>(m, "AdamW")
      .def("__init__",
           [](heads::AdamW* self, const std::vector<std::pair<std::string, InArray>>& params, double lr,
              double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool maximize) {
             heads::AdamWOptions o{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize};
             new (self) heads::AdamW(from_items(params), o);
           },
           "params"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "amsgrad"_a, "maximize"_a)
      .def("step",
           [](heads::AdamW& s, const std::vector<std::pair<std::string, InArray>>& grads) {
             const heads::StateDict g = from_items(grads);
             nb::gil_scoped_release release;
             s.step(g);
           },
           "grads"_a)
      .def_prop_ro("steps", &heads::AdamW::steps)
      .def_prop_rw("lr", [](const heads::AdamW& s) { return s.options().lr; }, &heads::AdamW::set_lr);
}
