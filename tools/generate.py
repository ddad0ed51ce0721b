"""Generate text from a checkpoint; see megatron/inference/generate_tool.py for the flags."""

import importlib.util
import os
import sys

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.inference.generate_tool import main

if __name__ == "__main__":
    main()
