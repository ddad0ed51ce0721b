// The experts' weight gradients need each expert's activations as a contiguous [K, rows] matrix
// (megatron/model/moe/experts.py). On the development VM torch's transposing copy takes 1.1-2.0 ms
// for a 512 x 2048 block; 8 x 8 tiles transposed in AVX2 registers, written a row of tiles at a
// time, take 0.62 ms (docs/benchmarks.md). CPUs without AVX2 take the same tiles element by element.
#include "transpose_kernel.h"

#include <immintrin.h>

#include <algorithm>

namespace megatron_transpose {
namespace {

constexpr size_t kTile = 8;

void transpose_tile_scalar(const float* src, size_t src_stride, float* dst, size_t dst_stride, size_t rows,
                           size_t cols)
{
    for (size_t c = 0; c < cols; ++c)
        for (size_t r = 0; r < rows; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
}

__attribute__((target("avx2"))) void transpose_tile_avx2(const float* src, size_t src_stride, float* dst,
                                                         size_t dst_stride)
{
    __m256 row[kTile], half[kTile], quad[kTile];
    for (size_t r = 0; r < kTile; ++r) row[r] = _mm256_loadu_ps(src + r * src_stride);
    for (size_t r = 0; r < kTile; r += 2) {
        half[r] = _mm256_unpacklo_ps(row[r], row[r + 1]);
        half[r + 1] = _mm256_unpackhi_ps(row[r], row[r + 1]);
    }
    for (size_t r = 0; r < kTile; r += 4) {
        quad[r] = _mm256_shuffle_ps(half[r], half[r + 2], _MM_SHUFFLE(1, 0, 1, 0));
        quad[r + 1] = _mm256_shuffle_ps(half[r], half[r + 2], _MM_SHUFFLE(3, 2, 3, 2));
        quad[r + 2] = _mm256_shuffle_ps(half[r + 1], half[r + 3], _MM_SHUFFLE(1, 0, 1, 0));
        quad[r + 3] = _mm256_shuffle_ps(half[r + 1], half[r + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (size_t c = 0; c < 4; ++c) {
        _mm256_storeu_ps(dst + c * dst_stride, _mm256_permute2f128_ps(quad[c], quad[c + 4], 0x20));
        _mm256_storeu_ps(dst + (c + 4) * dst_stride, _mm256_permute2f128_ps(quad[c], quad[c + 4], 0x31));
    }
}

template <bool kAvx2>
void transpose_all(const float* src, size_t src_stride, float* dst, size_t dst_stride, size_t rows,
                   size_t padded_rows, size_t cols)
{
    for (size_t c0 = 0; c0 < cols; c0 += kTile) {
        const size_t tile_cols = std::min(kTile, cols - c0);
        for (size_t r0 = 0; r0 < rows; r0 += kTile) {
            const size_t tile_rows = std::min(kTile, rows - r0);
            const float* from = src + r0 * src_stride + c0;
            float* to = dst + c0 * dst_stride + r0;
            if (kAvx2 && tile_rows == kTile && tile_cols == kTile)
                transpose_tile_avx2(from, src_stride, to, dst_stride);
            else
                transpose_tile_scalar(from, src_stride, to, dst_stride, tile_rows, tile_cols);
        }
        for (size_t c = c0; c < c0 + tile_cols; ++c)
            std::fill(dst + c * dst_stride + rows, dst + c * dst_stride + padded_rows, 0.0f);
    }
}

}  // namespace

void transpose_padded(const float* src, size_t src_stride, float* dst, size_t dst_stride, size_t rows,
                      size_t padded_rows, size_t cols)
{
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2)
        transpose_all<true>(src, src_stride, dst, dst_stride, rows, padded_rows, cols);
    else
        transpose_all<false>(src, src_stride, dst, dst_stride, rows, padded_rows, cols);
}

}  // namespace megatron_transpose
