"""The llava-tiny preset end to end on the embedded shapes corpus: the loss falls, greedy captions
of held-out images name the right colour far above chance, the checkpoint answers
`trireme generate --image`; stage-1 freezing trains the projector only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_parallel import losses

from trireme.checkpoint.model_state import model_from_state
from trireme.checkpoint.store import load_checkpoint
from trireme.config import config_from_toml, load_config
from trireme.data.shapes import COLOURS, SHAPES, draw_sample
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import ConfigError
from trireme.serving.captions import caption_accuracy
from trireme.training.build import apply_freeze
from trireme.training.train import train

PIL = pytest.importorskip("PIL.Image")
ROOT = Path(__file__).resolve().parent.parent
STAGE1 = '["vision.*","layers.*","embedding.*","final_norm.*"]'


def llava_tiny(cache: Path, run: Path, *extra: str):
    return load_config("llava-tiny", [f"--data.cache_dir={cache}", f"--run.dir={run}",
                                      "--logging.tensorboard=false", *extra])


@pytest.fixture(scope="module")
def shapes_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes")


def test_llava_tiny_learns_to_caption(shapes_cache, tmp_path):
    run = tmp_path / "run"
    train(llava_tiny(shapes_cache, run, f"--checkpoint.dir={tmp_path / 'ckpt'}",
                     "--checkpoint.interval=200"))
    loss = losses(run)
    # chance: a caption's 8 tokens cost ln 6 + ln 3 + 2 ln 2 nats without looking at the image
    blind = (torch.log(torch.tensor(6.0 * 3 * 2 * 2)) / 8).item()
    assert loss[-1] < 0.85 * blind < loss[0]
    ckpt = load_checkpoint(tmp_path / "ckpt")
    cfg = config_from_toml(ckpt.config_toml)
    model = model_from_state(cfg.model, ckpt.model, "cpu").eval()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    accuracy = caption_accuracy(model, tokenizer, count=64)
    print(f"held-out caption accuracy {accuracy} (chance: colour 1/6, shape 1/3)")
    assert accuracy["colour"] > 0.4  # chance is 1/6

    image, _ = draw_sample(np.random.default_rng(7), 32)
    PIL.fromarray(image).save(tmp_path / "shape.png")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "trireme", "generate", "--checkpoint",
                        str(tmp_path / "ckpt"), "--image", str(tmp_path / "shape.png"),
                        "--prompt", "<image>\nwhat is in the image?", "--greedy",
                        "--max-new-tokens", "10", "--device", "cpu"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    answer = r.stdout.split("assistant :")[-1].split()
    assert "<image>" not in r.stdout
    assert sum(w in COLOURS for w in answer) == 1 and sum(w in SHAPES for w in answer) == 1


def test_stage1_trains_only_the_projector(shapes_cache, tmp_path):
    cfg = llava_tiny(shapes_cache, tmp_path / "run", "--train.steps=3",
                     f"--model.freeze={STAGE1}", "--train.eval_interval=0")
    trainer = train(cfg)
    model = trainer.model
    fresh = trainer.model.__class__(trainer.cfg.model, seed=cfg.train.seed)  # resolved
    before = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        assert p.requires_grad == name.startswith("projector."), name
        assert torch.equal(p, before[name]) != name.startswith("projector."), name
    assert trainer.optimizer.names == [n for n, _ in model.named_parameters()
                                       if n.startswith("projector.")]


def test_freeze_pattern_that_matches_nothing(shapes_cache, tmp_path):
    cfg = llava_tiny(shapes_cache, tmp_path / "run", "--model.freeze=[\"visoin.*\"]")
    with pytest.raises(ConfigError, match="model.freeze pattern 'visoin.\\*' matches no"):
        train(cfg)


def test_freezing_the_output_of_a_tied_model_names_the_embedding(tmp_path):
    # docs/multimodal.md's stage-1 list names output.* for untied models; llava-tiny ties its
    # output layer to the embedding, where the old message only said "matches no parameter"
    cfg = load_config("llava-tiny", ["--model.vocab_size=300", f"--run.dir={tmp_path}",
                                     '--model.freeze=["vision.*","layers.*","output.*"]'])
    with pytest.raises(ConfigError, match="model.tie_embeddings = true the output layer is "
                                          "embedding.weight; drop the pattern"):
        apply_freeze(cfg, [])
