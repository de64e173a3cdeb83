// bind_functional.cc — threads, seeds, sdpa (inference and the training pair that heads.torch
// uses) and the functional ops' backward passes.
#include "convert.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <type_traits>

#include "heads/linear_attention.h"
#include "heads/ops.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"

namespace heads::py {

using namespace nb::literals;

namespace {

// The position and score modifiers by name, as heads/functional.py's _mods gives them: a dict with any
// of the SdpaOptions fields below (those left out keep their defaults).
using Mods = nb::dict;

void apply_mods(const std::optional<Mods>& mods, SdpaOptions& o) {
  if (!mods) return;
  for_each_option(*mods, [&](const std::string& key, nb::handle value) {
    const auto as = [&](auto* field) {
      *field = option_value<std::remove_pointer_t<decltype(field)>>("sdpa: modifier", key, value);
    };
    const auto array = [&](Tensor* field) {
      *field = opt_view(option_value<std::optional<InArray>>("sdpa: modifier", key, value), key.c_str());
    };
    if (key == "window_left") as(&o.window_left);
    else if (key == "window_right") as(&o.window_right);
    else if (key == "softcap") as(&o.softcap);
    else if (key == "alibi_slopes") array(&o.alibi_slopes);
    else if (key == "relative_attention_bias") array(&o.relative_attention_bias);
    else if (key == "relative_attention_max_distance") as(&o.relative_attention_max_distance);
    else if (key == "relative_attention_bidirectional") as(&o.relative_attention_bidirectional);
    else if (key == "sinks") array(&o.sinks);
    else if (key == "block_mask") array(&o.block_mask);
    else if (key == "block_size") as(&o.block_size);
    else if (key == "head_mask") array(&o.head_mask);
    else if (key == "k_scale") array(&o.k_scale);
    else if (key == "v_scale") array(&o.v_scale);
    else fail("sdpa: unknown modifier '", key, "'");
  });
}

heads::LinearAttentionOptions linear_options(const std::string& fm, bool causal, double eps,
                                             const std::optional<InArray>& key_padding_mask) {
  heads::LinearAttentionOptions o;
  o.feature_map = heads::feature_map_from_name(fm);
  o.causal = causal;
  o.eps = eps;
  o.key_padding_mask = opt_view(key_padding_mask, "key_padding_mask");
  if (o.key_padding_mask.defined() && o.key_padding_mask.dim() == 1) o.key_padding_mask = o.key_padding_mask.unsqueeze(0);
  return o;
}

// The options every sdpa binding takes, as torch names them (plus the bottom-right causal alignment
// and the modifiers).
SdpaOptions sdpa_options(const std::optional<InArray>& attn_mask, double dropout_p, bool is_causal,
                         bool causal_lower_right, std::optional<double> scale, bool enable_gqa,
                         const std::optional<Mods>& mods) {
  SdpaOptions o;
  apply_mods(mods, o);
  o.attn_mask = opt_view(attn_mask, "attn_mask");
  o.dropout_p = dropout_p;
  o.is_causal = is_causal;
  o.causal_align = causal_lower_right ? CausalAlign::BottomRight : CausalAlign::TopLeft;
  o.scale = scale;
  o.enable_gqa = enable_gqa;
  return o;
}

nb::object sdpa(const InArray& query, const InArray& key, const InArray& value,
                const std::optional<InArray>& attn_mask, double dropout_p, bool is_causal,
                std::optional<double> scale, bool enable_gqa, bool need_weights,
                std::optional<uint64_t> seed, bool torch_out, bool causal_lower_right,
                const std::optional<Mods>& mods) {
  const heads::Tensor q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  const int64_t rank = q.dim();
  HEADS_CHECK(k.dim() == rank && v.dim() == rank, "sdpa: query ", q.shape(), ", key ", k.shape(),
              " and value ", v.shape(), " must have the same rank");
  heads::SdpaOptions o = sdpa_options(attn_mask, dropout_p, is_causal, causal_lower_right, scale, enable_gqa, mods);
  o.dropout_seed = seed;
  o.need_weights = need_weights;
  for (Tensor* s : {&o.k_scale, &o.v_scale}) {  // [..., Lk] with the key's leading dims, as [B, Hkv, Lk]
    while (s->defined() && s->dim() < 3) *s = s->unsqueeze(0);
  }
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

// Training support for heads.torch: forward keeping (out, lse, seed), and the backward.
void bind_sdpa_training(nb::module_& m) {
  m.def("sdpa_train_forward",
        [](const InArray& query, const InArray& key, const InArray& value, const std::optional<InArray>& attn_mask,
           double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, bool causal_lower_right,
           const std::optional<Mods>& mods) {
          const heads::SdpaOptions o =
              sdpa_options(attn_mask, dropout_p, is_causal, causal_lower_right, scale, enable_gqa, mods);
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
        "is_causal"_a = false, "scale"_a = nb::none(), "enable_gqa"_a = false, "causal_lower_right"_a = false,
        "mods"_a = nb::none());
  m.def("sdpa_train_backward",
        [](const InArray& dout, const InArray& query, const InArray& key, const InArray& value,
           const InArray& out, const InArray& lse, uint64_t seed, const std::optional<InArray>& attn_mask,
           double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, bool mask_grad,
           bool causal_lower_right, const std::optional<Mods>& mods, bool partial_keys) {
          heads::SdpaOptions o =
              sdpa_options(attn_mask, dropout_p, is_causal, causal_lower_right, scale, enable_gqa, mods);
          o.partial_keys = partial_keys;
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
                                to_array(r.dmask, true), to_array(r.dsinks, true),
                                to_array(r.drelative_attention_bias, true));
        },
        "dout"_a, "query"_a, "key"_a, "value"_a, "out"_a, "lse"_a, "seed"_a, "attn_mask"_a = nb::none(),
        "dropout_p"_a = 0.0, "is_causal"_a = false, "scale"_a = nb::none(), "enable_gqa"_a = false,
        "mask_grad"_a = false, "causal_lower_right"_a = false, "mods"_a = nb::none(), "partial_keys"_a = false);
  // Blockwise / ring attention: (out, lse) over the union of two key sets, as new tensors.
  m.def("sdpa_merge",
        [](const InArray& out, const InArray& lse, const InArray& out_b, const InArray& lse_b) {
          const heads::Tensor o4 = to_4d(view_of(out, "out"), "out");
          const heads::Tensor o = o4.to(heads::DType::F32).clone();  // never the caller's memory
          const heads::Shape rows{o.size(0), o.size(1), o.size(2)};
          auto rows_of = [&](const InArray& a, const char* name) {
            const heads::Tensor t = view_of(a, name);
            HEADS_CHECK(t.numel() == rows[0] * rows[1] * rows[2], "sdpa_merge: ", name, ": expected ", rows,
                        " (the rows of out ", o4.shape(), "), got ", t.shape());
            return t.reshape(rows);
          };
          const heads::Tensor l = rows_of(lse, "lse").to(heads::DType::F32).clone();
          const heads::Tensor lb = rows_of(lse_b, "lse_b");
          const heads::Tensor ob = to_4d(view_of(out_b, "out_b"), "out_b");
          {
            nb::gil_scoped_release release;
            heads::sdpa_merge_(o, l, ob, lb);
          }
          return nb::make_tuple(to_array(o, true), to_array(l, true));
        },
        "out"_a, "lse"_a, "out_b"_a, "lse_b"_a);
}

// Backward passes of the functional ops (numpy in / numpy out), for training code and tests.
void bind_op_backwards(nb::module_& m) {
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
}

}  // namespace

void bind_functional(nb::module_& m) {
  m.def("set_num_threads", &heads::set_num_threads, "n"_a);
  m.def("get_num_threads", &heads::get_num_threads);
  m.def("set_batch_invariant", &heads::set_batch_invariant, "on"_a);
  m.def("is_batch_invariant", &heads::batch_invariant);
  m.def("manual_seed", &heads::manual_seed, "seed"_a);
  m.def("sdpa", &sdpa, "query"_a, "key"_a, "value"_a, "attn_mask"_a = nb::none(),
        "dropout_p"_a = 0.0, "is_causal"_a = false, "scale"_a = nb::none(),
        "enable_gqa"_a = false, "need_weights"_a = false, "seed"_a = nb::none(),
        "torch_out"_a = false, "causal_lower_right"_a = false, "mods"_a = nb::none());
  m.def("linear_attention",
        [](const InArray& q, const InArray& k, const InArray& v, const std::string& fm, bool causal, double eps,
           bool torch_out, const std::optional<InArray>& key_padding_mask) {
          const heads::LinearAttentionOptions o = linear_options(fm, causal, eps, key_padding_mask);
          const char* op = "linear_attention";
          const heads::Tensor qt = to_4d(view_of(q, "query"), "query", op), kt = to_4d(view_of(k, "key"), "key", op),
                             vt = to_4d(view_of(v, "value"), "value", op);
          heads::Tensor out;
          {
            nb::gil_scoped_release release;
            out = heads::linear_attention(qt, kt, vt, o);
          }
          return to_array(out, torch_out);
        },
        "query"_a, "key"_a, "value"_a, "feature_map"_a = "elu", "causal"_a = false, "eps"_a = 1e-6,
        "torch_out"_a = false, "key_padding_mask"_a = nb::none());
  m.def("linear_attention_backward",
        [](const InArray& g, const InArray& q, const InArray& k, const InArray& v, const std::string& fm, bool causal,
           double eps, const std::optional<InArray>& key_padding_mask) {
          const heads::LinearAttentionOptions o = linear_options(fm, causal, eps, key_padding_mask);
          const char* op = "linear_attention_backward";
          const heads::Tensor gt = to_4d(view_of(g, "dout"), "dout", op), qt = to_4d(view_of(q, "query"), "query", op),
                             kt = to_4d(view_of(k, "key"), "key", op), vt = to_4d(view_of(v, "value"), "value", op);
          heads::LinearAttentionGrads r;
          {
            nb::gil_scoped_release release;
            r = heads::linear_attention_backward(gt, qt, kt, vt, o);
          }
          return nb::make_tuple(to_array(r.dq, true), to_array(r.dk, true), to_array(r.dv, true));
        },
        "dout"_a, "query"_a, "key"_a, "value"_a, "feature_map"_a = "elu", "causal"_a = false, "eps"_a = 1e-6,
        "key_padding_mask"_a = nb::none());
  m.def("alibi_slopes", [](int64_t num_heads) { return to_numpy(heads::alibi_slopes(num_heads)); }, "num_heads"_a);
  m.def("t5_relative_bucket", &heads::t5_relative_bucket, "relative_position"_a, "bidirectional"_a, "num_buckets"_a,
        "max_distance"_a);
  bind_sdpa_training(m);
  bind_op_backwards(m);
}

}  // namespace heads::py
