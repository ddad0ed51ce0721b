"""The training loop and what it owns: loop.py (Trainer: micro-batches through the engine,
evaluation, saves), losses.py, log.py (log lines and TensorBoard), moe_monitor.py, distill.py (MoS),
upcycling.py, exit_conditions.py. Import the submodules directly."""
