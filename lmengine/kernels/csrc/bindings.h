// What every binding of the compiled kernels shares.
#pragma once

#include <torch/extension.h>

// Each kernel runs with the GIL released, as torch's own operators do. A prefill step spends
// most of its time in these calls (the packed GEMMs, attention); holding the GIL through them
// kept a server's event loop and tokenizer threads from running until the step ended.
using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
