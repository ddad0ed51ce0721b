// A float32 matrix transposed into another buffer, with zero columns appended (see transpose_kernel.cpp).
#pragma once

#include <cstddef>

namespace megatron_transpose {

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, 0 for rows <= r < padded_rows;
// c < cols. The two buffers must not overlap.
void transpose_padded(const float* src, size_t src_stride, float* dst, size_t dst_stride, size_t rows,
                      size_t padded_rows, size_t cols);

}  // namespace megatron_transpose
