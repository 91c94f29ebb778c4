"""Checkpoints: saving, loading and converting.

    store.py             save / load / latest / retention of trireme checkpoints (the public API)
    format.py            nested state <-> JSON + flat tensors; the streaming safetensors writer
    model_state.py       load_model_state: copy a state into a model, all or nothing
    rng.py               capture / restore every random generator
    convert.py           `trireme convert`: readers and writers meet in one `Converted` model
    convert_hf.py        Hugging Face Llama / Mistral / Qwen2 / Qwen3 / GPT-2, both ways
    convert_megatron.py  Megatron-Core legacy and torch_dist checkpoints, into trireme
    safe_pickle.py       reading other tools' pickles without running code from them
    describe.py, cli.py  `trireme inspect` and the two commands' argument parsing
"""
