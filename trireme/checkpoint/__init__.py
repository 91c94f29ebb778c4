"""Checkpoints: saving and loading (conversion to other formats is trireme.convert). Files,
roughly in import order (each imports only files above it):

    format.py            nested state <-> JSON + flat tensors; the streaming safetensors writer
    rng.py               capture / restore every random generator
    safe_pickle.py       reading other tools' pickles without running code from them
    directory.py         a checkpoint root: step directories, `latest`, atomic publish, retention
    model_state.py       what GPT(cfg) holds; load_model_state (all or nothing); model_from_state
    gathered.py          gathering TP / PP shards into the single-process form, and back
    pieces.py, dcp_io.py local shards as pieces of global tensors; DCP planners, reader, writer
    sharded.py           the sharded format (every rank writes what it holds, through DCP)
    store.py             the gathered format, and load_checkpoint for both (the public API)
    saver.py             the training loop's writer: either format, blocking or in the background
    files.py             an output folder written whole or not at all; a tokenizer folder's files
"""
