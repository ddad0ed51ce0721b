// One Linux native AIO context, driven through the raw system calls so that no libaio is needed.
#pragma once

#include <linux/aio_abi.h>

namespace megatron_aio {

class AioContext {
public:
    explicit AioContext(unsigned max_events);  // throws std::system_error
    ~AioContext();
    AioContext(const AioContext&) = delete;
    AioContext& operator=(const AioContext&) = delete;

    unsigned capacity() const { return capacity_; }
    // Both return the count handled, or -errno.
    long submit(long count, struct iocb** iocbs);
    long get_events(long min_nr, long max_nr, struct io_event* events);

private:
    aio_context_t ctx_ = 0;
    unsigned capacity_;
};

}  // namespace megatron_aio
