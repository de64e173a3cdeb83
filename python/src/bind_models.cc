// bind_models.cc — the WordPiece tokenizer, the sentence encoder (all-MiniLM-L6-v2 and other
// sentence-transformers BERT-family models) and the cross-encoder (rerankers).
#include "convert.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>

#include "heads/cross_encoder.h"
#include "heads/precision.h"
#include "heads/quantize.h"
#include "heads/sentence_encoder.h"
#include "heads/tokenizer.h"

namespace heads::py {

using namespace nb::literals;

void bind_models(nb::module_& m) {
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

  // Texts arrive as UTF-8 bytes or str (nanobind converts str to UTF-8).
  using Enc = heads::Tokenizer::Encoding;
  const auto encoding = [](const Enc& e) {
    nb::dict d;
    d["ids"] = e.ids;
    d["type_ids"] = e.type_ids;
    d["truncated"] = e.truncated;
    return d;
  };
  nb::class_<heads::Tokenizer>(m, "Tokenizer")
      .def_static("from_file", &heads::Tokenizer::from_file, "path"_a)
      .def_static("from_directory", &heads::Tokenizer::from_directory, "dir"_a)
      .def(
          "encode",
          [encoding](const heads::Tokenizer& t, const std::string& text, int64_t max_length, bool add_special_tokens) {
            Enc e;
            {
              nb::gil_scoped_release release;
              e = t.encode(text, max_length, add_special_tokens);
            }
            return encoding(e);
          },
          "text"_a, "max_length"_a = 0, "add_special_tokens"_a = true)
      .def(
          "encode_pair",
          [encoding](const heads::Tokenizer& t, const std::string& a, const std::string& b, int64_t max_length) {
            Enc e;
            {
              nb::gil_scoped_release release;
              e = t.encode_pair(a, b, max_length);
            }
            return encoding(e);
          },
          "a"_a, "b"_a, "max_length"_a = 0)
      .def("decode", &heads::Tokenizer::decode, "ids"_a, "skip_special_tokens"_a = true)
      .def("token", &heads::Tokenizer::token, "id"_a)
      .def("id", &heads::Tokenizer::id, "token"_a)
      .def_prop_ro("vocab_size", &heads::Tokenizer::vocab_size)
      .def_prop_ro("pad_id", &heads::Tokenizer::pad_id);

  m.def(
      "quantize",
      [](const std::string& model_dir, const std::string& out_dir, const std::string& dtype) {
        heads::QuantizeResult r;
        {
          nb::gil_scoped_release release;
          r = heads::quantize_model_dir(model_dir, out_dir, heads::storage_dtype_from_name(dtype));
        }
        nb::dict d;
        d["tensors"] = r.tensors;
        d["converted"] = r.converted;
        d["bytes_in"] = r.bytes_in;
        d["bytes_out"] = r.bytes_out;
        return d;
      },
      "model_dir"_a, "out_dir"_a, "dtype"_a = "int8");

  nb::class_<heads::SentenceEncoder>(m, "SentenceEncoder")
      .def_static(
          "load",
          [](const std::string& dir, const std::string& dtype) {
            return heads::SentenceEncoder::load(
                dir, dtype == "auto" ? std::nullopt : std::optional(heads::precision_from_name(dtype)));
          },
          "model_dir"_a, "dtype"_a = "auto")
      .def_prop_ro("dtype", [](const heads::SentenceEncoder& s) { return heads::precision_name(s.precision()); })
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

  nb::class_<heads::CrossEncoder>(m, "CrossEncoder")
      .def_static(
          "load",
          [](const std::string& dir, const std::string& dtype) {
            return heads::CrossEncoder::load(
                dir, dtype == "auto" ? std::nullopt : std::optional(heads::precision_from_name(dtype)));
          },
          "model_dir"_a, "dtype"_a = "auto")
      .def_prop_ro("dtype", [](const heads::CrossEncoder& c) { return heads::precision_name(c.precision()); })
      .def("predict",
           [](const heads::CrossEncoder& c, const std::vector<heads::CrossEncoder::Pair>& pairs,
              const std::string& activation, int64_t batch_size) {
             const heads::ScoreActivation act = heads::score_activation_from_name(activation);
             heads::Tensor out;
             int64_t truncated = 0;
             {
               nb::gil_scoped_release release;
               out = c.predict(pairs, act, batch_size, {}, &truncated);
             }
             return nb::make_tuple(to_numpy(out), truncated);
           },
           "pairs"_a, "activation"_a = "identity", "batch_size"_a = 32)
      .def("tokenize",
           [](const heads::CrossEncoder& c, const std::string& a, const std::string& b) {
             const auto e = c.tokenizer().encode_pair(a, b, c.max_length());
             return nb::make_tuple(e.ids, e.type_ids);
           },
           "a"_a, "b"_a)
      .def_prop_ro("num_labels", &heads::CrossEncoder::num_labels)
      .def_prop_ro("max_length", &heads::CrossEncoder::max_length)
      .def_prop_ro("model_dir", &heads::CrossEncoder::model_dir);
}

}  // namespace heads::py
