// Error values passed between the I/O workers and the Python binding.
#pragma once

#include <stdexcept>
#include <string>

namespace megatron_aio {

// errno plus what was being done; code 0 means success.
struct IoError {
    int code = 0;
    std::string detail;
    explicit operator bool() const { return code != 0; }
};

// Thrown on the calling thread; the binding turns it into OSError(code, message, path).
class OsError : public std::runtime_error {
public:
    OsError(int code, const std::string& detail, std::string path);
    int code() const { return code_; }
    const std::string& path() const { return path_; }

private:
    int code_;
    std::string path_;
};

// "No such file or directory (opening for reading)": strerror first, then the context.
std::string describe(int code, const std::string& detail);

}  // namespace megatron_aio
