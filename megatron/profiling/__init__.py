"""Profiling of models: a DeepSpeed-compatible flops profiler (flops_profiler.py: FlopsProfiler,
get_model_profile and DeepSpeed's string helpers) that counts every aten op of a forward through a
TorchDispatchMode with its own FLOP formulas (op_flops.py), attributes them to the modules running
and to each MoE layer's dispatch and combine beside its router and experts, with the experts' token
counts (moe_phases.py), and prints the records it builds (records.py) in DeepSpeed's layout
(report.py)."""
