// The handle: a pool of worker threads, each with its own AIO context, that splits every tensor
// transfer into one contiguous slice per thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io_error.h"
#include "slice_io.h"

namespace megatron_aio {

// One tensor <-> file transfer; its slices run on different workers and report back here. The file
// is named by path, or is a descriptor the caller opened (caller_fd >= 0; path then only names it
// in errors and warnings).
class FileOp {
public:
    FileOp(bool is_read, std::string path, int caller_fd, char* buffer, size_t nbytes, uint64_t file_offset);
    ~FileOp();
    FileOp(const FileOp&) = delete;
    FileOp& operator=(const FileOp&) = delete;

    // Throws OsError for everything that can be known before any I/O: a missing file or folder,
    // a file shorter than the read, a disk without room for the write, a closed or read-only
    // caller's descriptor.
    void open_files();
    void expect_slices(unsigned count);
    void finish_slice(const IoError& error);
    IoError wait();  // blocks until every slice finished; the first error wins

    const bool is_read;
    const std::string path;
    const int caller_fd;
    char* const buffer;
    const size_t nbytes;
    const uint64_t file_offset;
    int direct_fd = -1;
    int plain_fd = -1;
    bool direct_refused = false;

private:
    std::string caller_fd_name() const;

    std::mutex mutex_;
    std::condition_variable done_;
    unsigned remaining_ = 0;
    IoError first_error_;
};

class AioHandle {
public:
    AioHandle(const IoConfig& config, unsigned threads);
    ~AioHandle();  // finishes queued work before the threads exit

    std::shared_ptr<FileOp> start(bool is_read, const std::string& path, int caller_fd, char* buffer,
                                  size_t nbytes, uint64_t file_offset);
    void add_pending(std::shared_ptr<FileOp> op);
    std::vector<std::shared_ptr<FileOp>> take_pending();
    // True exactly once per handle, so the buffered-I/O fallback warns once.
    bool claim_fallback_warning();

private:
    struct Worker;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::mutex mutex_;
    std::vector<std::shared_ptr<FileOp>> pending_;
    bool fallback_warned_ = false;
};

// "tmpfs" or the statfs magic number of the file system holding fd, for the fallback warning.
std::string file_system_name(int fd);

// "file descriptor 7 (/path/of/the/file)", or without the path where /proc cannot tell it.
std::string describe_fd(int fd);

}  // namespace megatron_aio
