// Python binding of the handle. Tensors arrive as (address, byte count) from megatron/ops/aio.py,
// so this extension needs no torch headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>

#include "aio_handle.h"
#include "aligned_buffer.h"

namespace py = pybind11;
using namespace megatron_aio;

namespace {

py::object os_error(int code, const std::string& message, const std::string& path)
{
    // OSError(errno, message, path) picks the subclass (FileNotFoundError, ...) by errno.
    return py::module_::import("builtins").attr("OSError")(code, message, path);
}

// Opens the file and queues the transfer with the GIL held (errors and the warning are Python's),
// then waits without it. caller_fd is -1 for a named file.
void submit(AioHandle& handle, bool is_read, uintptr_t address, size_t nbytes, const std::string& path,
            int caller_fd, uint64_t file_offset, bool async_op)
{
    auto op = handle.start(is_read, path, caller_fd, reinterpret_cast<char*>(address), nbytes, file_offset);
    if (op->direct_refused && handle.claim_fallback_warning()) {
        const std::string message = "O_DIRECT is not supported by the " + file_system_name(op->plain_fd) +
                                    " holding '" + path + "'; this aio handle falls back to buffered I/O there";
        if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) != 0) throw py::error_already_set();
    }
    if (async_op) {
        handle.add_pending(std::move(op));
        return;
    }
    IoError error;
    {
        py::gil_scoped_release release;
        error = op->wait();
    }
    if (error) throw OsError(error.code, error.detail, path);
}

void transfer(AioHandle& handle, bool is_read, uintptr_t address, size_t nbytes, const std::string& path,
              uint64_t file_offset, bool async_op)
{
    submit(handle, is_read, address, nbytes, path, -1, file_offset, async_op);
}

// The same through a descriptor the caller opened; errors name it with its file where /proc knows it.
void transfer_fd(AioHandle& handle, bool is_read, uintptr_t address, size_t nbytes, int fd, uint64_t file_offset,
                 bool async_op)
{
    // Checked here: below, a negative descriptor means a named file.
    if (fd < 0) throw OsError(EBADF, "not an open file descriptor", describe_fd(fd));
    submit(handle, is_read, address, nbytes, describe_fd(fd), fd, file_offset, async_op);
}

// One entry per finished op in submission order: None, or the (errno, message, path) of its error.
py::list wait_all(AioHandle& handle)
{
    auto ops = handle.take_pending();
    std::vector<IoError> errors;
    {
        py::gil_scoped_release release;
        for (auto& op : ops) errors.push_back(op->wait());
    }
    py::list results;
    for (size_t i = 0; i < ops.size(); ++i) {
        if (errors[i])
            results.append(py::make_tuple(errors[i].code, describe(errors[i].code, errors[i].detail), ops[i]->path));
        else
            results.append(py::none());
    }
    return results;
}

}  // namespace

PYBIND11_MODULE(_aio, m)
{
    m.doc() = "Linux native async I/O between host memory and files (see megatron/ops/aio.py).";
    m.attr("ALIGNMENT") = kAlignment;

    py::register_exception_translator([](std::exception_ptr pointer) {
        try {
            if (pointer) std::rethrow_exception(pointer);
        } catch (const OsError& error) {
            py::object exception = os_error(error.code(), error.what(), error.path());
            PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
        }
    });

    py::class_<AlignedBuffer>(m, "LockedBuffer", py::buffer_protocol())
        .def(py::init([](size_t nbytes) { return std::make_unique<AlignedBuffer>(nbytes, true); }), py::arg("nbytes"))
        .def_property_readonly("locked", &AlignedBuffer::locked)
        .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
        .def_buffer([](AlignedBuffer& b) {
            return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(b.size())}, {static_cast<py::ssize_t>(1)});
        });

    py::class_<AioHandle>(m, "Handle")
        .def(py::init([](size_t block_size, unsigned queue_depth, bool single_submit, bool overlap_events,
                         unsigned threads) {
                 return std::make_unique<AioHandle>(IoConfig{block_size, queue_depth, single_submit, overlap_events},
                                                    threads);
             }),
             py::arg("block_size"), py::arg("queue_depth"), py::arg("single_submit"), py::arg("overlap_events"),
             py::arg("threads"))
        .def("transfer", &transfer, py::arg("is_read"), py::arg("address"), py::arg("nbytes"), py::arg("path"),
             py::arg("file_offset"), py::arg("async_op"))
        .def("transfer_fd", &transfer_fd, py::arg("is_read"), py::arg("address"), py::arg("nbytes"), py::arg("fd"),
             py::arg("file_offset"), py::arg("async_op"))
        .def("wait", &wait_all);
}
