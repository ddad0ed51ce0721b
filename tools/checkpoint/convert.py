"""Convert checkpoints to and from Hugging Face transformers (--to hf / --from hf); see
megatron/cli/convert_checkpoint.py for the flags."""
import importlib.util, os, sys  # noqa: E401
if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron.cli.convert_checkpoint import main  # noqa: E402
if __name__ == "__main__":
    main()
