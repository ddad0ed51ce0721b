"""Checkpoints to and from Hugging Face transformers, one tensor at a time:

architectures.py   which class computes a model exactly; config.json <-> our flags
routing.py         what a router computes, in both sides' terms
tensor_maps.py     tensor names and layouts per class, as links runnable either way
link_runner.py     links run on meta tensors (shapes) and then on real ones (data)
safetensors_io.py  safetensors read and written a tensor at a time; shard sizes
tokenizer_files.py tokenizers both ways, checked to give the same ids
our_checkpoint.py  the tensors a config calls for; a weights-only checkpoint of ours
to_hf.py, from_hf.py   the two conversions (megatron/cli/convert_checkpoint.py runs them)
"""
