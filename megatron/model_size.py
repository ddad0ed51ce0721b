"""How big a model is before it exists: built on the meta device (no memory) from the same flags
as training, it gives total and active parameters, training FLOPs per token, and the memory per
rank for weights, gradients and optimizer state under each ZeRO stage, expert-parallel size and
tensor/pipeline-parallel layout.

Memory follows this toolkit's layout: fp32 weights and gradients (bf16/fp16 run under autocast),
Adam's two fp32 moments, and under ZeRO an fp32 master partition. The ranks form the grid of
megatron/parallel.py, world = tp x dp x pp:
- pipeline parallelism (pp) gives each stage its layers, evenly or Megatron's uneven first/last
  stages; the first stage also holds the embeddings, the last the final norm and the output layer
  (with tied embeddings and pp > 1, a copy of the word embedding it trains too, as Megatron does);
  the table reports the most loaded stage;
- tensor parallelism (tp) splits what Megatron splits: the attention's query_key_value and the
  dense MLP's dense_h_to_4h (weights and biases, column-parallel), the attention's dense and
  dense_4h_to_h weights (row-parallel; their biases are whole), the word embedding and the untied
  output layer (by vocabulary rows). Norms, position embeddings and everything in an MoE layer but
  its experts (router, PR-MoE residual MLP and coefficient, shared experts) are whole on each tp rank;
- dense parameters are replicated over dp and partitioned over it by ZeRO; experts are split over
  the expert-parallel group (ep, carved out of a stage's tp x dp ranks), each expert's hidden
  features over the expert-tensor-parallel group (etp: w1, b1 and w2; the output bias b2 is whole),
  and partitioned over their expert-data-parallel group, tp x dp / (ep x etp) ranks.
Activations are not counted: they depend on micro-batch, sequence length and activation checkpointing.
"""

import os
from dataclasses import dataclass, replace

import torch

from megatron.config.flags import PretrainConfig
from megatron.data.tokenizer import padded_vocab_size, tokenizer_of
from megatron.errors import ConfigError, DataError
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoELayer
from megatron.model.pipeline_stage import layer_counts
from megatron.parallel import check_parallel_sizes
from megatron.placement import expert_ids
from megatron.tokenizer_spec import TokenizerSpec, tokenizer_spec_of

GIB = 2**30
ZERO_STAGES = (0, 1, 2, 3)
GPT2_VOCAB = 50257  # the vocabulary of GPT2BPETokenizer, the default --tokenizer-type
# Megatron's tensor-parallel linears, by the name of the module that holds the weight
COLUMN_PARALLEL = ("query_key_value", "dense_h_to_4h", "output_layer")  # output rows split: weight and bias
ROW_PARALLEL = ("dense", "dense_4h_to_h")  # input columns split: the weight; the bias is added whole after the sum
VOCAB_PARALLEL = ("word_embeddings",)
HEAD = (
    "final_layernorm",
    "output_layer",
)  # the last pipeline stage's; other parameters outside the layers: the first's


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of a part of the model, by how the parallel layout divides them."""

    tp_split: int = 0  # split over the tensor-parallel ranks
    tp_whole: int = 0  # whole on every tensor-parallel rank
    expert: int = 0  # in MoE experts: split over expert and expert-tensor parallelism
    expert_tp_whole: int = 0  # the experts' output biases: split over expert parallelism only

    def __add__(self, other: "ParameterCounts") -> "ParameterCounts":
        return ParameterCounts(
            self.tp_split + other.tp_split,
            self.tp_whole + other.tp_whole,
            self.expert + other.expert,
            self.expert_tp_whole + other.expert_tp_whole,
        )


@dataclass(frozen=True)
class ModelSize:
    total: int
    active: int  # parameters one token goes through: k experts of each MoE layer, everything dense
    dense: int  # replicated over data parallelism
    expert: int  # split over expert parallelism
    flops_per_token: float  # training (forward + backward)
    embedding: ParameterCounts = ParameterCounts()  # the first pipeline stage's: word and position embeddings
    layers: tuple[ParameterCounts, ...] = ()
    head: ParameterCounts = ParameterCounts()  # the last stage's: final norm and the untied output layer
    tied_output: int = 0  # the word embedding the last stage copies when the output layer is tied and pp > 1


@dataclass(frozen=True)
class RankParameters:
    """What one rank of a pipeline stage holds before ZeRO partitions it."""

    dense: float  # its tensor-parallel slice of the split parameters and the whole-per-rank ones
    expert: float  # its expert-parallel (and expert-tensor-parallel) share of the stage's experts


@dataclass(frozen=True)
class RankMemory:
    weights: float  # bytes
    gradients: float
    optimizer: float
    stage: int = 0  # the pipeline stage (from 0) these bytes are for: the most loaded one

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def _parameter_kinds(model: GPTModel) -> dict[str, str]:
    """Each parameter's name -> "expert", "expert_tp_whole", "tp_split" or "tp_whole" (see the module's docstring)."""
    in_moe = {
        f"{name}.{p}"
        for name, module in model.named_modules()
        if isinstance(module, MoELayer)
        for p, _ in module.named_parameters()
    }
    kinds = {}
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        holder = module.rpartition(".")[2]
        split = holder in COLUMN_PARALLEL or holder in VOCAB_PARALLEL or (holder in ROW_PARALLEL and leaf == "weight")
        if expert_ids(param) is not None:
            kinds[name] = "expert_tp_whole" if name.endswith("experts.b2") else "expert"
        else:
            kinds[name] = "tp_whole" if name in in_moe or not split else "tp_split"
    return kinds


def model_size(config: GPTConfig, seq_length: int) -> ModelSize:
    with torch.device("meta"):
        model = GPTModel(config)
    kinds = _parameter_kinds(model)
    embedding, head = ParameterCounts(), ParameterCounts()
    layers = [ParameterCounts()] * config.num_layers
    for name, param in model.named_parameters():
        counts = ParameterCounts(**{kinds[name]: param.numel()})
        top, _, rest = name.partition(".")
        if top == "layers":
            layers[int(rest.partition(".")[0])] += counts
        elif top in HEAD:
            head += counts
        else:
            embedding += counts
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    expert = sum(p.numel() for p in params if expert_ids(p) is not None)
    idle = 0  # expert parameters a token skips: (E - k) / E of each MoE layer's experts
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            per_layer = sum(p.numel() for p in layer.experts.parameters())
            idle += per_layer * (layer.num_experts - min(config.moe.topk, layer.num_experts)) // layer.num_experts
    tied = 0 if config.untie_embeddings_and_output_weights else model.word_embeddings.weight.numel()
    return ModelSize(
        total,
        total - idle,
        total - expert,
        expert,
        config.flops_per_token(seq_length),
        embedding,
        tuple(layers),
        head,
        tied,
    )


def stage_parameters(
    size: ModelSize, pp_size: int = 1, first_stage_layers: int | None = None, last_stage_layers: int | None = None
) -> list[ParameterCounts]:
    """The parameters of each pipeline stage, the word embedding's copy on the last one included."""
    stages, start = [], 0
    for stage, count in enumerate(layer_counts(len(size.layers), pp_size, first_stage_layers, last_stage_layers)):
        part = sum(size.layers[start : start + count], ParameterCounts())
        start += count
        if stage == 0:
            part += size.embedding
        if stage == pp_size - 1:
            part += size.head + ParameterCounts(tp_split=size.tied_output if pp_size > 1 else 0)
        stages.append(part)
    return stages


def rank_parameters(
    size: ModelSize,
    tp_size: int = 1,
    pp_size: int = 1,
    ep_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    expert_tp_size: int = 1,
) -> list[RankParameters]:
    """What one rank of each pipeline stage holds before ZeRO: dense split by TP, experts by EP and expert-TP."""
    return [
        RankParameters(
            stage.tp_split / tp_size + stage.tp_whole,
            stage.expert / (ep_size * expert_tp_size) + stage.expert_tp_whole / ep_size,
        )
        for stage in stage_parameters(size, pp_size, first_stage_layers, last_stage_layers)
    ]


def rank_memory(
    size: ModelSize,
    world_size: int,
    ep_size: int,
    zero_stage: int,
    tp_size: int = 1,
    pp_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    expert_tp_size: int = 1,
) -> RankMemory:
    """Bytes per rank of the most loaded pipeline stage for `world_size` ranks as tp x dp x pp, experts
    split `ep_size` x `expert_tp_size` ways, ZeRO stage 0-3 (dense partitioned over dp, experts over
    tp x dp / (ep x etp))."""
    check_parallel_sizes(world_size, tp_size, pp_size, ep_size, expert_tp_size)
    dp_size, expert_dp_size = world_size // (tp_size * pp_size), world_size // (pp_size * ep_size * expert_tp_size)
    stages = []
    held_by_stage = rank_parameters(
        size, tp_size, pp_size, ep_size, first_stage_layers, last_stage_layers, expert_tp_size
    )
    for stage, held in enumerate(held_by_stage):
        replica = held.dense + held.expert  # what one rank holds without ZeRO
        shard = held.dense / dp_size + held.expert / expert_dp_size
        stages.append(
            RankMemory(
                weights=4 * (shard if zero_stage >= 3 else replica),
                gradients=4 * (shard if zero_stage >= 2 else replica),
                optimizer=8 * replica if zero_stage == 0 else 12 * shard,  # Adam m, v (+ fp32 master under ZeRO)
                stage=stage,
            )
        )
    return max(stages, key=lambda memory: memory.total)  # the first of equals


def valid_ep_sizes(config: GPTConfig, world_size: int, pp_size: int = 1, expert_tp_size: int = 1) -> list[int]:
    """Expert-parallel sizes that (times expert-TP) divide a pipeline stage's ranks and that divide
    every MoE layer's expert count."""
    counts = [c for c in config.experts_per_layer if c > 1]
    stage_ranks = world_size // (pp_size * expert_tp_size)
    return (
        [ep for ep in range(1, stage_ranks + 1) if stage_ranks % ep == 0 and all(c % ep == 0 for c in counts)]
        if counts
        else [1]
    )


def check_layout(
    config: GPTConfig,
    world_size: int,
    tp_size: int = 1,
    pp_size: int = 1,
    ep_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    expert_tp_size: int = 1,
) -> None:
    """Raise a ConfigError unless the model splits over this layout of `world_size` ranks."""
    check_parallel_sizes(world_size, tp_size, pp_size, ep_size, expert_tp_size)
    has_dense_mlp = 1 in config.experts_per_layer  # MoE layers' own MLPs stay whole under TP
    for count, flag, splits in (
        (config.num_attention_heads, "--num-attention-heads", True),
        (config.kv_heads, "--num-query-groups", True),
        (config.ffn_hidden_size, "--ffn-hidden-size", has_dense_mlp),
    ):
        if splits and count % tp_size:
            raise ConfigError(
                f"{flag} {count} cannot be split over --tensor-model-parallel-size {tp_size}; "
                "choose a tensor-parallel size that divides the heads, key/value groups and MLP width"
            )
    if config.vocab_size % tp_size:
        raise ConfigError(
            f"the vocabulary of {config.vocab_size:,} rows cannot be split over --tensor-model-parallel-size "
            f"{tp_size}; give a --padded-vocab-size that is a multiple of it"
        )
    uneven = [count for count in config.experts_per_layer if count > 1 and count % ep_size]
    if uneven:
        raise ConfigError(
            f"{uneven[0]} experts cannot be split over --moe-expert-parallel-size {ep_size}; "
            "choose an expert-parallel size that divides every layer's expert count"
        )
    if config.is_moe and config.moe_ffn_hidden_size % expert_tp_size:
        raise ConfigError(
            f"the experts' hidden size {config.moe_ffn_hidden_size} is not divisible by "
            f"--expert-tensor-parallel-size {expert_tp_size}; choose sizes that divide it"
        )
    layer_counts(config.num_layers, pp_size, first_stage_layers, last_stage_layers)


@dataclass(frozen=True)
class Vocabulary:
    """The embedding's rows at each tensor-parallel size: the tokenizer's tokens padded to a multiple
    of --make-vocab-size-divisible-by x TP, as training pads them, or rows given as they are."""

    tokens: int
    divisible_by: int | None = None  # None: `tokens` are the rows (--padded-vocab-size, a checkpoint's)

    def rows(self, tp_size: int = 1) -> int:
        return self.tokens if self.divisible_by is None else padded_vocab_size(self.tokens, self.divisible_by * tp_size)


def sizing_vocab(tokenizer: TokenizerSpec, divisible_by: int) -> Vocabulary:
    """The vocabulary: from --vocab-size (GPT-2's is GPT2_VOCAB) or else from the tokenizer files."""
    raw = tokenizer.vocab_size
    if tokenizer.tokenizer_type == "NullTokenizer" or raw is None:
        try:
            raw = tokenizer_of(tokenizer).vocab_size
        except (DataError, OSError, TypeError, ValueError) as e:
            raise DataError(
                f"cannot read the tokenizer to size the vocabulary ({e}); "
                f"give --vocab-size N ({GPT2_VOCAB} for GPT-2) to size the model without its files"
            ) from e
    return Vocabulary(raw, divisible_by)


def with_scale(n: float) -> str:
    """1234567890 -> '1,234,567,890 (1.23B)': the exact number, then three digits to read at a glance."""
    rounded = float(f"{n:.3g}")  # scale after rounding, so that 999,999,999 reads 1B and not 1e+03M
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if rounded >= scale:
            return f"{n:,.0f} ({rounded / scale:g}{suffix})"
    return f"{n:,.0f}"


def model_options(config: GPTConfig) -> str:
    """The Megatron-LM model options that differ from the classic GPT, as a list to read ('' for none)."""
    c = config
    options = [
        (c.num_query_groups is not None, f"{c.kv_heads} query groups"),
        (c.kv_channels is not None, f"head dim {c.head_dim}"),
        (c.qk_layernorm, "qk norm"),
        (c.swiglu, "SwiGLU"),
        (c.normalization != "LayerNorm", c.normalization),
        (not c.add_bias_linear, "no linear biases"),
        (c.untie_embeddings_and_output_weights, "untied output layer"),
        (c.position_embedding_type != "learned_absolute", f"{c.position_embedding_type} positions"),
        (c.rotary_percent != 1.0, f"rotary percent {c.rotary_percent:g}"),
        (c.is_moe and c.moe_ffn_hidden_size != c.ffn_hidden_size, f"expert ffn {c.moe_ffn_hidden_size}"),
        (
            c.moe_shared_expert_intermediate_size is not None,
            f"shared experts {c.moe_shared_expert_intermediate_size}{' gated' if c.moe_shared_expert_gate else ''}",
        ),
    ]
    return "".join(f", {text}" for given, text in options if given)


def _memory_columns(m: RankMemory) -> str:
    return f"{m.weights / GIB:>10.2f} {m.gradients / GIB:>10.2f} {m.optimizer / GIB:>10.2f} {m.total / GIB:>10.2f}"


MEMORY_HEADER = f"{'weights':>10} {'gradients':>10} {'optimizer':>10} {'total':>10}"


@dataclass(frozen=True)
class Layout:
    """A run's parallel sizes (megatron/parallel.py's grid) and its uneven pipeline stages, if any."""

    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    expert_tp_size: int = 1

    @property
    def stages(self) -> dict[str, int | None]:
        """The uneven first/last stages and the expert-TP size as keyword arguments (layer_counts
        ignores the stages without pipelining)."""
        return {
            "first_stage_layers": self.first_stage_layers,
            "last_stage_layers": self.last_stage_layers,
            "expert_tp_size": self.expert_tp_size,
        }


def layout_rows(
    config: GPTConfig,
    seq_length: int,
    world_size: int,
    layout: Layout,
    zero_stage: int,
    vocabulary: Vocabulary | None = None,
    size: ModelSize | None = None,
) -> list[str]:
    """The memory per rank of every tensor x pipeline layout of `world_size` ranks the model splits over, at
    this run's EP size and `zero_stage`; the vocabulary padded for each TP size (else as `config` has it).
    `size`, if given, is `config`'s, so that it is not built again."""
    sizes: dict[int, ModelSize] = {config.vocab_size: size} if size is not None else {}
    uneven = ", ".join(
        f"{n} on the {where} stage"
        for where, n in (("first", layout.first_stage_layers), ("last", layout.last_stage_layers))
        if n is not None
    )
    lines = [
        f"memory per rank in GiB for each layout of {world_size} rank(s) at ZeRO stage {zero_stage} and EP size "
        f"{layout.ep_size}{f' x expert-TP {layout.expert_tp_size}' if layout.expert_tp_size > 1 else ''}, "
        f"the most loaded pipeline stage (layers {f'{uneven}, the rest ' if uneven else ''}split "
        "evenly; vocabulary padded for each TP size); * this run's layout",
        f"{'TP':>4} {'PP':>4} {'DP':>5} {'EP-DP':>6} {'stage':>6} {MEMORY_HEADER}",
    ]
    for tp in (n for n in range(1, world_size + 1) if world_size % n == 0):
        rows = vocabulary.rows(tp) if vocabulary is not None else config.vocab_size
        model = replace(config, vocab_size=rows)
        for pp in (n for n in range(1, world_size // tp + 1) if world_size % (tp * n) == 0):
            try:
                check_layout(model, world_size, tp, pp, layout.ep_size, **layout.stages)
            except ConfigError:
                continue
            if rows not in sizes:
                sizes[rows] = model_size(model, seq_length)
            m = rank_memory(sizes[rows], world_size, layout.ep_size, zero_stage, tp, pp, **layout.stages)
            mark = " *" if (tp, pp) == (layout.tp_size, layout.pp_size) else ""
            expert_dp = world_size // (pp * layout.ep_size * layout.expert_tp_size)
            lines.append(
                f"{tp:>4} {pp:>4} {world_size // (tp * pp):>5} {expert_dp:>6} {m.stage:>6} {_memory_columns(m)}{mark}"
            )
    return lines


def size_report(
    config: GPTConfig,
    seq_length: int,
    world_size: int,
    layout: Layout = Layout(),
    zero_stage: int = 0,
    vocabulary: Vocabulary | None = None,
) -> list[str]:
    """The lines `pretrain_gpt.py --dry-run` and tools/model_size.py print: the model, memory per rank
    for each ZeRO stage and EP size at this run's TP and PP sizes, then for each TP x PP layout at
    `zero_stage`. `config`'s vocabulary is this run's; `vocabulary` pads it for the other TP sizes."""
    tp, pp = layout.tp_size, layout.pp_size
    check_layout(config, world_size, tp, pp, layout.ep_size, **layout.stages)
    size = model_size(config, seq_length)
    grid = f" as TP {tp} x DP {world_size // (tp * pp)} x PP {pp}" if tp * pp > 1 else ""
    lines = [
        f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads"
        f"{model_options(config)}, "
        f"sequence {seq_length:,}, vocabulary {config.vocab_size:,} (padded), "
        f"experts per layer {config.experts_per_layer}"
        + (
            f", residual (PR-MoE), top-{config.moe.topk}"
            if config.mlp_type == "residual"
            else f", top-{config.moe.topk}"
            if config.is_moe
            else ""
        ),
        f"total parameters: {with_scale(size.total)}",
        f"active parameters per token: {with_scale(size.active)}",
        f"training FLOPs per token: {with_scale(size.flops_per_token)}, forward + backward over the active parameters",
        f"memory per rank in GiB on {world_size} rank(s){grid}: fp32 weights and gradients, Adam moments "
        "(+ fp32 master partition under ZeRO); activations not included"
        + ("; the most loaded pipeline stage" if pp > 1 else "")
        + (f"; experts split over expert-TP {layout.expert_tp_size}" if layout.expert_tp_size > 1 else "")
        + "; * this run's EP size",
        f"{'EP size':>8} {'ZeRO':>5} {MEMORY_HEADER}" + (f" {'stage':>6}" if pp > 1 else ""),
    ]
    for ep in valid_ep_sizes(config, world_size, pp, layout.expert_tp_size):
        for stage in ZERO_STAGES:
            m = rank_memory(size, world_size, ep, stage, tp, pp, **layout.stages)
            mark = " *" if ep == layout.ep_size else ""
            lines.append(f"{ep:>8} {stage:>5} {_memory_columns(m)}" + (f" {m.stage:>6}" if pp > 1 else "") + mark)
    return lines + layout_rows(config, seq_length, world_size, layout, zero_stage, vocabulary, size)


def dry_run(config: PretrainConfig, world: int) -> None:
    """`pretrain_gpt.py --dry-run`: the size of the model these (checked) flags train on `world` ranks."""
    t = config.training
    layout = Layout(
        t.tensor_parallel_size,
        t.pipeline_parallel_size,
        t.expert_parallel_size,
        t.first_stage_layers,
        t.last_stage_layers,
        t.expert_tensor_parallel_size,
    )
    vocabulary = sizing_vocab(tokenizer_spec_of(config.data), config.data.make_vocab_size_divisible_by)
    model = replace(config.model, vocab_size=vocabulary.rows(layout.tp_size))
    zero_stage = config.runtime_config(world // (layout.tp_size * layout.pp_size)).zero_optimization.stage
    if int(os.environ.get("RANK", "0")) == 0:
        lines = size_report(model, t.seq_length, world, layout, zero_stage, vocabulary)
        if config.checkpoint.async_save:
            lines.append(async_save_line(model, t.seq_length, world, layout, zero_stage))
        print("\n".join(lines), flush=True)


def async_save_line(config: GPTConfig, seq_length: int, world_size: int, layout: Layout, zero_stage: int) -> str:
    """--async-save's host copy: at most a rank's weights and optimizer state (what it saves)."""
    m = rank_memory(model_size(config, seq_length), world_size, layout.ep_size, zero_stage, layout.tp_size,
                    layout.pp_size, **layout.stages)  # fmt: skip
    return (
        f"--async-save: up to {(m.weights + m.optimizer) / GIB:.2f} GiB of host memory per rank for the copy of a "
        "checkpoint while it is written (the rank's weights and optimizer state)"
    )
