#include "parallel_step.h"

#include <algorithm>
#include <atomic>
#include <thread>

namespace megatron_adam {

namespace {

// Threads claim chunks of kChunk elements as they finish the last one, so a thread the OS holds
// back does less of the step instead of a fixed share; with fewer chunks than threads, starting
// a thread costs more than it saves. Chunks are cut on 64-byte (kBlock) boundaries of each tensor,
// so two threads never write one cache line.
constexpr size_t kBlock = 16;
constexpr size_t kChunk = 1 << 16;

size_t padded(size_t count) { return (count + kBlock - 1) / kBlock * kBlock; }

// Updates elements [lo, hi) of one tensor; those from tail_start on take torch's scalar-loop rounding.
void update_range(const AdamScalars& s, const TensorRuns& t, size_t lo, size_t hi, size_t tail_start)
{
    const size_t split = std::clamp(tail_start, lo, hi);
    if (lo < split) adam_update(s, t.param + lo, t.grad + lo, t.exp_avg + lo, t.exp_avg_sq + lo, split - lo);
    if (split < hi)
        adam_update_tail(s, t.param + split, t.grad + split, t.exp_avg + split, t.exp_avg_sq + split, hi - split);
}

// The tensors laid end to end, each padded to whole blocks (the padding holds no elements).
class Layout {
public:
    explicit Layout(const std::vector<TensorRuns>& tensors) : tensors_(tensors)
    {
        starts_.reserve(tensors.size() + 1);
        starts_.push_back(0);
        for (const TensorRuns& t : tensors) starts_.push_back(starts_.back() + padded(t.count));
    }

    size_t total() const { return starts_.back(); }

    // Updates the elements in [begin, end) of the laid-out index space.
    void run(const AdamScalars& s, size_t tail_width, size_t begin, size_t end) const
    {
        size_t i = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
        for (; i < tensors_.size() && starts_[i] < end; ++i) {
            const TensorRuns& t = tensors_[i];
            const size_t lo = std::max(begin, starts_[i]) - starts_[i];
            const size_t hi = std::min(end - starts_[i], t.count);
            if (lo < hi) update_range(s, t, lo, hi, t.count - t.count % tail_width);
        }
    }

private:
    const std::vector<TensorRuns>& tensors_;
    std::vector<size_t> starts_;
};

}  // namespace

void parallel_adam_step(const AdamScalars& scalars, const std::vector<TensorRuns>& tensors, unsigned num_threads,
                        size_t tail_width)
{
    const Layout layout(tensors);
    const size_t chunks = (layout.total() + kChunk - 1) / kChunk;
    std::atomic<size_t> next_chunk{0};
    auto work = [&] {
        for (size_t c = next_chunk++; c < chunks; c = next_chunk++)
            layout.run(scalars, tail_width, c * kChunk, (c + 1) * kChunk);
    };
    std::vector<std::thread> workers;
    for (size_t i = 1; i < std::min<size_t>(num_threads, chunks); ++i) workers.emplace_back(work);
    work();
    for (std::thread& worker : workers) worker.join();
}

}  // namespace megatron_adam
