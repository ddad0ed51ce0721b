"""Perplexity of a checkpoint; see megatron/inference/perplexity.py for the flags."""
import importlib.util, os, sys  # noqa: E401
if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.inference.perplexity import main  # noqa: E402
if __name__ == "__main__":
    main()
