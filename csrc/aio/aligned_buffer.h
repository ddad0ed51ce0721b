// Page-aligned host memory: O_DIRECT needs buffer addresses, offsets and lengths on this boundary.
#pragma once

#include <cstddef>

namespace megatron_aio {

constexpr size_t kAlignment = 4096;
// Buffers of at least this size start on a 2 MiB boundary and ask for transparent huge pages.
constexpr size_t kHugePage = 2u << 20;

inline size_t align_down(size_t value) { return value / kAlignment * kAlignment; }
inline size_t align_up(size_t value) { return align_down(value + kAlignment - 1); }

class AlignedBuffer {
public:
    // At least one page so that empty tensors still get a valid address; locked buffers are
    // mlock'd so the kernel never pages them out between transfers.
    //
    // Buffers of kHugePage bytes or more are mapped on a 2 MiB boundary with MADV_HUGEPAGE, so that
    // their memory is physically contiguous in 2 MiB pieces. A direct-I/O request can hold only so
    // many discontiguous pieces (a virtio disk: 254 pages), so a 1 MiB request into scattered 4 KiB
    // pages is split in two and adjacent requests cannot be merged; with huge pages every request
    // reaches the disk whole and neighbours merge (see docs/benchmarks.md, async-I/O section). Where
    // the kernel has no huge pages to give, the buffer simply keeps 4 KiB pages.
    AlignedBuffer(size_t nbytes, bool lock);  // throws std::bad_alloc
    ~AlignedBuffer();
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;

    char* data() const { return data_; }
    size_t size() const { return size_; }
    bool locked() const { return locked_; }

private:
    char* data_ = nullptr;
    size_t size_;
    bool locked_ = false;
    bool mapped_ = false;  // from mmap (freed with munmap), else from posix_memalign
};

}  // namespace megatron_aio
