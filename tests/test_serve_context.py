"""--max-model-len: serving a model at the context it supports (model.max_position_embeddings,
e.g. a converted Llama fine-tuned at a shorter seq_length) or at a shorter one."""

import pytest
import torch

from tests.serving import CONTEXT, make_checkpoint
from trireme.config import ModelConfig
from trireme.errors import ConfigError
from trireme.serving.engine import Engine, EngineSettings, RequestError
from trireme.serving.generate import generate
from trireme.serving.loading import inference_context, load_for_inference
from trireme.serving.sampling import SamplingParams

LONG = 2 * CONTEXT


def engine_of(ckpt, context: int = 0) -> Engine:
    loaded = load_for_inference(str(ckpt), device="cpu", context=context)
    return Engine(loaded.model, EngineSettings(max_running=4, max_batch_tokens=64))


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    (done,) = engine.generate([prompt], [SamplingParams(max_tokens=n, temperature=0,
                                                        ignore_eos=True)])
    return done.output_ids


def test_the_supported_context_serves_prompts_past_seq_length(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", max_position_embeddings=LONG)
    prompt = [int(i) for i in torch.randint(1, 257, (CONTEXT + 20,),
                                            generator=torch.Generator().manual_seed(0))]
    with pytest.raises(RequestError, match=f"context is {CONTEXT}"):
        engine_of(ckpt).check_prompt(prompt)  # the default: the length it was trained at
    engine = engine_of(ckpt, LONG)
    assert engine.room(len(prompt)) == LONG - len(prompt)
    served = greedy(engine, prompt, 12)
    reference = generate(engine.model, prompt, 12, greedy=True, use_cache=False)  # no cache
    assert served == reference.tolist()[len(prompt):]
    short = prompt[:30]  # within seq_length: the same answer at either context
    assert greedy(engine, short, 12) == greedy(engine_of(ckpt), short, 12)


def test_a_shorter_context_caps_requests(tmp_path):
    engine = engine_of(make_checkpoint(tmp_path / "ckpt"), 40)
    with pytest.raises(RequestError, match="context is 40"):
        engine.check_prompt(list(range(1, 41)))
    assert len(greedy(engine, list(range(1, 31)), 50)) == 10  # stops at the context


@pytest.mark.parametrize("wanted, model, message", [
    (LONG + 1, {"max_position_embeddings": LONG}, "model.max_position_embeddings"),
    (CONTEXT + 1, {}, f"past the {CONTEXT} positions .* \\(model.seq_length\\)"),
    # a converted Llama: rotary positions, max_position_embeddings = seq_length (the message
    # said "learned positions have no more")
    (CONTEXT + 1, {"max_position_embeddings": CONTEXT}, "\\(model.max_position_embeddings\\)"),
    (CONTEXT + 1, {"position_embedding": "learned"}, "learned positions"),
    (1, {}, "must be >= 2"),
    (-5, {}, "must be >= 2"),
])
def test_contexts_the_model_cannot_serve_are_one_line_errors(wanted, model, message):
    cfg = ModelConfig(seq_length=CONTEXT, **model)
    with pytest.raises(ConfigError, match=message):
        inference_context(cfg, wanted)


def test_zero_and_shorter_contexts(tmp_path):
    cfg = ModelConfig(seq_length=CONTEXT, max_position_embeddings=LONG)
    assert inference_context(cfg, 0) == CONTEXT
    assert inference_context(cfg, LONG) == LONG
    assert inference_context(ModelConfig(seq_length=CONTEXT, position_embedding="learned"),
                             CONTEXT // 2) == CONTEXT // 2
