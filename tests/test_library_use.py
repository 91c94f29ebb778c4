"""trireme used as a library, from a notebook or a script: train(cfg) run again in one process,
the config object kept by the caller, process-wide state left as it was."""

import torch
from test_train import toy_data  # noqa: F401  (a fixture)

from trireme.config import load_config
from trireme.training.train import train


def small_cfg(data, run_dir, **extra):
    return load_config("tiny", {
        "data.path": data, "data.tokenizer": "bytes", "run.dir": str(run_dir),
        "model.num_layers": 1, "model.hidden_size": 32, "model.num_attention_heads": 2,
        "model.num_query_groups": 1, "model.ffn_hidden_size": 64, "model.seq_length": 16,
        "train.global_batch_size": 4, "train.steps": 1, "train.eval_interval": 0,
        "logging.progress": False, "logging.tensorboard": False, **extra,
    })


def test_train_leaves_the_callers_config_as_it_was(toy_data, tmp_path):  # noqa: F811
    """train(cfg) filled in the caller's config (vocabulary size, micro batch, the embedded
    corpus's path): a notebook that then changed the batch size or the data and trained again
    got the first run's values silently (a micro batch of 4 for a batch of 8, a 257-token
    vocabulary for a larger tokenizer)."""
    cfg = small_cfg(toy_data, tmp_path / "a")
    before = cfg.to_dict()
    trainer = train(cfg)
    assert cfg.to_dict() == before
    assert (cfg.model.vocab_size, cfg.train.micro_batch_size) == (0, 0)
    assert (trainer.cfg.model.vocab_size, trainer.cfg.train.micro_batch_size) == (257, 4)
    cfg.train.global_batch_size, cfg.run.dir = 8, str(tmp_path / "b")
    assert train(cfg).cfg.train.micro_batch_size == 8  # derived afresh, as in a new process


def test_train_leaves_torchs_determinism_as_it_was(toy_data, tmp_path):  # noqa: F811
    """A run with train.deterministic left torch's deterministic algorithms on for the rest of
    the process: a notebook's next run with deterministic = false, and the notebook's own code,
    still ran (or refused ops without a deterministic kernel) as deterministic."""
    try:
        trainer = train(small_cfg(toy_data, tmp_path / "a", **{"train.deterministic": True}))
        assert not torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # the user's own choice stays
        train(small_cfg(toy_data, tmp_path / "b"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert trainer.state.step == 1
