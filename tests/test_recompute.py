"""Activation recomputation (train.recompute): the same gradients as without it (dropout on, so
the recomputation must draw the forward's masks, the tensor-parallel streams included), and fewer
bytes kept for the backward."""

import pytest
import torch
from distributed import run_ranks

import trireme.ops.recompute as recompute_module
from trireme.config import ModelConfig
from trireme.errors import TriremeError
from trireme.models.gpt import GPT
from trireme.parallel.context import ParallelContext
from trireme.parallel.mesh import ParallelDims, ParallelMesh
from trireme.parallel.tensor import build_tensor_parallel

SEED = 3
MODES = [("selective", 0), ("full", 0), ("full", 1)]


def llama(**kw) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, vocab_size=97, seq_length=16, qk_norm=True,
                  make_vocab_size_divisible_by=8, dropout=0.2)
    return ModelConfig(**{**values, **kw})


def gpt2(**kw) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  vocab_size=101, seq_length=16, position_embedding="learned",
                  normalization="layernorm", activation="gelu", bias=True, tie_embeddings=True,
                  make_vocab_size_divisible_by=8, dropout=0.2)
    return ModelConfig(**{**values, **kw})


def batch(cfg: ModelConfig, b: int = 2):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :2] = -100
    return ids[:, :-1], labels


def grads_after_step(model: GPT, cfg: ModelConfig, steps: int = 2) -> dict[str, torch.Tensor]:
    """Gradients summed over `steps` forward/backward passes (the dropout streams move on)."""
    torch.manual_seed(SEED)
    tokens, labels = batch(cfg)
    for _ in range(steps):
        model(tokens, labels).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("config", [llama, gpt2])
@pytest.mark.parametrize("mode,layers", MODES)
def test_same_gradients_with_dropout(config, mode, layers):
    cfg = config()
    ref = grads_after_step(GPT(cfg, seed=SEED).train(), cfg)
    model = GPT(cfg, seed=SEED).train()
    model.set_recompute(mode, layers)
    got = grads_after_step(model, cfg)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, msg=name)
    # not vacuous: without restoring the generator, the recomputation draws other masks
    other = GPT(cfg, seed=SEED).train()
    other.set_recompute(mode, layers)
    original = recompute_module.checkpoint

    def forgetful(fn, *args, **kwargs):
        return original(fn, *args, **{**kwargs, "preserve_rng_state": False})

    recompute_module.checkpoint = forgetful
    try:
        wrong = grads_after_step(other, cfg)
    finally:
        recompute_module.checkpoint = original
    assert any(not torch.allclose(wrong[n], g) for n, g in ref.items())


def test_set_recompute_flags_and_bad_mode():
    model = GPT(llama(num_layers=3), seed=SEED)
    model.set_recompute("full", 2)
    assert [b.recompute for b in model.layers.values()] == [True, True, False]
    model.set_recompute("selective")
    blocks = list(model.layers.values())
    assert not any(b.recompute for b in blocks)
    assert all(b.attention.recompute_core and b.mlp.recompute_activation for b in blocks)
    with pytest.raises(TriremeError, match="recompute"):
        model.set_recompute("some")


def saved_bytes(model: GPT, cfg: ModelConfig, monkeypatch=None) -> int:
    """Bytes of the distinct storages the autograd graph keeps for the backward after a forward:
    the tensors saved outside any recomputed region, plus the inputs each recomputed region keeps
    (parameters and buffers left out: they are there in every mode). Without `monkeypatch` the
    inputs of eager checkpoints are not counted (compiled blocks: their graphs save them)."""
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in fixed:
            kept[ptr] = t.untyped_storage().nbytes()

    def pack(t):
        keep(t)
        return t

    original = recompute_module.checkpoint

    def counting(fn, *args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                keep(a)
        return original(fn, *args, **kwargs)

    if monkeypatch is not None:
        monkeypatch.setattr(recompute_module, "checkpoint", counting)
    tokens, labels = batch(cfg, b=4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels)
    loss.backward()  # still runs
    return sum(kept.values())


def test_recompute_keeps_fewer_bytes(monkeypatch):
    cfg = llama(dropout=0.0, num_layers=4, seq_length=64, hidden_size=64, ffn_hidden_size=256)
    sizes = {}
    for mode, layers in [("none", 0), *MODES]:
        model = GPT(cfg, seed=SEED)
        model.set_recompute(mode, layers)
        sizes[(mode, layers)] = saved_bytes(model, cfg, monkeypatch)
    none, selective = sizes[("none", 0)], sizes[("selective", 0)]
    full, full_one = sizes[("full", 0)], sizes[("full", 1)]
    assert full < full_one < none and full < selective < none, sizes
    # selective drops at least silu(gate) ([b, s, ffn] per layer) and the RoPE'd q and k
    per_layer = 4 * 64 * (256 + 4 * 16 + 2 * 16) * 4  # b * s * (ffn + q + k) * fp32 bytes
    assert none - selective >= cfg.num_layers * per_layer, sizes


def tensor_parallel_worker(rank: int, world: int) -> None:
    mesh = ParallelMesh.build(ParallelDims(tensor=world), "cpu")
    cfg = llama()
    results = {}
    for mode, layers in [("none", 0), *MODES]:
        tp = build_tensor_parallel(mesh, cfg, True, SEED, "cpu")  # SP: residual dropout per rank
        model = GPT(cfg, seed=SEED, ctx=ParallelContext(mesh, tp)).train()
        model.set_recompute(mode, layers)
        results[mode, layers] = grads_after_step(model, cfg, steps=1)
    for key, got in results.items():
        for name, g in results[("none", 0)].items():
            torch.testing.assert_close(got[name], g, msg=f"{key} {name}")


def test_tensor_parallel_dropout_masks_replayed(tmp_path):
    run_ranks(tensor_parallel_worker, 2, tmp_path)


def test_compiled_block_recomputes_the_same():
    """The checkpoint sits inside Block.forward, so a compiled block captures it (aot_eager: the
    graph capture and the partition, without code generation): the same gradients, and the
    compiled graphs keep fewer bytes for the backward (what they save passes the hooks too)."""
    cfg = llama(dropout=0.0, seq_length=32)
    ref = GPT(cfg, seed=SEED)
    saved_bytes(ref, cfg)  # eager, no recomputation: the reference gradients
    sizes = {}
    for mode in ("none", "selective", "full"):
        torch._dynamo.reset()
        model = GPT(cfg, seed=SEED)
        model.set_recompute(mode)
        for block in model.layers.values():
            block.compile(backend="aot_eager", fullgraph=True)
        model(*batch(cfg, b=4)).backward()  # compiles (the counting hooks must not be traced)
        model.zero_grad()
        sizes[mode] = saved_bytes(model, cfg)
        for name, p in ref.named_parameters():
            got = dict(model.named_parameters())[name].grad
            torch.testing.assert_close(got, p.grad, msg=f"{mode} {name}")
    assert sizes["full"] < sizes["selective"] < sizes["none"], sizes


def test_config_errors():
    from trireme.config import load_config
    from trireme.errors import ConfigError

    assert load_config("tiny", ["train.recompute=full", "train.recompute_layers=1"])
    with pytest.raises(ConfigError, match="recompute_layers = 2 needs train.recompute"):
        load_config("tiny", ["train.recompute=selective", "train.recompute_layers=2"])
    with pytest.raises(ConfigError, match="not one of"):
        load_config("tiny", ["train.recompute=all"])
    with pytest.raises(ConfigError, match="recompute_layers = 9 is more than model.num_layers"):
        load_config("tiny", ["train.recompute=full", "train.recompute_layers=9",
                             "model.num_layers=4"])
    with pytest.raises(ConfigError, match="loss_chunk_size = 0"):
        load_config("tiny", ["model.fused_cross_entropy=true", "model.loss_chunk_size=0"])
