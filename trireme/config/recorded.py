"""The config as a run records it (the config.toml of its run directory and of each checkpoint).

A recorded config is read again from anywhere: `trireme train --config CKPT/step_N` to go on
with a run, `serve --chat-template auto` looking for the training data's chat template,
`generate` for the tokenizer. A relative path in it meant "from where that run was started",
which a later command, started elsewhere, cannot know: so the recorded paths are absolute. The
data prefixes (each of a blend) and a tokenizer file are made absolute where they exist from
here; `bytes`, `null:N` and names that are no file stay as given. The run directory is recorded
as the one the run wrote to, so going on from a checkpoint's config keeps the metrics together.
"""

from __future__ import annotations

import copy
import os

from trireme.config.sections import Config


def recorded(cfg: Config) -> Config:
    """A copy of `cfg` with its paths absolute (module docstring); `cfg` is not changed."""
    out = copy.deepcopy(cfg)
    out.data.path = _data_paths(cfg.data.path)
    out.data.tokenizer = _tokenizer(cfg.data.tokenizer)
    out.data.cache_dir = _absolute(cfg.data.cache_dir)
    out.checkpoint.dir = _absolute(cfg.checkpoint.dir)
    out.checkpoint.init_from = _absolute(cfg.checkpoint.init_from)
    out.run.dir = os.path.abspath(cfg.run_dir)
    return out


def _absolute(path: str) -> str:
    return os.path.abspath(path) if path else path


def _data_paths(text: str) -> str:
    """A dataset prefix, or a blend of weights and prefixes in turn, with the prefixes found
    here made absolute."""
    if _is_prefix(text.strip()):
        return os.path.abspath(text.strip())
    return " ".join(os.path.abspath(t) if _is_prefix(t) else t for t in text.split())


def _is_prefix(text: str) -> bool:
    return bool(text) and any(os.path.exists(text + end) for end in (".bin", ".idx", ""))


def _tokenizer(spec: str) -> str:
    """A tokenizer file or folder (or `kind:path`) made absolute where it exists."""
    if spec == "bytes" or spec.split(":")[0] == "null":  # no file, even if a folder is so named
        return spec
    if spec and os.path.exists(spec):
        return os.path.abspath(spec)
    kind, sep, path = spec.partition(":")
    if sep and path and os.path.exists(path):
        return f"{kind}:{os.path.abspath(path)}"
    return spec
