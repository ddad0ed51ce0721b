#include "aligned_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <new>

namespace megatron_aio {

AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock) : size_(align_up(nbytes ? nbytes : 1))
{
    void* memory = nullptr;
    if (posix_memalign(&memory, kAlignment, size_) != 0) throw std::bad_alloc();
    data_ = static_cast<char*>(memory);
    // A failed mlock (RLIMIT_MEMLOCK without CAP_IPC_LOCK) only costs speed, so the buffer stays
    // usable and locked() reports it.
    locked_ = lock && mlock(data_, size_) == 0;
}

AlignedBuffer::~AlignedBuffer()
{
    if (locked_) munlock(data_, size_);
    std::free(data_);
}

}  // namespace megatron_aio
