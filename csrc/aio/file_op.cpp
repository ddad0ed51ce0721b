#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "aio_handle.h"

namespace megatron_aio {

FileOp::FileOp(bool is_read, std::string path, char* buffer, size_t nbytes, uint64_t file_offset)
    : is_read(is_read), path(std::move(path)), buffer(buffer), nbytes(nbytes), file_offset(file_offset)
{
}

FileOp::~FileOp()
{
    if (direct_fd >= 0) close(direct_fd);
    if (plain_fd >= 0) close(plain_fd);
}

void FileOp::open_files()
{
    const int access = is_read ? O_RDONLY : O_WRONLY | O_CREAT;
    plain_fd = open(path.c_str(), access | O_CLOEXEC, 0644);
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
        // A write from offset 0 replaces the file, so it ends exactly at the tensor's end; a write
        // further in keeps what lies beyond.
        if ((file_offset == 0 || info.st_size < end) && ftruncate(plain_fd, end) != 0)
            throw OsError(errno, "setting the file size to " + std::to_string(end), path);
    }

    direct_fd = open(path.c_str(), (is_read ? O_RDONLY : O_WRONLY) | O_DIRECT | O_CLOEXEC);
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
