"""Chat datasets for a run: one prefix made by `trireme preprocess --chat`, or a weighted blend
of several (BlendedBatches), each split by data.split and packed with data.pack_conversations;
with a note per dataset of what trains (trireme.training.build prints them on the first rank)."""

from __future__ import annotations

from trireme.config import Config
from trireme.data.blend import BlendedBatches
from trireme.data.conversations import chat_datasets, is_chat
from trireme.data.packing import PackedConversations
from trireme.data.sources import DataSources, unique_names
from trireme.errors import ConfigError


def chat_sources(cfg: Config, sources: DataSources):
    """(train, valid or None, notes) of the chat data in `sources`."""
    d = cfg.data
    plain = [s.prefix for s in sources.datasets if not is_chat(s.prefix)]
    if plain:
        raise ConfigError(f"data.path = {d.path!r} blends chat data (trireme preprocess --chat) "
                          f"with plain text ({plain[0]}): blend chat datasets with each other")
    if sources.eod < 0:
        raise ConfigError("chat data needs data.tokenizer: its end-of-document id pads the "
                          "samples")
    names = unique_names(sources.datasets)
    parts = [chat_part(cfg, source.prefix, sources.eod) for source in sources.datasets]
    notes = [chat_data_note(train, valid, d.split, cfg.model.seq_length,
                            name if len(parts) > 1 else "")
             for name, (train, valid) in zip(names, parts)]
    if len(parts) == 1:
        return (*parts[0], notes)
    train = BlendedBatches([t for t, _ in parts], sources.weights, cfg.train.seed, names)
    kept = [(v, w, n) for (_, v), w, n in zip(parts, sources.weights, names) if v is not None]
    valid = (BlendedBatches([v for v, _, _ in kept], [w for _, w, _ in kept], cfg.train.seed,
                            [n for _, _, n in kept]) if kept else None)
    return train, valid, notes


def chat_part(cfg: Config, prefix: str, eod: int):
    """(train, valid or None) conversations of one chat prefix, packed with
    data.pack_conversations."""
    d = cfg.data
    train, valid = chat_datasets(
        prefix, seq_length=cfg.model.seq_length, seed=cfg.train.seed, split=d.split,
        eod=eod, mask_prompt=d.mask_prompt,
        want_valid=bool(cfg.train.eval_interval))
    if d.pack_conversations:
        return (PackedConversations(train),
                PackedConversations(valid) if valid is not None else None)
    return train, valid


def conversations(dataset) -> int:
    """Conversations in a chat dataset, packed or not."""
    return dataset.conversations if isinstance(dataset, PackedConversations) else len(dataset)


def chat_data_note(train, valid, split: str, seq_length: int, name: str = "") -> str:
    """How many conversations train and validate (data.split), how many are cut at the
    sample length, and a warning for those with no trained token left; `name`: which dataset
    of a blend."""
    held = f", {conversations(valid)} validate" if valid is not None else ""
    which = f" {name}" if name else ""
    text = (f"trireme: chat data{which}: {conversations(train)} conversations train{held} "
            f"(data.split = {split})")
    if isinstance(train, PackedConversations):
        text += f", packed into {len(train)} samples"
    cut, empty = train.too_long(), train.untrained()
    if cut:
        text += (f"; {cut} are longer than model.seq_length + 1 = {seq_length + 1} tokens and "
                 "are cut there")
    if empty:
        text += (f"\ntrireme: warning: {empty} training conversations{which} have no answer "
                 f"token within model.seq_length = {seq_length} (their first prompt fills it): "
                 "they train nothing; raise model.seq_length or shorten them")
    return text
