// One Adam/AdamW update over a contiguous run of fp32 elements, with torch's arithmetic.
#pragma once

#include <cstddef>

namespace megatron_adam {

// The per-step constants, computed in double as torch does and rounded to float once.
struct AdamScalars {
    bool adamw;                  // decoupled decay (AdamW) or L2 decay added to the gradient (Adam)
    float param_decay;           // AdamW: 1 - lr * weight_decay, else 1
    float grad_decay;            // Adam: weight_decay, else 0
    bool lerp_small;             // torch's lerp takes another formula when |1 - beta1| >= 0.5
    float lerp_coeff;            // 1 - beta1, or -beta1 for the other formula
    float beta2;
    float grad_sq_coeff;         // 1 - beta2
    float bias_correction2_sqrt;
    float eps;
    float neg_step_size;         // -lr / bias_correction1
};

// step counts from 1; without bias correction both corrections are 1, as in DeepSpeed's CPU Adam.
AdamScalars make_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                         bool bias_correction, bool adamw);

// Updates param, exp_avg and exp_avg_sq in place from grad; the four runs must not overlap.
// adam_update rounds like the vector loops of torch's fused CPU kernel, adam_update_tail like its
// scalar loop over the last elements of a tensor: the two differ in where exp_avg_sq's fused
// multiply-add sits.
void adam_update(const AdamScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                 size_t count);
void adam_update_tail(const AdamScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                      size_t count);

}  // namespace megatron_adam
