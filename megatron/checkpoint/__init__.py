"""Checkpoints: the folder layout, the save protocol (staging, manifest, fsync, atomic rename),
verification and recovery on load, and the tensors' global names. Import the submodules directly."""
