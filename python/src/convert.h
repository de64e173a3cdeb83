// convert.h — arrays in and out of the extension: DLPack arrays (numpy, torch, ...) become
// heads::Tensor views without a copy; results leave as numpy arrays or torch tensors that own the
// result tensor's storage.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "heads/error.h"
#include "heads/mha.h"
#include "heads/tensor.h"

namespace heads::py {

namespace nb = nanobind;

using InArray = nb::ndarray<nb::ro, nb::device::cpu>;
using Items = std::vector<std::pair<std::string, InArray>>;  // a state dict from Python

// A view of the array's memory (the caller keeps the array alive while the view is used).
Tensor view_of(const InArray& a, const char* name);
Tensor opt_view(const std::optional<InArray>& a, const char* name);

// A tape outlives the forward call, and what it keeps must not view the caller's arrays: Python may
// free them, or torch reuse their memory, before the backward runs. Replaces each defined tensor by
// an owned copy; tensors that were views of the same memory (self-attention's query, key and value)
// share one copy, so they stay recognisably the same.
void own_for_tape(std::initializer_list<Tensor*> tensors);
// A numpy array (or torch tensor) owning a reference to the tensor's storage; None if undefined.
nb::object to_array(const Tensor& t, bool torch);
inline nb::object to_numpy(const Tensor& t) { return to_array(t, false); }
// torch-style leading batch dims: [L, D] -> [1, 1, L, D], [X, L, D] -> [1, X, L, D].
Tensor to_4d(Tensor t, const char* name, const char* op = "sdpa");
// One entry of options passed by name (a dict from the Python side: SDPA's modifiers, a module's
// attention variant) as T: a number, bool, string or optional array; a value of another kind is an
// error naming `what` and the key.
template <class T>
T option_value(const char* what, const std::string& key, nb::handle value) {
  try {
    return nb::cast<T>(value);
  } catch (const nb::cast_error&) {
    const char* kind = std::is_same_v<T, bool>                    ? "a bool"
                       : std::is_same_v<T, std::string>           ? "a string"
                       : std::is_same_v<T, std::optional<InArray>> ? "an array or None"
                                                                   : "a number";
    fail(what, " ", key, ": expected ", kind, ", got ", nb::cast<std::string>(nb::str(value.type())));
  }
}
// Calls f(key, value) for each entry of a dict of options, whose keys are strings.
template <class F>
void for_each_option(const nb::dict& d, F&& f) {
  for (const auto& [k, v] : d) f(nb::cast<std::string>(k), v);
}

// State dicts both ways.
nb::dict to_dict(const StateDict& sd, bool torch = false);
StateDict from_items(const Items& items);

// The parts of the module, by what they bind.
void bind_functional(nb::module_& m);  // threads, seeds, sdpa, the functional ops and their backward
void bind_modules(nb::module_& m);     // MultiheadAttention, the encoder modules, tapes, AdamW
void bind_models(nb::module_& m);      // the tokenizer and the sentence encoder
void bind_decoder(nb::module_& m);     // CausalLM, KVCache, RoPE, RMSNorm

}  // namespace heads::py
