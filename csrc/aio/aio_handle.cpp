#include "aio_handle.h"

#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <new>
#include <thread>
#include <utility>

namespace megatron_aio {

struct AioHandle::Worker {
    explicit Worker(const IoConfig& config) : runner(config), thread([this] { loop(); }) {}

    ~Worker()
    {
        {
            std::lock_guard<std::mutex> lock(mutex);
            stopping = true;
        }
        wake.notify_one();
        thread.join();
    }

    void push(std::shared_ptr<FileOp> op, const Slice& slice)
    {
        {
            std::lock_guard<std::mutex> lock(mutex);
            queue.emplace_back(std::move(op), slice);
        }
        wake.notify_one();
    }

    void loop()
    {
        for (;;) {
            std::unique_lock<std::mutex> lock(mutex);
            wake.wait(lock, [this] { return stopping || !queue.empty(); });
            if (queue.empty()) return;  // stopping, and every queued slice is done
            auto [op, slice] = std::move(queue.front());
            queue.pop_front();
            lock.unlock();
            IoError error;
            try {
                error = runner.run(slice);
            } catch (const std::bad_alloc&) {
                error = {ENOMEM, "allocating bounce buffers"};
            }
            op->finish_slice(error);
        }
    }

    SliceRunner runner;
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<std::pair<std::shared_ptr<FileOp>, Slice>> queue;
    bool stopping = false;
    std::thread thread;  // last: starts after everything it uses exists
};

AioHandle::AioHandle(const IoConfig& config, unsigned threads)
{
    for (unsigned i = 0; i < threads; ++i) workers_.push_back(std::make_unique<Worker>(config));
}

AioHandle::~AioHandle() = default;

std::shared_ptr<FileOp> AioHandle::start(bool is_read, const std::string& path, int caller_fd, char* buffer,
                                         size_t nbytes, uint64_t file_offset)
{
    auto op = std::make_shared<FileOp>(is_read, path, caller_fd, buffer, nbytes, file_offset);
    op->open_files();

    // Cut points between slices are page-aligned in the file, so only the first slice can have
    // an unaligned head and only the last an unaligned tail.
    const uint64_t begin = file_offset;
    const uint64_t end = begin + nbytes;
    const uint64_t middle_begin = std::min<uint64_t>(align_up(begin), end);
    const uint64_t middle_end = std::max<uint64_t>(align_down(end), middle_begin);
    const uint64_t pages = (middle_end - middle_begin) / kAlignment;
    const uint64_t count = workers_.size();
    std::vector<Slice> slices;
    uint64_t slice_begin = begin;
    for (uint64_t i = 0; i < count; ++i) {
        const uint64_t slice_end = i + 1 == count ? end : middle_begin + kAlignment * (pages * (i + 1) / count);
        if (slice_end > slice_begin)
            slices.push_back({is_read, op->direct_fd, op->plain_fd, buffer + (slice_begin - begin), slice_begin,
                              static_cast<size_t>(slice_end - slice_begin)});
        slice_begin = slice_end;
    }
    op->expect_slices(static_cast<unsigned>(slices.size()));
    for (size_t i = 0; i < slices.size(); ++i) workers_[i]->push(op, slices[i]);
    return op;
}

void AioHandle::add_pending(std::shared_ptr<FileOp> op)
{
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(std::move(op));
}

std::vector<std::shared_ptr<FileOp>> AioHandle::take_pending()
{
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(pending_, {});
}

bool AioHandle::claim_fallback_warning()
{
    std::lock_guard<std::mutex> lock(mutex_);
    return !std::exchange(fallback_warned_, true);
}

std::string file_system_name(int fd)
{
    struct statfs info {};
    if (fstatfs(fd, &info) != 0) return "unknown file system";
    if (info.f_type == TMPFS_MAGIC) return "tmpfs";
    char name[32];
    std::snprintf(name, sizeof(name), "file system type 0x%lx", static_cast<unsigned long>(info.f_type));
    return name;
}

std::string describe_fd(int fd)
{
    std::string label = "file descriptor " + std::to_string(fd);
    char target[4096];
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t length = readlink(link.c_str(), target, sizeof(target));
    if (length > 0 && static_cast<size_t>(length) < sizeof(target))
        label += " (" + std::string(target, static_cast<size_t>(length)) + ")";
    return label;
}

}  // namespace megatron_aio
