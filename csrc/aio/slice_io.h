// Moves one contiguous slice of a tensor to or from a file: the page-aligned middle as O_DIRECT
// AIO requests, the unaligned head and tail with plain pread/pwrite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "aio_context.h"
#include "aligned_buffer.h"
#include "io_error.h"

namespace megatron_aio {

struct IoConfig {
    size_t block_size;
    unsigned queue_depth;
    bool single_submit;
    bool overlap_events;
};

struct Slice {
    bool is_read;
    int direct_fd;  // -1 when the file system refused O_DIRECT: everything goes through plain_fd
    int plain_fd;
    char* buffer;
    uint64_t file_offset;
    size_t nbytes;
};

// Blocking pread/pwrite of exactly nbytes; end of file or no progress is an error, never a
// silently short transfer.
IoError plain_io(bool is_read, int fd, char* buffer, size_t nbytes, uint64_t file_offset);

// Owned by one worker thread: its AIO context and its bounce buffers.
class SliceRunner {
public:
    explicit SliceRunner(const IoConfig& config);
    IoError run(const Slice& slice);

private:
    struct Request {
        struct iocb cb;
        char* user;
        size_t nbytes;
        uint64_t file_offset;
    };
    IoError run_direct(const Slice& slice, char* user, uint64_t begin, uint64_t end);
    IoError submit(std::vector<struct iocb*>& batch, unsigned& in_flight, std::vector<unsigned>& free_slots);
    IoError complete(const Slice& slice, const Request& request, char* io_buffer, long long result);

    IoConfig config_;
    AioContext context_;
    // One arena of depth x block bytes, slot i at i x block: one allocation, and large enough for
    // huge pages (see AlignedBuffer).
    std::unique_ptr<AlignedBuffer> bounce_;
};

}  // namespace megatron_aio
