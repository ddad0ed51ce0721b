"""Zero-shot evaluation through lm-eval (an optional extra), and two tasks on local files."""
