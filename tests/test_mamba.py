"""The Mamba-2 mixer (the `M` sublayer): config errors, initialization as the reference
implementation, the decoding state against full recomputation, selective recomputation, FLOPs,
and the mamba2-tiny / hybrid-tiny presets training."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_train import toy_data  # noqa: F401  (a fixture)

from trireme.config import ModelConfig, load_config
from trireme.convert.hf_mamba import mamba_family
from trireme.errors import ConfigError, TriremeError
from trireme.models import mamba as mamba_module
from trireme.models.gpt import GPT
from trireme.models.mamba import Mamba, MambaState
from trireme.models.mlp import MLP
from trireme.models.stages import layer_costs, stage_specs
from trireme.ops.ssd import FastKernels, discretize_dt, ssd_recurrence
from trireme.parallel.layout import resolve_layout
from trireme.serving.generate import generate
from trireme.training.train import train


def hybrid_config(**overrides) -> ModelConfig:
    values = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=61,
                  seq_length=48, layer_pattern="M-*-M", ffn_hidden_size=48, mamba_state_dim=8,
                  mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=8)
    return ModelConfig(**{**values, **overrides})


@pytest.mark.parametrize("overrides, words", [
    (["model.mamba_state_dim=0"], "model.mamba_state_dim = 0 must be at least 1"),
    (["model.mamba_head_dim=0"], "model.mamba_head_dim = 0 must be at least 1"),
    (["model.mamba_num_groups=5"], "model.mamba_num_groups = 5 must divide the 12 Mamba heads"),
    (["model.mamba_head_dim=40"], "not divisible by model.mamba_head_dim = 40"),
    (["model.mamba_num_groups=1", "parallel.tensor=2"],
     "model.mamba_num_groups = 1 is not divisible by parallel.tensor = 2"),
    (["model.mamba_dt_min=0.5"], "0 < dt_min <= dt_max"),
])
def test_bad_mamba_settings_are_one_line_errors(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config("hybrid-tiny", overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_pattern_with_m_but_no_mamba_settings_is_refused():
    with pytest.raises(ConfigError, match="mamba_state_dim = 0 must be at least 1 with Mamba-2"):
        load_config("tiny", ["model.layer_pattern=M-M-M-M-"])


def test_context_parallel_with_mamba_layers_is_a_one_line_error():
    cfg = load_config("hybrid-tiny", ["parallel.context=2"])
    with pytest.raises(ConfigError, match=r"Mamba-2 layers \(M\): not implemented yet"):
        resolve_layout(cfg, world_size=2)


def test_init_follows_the_reference_distributions_and_names():
    cfg = hybrid_config(mamba_dt_min=0.01, mamba_dt_max=0.05, mamba_a_init_min=2.0,
                        mamba_a_init_max=4.0)
    model = GPT(cfg, seed=7)
    mixer = model.layers["0"].mamba
    assert isinstance(mixer, Mamba) and model.layers["1"].sublayers == ("attention", "mlp")
    dt = F.softplus(mixer.dt_bias.detach())
    assert float(dt.min()) >= 0.01 - 1e-6 and float(dt.max()) <= 0.05 + 1e-6
    a = torch.exp(mixer.A_log.detach())
    assert float(a.min()) >= 2.0 and float(a.max()) <= 4.0 and a.std() > 0
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    assert torch.equal(mixer.norm.weight, torch.ones_like(mixer.norm.weight))
    assert not mixer.conv1d.bias.any()
    bound = 1 / math.sqrt(cfg.mamba_conv_kernel)
    assert float(mixer.conv1d.weight.abs().max()) <= bound
    # by (seed, name) only: another layer's mixer draws other numbers, the same seed the same
    other = model.layers["2"].mamba
    assert not torch.equal(other.A_log, mixer.A_log)
    again = GPT(cfg, seed=7).layers["0"].mamba
    assert all(torch.equal(p, q) for p, q in zip(mixer.parameters(), again.parameters()))


def test_sizes_and_flops():
    cfg = hybrid_config()
    mixer = GPT(cfg, seed=0).layers["0"].mamba
    heads = 2 * 32 // 8  # expand * hidden / head_dim
    d_in, gn = heads * 8, 2 * 8
    assert mixer.in_proj.weight.shape == (2 * d_in + 2 * gn + heads, 32)
    assert mixer.conv1d.weight.shape == (d_in + 2 * gn, 1, 4)
    flops = Mamba.flops(cfg)
    assert flops == 32 * (2 * d_in + 2 * gn + heads) + 3.5 * d_in * 8 + d_in * 32
    costs = layer_costs(cfg)
    assert costs[0] == Mamba.flops(cfg) + MLP.flops(cfg) and costs[2] == flops


@pytest.mark.parametrize("dtype", [torch.float64])
def test_state_decoding_equals_recomputation(dtype):
    """The state the mixer keeps per sequence (a serving engine's slot rows): a prefill, one
    token at a time, then a chunk, each continuing from the state, equal one pass over the
    whole sequence; a state given start position 0 starts afresh."""
    torch.manual_seed(0)
    model = GPT(hybrid_config(), seed=1).to(dtype).eval()
    mamba = model.layers["0"].mamba
    with torch.no_grad():
        zxbcdt = mamba.in_proj(torch.randn(2, 21, 32, dtype=dtype))
        full = mamba.core(zxbcdt)  # [b, s, d_in], no state
        state = mamba.new_cache(2, 30, zxbcdt.device, dtype)
        assert isinstance(state, MambaState)
        steps = [mamba.core(zxbcdt[:, :9], state, 0)]  # prefill 9 (chunks of 8: one ragged)
        for pos in range(9, 14):  # then one token at a time
            steps.append(mamba.core(zxbcdt[:, pos:pos + 1], state, pos))
        steps.append(mamba.core(zxbcdt[:, 14:], state, 14))  # a chunk of 7 again
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
        again = mamba.core(zxbcdt[:, :5], state, 0)
    torch.testing.assert_close(again, full[:, :5], rtol=1e-9, atol=1e-9)


def test_generate_with_the_state_equals_generate_without():
    model = GPT(hybrid_config(layer_pattern="MMM"), seed=2)
    prompt = torch.randint(0, 61, (3, 6), generator=torch.Generator().manual_seed(0))
    cached = generate(model, prompt, 12, greedy=True)
    assert torch.equal(cached, generate(model, prompt, 12, greedy=True, use_cache=False))
    sampled = generate(model, prompt, 12, temperature=1.0, seed=3)
    assert torch.equal(sampled, generate(model, prompt, 12, temperature=1.0, seed=3,
                                         use_cache=False))


def test_selective_recomputation_gives_the_same_gradients():
    torch.manual_seed(0)
    ids = torch.randint(0, 61, (2, 19))
    grads = []
    for mode in ("none", "selective", "full"):
        model = GPT(hybrid_config(), seed=4)
        model.set_recompute(mode)
        model(ids, ids).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, msg=name)


def _train_losses(data, run_dir, preset, *extra):
    cfg = load_config(preset, [
        f"data.path={data}", "data.tokenizer=bytes", f"run.dir={run_dir}", "model.seq_length=32",
        "model.hidden_size=64", "model.num_attention_heads=4", "model.mamba_head_dim=16",
        "train.global_batch_size=8",
        "train.steps=12", "train.log_interval=1", "train.eval_interval=0",
        "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false",
        "schedule.warmup_steps=2", "optimizer.lr=1e-2", *extra])
    train(cfg)
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]


@pytest.mark.parametrize("preset", ["mamba2-tiny", "hybrid-tiny"])
def test_presets_train_and_the_loss_falls(toy_data, tmp_path, preset):  # noqa: F811
    losses = _train_losses(toy_data, tmp_path / preset, preset)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < 0.75 * sum(losses[:3]) / 3, losses


def test_ssd_layer_bench_smoke(tmp_path):
    """bench/ssd_layer.py --smoke runs on the CPU and writes its table as JSON."""
    out = tmp_path / "ssd.json"
    bench = Path(__file__).resolve().parent.parent / "bench" / "ssd_layer.py"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, str(bench), "--smoke", "--out", str(out)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["part"], r["path"]) for r in rows} == {("scan", "torch"), ("layer", "torch")}
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_the_gpu_hybrid_preset_has_its_size_and_balances_its_stages():
    cfg = load_config("nemotron-h-1b", ["parallel.pipeline=4"])
    with torch.device("meta"):
        model = GPT(cfg.model, seed=None)
    assert 1.5e9 < model.num_parameters() < 1.7e9
    assert mamba_family(cfg.model) == "nemotron_h"  # Nemotron-H's layout: it exports as one
    assert "".join(cfg.model.layer_symbols).count("M") == 16
    specs = stage_specs(cfg.model, cfg.parallel)
    costs = layer_costs(cfg.model)
    stage_costs = [sum(costs[s.start:s.stop]) for s in specs]
    assert max(stage_costs) < 1.15 * sum(costs) / 4  # balanced by FLOPs, not by layer count


def test_the_fast_kernel_path_hands_mamba_ssm_what_it_expects(monkeypatch):
    """The optional kernels' glue (raw dt with its bias, softplus and limits for the kernel,
    the convolution on [b, d, l]) with stand-ins that follow mamba_ssm's and causal_conv1d's
    signatures, built on the step-by-step recurrence: the same loss and gradients as the plain
    path. Asking for mamba_ssm where it does not import is a one-line error."""
    calls = []

    def scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf"))):
        calls.append("scan")
        return ssd_recurrence(x, discretize_dt(dt, dt_bias, dt_softplus, dt_limit), A, B, C, D)[0]

    def conv(x, weight, bias=None, activation=None):  # x [b, d, l], weight [d, w]
        calls.append("conv")
        out = F.conv1d(F.pad(x, (weight.shape[-1] - 1, 0)), weight.unsqueeze(1), bias,
                       groups=x.shape[1])
        return F.silu(out) if activation == "silu" else out

    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(0))
    cfg = hybrid_config(mamba_dt_limit_min=0.05, mamba_dt_limit_max=0.5)
    results = []
    for kernels in ("torch", "mamba_ssm"):
        model = GPT(dataclasses.replace(cfg, mamba_kernels=kernels), seed=5)
        if kernels == "mamba_ssm":
            with pytest.raises(TriremeError, match="mamba_ssm does not import") as err:
                model(ids, ids)
            assert "\n" not in str(err.value)
            monkeypatch.setattr(mamba_module, "fast_ssd_kernels",
                                lambda device: FastKernels(scan, conv))
        loss = model(ids, ids)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    assert calls.count("scan") == calls.count("conv") == 2  # two M layers, once each
    torch.testing.assert_close(results[1][0], results[0][0])
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, msg=name)


def test_packed_documents_with_mamba_layers_are_refused():
    with pytest.raises(ConfigError, match="reset_attention_mask .* Mamba-2 layers"):
        load_config("hybrid-tiny", ["data.reset_attention_mask=true"])


@torch.no_grad()
def test_the_serving_engine_decodes_a_hybrid_model_as_generate_does():
    """Continuous batching with per-request Mamba states (slots reused by later requests, prompts
    prefilled in chunks next to decoding ones) gives each prompt generate's greedy tokens."""
    from trireme.serving.engine import Engine, EngineSettings
    from trireme.serving.sampling import SamplingParams

    model = GPT(hybrid_config(layer_pattern="M*-M-"), seed=5).eval()
    gen = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, 61, (n,), generator=gen).tolist() for n in (3, 11, 7, 17, 5)]
    params = [SamplingParams(max_tokens=4 + i % 3, greedy=True) for i in range(len(texts))]
    engine = Engine(model, EngineSettings(block_size=4, max_running=2, max_batch_tokens=9))
    for prompt, p, request in zip(texts, params, engine.generate(texts, params)):
        want = generate(model, prompt, p.max_tokens, greedy=True,
                        use_cache=False).tolist()[len(prompt):]
        assert request.output_ids == want
