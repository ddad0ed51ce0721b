// One optimizer step over many tensors, handed out in chunks to a few threads.
#pragma once

#include <cstddef>
#include <vector>

#include "adam_kernel.h"

namespace megatron_adam {

// The four same-sized fp32 runs of one parameter; the addresses come from tensor.data_ptr().
struct TensorRuns {
    float* param;
    const float* grad;
    float* exp_avg;
    float* exp_avg_sq;
    size_t count;
};

// Updates every element of every tensor on up to num_threads threads (the calling thread is one
// of them; small steps stay on it). The last (count % tail_width) elements of each tensor take
// adam_update_tail, as in torch's fused kernel (tail_width 8 for its AVX2 and AVX-512 builds).
void parallel_adam_step(const AdamScalars& scalars, const std::vector<TensorRuns>& tensors, unsigned num_threads,
                        size_t tail_width);

}  // namespace megatron_adam
