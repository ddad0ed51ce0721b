"""Command-line entry points: each main() runs through megatron.entry_point.run_entry_point;
tools/*.py are thin wrappers around them."""
