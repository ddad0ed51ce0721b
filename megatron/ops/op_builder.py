"""DeepNVMe-style op builders: `AsyncIOBuilder().load().aio_handle(...)` runs DeepNVMe tutorial
code after changing only the import. The extension is compiled by setup.py, never at load()."""

import sys


class AsyncIOBuilder:
    NAME = "async_io"

    def is_compatible(self, verbose=False):
        """True where the compiled extension imports (Linux, built by `pip install -e .`)."""
        try:
            self.load()
        except ImportError as error:
            if verbose:
                print(f"{self.NAME}: {error}", file=sys.stderr)
            return False
        return True

    def load(self, verbose=False):
        """The megatron.ops.aio module, whose `aio_handle` is the handle class."""
        from megatron.ops import aio

        aio.extension()
        return aio


class GDSBuilder(AsyncIOBuilder):
    """GPUDirect Storage: `load().gds_handle(...)` exists, and its methods raise on this machine."""

    NAME = "gds"

    def is_compatible(self, verbose=False):
        if verbose:
            print(f"{self.NAME}: GPUDirect Storage is not available on this machine", file=sys.stderr)
        return False
