"""The one reader of a trained model: the verified checkpoint folder of a run and its typed record
(model config, tokenizer, iteration), and the model built from its weights. Inference, distillation,
upcycling and the Hugging Face export all read checkpoints through it; the weights are read by
global name, so a checkpoint saved with any parallel layout loads into any other (each rank reads
only its own experts and slices)."""

from dataclasses import dataclass
from pathlib import Path

from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import MODEL, iteration_tag
from megatron.checkpoint.manifest import RunRecord
from megatron.checkpoint.tensors import ShardedReader, load_model_entries
from megatron.checkpoint.verify import verify_folder
from megatron.errors import CheckpointError
from megatron.model import GPTConfig, GPTModel
from megatron.model.tensor_parallel import TensorParallel
from megatron.parallel import ParallelGrid


@dataclass(frozen=True)
class SavedRun:
    folder: Path  # load_dir/iter_N/, its files verified
    run: RunRecord


def saved_run(load_dir: str | Path, grid: ParallelGrid, iteration: int | None = None) -> SavedRun:
    """`load_dir/iter_N/` for the given iteration, or the latest one, once its files verify, and
    what the training run (or import) that saved it recorded. Every rank must call it."""
    if iteration is None:
        iteration, problem = read_latest(str(load_dir))
        if iteration is None:
            raise CheckpointError(f"{problem}; pass the --save directory of a training run, or --iteration N")
    folder = Path(load_dir) / iteration_tag(iteration)
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint at {folder}; check --load and --iteration")
    record = verify_folder(folder, grid)
    if record.run is None:
        raise CheckpointError(
            f"{folder} holds no model config or tokenizer (it was saved through the engine alone); "
            "load a checkpoint saved by pretrain_gpt.py"
        )
    return SavedRun(folder, record.run)


def build_saved_model(
    folder: Path, config: GPTConfig, grid: ParallelGrid, tp: TensorParallel = TensorParallel()
) -> GPTModel:
    """`config`'s model on `grid` with the weights of checkpoint `folder`, in eval mode (each rank
    reads only its own experts, whatever expert-parallel size saved them, and under tensor
    parallelism `tp` its slices)."""
    model = GPTModel(config, ep_group=grid.ep_group, tp=tp)
    load_model_entries(model, ShardedReader(folder, MODEL))
    return model.to(grid.device).eval()
