"""What an engine step carrying prompts does (bench/serve_mixed.py measures it): its attention
calls never let SDPA pick cuDNN, which builds an execution plan for every new shape (each new
prompt or chunk length), and only the sampled rows reach the output layer."""

import pytest
import torch
from torch.nn.attention import SDPBackend

import trireme.ops.attention as attention_module
from trireme.config import ModelConfig
from trireme.models.gpt import GPT
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.sampling import SamplingParams

VOCAB = 100
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model() -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=VOCAB, seq_length=64,
                      position_embedding="rope", normalization="rmsnorm", activation="swiglu")
    return GPT(cfg, seed=0).eval()


def test_varying_shapes_keep_sdpa_off_cudnn_on_hopper(monkeypatch):
    monkeypatch.setitem(attention_module._HOPPER, 0, True)  # as on an H200
    cuda = torch.device("cuda", 0)
    with attention_module._kernel_choice("auto", cuda, varying=False):  # training: cuDNN first
        assert torch.backends.cuda.cudnn_sdp_enabled()
        if hasattr(torch._C, "_get_sdp_priority_order"):
            assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
    with attention_module._kernel_choice("auto", cuda, varying=True):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored on leaving


def recorded_choices(monkeypatch) -> list[bool]:
    """The `varying` flag of every attention call from now on."""
    calls, real = [], attention_module._kernel_choice

    def record(backend, device, varying=False):
        calls.append(varying)
        return real(backend, device, varying)

    monkeypatch.setattr(attention_module, "_kernel_choice", record)
    return calls


@torch.no_grad()
def test_prompt_attention_in_serving_is_marked_varying(monkeypatch):
    model = tiny_model()
    calls = recorded_choices(monkeypatch)
    model(torch.randint(0, VOCAB, (1, 12)))  # training's shape: the fixed-shape choice
    assert calls == [False, False]
    calls.clear()
    # a 30-token prompt in chunks of at most 8 tokens (later chunks: q_offset > 0) next to a
    # short one that is decoding meanwhile
    engine = Engine(model, EngineSettings(max_running=4, max_batch_tokens=8, num_blocks=32))
    params = [SamplingParams(max_tokens=4, greedy=True)] * 2
    engine.generate([list(range(1, 31)), [5, 6, 7]], params)
    assert len(calls) >= 2 * 4 and all(calls)  # >= 4 chunks of the long prompt, 2 layers


@torch.no_grad()
def test_a_prefill_step_sends_only_the_sampled_rows_to_the_output_layer():
    model = tiny_model()
    rows: list[int] = []
    model.final_norm.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    engine = Engine(model, EngineSettings(max_running=4, max_batch_tokens=64, num_blocks=32))
    params = [SamplingParams(max_tokens=2, greedy=True)] * 3
    engine.generate([list(range(1, 41)), list(range(3, 20)), [7]], params)
    # step 1: three whole prompts (58 tokens), one row each; step 2: three decode rows
    assert rows == [3, 3]
