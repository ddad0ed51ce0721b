"""DeepSpeed's autotuner for a pretrain_gpt.py command line; see megatron/cli/autotune.py for the flags."""

import importlib.util
import os
import sys

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.cli.autotune import main

if __name__ == "__main__":
    main()
