"""A run's datasets from its config: where the data is (the embedded corpus when no data.path is
given), the sources opened and checked against the tokenizer, and the train and validation
datasets of the kind the data holds (text, conversations, or image + text samples).

The trainer (trireme.training.build) resolves the config around these: the tokenizer, the
vocabulary size and the image placeholder id."""

from __future__ import annotations

import sys

from trireme.config import Config
from trireme.data.batch import BatchOptions
from trireme.data.blend import BlendedBatches
from trireme.data.cache import index_cache_dir
from trireme.data.chat_sources import chat_sources
from trireme.data.conversations import is_chat
from trireme.data.corpus import default_corpus
from trireme.data.gpt_dataset import GPTDataset
from trireme.data.multimodal import IMAGES_SUFFIX, is_multimodal, multimodal_datasets
from trireme.data.shapes import shapes_corpus
from trireme.data.sources import DataSources, build_split_datasets, open_sources
from trireme.data.tokenizer import Tokenizer
from trireme.data.tokenizer_mark import check_mark
from trireme.errors import ConfigError


def data_paths(cfg: Config) -> tuple[str, str]:
    """(data.path, data.tokenizer) of the run: as given, or with no data.path (and not
    data.mock) the embedded corpus, built on first use (for a vision model, images drawn by
    code with their captions); a tokenizer given is kept."""
    d = cfg.data
    if d.path or d.mock:
        return d.path, d.tokenizer
    if cfg.model.vision_layers > 0:
        prefix, tokenizer = shapes_corpus(d.cache_dir or None, cfg.model.vision_image_size)
    else:
        prefix, tokenizer = default_corpus(d.cache_dir or None, d.embedded_vocab_size)
    return str(prefix), d.tokenizer or str(tokenizer)


def open_data(path: str, mock: bool) -> DataSources:
    """The datasets of `path` (one prefix or a weighted blend), their files checked; nothing for
    data.mock."""
    return DataSources() if mock else open_sources(path)


def mark_sources(sources: DataSources, tokenizer: Tokenizer | None, spec: str) -> None:
    """Check that each dataset was made with `tokenizer` (data.tokenizer `spec`) and take its
    end-of-document id (-1 without a tokenizer)."""
    for source in sources.datasets if tokenizer is not None else []:
        check_mark(source.prefix, tokenizer, spec)
    sources.eod = tokenizer.eod if tokenizer is not None else -1


def build_datasets(cfg: Config, sources: DataSources, image_tokens: int = 0,
                   log: bool = True) -> tuple[GPTDataset, GPTDataset | None]:
    """Train and validation datasets (GPTDataset, a BlendedDataset, or mock data) of a resolved
    config. `image_tokens`: the placeholders one image takes (a vision model); `log`: print the
    notes of conversation data (the main process)."""
    d = cfg.data
    chat = any(is_chat(source.prefix) for source in sources.datasets)
    if d.pack_conversations and (cfg.model.vision_layers or not chat):
        raise ConfigError("data.pack_conversations is for chat data (trireme preprocess --chat); "
                          "text data runs on across samples already, image samples are one each")
    if cfg.model.vision_layers:
        return build_multimodal_datasets(cfg, sources, image_tokens)
    if chat:
        return build_chat_datasets(cfg, sources, log)
    options = BatchOptions(sources.eod, d.eod_mask_loss, d.reset_position_ids,
                           d.reset_attention_mask)
    return build_split_datasets(
        sources, seq_length=cfg.model.seq_length, seed=cfg.train.seed, split=d.split,
        options=options, cache_dir=index_cache_dir(d.cache_dir or None),
        mock_vocab_size=cfg.model.vocab_size, want_valid=bool(cfg.train.eval_interval),
        log_samples=cfg.train.steps * cfg.train.global_batch_size,
    )


def build_chat_datasets(cfg: Config, sources: DataSources, log: bool = True):
    """Train and validation datasets of conversations (trireme.data.chat_sources); with `log`
    its notes: each dataset's counts and a blend's draw."""
    train, valid, notes = chat_sources(cfg, sources)
    if log:
        for note in notes:
            print(note, file=sys.stderr)
        if isinstance(train, BlendedBatches):
            train.log(cfg.train.steps * cfg.train.global_batch_size)
    return train, valid


def build_multimodal_datasets(cfg: Config, sources: DataSources, image_tokens: int):
    """Train and validation datasets of image + text samples (trireme.data.multimodal)."""
    m, d = cfg.model, cfg.data
    if len(sources.datasets) != 1 or not is_multimodal(sources.datasets[0].prefix):
        raise ConfigError(f"model.vision_layers = {m.vision_layers} needs one multimodal dataset "
                          f"(a prefix with {IMAGES_SUFFIX}, `trireme preprocess --images`), not "
                          f"data.path = {d.path!r}" + (" (data.mock)" if d.mock else ""))
    return multimodal_datasets(
        sources.datasets[0].prefix, seq_length=m.seq_length, seed=cfg.train.seed, split=d.split,
        image_size=m.vision_image_size, image_id=m.image_token_id,
        image_tokens=image_tokens, eod=sources.eod, mask_prompt=d.mask_prompt,
        want_valid=bool(cfg.train.eval_interval))
