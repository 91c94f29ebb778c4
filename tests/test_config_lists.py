"""List values given on the command line: `[a, b]`, `a,b`, quoted items; unpaired brackets are an
error (`--model.kernels='['` was taken as an empty list, `[1,2` as [1, 2])."""

from __future__ import annotations

import pytest

from trireme.config import load_config
from trireme.errors import ConfigError


def test_lists_from_the_command_line_parse():
    cfg = load_config("tiny", ['model.freeze=["layers.[01].*", "embedding.*"]',
                               "optimizer.no_decay=bias,norm", "model.kernels=[]"])
    assert cfg.model.freeze == ["layers.[01].*", "embedding.*"]  # a glob's brackets stay
    assert cfg.optimizer.no_decay == ["bias", "norm"]
    assert cfg.model.kernels == []


@pytest.mark.parametrize("text", ["[", "]", "[bias, norm", "bias, norm]"])
def test_unpaired_brackets_are_an_error(text):
    with pytest.raises(ConfigError, match=r"optimizer.no_decay = .*unbalanced brackets"):
        load_config("tiny", [f"optimizer.no_decay={text}"])
