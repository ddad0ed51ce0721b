#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "aio_handle.h"

namespace megatron_aio {

FileOp::FileOp(bool is_read, std::string path, int caller_fd, char* buffer, size_t nbytes, uint64_t file_offset)
    : is_read(is_read),
      path(std::move(path)),
      caller_fd(caller_fd),
      buffer(buffer),
      nbytes(nbytes),
      file_offset(file_offset)
{
}

FileOp::~FileOp()
{
    if (direct_fd >= 0) close(direct_fd);
    if (plain_fd >= 0) close(plain_fd);
}

// The /proc name that reopens the caller's descriptor, once it is known to be open for this transfer.
std::string FileOp::caller_fd_name() const
{
    const int flags = fcntl(caller_fd, F_GETFL);
    if (flags < 0) throw OsError(errno, "not an open file descriptor", path);
    if ((flags & O_ACCMODE) == (is_read ? O_WRONLY : O_RDONLY))
        throw OsError(EBADF, is_read ? "the descriptor is open for writing only; open it with os.O_RDONLY or os.O_RDWR"
                                     : "the descriptor is open for reading only; open it with os.O_WRONLY or os.O_RDWR",
                      path);
    return "/proc/self/fd/" + std::to_string(caller_fd);
}

void FileOp::open_files()
{
    // A caller's descriptor is reopened through /proc: that gives O_DIRECT where the caller's has
    // none, copies that are ours to close (the caller may close theirs before wait()), and writes
    // at file_offset even where the caller's has O_APPEND.
    const std::string name = caller_fd < 0 ? path : caller_fd_name();
    const int access = is_read ? O_RDONLY : O_WRONLY | (caller_fd < 0 ? O_CREAT : 0);
    plain_fd = open(name.c_str(), access | O_CLOEXEC, 0644);
    if (plain_fd < 0) throw OsError(errno, is_read ? "opening for reading" : "opening for writing", path);

    struct stat info {};
    if (fstat(plain_fd, &info) != 0) throw OsError(errno, "fstat", path);
    const bool regular = S_ISREG(info.st_mode);
    const auto end = static_cast<off_t>(file_offset + nbytes);
    if (is_read && regular && info.st_size < end)
        throw OsError(EINVAL,
                      "the file has " + std::to_string(info.st_size) + " bytes, reading " +
                          std::to_string(nbytes) + " bytes at file offset " + std::to_string(file_offset) +
                          " needs " + std::to_string(end),
                      path);
    if (!is_read && regular) {
        // Reserving the space first makes a full disk fail here, before any byte is overwritten;
        // file systems without fallocate just skip the reservation.
        if (nbytes > 0 && fallocate(plain_fd, 0, static_cast<off_t>(file_offset), static_cast<off_t>(nbytes)) != 0 &&
            errno != EOPNOTSUPP)
            throw OsError(errno, "reserving " + std::to_string(nbytes) + " bytes at file offset " +
                                     std::to_string(file_offset), path);
        // A write from offset 0 replaces a named file, so it ends exactly at the tensor's end; a write
        // further in, or through the caller's descriptor, keeps what lies beyond.
        if (((file_offset == 0 && caller_fd < 0) || info.st_size < end) && ftruncate(plain_fd, end) != 0)
            throw OsError(errno, "setting the file size to " + std::to_string(end), path);
    }

    direct_fd = open(name.c_str(), (is_read ? O_RDONLY : O_WRONLY) | O_DIRECT | O_CLOEXEC);
    if (direct_fd < 0) {
        if (errno != EINVAL) throw OsError(errno, "opening with O_DIRECT", path);
        direct_refused = true;
    }
}

void FileOp::expect_slices(unsigned count)
{
    std::lock_guard<std::mutex> lock(mutex_);
    remaining_ = count;
}

void FileOp::finish_slice(const IoError& error)
{
    std::lock_guard<std::mutex> lock(mutex_);
    if (error && !first_error_) first_error_ = error;
    if (--remaining_ == 0) done_.notify_all();
}

IoError FileOp::wait()
{
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return remaining_ == 0; });
    return first_error_;
}

}  // namespace megatron_aio
