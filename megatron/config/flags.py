"""Megatron-style command-line flags -> one frozen `PretrainConfig`, parsed and validated once.

Unknown flags and contradictions stop here, with one sentence, before any work is done.
"""

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from megatron.config.deepspeed_json import explicit_flags, flag_for, merge_deepspeed_config, runtime_dict
from megatron.config.distill_flags import DistillConfig, add_distill_args, distill_config_from_args
from megatron.config.parser import (
    FlagParser,
    finite_float,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    ranged,
)
from megatron.config.spans import Span, SpanUnit
from megatron.data.gpt_dataset import SPLIT_CUMULATIVE, SPLIT_ROUNDINGS
from megatron.data.tokenizer import NULL_EOD_CONVENTIONS, NULL_EOD_LAST
from megatron.errors import ConfigError
from megatron.model.config import MLP_TYPES, NORMALIZATIONS, POSITION_EMBEDDING_TYPES, GPTConfig
from megatron.model.moe import MoEConfig
from megatron.model.moe.config import DROP_POLICIES, LOAD_BALANCING_TYPES, SCORE_FUNCTIONS
from megatron.model.pipeline_stage import layer_counts
from megatron.runtime.config.combinations import refuse_contradictions, tied_embedding_refusal
from megatron.runtime.config.folders import blocking_file
from megatron.runtime.config.schema import RuntimeConfig, explain, resolve_batch_sizes
from megatron.runtime.config.schema_types import LOSS_SCALE_RANGE, LOSS_SCALE_WORDS
from megatron.runtime.lr_schedules import scheduler_parameters


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] | None
    train_data_path: tuple[str, ...] | None
    valid_data_path: tuple[str, ...] | None
    test_data_path: tuple[str, ...] | None
    split: str
    split_rounding: str  # gpt_dataset.SPLIT_ROUNDINGS
    tokenizer_type: str
    tokenizer_model: str | None
    vocab_file: str | None
    merge_file: str | None
    vocab_size: int | None
    null_tokenizer_eod: str  # tokenizer.NULL_EOD_CONVENTIONS
    make_vocab_size_divisible_by: int
    num_workers: int
    eod_mask_loss: bool
    data_checksum: bool = True  # check each data set against its PREFIX.checksum.json when opened


@dataclass(frozen=True)
class TrainingConfig:
    """What the training loop and the data need. The engine's settings (optimizer, precision, loss
    scale, clipping, ZeRO) have one home, `PretrainConfig.runtime`: the flags reach it through
    deepspeed_json.FLAG_KEYS, the one table between flags and DeepSpeed's JSON keys."""

    seq_length: int
    micro_batch_size: int  # the data's batch shapes; the runtime config checks them against its own
    # until with_data_parallel_size applies Megatron's default (micro batch x data-parallel size)
    # where none was given (`default_global_batch`), the micro batch
    global_batch_size: int
    default_global_batch: bool
    train_length: Span  # --train-iters or --train-samples, else --train-tokens
    min_lr: float  # Megatron's annealing (the peak is the optimizer's lr)
    lr_decay_style: str
    lr_warmup: Span | None  # None: no warmup
    lr_decay: Span | None  # None: decay over the whole run
    seed: int
    expert_parallel_size: int
    expert_tensor_parallel_size: int
    tensor_parallel_size: int
    sequence_parallel: bool
    pipeline_parallel_size: int
    first_stage_layers: int | None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None
    check_for_nan: bool  # a non-finite loss or gradient in bf16/fp32 stops the run
    max_consecutive_skipped_iterations: int  # 0: no limit
    deepspeed_config: str | None  # the --deepspeed_config file, named in messages
    curriculum_learning_legacy: bool = False  # Megatron-DeepSpeed's flag for the ds_config curriculum_learning block
    random_ltd: bool = False  # Megatron-DeepSpeed's flag for the ds_config data_routing.random_ltd block
    # Megatron-DeepSpeed's flag for the ds_config data_sampling.curriculum_learning block
    data_efficiency_curriculum_learning: bool = False
    train_tokens: int | None = None  # --train-tokens: a stop on the tokens trained (training/run_length.py)

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch_size * self.seq_length

    @property
    def train_iters(self) -> int:
        """The iterations of train_length with whole sequences; run_length() resolves --train-tokens."""
        return self.train_length.iterations(self.global_batch_size, self.seq_length)

    @property
    def lr_warmup_tokens(self) -> int:
        """The LR schedule counts tokens; iteration and sample flags convert."""
        return 0 if self.lr_warmup is None else self.lr_warmup.tokens(self.global_batch_size, self.seq_length)

    @property
    def lr_decay_tokens(self) -> int:
        if self.lr_decay is None:
            return self.train_iters * self.tokens_per_iteration
        return self.lr_decay.tokens(self.global_batch_size, self.seq_length)


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    eval_interval: int
    eval_iters: int
    eval_at_start: bool
    tensorboard_dir: str | None
    peak_tflops: float | None = None  # per rank, the MFU's denominator; None: a table or a probe
    timing_log_level: int = 0  # Megatron's: 0 no timers, 1 the iteration's parts, 2 also their pieces
    timing_log_option: str = "minmax"  # across ranks: max | minmax | all
    log_timers_to_tensorboard: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    load_optim: bool
    load_rng: bool
    reset_iteration: bool  # --load reads the weights only and the run starts at iteration 0
    ckpt_step: int | None  # the iteration to load instead of `latest`
    overwrite_checkpoints: bool  # a run from scratch may save over the checkpoints already in --save
    # --load holds a dense model whose weights start this MoE model (megatron/training/upcycling.py)
    moe_use_upcycling: bool = False
    async_save: bool = False  # --async-save (megatron/checkpoint/async_save.py)


@dataclass(frozen=True)
class ExitConfig:
    """When a run stops early on purpose, saving a checkpoint first (Megatron's flags)."""

    signal_handler: bool
    signal: str  # the signal's name, e.g. "SIGTERM"
    interval: int | None  # iterations
    duration_minutes: float | None


@dataclass(frozen=True)
class PretrainConfig:
    model: GPTConfig  # vocab_size is filled in from the tokenizer at start-up
    data: DataConfig
    training: TrainingConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    exit: ExitConfig
    # the engine's config: the --deepspeed_config JSON as written with the flags' values laid over
    # it (deepspeed_json.py), its batch sizes resolved for a data-parallel size by runtime_config
    runtime: RuntimeConfig
    distill: DistillConfig | None = None  # None: no teacher
    dry_run: bool = False  # size the model on the meta device and stop

    def runtime_config(self, dp_size: int) -> RuntimeConfig:
        """The engine's config with its batch sizes checked against `dp_size`."""
        return resolve_batch_sizes(self.runtime, dp_size)


def _runtime_from_args(args: argparse.Namespace) -> RuntimeConfig:
    merged = runtime_dict(vars(args), args.deepspeed_json)
    try:
        runtime = RuntimeConfig.model_validate(merged)
    except ValidationError as exc:
        # the JSON was checked on its own when it was read, so a problem here comes from a flag
        problem = explain(exc, "the command-line flags", merged)
        key = flag_for(problem.loc)
        raise ConfigError(
            problem.sentence
            if key is None
            else f"{key.flag} {getattr(args, key.dest)} is out of range (as {key.key} {problem.value!r}: {problem.reason})"
        ) from None
    refuse_contradictions(runtime)
    tied_refusal = tied_embedding_refusal(runtime.zero_optimization.stage)
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights and tied_refusal:
        raise ConfigError(tied_refusal)
    return runtime


# the ranges of the ds_config's fp16 keys that these flags set; DeepSpeed keeps the initial scale as
# a power of two (fp16.initial_scale_power, 0 to 127)
loss_scale = ranged(
    finite_float, lambda v: LOSS_SCALE_RANGE[0] <= v <= LOSS_SCALE_RANGE[1], f"a loss scale {LOSS_SCALE_WORDS}"
)
power_of_two_loss_scale = ranged(
    finite_float, lambda v: 1 <= v <= 2.0**127 and math.frexp(v)[0] == 0.5, "a power of two from 1 to 2**127"
)


def build_parser(sizing: bool = False) -> FlagParser:
    """Every flag of pretrain_gpt.py; with `sizing` (tools/model_size.py) without --dry-run, which
    that tool does anyway."""
    parser = FlagParser(prog="pretrain_gpt.py", description="Pretrain a GPT model (Megatron-style flags).")
    if not sizing:
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="build the model on the meta device, print its size and memory per rank, and stop",
        )
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=positive_int, required=True)
    g.add_argument("--hidden-size", type=positive_int, required=True)
    g.add_argument("--ffn-hidden-size", type=positive_int, default=None, help="default 4 x hidden size")
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=positive_int,
        default=None,
        help="each expert's ffn width (fine-grained experts); default --ffn-hidden-size",
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=positive_int,
        default=None,
        help="width of a dense MLP every token of an MoE layer goes through beside its routed experts",
    )
    g.add_argument(
        "--moe-shared-expert-gate",
        action="store_true",
        help="scale the shared experts' output per token by a sigmoid gate (Qwen2-MoE)",
    )
    g.add_argument("--num-attention-heads", type=positive_int, required=True)
    g.add_argument("--seq-length", type=positive_int, required=True)
    g.add_argument("--max-position-embeddings", type=positive_int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default="learned_absolute")
    g.add_argument(
        "--use-rotary-position-embeddings", action="store_true", help="same as --position-embedding-type rope"
    )
    g.add_argument(
        "--rotary-percent",
        type=positive_float,
        default=1.0,
        help="rope rotates this share of each head's dims, the first ones (GPT-NeoX: 0.25)",
    )
    g.add_argument("--rotary-base", type=positive_float, default=10000.0)
    g.add_argument("--hidden-dropout", type=probability, default=0.1)
    g.add_argument("--attention-dropout", type=probability, default=0.1)
    g.add_argument(
        "--init-method-std",
        type=positive_float,
        default=0.02,
        help="std of every weight matrix's normal init (output projections scaled by 1/sqrt(2 x layers))",
    )
    g.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=positive_float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU dense MLP: --ffn-hidden-size gated units")
    g.add_argument(
        "--disable-bias-linear",
        dest="add_bias_linear",
        action="store_false",
        help="no biases in the attention and MLP linears",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="an output layer of its own instead of the token embedding",
    )
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention: --num-query-groups key/value heads shared by the attention heads",
    )
    g.add_argument(
        "--num-query-groups",
        type=positive_int,
        default=None,
        help="key/value heads under --group-query-attention; default 1 as in Megatron-LM",
    )
    g.add_argument("--kv-channels", type=positive_int, default=None, help="head dim; default hidden size / heads")
    g.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="a --normalization norm over each head's queries and keys, before rope",
    )
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    g.add_argument(
        "--checkpoint-activations", "--recompute-activations", action="store_true", dest="checkpoint_activations"
    )

    g = parser.add_argument_group("mixture of experts (Megatron-DeepSpeed's flags)")
    g.add_argument(
        "--num-experts",
        type=positive_int,
        nargs="+",
        default=[1],
        help="experts per MoE layer: one value, or one per MoE layer (pyramid); 1 = dense",
    )
    g.add_argument(
        "--expert-interval", type=positive_int, default=2, help="layer n (from 1) is MoE when n %% interval == 0"
    )
    g.add_argument("--topk", "--moe-router-topk", type=positive_int, default=1, help="experts per token")
    g.add_argument("--moe-expert-parallel-size", type=positive_int, default=1)
    g.add_argument("--moe-loss-coeff", type=non_negative_float, default=0.01)
    g.add_argument("--moe-z-loss-coeff", type=non_negative_float, default=0.0, help="ST-MoE router z-loss weight")
    g.add_argument("--moe-train-capacity-factor", type=positive_float, default=1.0)
    g.add_argument("--moe-eval-capacity-factor", type=positive_float, default=1.0)
    g.add_argument("--moe-min-capacity", type=non_negative_int, default=4)
    g.add_argument("--disable-moe-token-dropping", action="store_true")
    g.add_argument("--mlp-type", choices=MLP_TYPES, default="standard", help="residual: PR-MoE")
    g.add_argument("--moe-noisy-gate-policy", choices=["None", "Jitter", "RSample"], default="None")
    g.add_argument("--disable-moe-rts", action="store_true", help="keep the first tokens, not random ones")
    g.add_argument(
        "--moe-token-drop-policy",
        choices=DROP_POLICIES,
        default="probs",
        help="top-k with k >= 3: an over-full expert keeps the highest probabilities or the earliest tokens",
    )
    g.add_argument("--disable-moe-top2-2nd-expert-sampling", action="store_true")
    g = parser.add_argument_group(
        "mixture of experts: Megatron-Core's routing (any score, pre-softmax, scaling, "
        "expert-bias or group flag replaces DeepSpeed's gating rules)"
    )
    g.add_argument(
        "--moe-router-score-function",
        choices=SCORE_FUNCTIONS,
        default=None,
        help="score each expert by a softmax over the experts or by its own sigmoid",
    )
    g.add_argument(
        "--moe-router-pre-softmax",
        action="store_true",
        help="softmax over all experts before the top-k (gates not renormalised); default: softmax over "
        "the top-k logits",
    )
    g.add_argument(
        "--moe-router-topk-scaling-factor", type=positive_float, default=None, help="multiply the gates by this"
    )
    g.add_argument(
        "--disable-moe-router-norm-topk-prob",
        dest="moe_router_norm_topk_prob",
        action="store_false",
        help="sigmoid scores, top-k > 1: keep the gates as scored instead of dividing them by their sum "
        "(Hugging Face's norm_topk_prob false)",
    )
    g.add_argument(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="aux-loss-free balancing: a per-expert bias added to the scores for choosing only, moved "
        "after each step towards an even load (sigmoid scores)",
    )
    g.add_argument(
        "--moe-router-bias-update-rate",
        type=positive_float,
        default=1e-3,
        help="how far each step moves the expert bias",
    )
    g.add_argument(
        "--moe-router-num-groups",
        type=positive_int,
        default=None,
        help="group-limited routing: the experts in this many equal groups (e.g. one per expert-parallel rank)",
    )
    g.add_argument(
        "--moe-router-group-topk",
        type=positive_int,
        default=None,
        help="group-limited routing: each token chooses its experts within this many groups",
    )
    g.add_argument(
        "--moe-router-load-balancing-type",
        choices=LOAD_BALANCING_TYPES,
        default="aux_loss",
        help="aux_loss over the micro-batch, seq_aux_loss per sequence, or none; weighted by --moe-loss-coeff",
    )
    g.add_argument(
        "--create-moe-param-group",
        action="store_true",
        help="accepted for Megatron-DeepSpeed recipes; expert parameters are always handled apart",
    )

    g = parser.add_argument_group("model parallelism (Megatron's flags; ranks ordered tp, dp, pp)")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=positive_int,
        default=1,
        help="split attention heads, the MLP width and the vocabulary over this many ranks",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="under tensor parallelism, split norms, dropout and residuals along the sequence too",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=positive_int,
        default=1,
        help="split the layers into this many stages, run in Megatron's 1F1B schedule",
    )
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=positive_int,
        default=None,
        help="layers of the first stage (default: an even split)",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=positive_int,
        default=None,
        help="layers of the last stage (default: an even split)",
    )
    g.add_argument("--expert-tensor-parallel-size", type=positive_int, default=1)

    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None, help="PREFIX or W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-impl", choices=["mmap"], default="mmap")
    g.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=["SentencePieceTokenizer", "GPT2BPETokenizer", "NullTokenizer"],
    )
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=positive_int, default=None, help="for NullTokenizer")
    # Megatron-LM changed both of these conventions; its current one is the default (README, data).
    g.add_argument(
        "--split-rounding",
        choices=SPLIT_ROUNDINGS,
        default=SPLIT_CUMULATIVE,
        help="--split boundaries over sequences: rounded cumulative shares (current Megatron-LM) or "
        "rounded sizes shifted to the total (legacy: Megatron-DeepSpeed)",
    )
    g.add_argument(
        "--null-tokenizer-eod",
        choices=NULL_EOD_CONVENTIONS,
        default=NULL_EOD_LAST,
        help="NullTokenizer's end-of-document id: the last of --vocab-size ids (current Megatron-LM) "
        "or one extra id, --vocab-size itself (Megatron-DeepSpeed)",
    )
    g.add_argument("--num-workers", type=non_negative_int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument(
        "--no-data-checksum",
        dest="data_checksum",
        action="store_false",
        help="open the data without reading it against the checksums preprocessing recorded beside it "
        "(PREFIX.checksum.json)",
    )

    g = parser.add_argument_group("training")
    g.add_argument(
        "--micro-batch-size",
        type=positive_int,
        default=None,
        help="required, unless --deepspeed_config sets train_micro_batch_size_per_gpu",
    )
    g.add_argument(
        "--global-batch-size", type=positive_int, default=None, help="default micro batch x data-parallel size"
    )
    g.add_argument("--train-iters", type=positive_int, default=None)
    g.add_argument("--train-samples", type=positive_int, default=None)
    g.add_argument(
        "--train-tokens",
        type=positive_int,
        default=None,
        help="stop once this many tokens are trained (a curriculum's as cut); with --train-iters or "
        "--train-samples, at whichever comes first",
    )
    g.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help="peak learning rate; required, unless --deepspeed_config sets optimizer.params.lr",
    )
    g.add_argument("--min-lr", type=non_negative_float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-iters", type=non_negative_int, default=None)
    g.add_argument("--lr-warmup-samples", type=non_negative_int, default=None)
    g.add_argument("--lr-warmup-tokens", type=non_negative_int, default=None)
    g.add_argument("--lr-decay-iters", type=positive_int, default=None)
    g.add_argument("--lr-decay-samples", type=positive_int, default=None)
    g.add_argument("--lr-decay-tokens", type=positive_int, default=None)
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.01)
    g.add_argument("--adam-beta1", type=probability, default=0.9)
    g.add_argument("--adam-beta2", type=probability, default=0.999)
    g.add_argument("--adam-eps", type=positive_float, default=1e-8)
    g.add_argument("--clip-grad", type=non_negative_float, default=1.0, help="gradient-norm clipping; 0: off")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=loss_scale, default=None, help="static fp16 loss scale; default dynamic")
    g.add_argument(
        "--initial-loss-scale",
        type=power_of_two_loss_scale,
        default=2.0**32,
        help="where the dynamic fp16 loss scale starts (DeepSpeed keeps it as fp16.initial_scale_power)",
    )
    g.add_argument("--min-loss-scale", type=loss_scale, default=1.0)
    g.add_argument("--loss-scale-window", type=positive_int, default=1000)
    g.add_argument("--hysteresis", type=positive_int, default=2)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--distributed-backend", choices=["gloo", "nccl"], default=None, help="chosen from the device when omitted"
    )
    g.add_argument("--deepspeed", action="store_true", help="read --deepspeed_config (Megatron-DeepSpeed's spelling)")
    g.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        dest="deepspeed_config",
        default=None,
        help="DeepSpeed-style JSON; values must agree with the flags given",
    )
    g.add_argument(
        "--curriculum-learning-legacy",
        action="store_true",
        help="curriculum learning by sequence length from the ds_config curriculum_learning block "
        "(Megatron-DeepSpeed's flag; the block turns it on)",
    )
    g.add_argument(
        "--random-ltd",
        action="store_true",
        help="random layerwise token dropping from the ds_config data_efficiency.data_routing.random_ltd block "
        "(Megatron-DeepSpeed's flag; the block turns it on)",
    )
    g.add_argument(
        "--data-efficiency-curriculum-learning",
        action="store_true",
        help="curriculum sampling from the ds_config data_efficiency.data_sampling.curriculum_learning block, with "
        "indexes from tools/analyze_data.py (Megatron-DeepSpeed's flag; the block turns it on)",
    )
    g.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=0,
        help="ZeRO stage: 0, 1 (optimizer state partitioned), 2 (also gradients) or 3 (also parameters)",
    )
    parser.set_defaults(deepspeed_json=None, dry_run=False)

    g = parser.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=positive_int, default=100)
    g.add_argument("--eval-interval", type=positive_int, default=1000)
    g.add_argument("--eval-iters", type=non_negative_int, default=100)
    g.add_argument("--eval-at-start", action="store_true", help="also evaluate before the first iteration")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=None,
        help="each device's peak TFLOP/s in the run's dtype, for the MFU in the log; default: a data-sheet table "
        "for common GPUs, else a GEMM probe at start-up (cached)",
    )
    g.add_argument(
        "--timing-log-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="timers in the log at each log interval: 0 none; 1 forward-backward, gradient sync, optimizer, "
        "parameter gathering, checkpoint save; 2 also forward/backward compute, data loading, pipeline sends, "
        "receives and bubble, the MoE all-to-alls and NVMe swapping",
    )
    g.add_argument(
        "--timing-log-option",
        choices=["max", "minmax", "all"],
        default="minmax",
        help="each timer across ranks: the max, the min and max, or every rank's",
    )
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="the timers as TensorBoard scalars too")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=positive_int, default=None)
    g.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in the background from a copy in host memory; `latest` moves once every "
        "rank's files are durable",
    )
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--reset-iteration",
        action="store_true",
        help="--load only the weights and start at iteration 0 with a fresh optimizer and LR schedule",
    )
    g.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="accepted for Megatron scripts: this run's LR-schedule flags always win over the checkpoint's, "
        "with one line saying what changed",
    )
    g.add_argument(
        "--ckpt-step", type=positive_int, default=None, help="load this iteration instead of the one `latest` names"
    )
    g.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="let a run that starts from scratch save into a --save folder that already holds checkpoints",
    )
    g.add_argument(
        "--moe-use-upcycling",
        action="store_true",
        help="start this MoE model from the dense checkpoint in --load (every expert a copy or slice of its "
        "layer's dense MLP) at iteration 0; once --save holds checkpoints, the run resumes those",
    )

    g = parser.add_argument_group("long runs: faults and planned exits")
    g.add_argument(
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="stop on a NaN or infinite loss or gradient in bf16/fp32 (default)",
    )
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="skip such steps instead, as fp16 always does",
    )
    g.add_argument(
        "--max-consecutive-skipped-iterations",
        type=non_negative_int,
        default=50,
        help="stop when this many iterations in a row skip their step (fp16 overflow); 0: never",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on --exit-signal, save a checkpoint at the next iteration and exit 0",
    )
    g.add_argument("--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"])
    g.add_argument(
        "--exit-interval",
        type=positive_int,
        default=None,
        help="save and exit when the iteration is a multiple of this",
    )
    g.add_argument(
        "--exit-duration-in-mins",
        type=positive_float,
        default=None,
        help="save and exit once training has run this many minutes",
    )
    add_distill_args(parser)
    return parser


def _one_of(args: argparse.Namespace, names: list[str]) -> str | None:
    given = [n for n in names if getattr(args, n) is not None]
    if len(given) > 1:
        flags = " and ".join("--" + n.replace("_", "-") for n in given)
        raise ConfigError(f"{flags} were both given; use only one of them")
    return given[0] if given else None


def _span(args: argparse.Namespace, kind: str) -> Span | None:
    """The length --KIND-iters, --KIND-samples or --KIND-tokens gives (at most one of them)."""
    units: dict[str, SpanUnit] = {f"{kind}_iters": "iters", f"{kind}_samples": "samples"}
    if kind != "train":  # --train-tokens is a stop of its own (_train_length)
        units[f"{kind}_tokens"] = "tokens"
    which = _one_of(args, list(units))
    return None if which is None else Span(units[which], getattr(args, which))


def _train_length(args: argparse.Namespace) -> Span:
    """--train-iters or --train-samples, else --train-tokens: Megatron-DeepSpeed takes --train-tokens
    beside either as a second stop (training/run_length.py)."""
    length = _span(args, "train")
    if length is not None:
        return length
    if args.train_tokens is None:
        raise ConfigError("give the training length with one of --train-iters, --train-samples, --train-tokens")
    return Span("tokens", args.train_tokens)


def _check_lr_spans(training: TrainingConfig) -> None:
    if training.lr_decay_style != "constant" and training.lr_decay_tokens <= training.lr_warmup_tokens:
        raise ConfigError(
            f"the LR warmup ({training.lr_warmup_tokens} tokens) is not shorter than its decay "
            f"({training.lr_decay_tokens} tokens); shorten --lr-warmup-* or lengthen --lr-decay-* or the training"
        )


def _num_query_groups(args: argparse.Namespace) -> int | None:
    """Megatron-LM's GQA flags: --num-query-groups counts only with --group-query-attention (default 1)."""
    if not args.group_query_attention:
        if args.num_query_groups is not None:
            raise ConfigError("--num-query-groups needs --group-query-attention; add it, or drop --num-query-groups")
        return None
    return args.num_query_groups or 1


def model_config_from_args(args: argparse.Namespace) -> GPTConfig:
    """The model's shape from the flags (vocab_size is filled in once the tokenizer is known)."""
    max_positions = args.max_position_embeddings or args.seq_length
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=None,
        max_position_embeddings=max_positions,
        ffn_hidden_size=args.ffn_hidden_size,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        num_query_groups=_num_query_groups(args),
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        position_embedding_type="rope" if args.use_rotary_position_embeddings else args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        checkpoint_activations=args.checkpoint_activations,
        num_experts=tuple(args.num_experts),
        expert_interval=args.expert_interval,
        mlp_type=args.mlp_type,
        moe=MoEConfig(
            topk=args.topk,
            train_capacity_factor=args.moe_train_capacity_factor,
            eval_capacity_factor=args.moe_eval_capacity_factor,
            min_capacity=args.moe_min_capacity,
            drop_tokens=not args.disable_moe_token_dropping,
            use_rts=not args.disable_moe_rts,
            noisy_gate_policy=None if args.moe_noisy_gate_policy == "None" else args.moe_noisy_gate_policy,
            sample_second_expert=not args.disable_moe_top2_2nd_expert_sampling,
            aux_loss_coeff=args.moe_loss_coeff,
            z_loss_coeff=args.moe_z_loss_coeff,
            use_residual=args.mlp_type == "residual",
            drop_policy=args.moe_token_drop_policy,
            router_score_function=args.moe_router_score_function,
            router_pre_softmax=args.moe_router_pre_softmax,
            router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            router_enable_expert_bias=args.moe_router_enable_expert_bias,
            router_num_groups=args.moe_router_num_groups,
            router_group_topk=args.moe_router_group_topk,
            router_norm_topk_prob=args.moe_router_norm_topk_prob,
            router_bias_update_rate=args.moe_router_bias_update_rate,
            router_load_balancing_type=args.moe_router_load_balancing_type,
        ),
    )


def _check_model_parallel_flags(args: argparse.Namespace) -> None:
    """What tensor and pipeline parallelism cover so far; the rest stops here with one sentence each."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.sequence_parallel and tp == 1:
        raise ConfigError(
            "--sequence-parallel splits the activations between tensor-parallel regions; "
            "add --tensor-model-parallel-size N (N > 1) or drop it"
        )
    layer_counts(args.num_layers, pp, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)


def _check_tensorboard_dir(folder: str | None) -> None:
    """Stop at config time, not at the first log line, where a file is in the way of the folder."""
    in_the_way = blocking_file(Path(folder)) if folder else None
    if in_the_way is None:
        return
    where = "is a file" if in_the_way == Path(folder) else f"lies under {in_the_way}, which is a file"
    raise ConfigError(
        f"--tensorboard-dir {folder} {where}, not a folder; point it at a folder, or at a path that does not exist yet"
    )


def config_from_args(args: argparse.Namespace) -> PretrainConfig:
    _check_model_parallel_flags(args)
    for dest, key in (("micro_batch_size", "train_micro_batch_size_per_gpu"), ("lr", "optimizer.params.lr")):
        if getattr(args, dest) is None:
            raise ConfigError(f"--{dest.replace('_', '-')} is required; give it, or {key} in --deepspeed_config")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 were both given; choose one precision")
    if args.fp16 and args.loss_scale is None and args.min_loss_scale > args.initial_loss_scale:
        raise ConfigError(
            f"--min-loss-scale {args.min_loss_scale:g} is above --initial-loss-scale {args.initial_loss_scale:g}, so "
            "the dynamic fp16 loss scale would start below its minimum; lower --min-loss-scale or raise the other"
        )
    _check_tensorboard_dir(args.tensorboard_dir)
    max_positions = args.max_position_embeddings or args.seq_length
    if args.seq_length > max_positions:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {max_positions}")
    if not args.data_path and not args.train_data_path:
        raise ConfigError(
            "no training data: give --data-path PREFIX (made by tools/preprocess_data.py) or --train-data-path"
        )
    if args.data_path and args.train_data_path:
        raise ConfigError("--data-path and --train-data-path were both given; use one of them for training data")
    train_length = _train_length(args)
    model = model_config_from_args(args)
    data = DataConfig(
        data_path=tuple(args.data_path) if args.data_path else None,
        train_data_path=tuple(args.train_data_path) if args.train_data_path else None,
        valid_data_path=tuple(args.valid_data_path) if args.valid_data_path else None,
        test_data_path=tuple(args.test_data_path) if args.test_data_path else None,
        split=args.split,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        split_rounding=args.split_rounding,
        null_tokenizer_eod=args.null_tokenizer_eod,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        num_workers=args.num_workers,
        eod_mask_loss=args.eod_mask_loss,
        data_checksum=args.data_checksum,
    )
    training = TrainingConfig(
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size or args.micro_batch_size,
        default_global_batch=args.global_batch_size is None,
        train_length=train_length,
        train_tokens=args.train_tokens,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_warmup=_span(args, "lr_warmup"),
        lr_decay=_span(args, "lr_decay"),
        seed=args.seed,
        expert_parallel_size=args.moe_expert_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        tensor_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_parallel_size=args.pipeline_model_parallel_size,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
        check_for_nan=args.check_for_nan_in_loss_and_grad,
        max_consecutive_skipped_iterations=args.max_consecutive_skipped_iterations,
        deepspeed_config=args.deepspeed_config,
        curriculum_learning_legacy=args.curriculum_learning_legacy,
        random_ltd=args.random_ltd,
        data_efficiency_curriculum_learning=args.data_efficiency_curriculum_learning,
    )
    _check_lr_spans(training)
    logging = LoggingConfig(
        log_interval=args.log_interval,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        eval_at_start=args.eval_at_start,
        tensorboard_dir=args.tensorboard_dir,
        peak_tflops=args.peak_tflops,
        timing_log_level=args.timing_log_level,
        timing_log_option=args.timing_log_option,
        log_timers_to_tensorboard=args.log_timers_to_tensorboard,
    )
    if args.reset_iteration and not args.load:
        raise ConfigError("--reset-iteration restarts from the weights in --load; add --load DIR or drop it")
    if args.async_save and not args.save:
        raise ConfigError("--async-save writes the checkpoints of --save in the background; add --save DIR or drop it")
    checkpoint = CheckpointConfig(
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        load_optim=not args.no_load_optim,
        load_rng=not args.no_load_rng,
        reset_iteration=args.reset_iteration,
        ckpt_step=args.ckpt_step,
        overwrite_checkpoints=args.overwrite_checkpoints,
        moe_use_upcycling=args.moe_use_upcycling,
        async_save=args.async_save,
    )
    if args.moe_use_upcycling and (not args.load or args.reset_iteration):
        raise ConfigError(
            "--moe-use-upcycling starts from the dense checkpoint in --load at iteration 0; "
            "give --load DIR, without --reset-iteration"
        )
    if args.ckpt_step is not None and not args.load:
        raise ConfigError("--ckpt-step picks a checkpoint in --load; add --load DIR or drop it")
    exit_config = ExitConfig(
        signal_handler=args.exit_signal_handler,
        signal=args.exit_signal,
        interval=args.exit_interval,
        duration_minutes=args.exit_duration_in_mins,
    )
    distill = distill_config_from_args(args, training.global_batch_size, training.seq_length)
    runtime = _runtime_from_args(args)
    return PretrainConfig(
        model, data, training, logging, checkpoint, exit_config, runtime, distill=distill, dry_run=args.dry_run
    )


def parse_args(argv: list[str] | None = None) -> PretrainConfig:
    """Parse and validate Megatron-style flags (merged with --deepspeed_config when given); a
    bad or unknown flag is a ConfigError naming it."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.deepspeed_config and not args.deepspeed:
        raise ConfigError("--deepspeed_config is read only with --deepspeed; add --deepspeed")
    if args.deepspeed_config:
        args = merge_deepspeed_config(args, explicit_flags(parser, argv))
    return config_from_args(args)


def with_data_parallel_size(config: PretrainConfig, dp_size: int) -> PretrainConfig:
    """Apply Megatron's default global batch (micro batch x data-parallel size) once the world
    size is known, and check that the global batch divides into micro-batches and that the
    expert-parallel size divides every MoE layer's expert count (the grid checks the ranks)."""
    ep = config.training.expert_parallel_size
    uneven = [count for count in config.model.experts_per_layer if count > 1 and count % ep]
    if uneven:
        raise ConfigError(
            f"{uneven[0]} experts cannot be split over --moe-expert-parallel-size {ep}; "
            "choose an expert-parallel size that divides every layer's expert count"
        )
    if config.training.default_global_batch and dp_size > 1:
        training = replace(config.training, global_batch_size=config.training.micro_batch_size * dp_size)
        _check_lr_spans(training)
        distill = config.distill and config.distill.for_batch(training.global_batch_size, training.seq_length)
        config = replace(config, training=training, distill=distill)
    t = config.training
    if t.global_batch_size % (t.micro_batch_size * dp_size):
        raise ConfigError(
            f"--global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp_size}; change one of them"
        )
    accumulation = t.global_batch_size // (t.micro_batch_size * dp_size)
    json_accumulation = config.runtime.gradient_accumulation_steps  # only the JSON sets it
    if json_accumulation is not None and json_accumulation != accumulation:
        raise ConfigError(
            f"gradient_accumulation_steps {json_accumulation} in {t.deepspeed_config} disagrees "
            f"with global batch {t.global_batch_size} / (micro batch {t.micro_batch_size} x {dp_size} ranks) "
            f"= {accumulation}; fix one of them"
        )
    scheduler = config.runtime_config(dp_size).scheduler  # every runtime setting, checked before any work
    if scheduler is not None:
        scheduler_parameters(scheduler.type, scheduler.params)
    return config
