"""Train a SentencePiece tokenizer; see megatron/cli/train_tokenizer.py for the flags."""

import importlib.util
import os
import sys

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.cli.train_tokenizer import main

if __name__ == "__main__":
    main()
