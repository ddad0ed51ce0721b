"""Install the `megatron` package and its command-line tools.

torch is declared as torch>=2.4; `make install` puts the CPU build 2.13.0 in place first when no
torch is installed, so pip does not pull a multi-GB CUDA build on a CPU-only machine.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-moe",
    version="0.1.0",
    description="Megatron-style pretraining toolkit for Mixture-of-Experts GPT models",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "datasets",
        "tensorboard",
        "safetensors",
        "pydantic>=2",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest"],
        "eval": ["lm-eval"],
    },
    entry_points={
        "console_scripts": [
            "megatron-pretrain-gpt=megatron.gpt_pretrain:main",
            "megatron-preprocess-data=megatron.data.preprocess:main",
            "megatron-train-tokenizer=megatron.data.tokenizer_training:main",
        ]
    },
)
