#include "slice_io.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace megatron_aio {

namespace {

// Memory in flight through bounce buffers per worker; bounds the copies of unaligned tensors.
constexpr size_t kBounceBytes = 32u << 20;

std::string what(bool is_read, size_t nbytes, uint64_t file_offset)
{
    return std::string(is_read ? "reading " : "writing ") + std::to_string(nbytes) +
           " bytes at file offset " + std::to_string(file_offset);
}

}  // namespace

IoError plain_io(bool is_read, int fd, char* buffer, size_t nbytes, uint64_t file_offset)
{
    while (nbytes > 0) {
        const ssize_t rc = is_read ? pread(fd, buffer, nbytes, file_offset)
                                   : pwrite(fd, buffer, nbytes, file_offset);
        if (rc < 0) {
            if (errno == EINTR) continue;
            return {errno, what(is_read, nbytes, file_offset)};
        }
        if (rc == 0)
            return {EIO, what(is_read, nbytes, file_offset) +
                             (is_read ? ": the file ended early" : ": no byte was written")};
        buffer += rc;
        nbytes -= static_cast<size_t>(rc);
        file_offset += static_cast<uint64_t>(rc);
    }
    return {};
}

SliceRunner::SliceRunner(const IoConfig& config) : config_(config), context_(config.queue_depth) {}

IoError SliceRunner::run(const Slice& slice)
{
    const uint64_t begin = slice.file_offset;
    const uint64_t end = begin + slice.nbytes;
    const uint64_t middle_begin = align_up(begin);
    const uint64_t middle_end = align_down(end);
    if (slice.direct_fd < 0 || middle_begin >= middle_end)
        return plain_io(slice.is_read, slice.plain_fd, slice.buffer, slice.nbytes, begin);

    // Head and tail are less than a page each; plain I/O avoids a read-modify-write of the
    // neighbouring bytes of the file and never writes padding past the tensor's end.
    if (middle_begin > begin) {
        IoError error = plain_io(slice.is_read, slice.plain_fd, slice.buffer, middle_begin - begin, begin);
        if (error) return error;
    }
    IoError error = run_direct(slice, slice.buffer + (middle_begin - begin), middle_begin, middle_end);
    if (error || end == middle_end) return error;
    return plain_io(slice.is_read, slice.plain_fd, slice.buffer + (middle_end - begin), end - middle_end,
                    middle_end);
}

IoError SliceRunner::run_direct(const Slice& slice, char* user, uint64_t begin, uint64_t end)
{
    const size_t block = std::max(kAlignment, align_up(config_.block_size));
    // O_DIRECT needs the memory address aligned too; other memory is copied through bounce buffers.
    const bool bounce = reinterpret_cast<uintptr_t>(user) % kAlignment != 0;
    unsigned depth = context_.capacity();
    if (bounce) {
        depth = static_cast<unsigned>(std::min<size_t>(depth, std::max<size_t>(1, kBounceBytes / block)));
        if (!bounce_ || bounce_->size() < depth * block) bounce_ = std::make_unique<AlignedBuffer>(depth * block, true);
    }
    auto bounce_slot = [&](unsigned slot) { return bounce_->data() + static_cast<size_t>(slot) * block; };

    std::vector<Request> slots(depth);
    std::vector<unsigned> free_slots;
    for (unsigned slot = depth; slot > 0; --slot) free_slots.push_back(slot - 1);
    std::vector<struct iocb*> batch;
    std::vector<struct io_event> events(depth);
    uint64_t next = begin;
    unsigned in_flight = 0;
    IoError first_error;

    for (;;) {
        // overlap_events tops the queue up after every completion; otherwise the whole batch
        // has to finish before the next one goes out.
        if (!first_error && next < end && (config_.overlap_events || in_flight == 0)) {
            batch.clear();
            while (next < end && in_flight + batch.size() < depth) {
                const unsigned slot = free_slots.back();
                free_slots.pop_back();
                Request& request = slots[slot];
                request.nbytes = static_cast<size_t>(std::min<uint64_t>(block, end - next));
                request.file_offset = next;
                request.user = user + (next - begin);
                char* io_buffer = bounce ? bounce_slot(slot) : request.user;
                if (bounce && !slice.is_read) std::memcpy(io_buffer, request.user, request.nbytes);
                std::memset(&request.cb, 0, sizeof(request.cb));
                request.cb.aio_data = slot;
                request.cb.aio_lio_opcode = slice.is_read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
                request.cb.aio_fildes = static_cast<uint32_t>(slice.direct_fd);
                request.cb.aio_buf = reinterpret_cast<uint64_t>(io_buffer);
                request.cb.aio_nbytes = request.nbytes;
                request.cb.aio_offset = static_cast<int64_t>(next);
                batch.push_back(&request.cb);
                next += request.nbytes;
            }
            first_error = submit(batch, in_flight, free_slots);
        }
        if (in_flight == 0) return first_error;

        const long count = context_.get_events(config_.overlap_events ? 1 : in_flight, in_flight, events.data());
        if (count < 0) return {static_cast<int>(-count), "io_getevents"};
        for (long i = 0; i < count; ++i) {
            const auto slot = static_cast<unsigned>(events[i].data);
            char* io_buffer = bounce ? bounce_slot(slot) : slots[slot].user;
            IoError error = complete(slice, slots[slot], io_buffer, events[i].res);
            if (!first_error) first_error = error;
            free_slots.push_back(slot);
            --in_flight;
        }
    }
}

IoError SliceRunner::submit(std::vector<struct iocb*>& batch, unsigned& in_flight, std::vector<unsigned>& free_slots)
{
    size_t submitted = 0;
    while (submitted < batch.size()) {
        const long count = config_.single_submit ? 1 : static_cast<long>(batch.size() - submitted);
        const long rc = context_.submit(count, batch.data() + submitted);
        if (rc <= 0) {
            // Requests that never reached the kernel give their slots back and are not waited for.
            const struct iocb* failed = batch[submitted];
            for (size_t i = submitted; i < batch.size(); ++i)
                free_slots.push_back(static_cast<unsigned>(batch[i]->aio_data));
            const bool is_read = failed->aio_lio_opcode == IOCB_CMD_PREAD;
            return {rc < 0 ? static_cast<int>(-rc) : EAGAIN,
                    "io_submit " + what(is_read, failed->aio_nbytes, static_cast<uint64_t>(failed->aio_offset))};
        }
        submitted += static_cast<size_t>(rc);
        in_flight += static_cast<unsigned>(rc);
    }
    return {};
}

IoError SliceRunner::complete(const Slice& slice, const Request& request, char* io_buffer, long long result)
{
    if (result < 0) return {static_cast<int>(-result), what(slice.is_read, request.nbytes, request.file_offset)};
    // A short transfer is finished with blocking I/O, which either completes it or reports the
    // real cause (ENOSPC, end of file) instead of losing the rest.
    const auto done = static_cast<size_t>(result);
    if (done < request.nbytes) {
        IoError error = plain_io(slice.is_read, slice.plain_fd, io_buffer + done, request.nbytes - done,
                                 request.file_offset + done);
        if (error) return error;
    }
    if (slice.is_read && io_buffer != request.user) std::memcpy(request.user, io_buffer, request.nbytes);
    return {};
}

}  // namespace megatron_aio
