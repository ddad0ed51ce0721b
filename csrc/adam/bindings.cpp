// Python binding of the CPU Adam step. Tensors arrive as addresses from
// megatron/runtime/optim/cpu_adam.py, which checks dtype, device, layout and sizes, so this
// extension needs no torch headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adam_kernel.h"
#include "parallel_step.h"

namespace py = pybind11;
using namespace megatron_adam;

namespace {

// Lists of addresses and element counts, one entry per parameter tensor.
struct Addresses {
    std::vector<uintptr_t> params, grads, exp_avgs, exp_avg_sqs;
    std::vector<size_t> counts;
};

void adam_step(const Addresses& a, double lr, double beta1, double beta2, double eps, double weight_decay,
               double step, bool bias_correction, bool adamw_mode, unsigned num_threads, size_t tail_width)
{
    const size_t n = a.counts.size();
    if (a.params.size() != n || a.grads.size() != n || a.exp_avgs.size() != n || a.exp_avg_sqs.size() != n)
        throw std::invalid_argument("adam_step needs one param, grad, exp_avg, exp_avg_sq address per count");
    if (step < 1) throw std::invalid_argument("adam_step needs step >= 1, got " + std::to_string(step));
    if (tail_width < 1) throw std::invalid_argument("adam_step needs tail_width >= 1");
    std::vector<TensorRuns> tensors;
    tensors.reserve(n);
    for (size_t i = 0; i < n; ++i)
        tensors.push_back({reinterpret_cast<float*>(a.params[i]), reinterpret_cast<const float*>(a.grads[i]),
                           reinterpret_cast<float*>(a.exp_avgs[i]), reinterpret_cast<float*>(a.exp_avg_sqs[i]),
                           a.counts[i]});
    const AdamScalars scalars = make_scalars(lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode);
    py::gil_scoped_release release;
    parallel_adam_step(scalars, tensors, num_threads, tail_width);
}

}  // namespace

PYBIND11_MODULE(_cpu_adam, m)
{
    m.doc() = "Multi-threaded fp32 Adam/AdamW step on host memory (see megatron/runtime/optim/cpu_adam.py).";
    m.def(
        "adam_step",
        [](std::vector<uintptr_t> params, std::vector<uintptr_t> grads, std::vector<uintptr_t> exp_avgs,
           std::vector<uintptr_t> exp_avg_sqs, std::vector<size_t> counts, double lr, double beta1, double beta2,
           double eps, double weight_decay, double step, bool bias_correction, bool adamw_mode,
           unsigned num_threads, size_t tail_width) {
            adam_step({std::move(params), std::move(grads), std::move(exp_avgs), std::move(exp_avg_sqs),
                       std::move(counts)},
                      lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode, num_threads, tail_width);
        },
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("counts"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("bias_correction"), py::arg("adamw_mode"), py::arg("num_threads"), py::arg("tail_width"));
}
