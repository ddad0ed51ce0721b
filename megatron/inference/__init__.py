"""Using a trained model: load it from a checkpoint, generate text, score continuations."""
