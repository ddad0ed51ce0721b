// The element loop, written as scalar code that gcc vectorises once per instruction set:
// target_clones builds it for x86-64-v4 (AVX-512), v3 (AVX2 + FMA) and the baseline, and picks
// the widest the CPU has at load time (the baseline calls fmaf). The build passes -ffp-contract=off,
// so the only fused multiply-adds are the explicit ones below: they sit where gcc contracted
// torch 2.13's fused CPU Adam kernel, which makes our results bit-identical to
// torch.optim.AdamW(fused=True) (tests/test_cpu_adam.py checks it).
#include "adam_kernel.h"

#include <cmath>

#if defined(__x86_64__)
#define MEGATRON_ADAM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MEGATRON_ADAM_CLONES
#endif

namespace megatron_adam {

AdamScalars make_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                         bool bias_correction, bool adamw)
{
    const double bias_correction1 = bias_correction ? 1 - std::pow(beta1, step) : 1.0;
    const double bias_correction2 = bias_correction ? 1 - std::pow(beta2, step) : 1.0;
    const float lerp_weight = static_cast<float>(1 - beta1);
    AdamScalars s;
    // without weight decay both modes are one update; AdamW's path (times 1) leaves the gradient
    // untouched, as torch does, where fma(param, 0, grad) would turn an inf parameter into NaN
    s.adamw = adamw || weight_decay == 0;
    s.param_decay = adamw ? static_cast<float>(1 - lr * weight_decay) : 1.0f;
    s.grad_decay = adamw ? 0.0f : static_cast<float>(weight_decay);
    s.lerp_small = std::abs(lerp_weight) < 0.5f;
    s.lerp_coeff = s.lerp_small ? lerp_weight : lerp_weight - 1.0f;
    s.beta2 = static_cast<float>(beta2);
    s.grad_sq_coeff = static_cast<float>(1 - beta2);
    s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    s.eps = static_cast<float>(eps);
    s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
    return s;
}

namespace {

template <bool AdamW, bool Tail>
__attribute__((always_inline)) inline void update_loop(const AdamScalars& s, float* __restrict param,
                                                       const float* __restrict grad, float* __restrict exp_avg,
                                                       float* __restrict exp_avg_sq, size_t count)
{
    const float param_decay = s.param_decay, grad_decay = s.grad_decay, lerp_coeff = s.lerp_coeff;
    const bool lerp_small = s.lerp_small;
    const float beta2 = s.beta2, grad_sq_coeff = s.grad_sq_coeff, bias_correction2_sqrt = s.bias_correction2_sqrt;
    const float eps = s.eps, neg_step_size = s.neg_step_size;
    for (size_t i = 0; i < count; ++i) {
        const float p = param[i];
        const float g = AdamW ? grad[i] : __builtin_fmaf(p, grad_decay, grad[i]);
        const float m_old = exp_avg[i];
        // torch's lerp: m + w (g - m) for a small weight, else g + (w - 1)(g - m), one rounding
        const float m = __builtin_fmaf(lerp_coeff, g - m_old, lerp_small ? m_old : g);
        const float g_sq = grad_sq_coeff * g;
        const float v = Tail ? __builtin_fmaf(exp_avg_sq[i], beta2, g_sq * g)
                             : __builtin_fmaf(g_sq, g, exp_avg_sq[i] * beta2);
        const float denom = __builtin_sqrtf(v) / bias_correction2_sqrt + eps;
        const float update = neg_step_size * m / denom;
        param[i] = AdamW ? p * param_decay + update : p + update;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

MEGATRON_ADAM_CLONES void update_adamw(const AdamScalars& s, float* param, const float* grad, float* exp_avg,
                                       float* exp_avg_sq, size_t count)
{
    update_loop<true, false>(s, param, grad, exp_avg, exp_avg_sq, count);
}

MEGATRON_ADAM_CLONES void update_adam(const AdamScalars& s, float* param, const float* grad, float* exp_avg,
                                      float* exp_avg_sq, size_t count)
{
    update_loop<false, false>(s, param, grad, exp_avg, exp_avg_sq, count);
}

}  // namespace

void adam_update(const AdamScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                 size_t count)
{
    if (s.adamw)
        update_adamw(s, param, grad, exp_avg, exp_avg_sq, count);
    else
        update_adam(s, param, grad, exp_avg, exp_avg_sq, count);
}

void adam_update_tail(const AdamScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                      size_t count)
{
    if (s.adamw)
        update_loop<true, true>(s, param, grad, exp_avg, exp_avg_sq, count);
    else
        update_loop<false, true>(s, param, grad, exp_avg, exp_avg_sq, count);
}

}  // namespace megatron_adam
