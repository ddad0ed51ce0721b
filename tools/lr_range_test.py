"""Run an LR range test on pretrain_gpt.py's model and data (or --toy) and plot loss against lr;
see megatron/cli/lr_range_test.py for the flags."""

import importlib.util
import os
import sys

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.cli.lr_range_test import main

if __name__ == "__main__":
    main()
