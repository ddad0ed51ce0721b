"""Knowledge-distillation flags (Megatron-DeepSpeed's MoS spelling) -> one frozen `DistillConfig`.

The teacher's shape comes from its own checkpoint; the `--*-teacher` flags, when given, are
checks against it, so a recipe states what it expects and a wrong checkpoint stops the run.
"""

import argparse
from dataclasses import dataclass, fields, replace

from megatron.config.parser import non_negative_float, positive_float, positive_int
from megatron.config.spans import Span
from megatron.errors import ConfigError
from megatron.model.config import MLP_TYPES, GPTConfig

TEACHER_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_experts", "mlp_type")


@dataclass(frozen=True)
class TeacherExpectation:
    """The teacher's sizes as the `--*-teacher` flags state them; None where a flag was not given."""

    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    ffn_hidden_size: int | None = None
    num_experts: tuple[int, ...] | None = None
    mlp_type: str | None = None

    def mismatches(self, saved: GPTConfig) -> list[str]:
        """'--flag X but the checkpoint has Y' for every stated size the saved config contradicts."""
        found = []
        for f in fields(self):
            expected = getattr(self, f.name)
            if expected is None:
                continue
            actual = getattr(saved, f.name)
            stated = getattr(self, f.name)
            if f.name == "num_experts":  # one count or one per MoE layer: compare the per-layer plan
                expected, actual = _experts_per_layer(saved, expected), saved.experts_per_layer
                stated = " ".join(map(str, stated))
            if expected != actual:
                found.append(f"--{f.name.replace('_', '-')}-teacher {stated} but the checkpoint has {actual}")
        return found


def _experts_per_layer(saved: GPTConfig, counts: tuple[int, ...]) -> list[int] | tuple[int, ...]:
    try:
        return replace(saved, num_experts=counts).experts_per_layer
    except ConfigError:
        return counts  # a count list that does not fit the saved depth cannot match


@dataclass(frozen=True)
class DistillConfig:
    load_teacher: str
    kd: bool  # the KD term is on (until `stop_iteration`); False: the teacher only initialises the student
    alpha_ce: float  # weight of the student's own LM cross entropy while KD is on
    beta_ce: float  # weight of the KD term
    temperature: float
    kd_stop: Span | None  # --kd-stop-iters or --kd-stop-tokens as given; None: KD for the whole run
    stop_iteration: int | None  # kd_stop in iterations of the global batch: KD off from this one on
    init_from_teacher: bool
    teacher: TeacherExpectation

    def for_batch(self, global_batch_size: int, seq_length: int) -> "DistillConfig":
        """This config with the KD stop counted in iterations of this global batch."""
        stop = None if self.kd_stop is None else self.kd_stop.iterations(global_batch_size, seq_length)
        return replace(self, stop_iteration=stop)

    def kd_active(self, iteration: int) -> bool:
        return self.kd and (self.stop_iteration is None or iteration < self.stop_iteration)


def add_distill_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("knowledge distillation (MoS)")
    g.add_argument("--kd", action="store_true", help="distil from --load-teacher: alpha x LM loss + beta x T^2 x KL")
    g.add_argument(
        "--mos", action="store_true", help="Mixture-of-Students: the same as --kd (the reference's spelling)"
    )
    g.add_argument(
        "--kd-alpha-ce", type=non_negative_float, default=1.0, help="weight of the student's own LM loss while KD is on"
    )
    g.add_argument("--kd-beta-ce", type=non_negative_float, default=1.0, help="weight of the KD term")
    g.add_argument("--kd-temp", type=positive_float, default=1.0, help="softmax temperature T of teacher and student")
    g.add_argument(
        "--kd-stop-iters", type=positive_int, default=None, help="staged KD: switch KD off and free the teacher here"
    )
    g.add_argument("--kd-stop-tokens", type=positive_int, default=None, help="the same, in training tokens")
    g.add_argument("--load-teacher", default=None, help="the teacher's checkpoint directory (a --save of this toolkit)")
    g.add_argument(
        "--mos-init-from-teacher",
        action="store_true",
        help="start the student from the teacher's weights where their shapes agree",
    )
    g.add_argument("--num-layers-teacher", type=positive_int, default=None)
    g.add_argument("--hidden-size-teacher", type=positive_int, default=None)
    g.add_argument("--num-attention-heads-teacher", type=positive_int, default=None)
    g.add_argument("--ffn-hidden-size-teacher", type=positive_int, default=None)
    g.add_argument("--num-experts-teacher", type=positive_int, nargs="+", default=None)
    g.add_argument("--mlp-type-teacher", choices=MLP_TYPES, default=None)


def distill_config_from_args(args: argparse.Namespace, global_batch_size: int, seq_length: int) -> DistillConfig | None:
    """None when no distillation flag is given; otherwise the checked config."""
    kd = args.kd or args.mos
    stated = {name: getattr(args, f"{name}_teacher") for name in TEACHER_FLAGS}
    if not (kd or args.load_teacher or args.mos_init_from_teacher):
        given = [name for name, value in stated.items() if value is not None]
        if given or args.kd_stop_iters is not None or args.kd_stop_tokens is not None:
            flag = f"--{given[0].replace('_', '-')}-teacher" if given else "--kd-stop-iters/--kd-stop-tokens"
            raise ConfigError(f"{flag} was given without --kd or --mos; add --kd --load-teacher DIR or drop the flag")
        return None
    if not args.load_teacher:
        raise ConfigError(
            "distillation needs the teacher's checkpoint; add --load-teacher DIR (the teacher run's --save)"
        )
    if not kd and (args.kd_stop_iters is not None or args.kd_stop_tokens is not None):
        raise ConfigError("--kd-stop-iters/--kd-stop-tokens stop a KD term that is off; add --kd or drop the flag")
    if args.kd_stop_iters is not None and args.kd_stop_tokens is not None:
        raise ConfigError("--kd-stop-iters and --kd-stop-tokens were both given; use only one of them")
    stop = None if args.kd_stop_iters is None else Span("iters", args.kd_stop_iters)
    if args.kd_stop_tokens is not None:
        stop = Span("tokens", args.kd_stop_tokens)
    if stated["num_experts"] is not None:
        stated["num_experts"] = tuple(stated["num_experts"])
    return DistillConfig(
        load_teacher=args.load_teacher,
        kd=kd,
        alpha_ce=args.kd_alpha_ce,
        beta_ce=args.kd_beta_ce,
        temperature=args.kd_temp,
        kd_stop=stop,
        stop_iteration=None,
        init_from_teacher=args.mos_init_from_teacher,
        teacher=TeacherExpectation(**stated),
    ).for_batch(global_batch_size, seq_length)
