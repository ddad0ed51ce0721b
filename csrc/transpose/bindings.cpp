// Python binding of the padded transpose. Tensors arrive as addresses from
// megatron/ops/transpose.py, which checks dtype, device, layout and sizes, so this extension needs
// no torch headers.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "transpose_kernel.h"

namespace py = pybind11;

PYBIND11_MODULE(_transpose, m)
{
    m.doc() = "A float32 matrix transposed with zero columns appended (see megatron/ops/transpose.py).";
    m.def(
        "transpose_padded",
        [](uintptr_t src, size_t src_stride, uintptr_t dst, size_t dst_stride, size_t rows, size_t padded_rows,
           size_t cols) {
            if (padded_rows < rows || dst_stride < padded_rows || src_stride < cols)
                throw std::invalid_argument("transpose_padded needs rows <= padded_rows <= dst_stride and cols <= src_stride");
            megatron_transpose::transpose_padded(reinterpret_cast<const float*>(src), src_stride,
                                                 reinterpret_cast<float*>(dst), dst_stride, rows, padded_rows, cols);
        },
        py::arg("src"), py::arg("src_stride"), py::arg("dst"), py::arg("dst_stride"), py::arg("rows"),
        py::arg("padded_rows"), py::arg("cols"));
}
