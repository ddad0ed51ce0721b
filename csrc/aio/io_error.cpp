#include "io_error.h"

#include <cstring>

namespace megatron_aio {

std::string describe(int code, const std::string& detail)
{
    std::string text = std::strerror(code);
    if (!detail.empty()) text += " (" + detail + ")";
    return text;
}

OsError::OsError(int code, const std::string& detail, std::string path)
    : std::runtime_error(describe(code, detail)), code_(code), path_(std::move(path))
{
}

}  // namespace megatron_aio
