"""Checkpoint save / resume for one process: round trips, atomicity, retention and clear errors."""

from __future__ import annotations

import ast
import json
import math
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

import trireme.checkpoint.directory as directory
import trireme.checkpoint.format as fmt
import trireme.checkpoint.store as store
from trireme.checkpoint.store import (
    Checkpoint,
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
    restore_rng_state,
    save_checkpoint,
)
from trireme.errors import CheckpointError

PACKAGE_DIR = Path(store.__file__).resolve().parent
CONFIG = '[train]\nsteps = 10\nsample_prompt = "def "\n'


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(raw(a), raw(b))


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Nested equality that also checks exact types (ints stay ints, tuples stay tuples)."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert same_bits(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def model_state(value: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    nan = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "embedding.weight": torch.randn(16, 8, generator=g) + value,
        "layers.0.mlp.fc1.weight": torch.randn(8, 6, generator=g).t(),  # not contiguous
        "layers.0.norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "layers.0.attn.scale": torch.tensor(0.125, dtype=torch.float16),  # 0-dim
        "layers.0.attn.mask": torch.tril(torch.ones(4, 4, dtype=torch.bool)),
        "pos_ids": torch.arange(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "special": nan,
    }


def optimizer_state(model: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = ["embedding.weight", "layers.0.mlp.fc1.weight"]
    return {
        "exp_avg": {n: torch.full_like(model[n], 0.5) for n in names},
        "exp_avg_sq": {n: torch.full_like(model[n], 0.25) for n in names},
        "master": {n: model[n].double() for n in names},
        "step": 5,
        "loss_scale": 65536.0,
        "found_inf": False,
        "name": "adamw",
        "lrs": [0.001, 0.0005],
        "betas": (0.9, 0.95),
        "clip": None,
        "growth": {"__window": 1000, "nan": float("nan")},  # a key that looks like a tag
        "state": {0: {"step": torch.tensor(5.0)}, 1: {"step": torch.tensor(5.0)}},  # torch-style
        "param_groups": [{"params": [0, 1], "lr": 1e-3, "weight_decay": 0.1}],
    }


def save(root: Path, step: int, value: float = 0.0, **kw: Any) -> Path:
    model = model_state(value)
    return save_checkpoint(root, step, model=model, optimizer=optimizer_state(model),
                           trainer={"step": step, "consumed_samples": 16 * step},
                           config_toml=CONFIG, **kw)


def test_round_trip(tmp_path: Path) -> None:
    model = model_state()
    optimizer = optimizer_state(model)
    trainer = {"step": 100, "consumed_samples": 1600, "rng": capture_rng_state()}
    path = save_checkpoint(tmp_path, 100, model=model, optimizer=optimizer, trainer=trainer,
                           config_toml=CONFIG)
    assert path == tmp_path / "step_0000100"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["model.safetensors", "optimizer.safetensors", "optimizer.json", "rng.safetensors",
         "trainer.json", "config.toml", "meta.json"])
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 100 and meta["format_version"] == 1
    assert meta["files"]["model.safetensors"]["size"] == (path / "model.safetensors").stat().st_size
    with safe_open(str(path / "optimizer.safetensors"), "pt") as f:
        assert "exp_avg/layers.0.mlp.fc1.weight" in f.keys()

    for source in (tmp_path, path, str(path)):
        ckpt = load_checkpoint(source)
        assert isinstance(ckpt, Checkpoint)
        assert ckpt.step == 100 and ckpt.path == path and ckpt.config_toml == CONFIG
        assert_identical(ckpt.model, {k: v.contiguous() for k, v in model.items()}, "model")
        assert_identical(ckpt.optimizer, optimizer, "optimizer")
        assert_identical(ckpt.trainer, trainer, "trainer")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_rng_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.rand(3), np.random.randn(1)  # numpy now holds a cached gaussian
    save_checkpoint(tmp_path, 1, model={}, optimizer={}, config_toml="",
                    trainer={"rng": capture_rng_state()})
    expected = (torch.rand(5), random.random(), np.random.randn(3))
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    restore_rng_state(load_checkpoint(tmp_path).trainer["rng"])
    got = (torch.rand(5), random.random(), np.random.randn(3))
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1]
    assert np.array_equal(expected[2], got[2])


class Tied(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.output = nn.Linear(4, 10, bias=False)
        if tie:
            self.output.weight = self.embedding.weight
        self.register_buffer("inv_freq", torch.arange(2.0))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def test_tied_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = Tied()
    state = src.state_dict()
    assert state["output.weight"].data_ptr() == state["embedding.weight"].data_ptr()
    path = save_checkpoint(tmp_path, 1, model=state, optimizer={}, trainer={}, config_toml="")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert len([k for k in f.keys() if k.endswith(".weight") and "norm" not in k]) == 1
    ckpt = load_checkpoint(path)
    assert ckpt.model["output.weight"] is ckpt.model["embedding.weight"]

    dst = Tied()
    load_model_state(dst, ckpt.model)
    assert dst.output.weight is dst.embedding.weight
    assert torch.equal(dst.embedding.weight, src.embedding.weight)
    assert torch.equal(dst.norm.bias, src.norm.bias)
    # A state listing each tied parameter once (named_parameters) loads as well.
    once = {n: p.detach() for n, p in src.named_parameters()} | {"inv_freq": src.inv_freq}
    assert "output.weight" not in once
    load_model_state(Tied(), once)
    # An untied checkpoint whose two matrices differ cannot silently lose one of them.
    untied = Tied(tie=False).state_dict()
    with pytest.raises(CheckpointError, match="embedding.weight=output.weight"):
        load_model_state(Tied(), untied)


def test_latest_pointer(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "nowhere") is None
    for step in (1, 2, 3):
        save(tmp_path, step)
    assert (tmp_path / "latest").read_text().strip() == "step_0000003"
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000003"
    save(tmp_path, 2, value=7.0)  # rolled back and saved again: the pointer follows
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000002"
    assert torch.equal(load_checkpoint(tmp_path).model["embedding.weight"],
                       model_state(7.0)["embedding.weight"])
    (tmp_path / "step_0000002" / "optimizer.json").unlink()  # broken: fall back to the newest
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000003"
    (tmp_path / "latest").write_text("../../etc\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000003"
    (tmp_path / "latest").unlink()
    (tmp_path / "step_0000003" / "meta.json").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    with pytest.raises(CheckpointError, match="step_0000003 is damaged.*give .*step_0000001"):
        load_checkpoint(tmp_path)  # reading a root never falls back to an older step silently
    assert load_checkpoint(tmp_path / "step_0000001").step == 1


@pytest.mark.parametrize("exchange", [True, False])
def test_resave_same_step_replaces_it(tmp_path: Path, monkeypatch: Any, exchange: bool) -> None:
    if not exchange:  # file systems without renameat2(RENAME_EXCHANGE): rename aside, then in
        monkeypatch.setattr(directory, "_exchange", lambda a, b: False)
    save(tmp_path, 4)
    save(tmp_path, 4, value=3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000004"]
    assert same_bits(load_checkpoint(tmp_path).model["embedding.weight"],
                     model_state(3.0)["embedding.weight"])


def test_keep_last_and_stale_temporaries(tmp_path: Path) -> None:
    (tmp_path / ".tmp-step_0000009-dead").mkdir(parents=True)
    (tmp_path / ".tmp-step_0000009-dead" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".tmp-latest-dead").write_text("step_0000009")
    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000004", "step_0000005"]
    save(tmp_path, 1, keep_last=2)  # the one just written is never deleted
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_0000001", "step_0000004", "step_0000005"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    save(tmp_path, 6, keep_last=0)  # 0 keeps everything
    assert len(list(tmp_path.glob("step_*"))) == 4


def child(code: str, root: Path) -> list[str]:
    """The command line of a fresh Python process running `code` with `store`, `save`, `root`."""
    prelude = f"""
import os, sys, torch
import trireme.checkpoint.directory as directory
import trireme.checkpoint.format as fmt
import trireme.checkpoint.format as fmt
import trireme.checkpoint.store as store
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_checkpoint_store import save
root = {str(root)!r}
"""
    return [sys.executable, "-c", prelude + textwrap.dedent(code)]


CRASHES = {
    # halfway through the model file (the last tensor file written)
    "mid-file": """
        orig = fmt.write_safetensors
        def crash(f, tensors, metadata):
            if 'embedding.weight' in tensors:
                f.write(b'x' * 1000)
                f.f.flush()
                os._exit(1)
            orig(f, tensors, metadata)
        fmt.write_safetensors = crash
        """,
    # everything written but meta.json
    "before-meta": """
        orig = fmt.write_json
        def crash(f, obj):
            if isinstance(obj, dict) and obj.get('format') == directory.FORMAT:
                os._exit(1)
            orig(f, obj)
        fmt.write_json = crash
        """,
    # the new directory renamed into place, the pointer not yet moved
    "before-latest": """
        directory.write_latest = lambda root, name: os._exit(1)
        """,
}


@pytest.mark.parametrize("crash", list(CRASHES))
def test_crash_midway_keeps_previous(tmp_path: Path, crash: str) -> None:
    save(tmp_path, 1)
    code = textwrap.dedent(CRASHES[crash]) + "\nsave(root, 2, value=1.0)\n"
    proc = subprocess.run(child(code, tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1 and ckpt.trainer["step"] == 1
    assert same_bits(ckpt.model["embedding.weight"], model_state()["embedding.weight"])
    if crash != "before-latest":
        assert list(tmp_path.glob(".tmp-step_0000002-*"))
        assert not (tmp_path / "step_0000002").exists()
    save(tmp_path, 2)  # the next save cleans up what the crash left
    assert not list(tmp_path.glob(".tmp-*"))
    assert load_checkpoint(tmp_path).step == 2


def test_sigkill_at_any_moment(tmp_path: Path) -> None:
    """Kill a process that saves in a loop; whatever was latest stays consistent and loadable."""
    code = """
    for step in range(1, 10_000):
        t = torch.full((1 << 21,), float(step))
        store.save_checkpoint(root, step, model={'w': t}, optimizer={'m': t * 2}, config_toml='',
                              trainer={'step': step}, keep_last=2)
    """
    proc = subprocess.Popen(child(code, tmp_path))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step >= 1 and ckpt.trainer["step"] == ckpt.step
    assert torch.equal(ckpt.model["w"], torch.full((1 << 21,), float(ckpt.step)))
    assert torch.equal(ckpt.optimizer["m"], 2 * ckpt.model["w"])


def test_corrupted_files_name_the_file(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    opt = path / "optimizer.safetensors"
    data = opt.read_bytes()

    opt.write_bytes(data[: len(data) // 2])  # truncated: size differs from meta.json
    with pytest.raises(CheckpointError, match="optimizer.safetensors.*truncated"):
        load_checkpoint(path)
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="step_0000003 is damaged.*no intact checkpoint"):
        load_checkpoint(tmp_path)

    garbled = bytearray(data)
    garbled[12] ^= 0xFF  # same size, broken header
    opt.write_bytes(bytes(garbled))
    with pytest.raises(CheckpointError,
                       match="optimizer.safetensors is corrupted: its sha256 does not match"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="optimizer.safetensors is truncated or corrupted"):
        load_checkpoint(path, verify=False)  # the library's error, naming the file

    opt.write_bytes(data)
    (path / "trainer.json").write_text("{" + " " * (len((path / "trainer.json").read_text()) - 1))
    with pytest.raises(CheckpointError, match="trainer.json is unreadable or corrupted"):
        load_checkpoint(path, verify=False)

    (path / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rng.safetensors is missing"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "step_0000004").mkdir()
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        load_checkpoint(tmp_path / "step_0000004")


def test_unsupported_values_leave_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'exp_avg/w'.*ndarray"):
        save_checkpoint(tmp_path, 1, model={}, optimizer={"exp_avg": {"w": np.zeros(2)}},
                        trainer={}, config_toml="")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)


def test_load_model_state_reports_every_problem(tmp_path: Path) -> None:
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.randn_like(v) for k, v in before.items()}
    del state["fc2.bias"]
    state["fc3.weight"] = torch.zeros(1)
    state["fc1.weight"] = torch.zeros(3, 4)
    with pytest.raises(CheckpointError) as err:
        load_model_state(model, state)
    msg = str(err.value)
    assert "\n" not in msg
    assert "missing keys: fc2.bias" in msg and "unexpected keys: fc3.weight" in msg
    assert "fc1.weight: checkpoint (3, 4) vs model (4, 4)" in msg
    for k, v in model.state_dict().items():  # nothing was copied
        assert torch.equal(v, before[k]), k

    with pytest.raises(CheckpointError, match="shape mismatches"):  # even when not strict
        load_model_state(model, state, strict=False)
    state["fc1.weight"] = torch.randn(4, 4, dtype=torch.bfloat16)
    result = load_model_state(model, state, strict=False)
    assert result.missing == ["fc2.bias"] and result.unexpected == ["fc3.weight"]
    assert model.fc1.weight.dtype == torch.float32
    assert torch.equal(model.fc1.weight, state["fc1.weight"].float())
    assert torch.equal(model.fc2.weight, state["fc2.weight"])


BANNED_MODULES = {"cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
RESTRICTED_UNPICKLER_FILE = "safe_pickle.py"  # the one place allowed to import pickle


def _is_weights_only(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
               and k.value.value is True for k in call.keywords)


def code_execution_risks(source: str, pickle_allowed: bool = False) -> list[int]:
    """Lines that could unpickle arbitrary objects (docstrings and comments aside).

    Flagged: pickle-like modules; `pickle` itself outside the restricted unpickler's file;
    `pickle.load` / `pickle.loads` anywhere (the restricted unpickler subclasses pickle.Unpickler
    and overrides find_class instead); `torch.load` without a literal `weights_only=True`;
    `from torch import load`; an Unpickler subclass that does not override find_class.
    """
    lines = []
    for node in ast.walk(ast.parse(source)):
        bad = False
        if isinstance(node, ast.Import):
            for a in node.names:
                mod = a.name.split(".")[0]
                bad |= mod in BANNED_MODULES or (mod == "pickle" and not pickle_allowed)
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            bad = (mod in BANNED_MODULES or mod == "pickle"
                   or (mod == "torch" and any(a.name == "load" for a in node.names)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr == "load":
                bad = not _is_weights_only(node)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            bad = node.value.id == "pickle" and node.attr in ("load", "loads")
        elif isinstance(node, ast.ClassDef):
            unpickler = any(isinstance(b, ast.Attribute) and b.attr == "Unpickler"
                            for b in node.bases)
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            bad = unpickler and "find_class" not in methods
        if bad:
            lines.append(node.lineno)
    return lines


def test_no_code_execution_on_load() -> None:
    """trireme/checkpoint/ unpickles only through torch's weights_only loader or its own
    restricted unpickler (safe_pickle.py); nothing calls pickle.load or a bare torch.load."""
    bad = ("import pickle\nx = torch.load(f)\nfrom torch import load\nfrom dill import loads\n"
           "y = pickle.loads(b)\nz = torch.load(f, weights_only=False)\n"
           "class U(pickle.Unpickler):\n    pass\n")
    assert sorted(code_execution_risks(bad + "'torch.load in a docstring'")) == [
        1, 2, 3, 4, 5, 6, 7]
    good = ("import pickle\nx = torch.load(f, map_location='cpu', weights_only=True)\n"
            "class U(pickle.Unpickler):\n    def find_class(self, m, n):\n        raise KeyError\n")
    assert code_execution_risks(good, pickle_allowed=True) == []
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert PACKAGE_DIR / "store.py" in files and PACKAGE_DIR / RESTRICTED_UNPICKLER_FILE in files
    problems = {f.name: code_execution_risks(f.read_text(), f.name == RESTRICTED_UNPICKLER_FILE)
                for f in files}
    assert not any(problems.values()), f"unsafe unpickling in trireme/checkpoint: {problems}"


def test_model_only_loads_leave_the_optimizer_unread(tmp_path: Path, monkeypatch: Any) -> None:
    path = save(tmp_path, 3)
    read = []
    real = fmt.read_safetensors
    monkeypatch.setattr(fmt, "read_safetensors", lambda p: read.append(Path(p).name) or real(p))
    ckpt = load_checkpoint(path, model_only=True)
    assert ckpt.optimizer == {} and "optimizer.safetensors" not in read
    assert torch.equal(ckpt.model["embedding.weight"], model_state()["embedding.weight"])
