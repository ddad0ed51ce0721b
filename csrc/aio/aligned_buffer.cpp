#include "aligned_buffer.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <new>

namespace megatron_aio {

namespace {

// size bytes starting on a kHugePage boundary: map kHugePage more than needed, then unmap the
// unaligned head and the unused tail.
char* map_huge_aligned(size_t size)
{
    const size_t reserved = size + kHugePage;
    void* memory = mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) throw std::bad_alloc();
    char* const start = static_cast<char*>(memory);
    const uintptr_t address = reinterpret_cast<uintptr_t>(start);
    char* const aligned = start + ((kHugePage - address % kHugePage) % kHugePage);
    if (aligned > start) munmap(start, static_cast<size_t>(aligned - start));
    char* const end = aligned + size;
    if (start + reserved > end) munmap(end, static_cast<size_t>(start + reserved - end));
    // Only a hint: kernels without transparent huge pages (or with them turned off) refuse it.
    madvise(aligned, size, MADV_HUGEPAGE);
    return aligned;
}

}  // namespace

AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock) : size_(align_up(nbytes ? nbytes : 1))
{
    if (size_ >= kHugePage) {
        data_ = map_huge_aligned(size_);
        mapped_ = true;
    } else {
        void* memory = nullptr;
        if (posix_memalign(&memory, kAlignment, size_) != 0) throw std::bad_alloc();
        data_ = static_cast<char*>(memory);
    }
    // A failed mlock (RLIMIT_MEMLOCK without CAP_IPC_LOCK) only costs speed, so the buffer stays
    // usable and locked() reports it.
    locked_ = lock && mlock(data_, size_) == 0;
}

AlignedBuffer::~AlignedBuffer()
{
    if (locked_) munlock(data_, size_);
    if (mapped_)
        munmap(data_, size_);
    else
        std::free(data_);
}

}  // namespace megatron_aio
