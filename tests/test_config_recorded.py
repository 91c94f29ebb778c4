"""A run records its config with absolute paths (trireme/config/recorded.py): its checkpoint's
config.toml, read from another directory, found no data ('data/p_text_document not found') and
would have saved into a new relative checkpoint.dir instead of going on."""

from __future__ import annotations

import tomllib

from test_train import tiny_cfg, write_toy_data

from trireme.config import load_config
from trireme.config.recorded import recorded
from trireme.training.train import train


def test_a_checkpoints_config_goes_on_from_another_directory(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    write_toy_data(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    train(tiny_cfg("toy", tmp_path / "unused", "train.steps=2", "checkpoint.dir=ck",
                   "run.dir=run", "train.eval_interval=0"))
    saved = tomllib.loads((tmp_path / "work/ck/step_0000002/config.toml").read_text())
    assert saved["data"]["path"] == str(tmp_path / "work/toy")
    assert saved["checkpoint"]["dir"] == str(tmp_path / "work/ck")
    assert saved["run"]["dir"] == str(tmp_path / "work/run")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(tmp_path / "work/ck/step_0000002"), ["train.steps=3"])
    trainer = train(cfg)
    assert trainer.state.step == 3  # went on from step 2 of the same checkpoint.dir
    assert not (tmp_path / "ck").exists() and not (tmp_path / "run").exists()


def test_blends_and_tokenizer_specs_are_recorded_absolute_where_they_exist(tmp_path, monkeypatch):
    write_toy_data(tmp_path)
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "bytes").mkdir()  # a folder so named does not make the spec a path
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", ["data.path=0.3 toy 0.7 toy"])
    tok = tmp_path / "tok.json"
    for spec, want in [("bytes", "bytes"), ("null:64", "null:64"), ("tok.json", tok),
                       ("hf:tok.json", f"hf:{tok}"), ("absent.json", "absent.json")]:
        cfg.data.tokenizer = spec
        assert recorded(cfg).data.tokenizer == str(want), spec
    assert recorded(cfg).data.path == f"0.3 {tmp_path / 'toy'} 0.7 {tmp_path / 'toy'}"
    assert cfg.data.path == "0.3 toy 0.7 toy"  # the running config is not changed
