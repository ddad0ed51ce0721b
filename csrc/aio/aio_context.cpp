#include "aio_context.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace megatron_aio {

AioContext::AioContext(unsigned max_events) : capacity_(max_events)
{
    if (syscall(SYS_io_setup, max_events, &ctx_) != 0)
        throw std::system_error(errno, std::generic_category(), "io_setup");
}

AioContext::~AioContext() { syscall(SYS_io_destroy, ctx_); }

long AioContext::submit(long count, struct iocb** iocbs)
{
    long rc;
    do {
        rc = syscall(SYS_io_submit, ctx_, count, iocbs);
    } while (rc < 0 && errno == EINTR);
    return rc < 0 ? -errno : rc;
}

long AioContext::get_events(long min_nr, long max_nr, struct io_event* events)
{
    long rc;
    do {
        rc = syscall(SYS_io_getevents, ctx_, min_nr, max_nr, events, nullptr);
    } while (rc < 0 && errno == EINTR);
    return rc < 0 ? -errno : rc;
}

}  // namespace megatron_aio
