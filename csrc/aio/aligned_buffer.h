// Page-aligned host memory: O_DIRECT needs buffer addresses, offsets and lengths on this boundary.
#pragma once

#include <cstddef>

namespace megatron_aio {

constexpr size_t kAlignment = 4096;

inline size_t align_down(size_t value) { return value / kAlignment * kAlignment; }
inline size_t align_up(size_t value) { return align_down(value + kAlignment - 1); }

class AlignedBuffer {
public:
    // At least one page so that empty tensors still get a valid address; locked buffers are
    // mlock'd so the kernel never pages them out between transfers.
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
};

}  // namespace megatron_aio
