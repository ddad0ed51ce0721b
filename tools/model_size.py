"""Size a model from pretrain_gpt.py's flags without building it; see megatron/model_size.py."""

import importlib.util
import os
import sys

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.model_size import main

if __name__ == "__main__":
    main()
