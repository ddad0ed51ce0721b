"""Data pipeline: tokenizer -> indexed dataset (.bin/.idx) -> GPT samples -> loader."""
