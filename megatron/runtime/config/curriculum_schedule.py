"""DeepSpeed's curriculum schedule keys, shared by the legacy curriculum_learning block and each
metric of data_efficiency's curriculum sampling."""

from typing import Literal

from megatron.runtime.config.schema_types import PositiveCount, Section


class CurriculumScheduleConfig(Section):
    total_curriculum_step: PositiveCount | None = None  # fixed_linear, fixed_root
    difficulty_step: PositiveCount | None = None  # fixed_linear, fixed_root: a multiple of it
    root_degree: PositiveCount | None = None  # fixed_root
    difficulty: list[PositiveCount] | None = None  # fixed_discrete: one more than max_step
    max_step: list[PositiveCount] | None = None  # fixed_discrete


class DifficultySchedule(Section):
    """DeepSpeed's curriculum schedule (pacing function) from min_difficulty to max_difficulty:
    the legacy block's, and each data-sampling metric's (megatron/training/curriculum.py)."""

    min_difficulty: PositiveCount = 8
    max_difficulty: PositiveCount = 1024
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] = "fixed_linear"
    schedule_config: CurriculumScheduleConfig = CurriculumScheduleConfig()

    def check_schedule(self, scheduled: str) -> None:
        """`scheduled`: what the difficulty sets, for the messages ("sequences")."""
        s, kind = self.schedule_config, self.schedule_type
        if kind == "custom":
            raise ValueError(
                "schedule_type custom needs a Python schedule function (DeepSpeed's "
                "set_custom_curriculum_learning_schedule), which a config cannot give; use a fixed_* schedule"
            )
        needed = {
            "fixed_linear": ("total_curriculum_step", "difficulty_step"),
            "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
            "fixed_discrete": ("difficulty", "max_step"),
        }[kind]
        missing = [key for key in needed if getattr(s, key) is None]
        if missing:
            raise ValueError(f"schedule_type {kind} needs schedule_config.{missing[0]}")
        if self.min_difficulty > self.max_difficulty:
            raise ValueError(f"min_difficulty {self.min_difficulty} is above max_difficulty {self.max_difficulty}")
        if kind == "fixed_discrete" and len(s.difficulty) != len(s.max_step) + 1:
            raise ValueError(
                f"schedule_config.difficulty has {len(s.difficulty)} values and max_step {len(s.max_step)}; "
                "give one difficulty more than max_steps (the last holds after the last max_step)"
            )
        if kind != "fixed_discrete" and self.min_difficulty % s.difficulty_step:
            raise ValueError(
                f"min_difficulty {self.min_difficulty} is not a multiple of schedule_config.difficulty_step "
                f"{s.difficulty_step}, so the first {scheduled} would be cut below it; make it one"
            )
