// heads_ext.cc — the nanobind extension `heads._heads`: its parts by what they bind
// (bind_functional.cc, bind_modules.cc, bind_models.cc, bind_decoder.cc), arrays through convert.h.
//
// Arrays arrive through DLPack (numpy, torch, ...) and become heads::Tensor views without a copy;
// results leave as numpy arrays (or torch tensors) that own the result tensor's storage.
// heads::Error becomes ValueError. The computation runs with the GIL released.
#include "convert.h"

#include <nanobind/nanobind.h>

#include <exception>

#include "heads/error.h"

namespace nb = nanobind;

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
  heads::py::bind_functional(m);
  heads::py::bind_modules(m);
  heads::py::bind_models(m);
  heads::py::bind_decoder(m);
}
