"""Index the training samples by a difficulty metric for curriculum sampling; see megatron/cli/analyze_data.py."""

import importlib.util
import os
import sys

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.cli.analyze_data import main

if __name__ == "__main__":
    main()
