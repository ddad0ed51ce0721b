"""Pretrain a GPT model: `python pretrain_gpt.py ...` or `torchrun --nproc_per_node N pretrain_gpt.py ...`."""

from megatron.cli.pretrain_gpt import main

if __name__ == "__main__":
    main()
