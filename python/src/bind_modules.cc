// bind_modules.cc — MultiheadAttention, TransformerEncoderLayer / TransformerEncoder with their
// tapes (forward keeps what backward needs), and AdamW over parameters shared with the modules.
#include "convert.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <type_traits>

#include "heads/encoder.h"
#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/optim.h"

namespace heads::py {

using namespace nb::literals;

namespace {

// The attention variant by name, as heads/nn.py's _variant gives it: a dict with any of attention,
// feature_map, window, sparse_block, sparse_stride, head_gate, gate_threshold (those left out keep
// AttentionVariant's defaults).
using Variant = nb::dict;

heads::AttentionVariant variant_of(const std::optional<Variant>& v) {
  heads::AttentionVariant a;
  if (!v) return a;
  const char* what = "attention variant";
  for_each_option(*v, [&](const std::string& key, nb::handle value) {
    if (key == "attention") a.kind = heads::attention_kind_from_name(option_value<std::string>(what, key, value));
    else if (key == "feature_map") a.feature_map = heads::feature_map_from_name(option_value<std::string>(what, key, value));
    else if (key == "window") a.window = option_value<int64_t>(what, key, value);
    else if (key == "sparse_block") a.sparse_block = option_value<int64_t>(what, key, value);
    else if (key == "sparse_stride") a.sparse_stride = option_value<int64_t>(what, key, value);
    else if (key == "head_gate") a.head_gate = heads::head_gate_from_name(option_value<std::string>(what, key, value));
    else if (key == "gate_threshold") a.gate_threshold = option_value<double>(what, key, value);
    else fail("attention variant: unknown option '", key, "'");
  });
  return a;
}

heads::TransformerEncoderLayerOptions layer_options(int64_t d_model, int64_t nhead, int64_t dim_feedforward,
                                                    double dropout, const std::string& activation,
                                                    double layer_norm_eps, bool batch_first,
                                                    bool norm_first, bool bias, const std::optional<Variant>& attention) {
  heads::TransformerEncoderLayerOptions o;
  o.attention = variant_of(attention);
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

// train/state_dict/load_state_dict and the precision of the linear layers (dtype), shared by the
// module classes.
template <class Module, class Class>
void bind_module_state(Class& cls) {
  cls.def_prop_rw(
      "dtype", [](const Module& s) { return heads::precision_name(s.precision()); },
      [](Module& s, const std::string& d) { s.set_precision(heads::precision_from_name(d)); });
  cls.def("_set_training", &Module::train, "mode"_a)
      .def("pack_f32", &Module::pack_f32)
      .def("state_dict", [](const Module& s) { return to_dict(s.state_dict()); })
      .def("quantized_state_dict", [](const Module& s) { return to_dict(s.quantized_state_dict()); })
      .def("load_state_dict",
           [](Module& s, const Items& items, bool strict) {
             s.load_state_dict(from_items(items), strict);
           },
           "items"_a, "strict"_a = true);
}

// The encoder modules' forward, with the GIL released; with a tape, it keeps what backward needs.
template <class Module, class Tape>
nb::object encoder_forward(const Module& s, const InArray& src, const std::optional<InArray>& mask,
                           const std::optional<InArray>& src_key_padding_mask, bool is_causal, bool torch_out,
                           Tape* tape) {
  Tensor x = view_of(src, "src");
  Tensor mk = opt_view(mask, std::is_same_v<Module, TransformerEncoder> ? "mask" : "src_mask");
  Tensor kp = opt_view(src_key_padding_mask, "src_key_padding_mask");
  Tensor out;
  {
    nb::gil_scoped_release release;
    if (tape != nullptr) own_for_tape({&x, &mk, &kp});
    if constexpr (std::is_same_v<Module, TransformerEncoder>) {
      out = s.forward(x, mk, kp, is_causal, nullptr, tape);
    } else {
      EncoderForwardArgs a;
      a.tape = tape;
      a.src_mask = mk;
      a.src_key_padding_mask = kp;
      a.is_causal = is_causal;
      out = s.forward(x, a);
    }
  }
  return to_array(out, torch_out);
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

// MultiheadAttention: construction from torch's arguments, options, forward (with a tape on
// request) and backward.
void bind_mha(nb::module_& m) {
  // A linear layer's weight prepared once for a precision (heads/precision.h), and y = x Wᵀ + b.
  nb::class_<heads::PackedLinear>(m, "PackedLinear")
      .def(
          "__init__",
          [](heads::PackedLinear* self, const InArray& weight, const std::string& dtype) {
            new (self) heads::PackedLinear(view_of(weight, "weight"), heads::precision_from_name(dtype));
          },
          "weight"_a, "dtype"_a)
      .def_static(
          "from_tensors",
          [](const std::string& name, const Items& items) {
            const StateDict sd = from_items(items);
            const auto get = [&](const std::string& n) -> const Tensor* {
              for (const auto& [k, t] : sd) {
                if (k == n) return &t;
              }
              return nullptr;
            };
            return heads::int8_from_tensors(name, get, "PackedLinear.from_tensors");
          },
          "name"_a, "items"_a)
      .def("tensors", [](const heads::PackedLinear& p, const std::string& name) {
        return to_dict(heads::int8_tensors(name, p));
      }, "name"_a)
      .def_prop_ro("dtype", [](const heads::PackedLinear& p) { return heads::precision_name(p.precision()); })
      .def_prop_ro("in_features", &heads::PackedLinear::in_features)
      .def_prop_ro("out_features", &heads::PackedLinear::out_features)
      .def_prop_ro("data", [](const heads::PackedLinear& p) { return to_numpy(p.data()); })
      .def_prop_ro("scales", [](const heads::PackedLinear& p) { return to_numpy(p.scales()); })
      .def("dequantize", [](const heads::PackedLinear& p) { return to_numpy(heads::dequantize(p)); })
      .def(
          "__call__",
          [](const heads::PackedLinear& p, const InArray& x, const std::optional<InArray>& bias, bool torch_out) {
            const Tensor xt = view_of(x, "x"), b = opt_view(bias, "bias");
            HEADS_CHECK(xt.dim() >= 1 && xt.size(-1) == p.in_features(), "PackedLinear: x: expected [..., ",
                        p.in_features(), "], got ", xt.shape());
            HEADS_CHECK(!b.defined() || b.shape() == Shape({p.out_features()}), "PackedLinear: bias: expected [",
                        p.out_features(), "], got ", b.shape());
            Tensor y;
            {
              nb::gil_scoped_release release;
              y = heads::linear(xt, p, b);
            }
            return to_array(y, torch_out);
          },
          "x"_a, "bias"_a = nb::none(), "torch_out"_a = false);

  auto mha_cls = nb::class_<heads::MultiheadAttention>(m, "MultiheadAttention");
  bind_module_state<heads::MultiheadAttention>(mha_cls);
  mha_cls
      .def("__init__",
           [](heads::MultiheadAttention* self, int64_t embed_dim, int64_t num_heads, double dropout,
              bool bias, bool add_bias_kv, bool add_zero_attn, std::optional<int64_t> kdim,
              std::optional<int64_t> vdim, bool batch_first, std::optional<int64_t> head_dim,
              const std::optional<Variant>& variant, std::optional<uint64_t> seed) {
             heads::MultiheadAttentionOptions o;
             HEADS_CHECK(!head_dim || *head_dim > 0, "MultiheadAttention: head_dim must be positive, got ", *head_dim);
             o.head_dim = head_dim.value_or(0);
             o.variant = variant_of(variant);
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
           "vdim"_a = nb::none(), "batch_first"_a = false, "head_dim"_a = nb::none(), "variant"_a = nb::none(),
           "seed"_a = nb::none())
      .def_prop_ro("head_dim", [](const heads::MultiheadAttention& s) { return s.options().head_dim; })
      .def("prune_heads", &heads::MultiheadAttention::prune_heads, "heads"_a)
      .def("head_gates",
           [](const heads::MultiheadAttention& s, const InArray& query, bool torch_out) {
             const heads::Tensor q = view_of(query, "query");
             heads::Tensor g;
             {
               nb::gil_scoped_release release;
               g = s.head_gates(q);
             }
             return to_array(g, torch_out);
           },
           "query"_a, "torch_out"_a = false)
      .def_prop_ro("embed_dim", [](const heads::MultiheadAttention& s) { return s.options().embed_dim; })
      .def_prop_ro("num_heads", [](const heads::MultiheadAttention& s) { return s.options().num_heads; })
      .def_prop_ro("kdim", [](const heads::MultiheadAttention& s) { return s.options().kdim; })
      .def_prop_ro("vdim", [](const heads::MultiheadAttention& s) { return s.options().vdim; })
      .def_prop_ro("dropout", [](const heads::MultiheadAttention& s) { return s.options().dropout; })
      .def_prop_ro("batch_first", [](const heads::MultiheadAttention& s) { return s.options().batch_first; })
      .def_prop_ro("training", &heads::MultiheadAttention::training)
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
             heads::Tensor q = view_of(query, "query");
             heads::Tensor k = view_of(key, "key"), v = view_of(value, "value");
             std::pair<heads::Tensor, heads::Tensor> r;
             {
               nb::gil_scoped_release release;
               if (tape != nullptr) own_for_tape({&q, &k, &v, &a.key_padding_mask, &a.attn_mask});
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
}

// TransformerEncoderLayer and TransformerEncoder: the same forward and backward bodies for both.
void bind_encoders(nb::module_& m) {
  auto layer_cls = nb::class_<heads::TransformerEncoderLayer>(m, "TransformerEncoderLayer");
  bind_module_state<heads::TransformerEncoderLayer>(layer_cls);
  layer_cls
      .def("__init__",
           [](heads::TransformerEncoderLayer* self, int64_t d_model, int64_t nhead, int64_t dim_feedforward,
              double dropout, const std::string& activation, double layer_norm_eps, bool batch_first,
              bool norm_first, bool bias, const std::optional<Variant>& attention, std::optional<uint64_t> seed) {
             new (self) heads::TransformerEncoderLayer(
                 layer_options(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                               batch_first, norm_first, bias, attention),
                 seed);
           },
           "d_model"_a, "nhead"_a, "dim_feedforward"_a = 2048, "dropout"_a = 0.1,
           "activation"_a = "relu", "layer_norm_eps"_a = 1e-5, "batch_first"_a = false,
           "norm_first"_a = false, "bias"_a = true, "attention"_a = nb::none(), "seed"_a = nb::none())
      .def("prune_heads", &heads::TransformerEncoderLayer::prune_heads, "heads"_a)
      .def_prop_ro("training", &heads::TransformerEncoderLayer::training)
      .def("forward", &encoder_forward<heads::TransformerEncoderLayer, heads::EncoderLayerTape>, "src"_a,
           "src_mask"_a = nb::none(), "src_key_padding_mask"_a = nb::none(), "is_causal"_a = false,
           "torch_out"_a = false, "tape"_a = nb::none())
      .def("backward", &module_backward<heads::TransformerEncoderLayer, heads::EncoderLayerTape>,
           "tape"_a, "grad_output"_a, "torch_out"_a = false);

  auto enc_cls = nb::class_<heads::TransformerEncoder>(m, "TransformerEncoder");
  bind_module_state<heads::TransformerEncoder>(enc_cls);
  enc_cls
      .def("__init__",
           [](heads::TransformerEncoder* self, int64_t d_model, int64_t nhead, int64_t dim_feedforward,
              double dropout, const std::string& activation, double layer_norm_eps, bool batch_first,
              bool norm_first, bool bias, int64_t num_layers, bool final_norm, const std::optional<Variant>& attention,
              std::optional<uint64_t> seed) {
             new (self) heads::TransformerEncoder(
                 layer_options(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                               batch_first, norm_first, bias, attention),
                 num_layers, final_norm, seed);
           },
           "d_model"_a, "nhead"_a, "dim_feedforward"_a, "dropout"_a, "activation"_a,
           "layer_norm_eps"_a, "batch_first"_a, "norm_first"_a, "bias"_a, "num_layers"_a,
           "final_norm"_a, "attention"_a = nb::none(), "seed"_a = nb::none())
      .def("prune_heads", &heads::TransformerEncoder::prune_heads, "heads_by_layer"_a)
      .def("forward", &encoder_forward<heads::TransformerEncoder, heads::EncoderTape>, "src"_a,
           "mask"_a = nb::none(), "src_key_padding_mask"_a = nb::none(), "is_causal"_a = false,
           "torch_out"_a = false, "tape"_a = nb::none())
      .def("backward", &module_backward<heads::TransformerEncoder, heads::EncoderTape>,
           "tape"_a, "grad_output"_a, "torch_out"_a = false);
}

void bind_adamw(nb::module_& m) {
  nb::class_<heads::AdamW>(m, "AdamW")
      .def("__init__",
           [](heads::AdamW* self, const Items& params, double lr,
              double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool maximize) {
             heads::AdamWOptions o{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize};
             new (self) heads::AdamW(from_items(params), o);
           },
           "params"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "amsgrad"_a, "maximize"_a)
      .def("step",
           [](heads::AdamW& s, const Items& grads) {
             const heads::StateDict g = from_items(grads);
             nb::gil_scoped_release release;
             s.step(g);
           },
           "grads"_a)
      .def_prop_ro("steps", &heads::AdamW::steps)
      .def_prop_rw("lr", [](const heads::AdamW& s) { return s.options().lr; }, &heads::AdamW::set_lr);
}

}  // namespace

void bind_modules(nb::module_& m) {
  nb::class_<heads::MhaTape>(m, "MhaTape").def(nb::init<>()).def_prop_ro("defined", &heads::MhaTape::defined);
  nb::class_<heads::EncoderLayerTape>(m, "EncoderLayerTape")
      .def(nb::init<>())
      .def_prop_ro("defined", &heads::EncoderLayerTape::defined);
  nb::class_<heads::EncoderTape>(m, "EncoderTape").def(nb::init<>()).def_prop_ro("defined", &heads::EncoderTape::defined);

  bind_mha(m);
  bind_encoders(m);
  bind_adamw(m);
}

}  // namespace heads::py
