"""Install the `megatron` package and its command-line tools.

torch is declared as torch>=2.4; `make install` puts the CPU build 2.13.0 in place first when no
torch is installed, so pip does not pull a multi-GB CUDA build on a CPU-only machine.
"""

import pybind11
from setuptools import Extension, find_packages, setup

# The native async-I/O op: plain C++17 and pybind11, no torch headers, so it builds in seconds.
AIO_SOURCES = [
    "csrc/aio/aio_context.cpp",
    "csrc/aio/aio_handle.cpp",
    "csrc/aio/aligned_buffer.cpp",
    "csrc/aio/bindings.cpp",
    "csrc/aio/file_op.cpp",
    "csrc/aio/io_error.cpp",
    "csrc/aio/slice_io.cpp",
]
AIO_EXTENSION = Extension(
    "megatron.ops._aio",
    sources=AIO_SOURCES,
    depends=[f"csrc/aio/{name}.h" for name in ("aio_context", "aio_handle", "aligned_buffer", "io_error", "slice_io")],
    include_dirs=[pybind11.get_include()],
    extra_compile_args=["-O2", "-std=c++17", "-pthread"],
    extra_link_args=["-pthread"],
    language="c++",
)

# The CPU Adam step for optimizer state in host memory: plain C++17, pybind11, no torch headers.
# No -march: gcc compiles the element loop for AVX-512, AVX2 and baseline x86-64 and picks one at
# load time; -ffp-contract=off keeps its rounding exactly where csrc/adam/adam_kernel.cpp puts it.
ADAM_EXTENSION = Extension(
    "megatron.ops._cpu_adam",
    sources=["csrc/adam/adam_kernel.cpp", "csrc/adam/bindings.cpp", "csrc/adam/parallel_step.cpp"],
    depends=["csrc/adam/adam_kernel.h", "csrc/adam/parallel_step.h"],
    include_dirs=[pybind11.get_include()],
    extra_compile_args=["-O3", "-std=c++17", "-pthread", "-ffp-contract=off", "-fno-math-errno"],
    extra_link_args=["-pthread"],
    language="c++",
)

# The padded transpose behind the experts' weight gradients: plain C++17, pybind11, no torch headers;
# its AVX2 tile kernel is chosen at run time, so no -march either.
TRANSPOSE_EXTENSION = Extension(
    "megatron.ops._transpose",
    sources=["csrc/transpose/transpose_kernel.cpp", "csrc/transpose/bindings.cpp"],
    depends=["csrc/transpose/transpose_kernel.h"],
    include_dirs=[pybind11.get_include()],
    extra_compile_args=["-O3", "-std=c++17"],
    language="c++",
)

setup(
    name="megatron-moe",
    version="0.1.0",
    description="Megatron-style pretraining toolkit for Mixture-of-Experts GPT models",
    packages=find_packages(include=["megatron", "megatron.*", "tasks", "tasks.*"]),
    # the local evaluation tasks: lm-eval task definitions and their tiny JSONL data
    package_data={"tasks.eval_harness": ["tasks/*.yaml", "data/*.jsonl"]},
    ext_modules=[AIO_EXTENSION, ADAM_EXTENSION, TRANSPOSE_EXTENSION],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "datasets",  # brings pyarrow, which reads Parquet corpora (megatron/data/corpus_reader.py)
        "tensorboard",
        "safetensors",
        "pydantic>=2",
        "tqdm",
    ],
    extras_require={
        # transformers: the Hugging Face tests (GLM-4-MoE, SentencePiece export need 5); ruff: `make test` lints first
        "test": ["pytest", "transformers>=5", "ruff>=0.17,<0.18", "matplotlib"],
        "eval": ["lm-eval"],
        "plot": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "megatron-pretrain-gpt=megatron.cli.pretrain_gpt:main",
            "megatron-preprocess-data=megatron.cli.preprocess_data:main",
            "megatron-train-tokenizer=megatron.cli.train_tokenizer:main",
            "megatron-autotune=megatron.cli.autotune:main",
            "ds_io=megatron.cli.ds_io:main",
            "ds_nvme_tune=megatron.cli.ds_nvme_tune:main",
        ]
    },
)
