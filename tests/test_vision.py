"""The vision encoder, projector and image merge of a LLaVA-style GPT (trireme.models.vision)."""

import pytest
import torch
import torch.nn.functional as F

from trireme.config import ModelConfig
from trireme.errors import ConfigError, TriremeError
from trireme.models.gpt import GPT
from trireme.models.vision import (
    check_freeze_patterns,
    freeze_parameters,
    num_image_tokens,
    patchify,
)
from trireme.parallel.context import ParallelContext
from trireme.parallel.tensor import TensorParallel

IMAGE = 49  # the placeholder id of these tests


def vlm_config(**over) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50,
                seq_length=48, vision_layers=3, vision_image_size=16, vision_patch_size=4,
                vision_hidden_size=24, vision_attention_heads=2, image_token_id=IMAGE)
    return ModelConfig(**{**base, **over})


def image_ids(cfg: ModelConfig, batch: int, text: int = 10) -> torch.Tensor:
    """[batch, n + text]: one image's placeholders, then text ids."""
    n = num_image_tokens(cfg)
    gen = torch.Generator().manual_seed(0)
    return torch.cat([torch.full((batch, n), IMAGE), torch.randint(0, 40, (batch, text),
                                                                   generator=gen)], 1)


def test_patchify_is_the_stride_p_convolution():
    images, weight = torch.randn(2, 3, 16, 12), torch.randn(5, 3, 4, 4)
    conv = F.conv2d(images, weight, stride=4).flatten(2).transpose(1, 2)  # [b, n, 5]
    assert torch.allclose(patchify(images, 4) @ weight.reshape(5, -1).T, conv, atol=1e-5)


def test_image_tokens_and_built_blocks_follow_the_feature_layer():
    cfg = vlm_config()
    assert num_image_tokens(cfg) == 16
    assert num_image_tokens(vlm_config(vision_feature_select="full")) == 17
    assert num_image_tokens(vlm_config(vision_class_token=False,
                                       vision_feature_select="full")) == 16
    assert len(GPT(cfg).vision.layers) == 2  # -2 of 3 blocks: the last never runs
    assert len(GPT(vlm_config(vision_feature_layer=1)).vision.layers) == 1
    assert len(GPT(vlm_config(vision_feature_layer=-1)).vision.layers) == 3


@pytest.mark.parametrize("over, words", [
    ({"vision_image_size": 18}, "multiple of model.vision_patch_size"),
    ({"vision_feature_layer": 4}, "vision_feature_layer = 4"),
    ({"vision_attention_heads": 5}, "vision_attention_heads = 5"),
    ({"seq_length": 16}, "raise seq_length"),
])
def test_bad_vision_settings_are_one_line_errors(over, words):
    with pytest.raises(ConfigError, match=words):
        GPT(vlm_config(**over))


def test_encoder_attends_both_ways_and_images_replace_placeholders():
    torch.manual_seed(0)
    model = GPT(vlm_config(), seed=3)
    images = torch.randn(2, 3, 16, 16)
    features = model.vision(images)  # [2, 16, 24]
    changed = images.clone()
    changed[:, :, -4:, -4:] += 1.0  # only the last patch
    assert not torch.allclose(model.vision(changed)[:, 0], features[:, 0])  # non-causal
    ids = image_ids(model.cfg, 2)
    logits = model(ids, images=images)
    text_only = model(ids)  # the placeholders' own embeddings
    assert not torch.allclose(logits, text_only)
    # the image of row 1 does not leak into row 0
    other = torch.stack([images[0], images[0] + 1.0])
    assert torch.allclose(model(ids, images=other)[0], logits[0], atol=1e-6)
    # the merge is exactly the projector's output in place of each placeholder
    embedded = model._embed(ids, None, images)
    n = num_image_tokens(model.cfg)
    assert torch.equal(embedded[:, :n], model.projector(features))
    assert torch.equal(embedded[:, n:], model.embedding(ids[:, n:]))


def test_init_is_a_function_of_seed_and_name():
    a, b = GPT(vlm_config(), seed=5), GPT(vlm_config(num_layers=3), seed=5)
    for name, p in a.named_parameters():
        if name.startswith(("vision.", "projector.")):
            assert torch.equal(p, dict(b.named_parameters())[name]), name
    assert not torch.equal(GPT(vlm_config(), seed=6).projector.fc1.weight, a.projector.fc1.weight)


def test_freeze_patterns_and_their_errors():
    model = GPT(vlm_config())
    frozen = freeze_parameters(model, ["vision.*", "layers.*"])
    assert frozen and all(n.startswith(("vision.", "layers.")) for n in frozen)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "projector.fc1.weight" in trainable and "embedding.weight" in trainable
    assert not any(n.startswith(("vision.", "layers.")) for n in trainable)
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ConfigError, match="'visoin.\\*' matches no parameter"):
        check_freeze_patterns(names, ["visoin.*"])
    for everything in (["*"], ["vision.*", "projector.*", "layers.*", "embedding.*", "final_*",
                                "output.*"]):
        with pytest.raises(ConfigError, match="freezes every parameter"):
            check_freeze_patterns(names, everything)
    check_freeze_patterns(names, ["vision.*", "layers.*"])  # leaves the projector: fine


def test_sequence_or_context_parallel_vision_is_a_one_line_error():
    tp = TensorParallel(group=None, size=2, rank=0, sequence_parallel=True, rng=None)
    with pytest.raises(TriremeError, match="sequence_parallel yet; turn them off"):
        GPT(vlm_config(), seed=None, ctx=ParallelContext(tensor=tp))
