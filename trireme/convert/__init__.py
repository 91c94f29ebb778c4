"""Conversion between trireme checkpoints and other tools' formats (`trireme convert`,
`trireme inspect`): `Converted` (converted.py) is the model on its way, every reader produces one
and every writer takes one (convert.py pairs them).

    hf.py, hf_table.py   Hugging Face Llama / Mistral / Qwen2 / Qwen3 / GPT-2, both ways
    hf_moe.py            Mixtral and Qwen3-MoE experts
    hf_mamba.py          Mamba2 and Nemotron-H
    hf_llava.py          Llava
    megatron.py          Megatron-Core legacy and torch_dist checkpoints, into trireme
    describe.py          `trireme inspect`: what a checkpoint of any of these formats holds
"""
