"""Generate text from a checkpoint; see megatron/inference/generate_tool.py for the flags."""
import importlib.util, os, sys  # noqa: E401
if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.inference.generate_tool import main  # noqa: E402
if __name__ == "__main__":
    main()
