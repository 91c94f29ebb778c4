"""Images in the serving engine and the chat endpoint (trireme.serving.image_parts, .images):
the engine's greedy tokens for (image, prompt) equal `generate`'s, with prompt chunks that split
the image placeholders and other requests in the same steps; the live server answers image data
URLs (PNG, JPEG) with what `trireme generate --image --greedy` prints, streamed or whole; bad
images and image parts are one-line 400s, and the server keeps serving."""

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from serving import client
from serving import live_server as serve_api_server

import trireme.serving.server as server_module
from trireme.checkpoint.store import save_checkpoint
from trireme.cli import main as trireme_main
from trireme.commands.serve import chat_format, serve_main
from trireme.config import Config, ModelConfig
from trireme.data.images import load_image, pixels
from trireme.data.multimodal import image_prompt_ids
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.models.vision import num_image_tokens
from trireme.serving.engine import Engine, EngineSettings, RequestError
from trireme.serving.generate import generate
from trireme.serving.image_parts import VisionInputs
from trireme.serving.loading import load_for_inference
from trireme.serving.openai_api import parse_chat
from trireme.serving.sampling import SamplingParams

PIL = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
IMAGE_ID = 257  # the byte tokenizer's ids are 0..256 (eod); the placeholder comes after
QUESTIONS = ["what is in the image?", "colour?", "<image>\ndescribe it", "and the shape?"]


def model_config(vision: bool, positions: str = "rope") -> ModelConfig:
    extra = dict(vision_layers=2, vision_image_size=16, vision_patch_size=4,
                 vision_hidden_size=32, vision_attention_heads=2, image_token_id=IMAGE_ID,
                 vision_activation="quick_gelu") if vision else {}
    return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=128, vocab_size=258, seq_length=96,
                       position_embedding=positions, normalization="rmsnorm",
                       activation="swiglu", precision="fp32", **extra)


def tiny_model(cfg: ModelConfig) -> GPT:
    """The language model's weights scaled up: clear greedy choices."""
    model = GPT(cfg, seed=5).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and not name.startswith("vision."):
                p.mul_(8.0)
    return model


def save_model(root: Path, vision: bool) -> Path:
    """A tiny Llama-shaped model (with a LLaVA-style image side when `vision`), saved with the
    byte tokenizer."""
    cfg = Config()
    cfg.model = model_config(vision)
    cfg.data.tokenizer = "bytes"
    state = {n: t.detach().clone() for n, t in tiny_model(cfg.model).state_dict().items()}
    save_checkpoint(root, 0, model=state, optimizer={}, trainer={"step": 0},
                    config_toml=cfg.to_toml())
    return root


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("vlm") / "ckpt", vision=True)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> list[Path]:
    """Random images: square and not, PNG and JPEG, none of them the model's 16 x 16."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h, kind) in enumerate([(24, 24, "png"), (30, 18, "jpeg"), (12, 20, "png")]):
        path = folder / f"image{i}.{kind}"
        PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def data_url(path: Path) -> str:
    kind = "jpeg" if path.suffix == ".jpeg" else "png"
    return f"data:image/{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def image_message(text: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.mark.parametrize("positions", ["rope", "learned"])
@torch.no_grad()
def test_engine_greedy_equals_generate_with_images(positions, image_files):
    cfg = model_config(vision=True, positions=positions)
    model, tok = tiny_model(cfg), load_tokenizer("bytes")
    jobs = []  # (prompt ids, pixels or None)
    for i, question in enumerate(QUESTIONS):
        image = pixels(load_image(image_files[i % 3], cfg.vision_image_size)[None])
        jobs.append((image_prompt_ids(tok, question, IMAGE_ID, num_image_tokens(cfg)), image))
        jobs.append((tok.encode(question), None))  # text-only requests in the same steps
    # 7 tokens a step: prompt chunks start and end inside the 16 placeholders of an image
    engine = Engine(model, EngineSettings(max_running=8, max_batch_tokens=7), tokenizer=tok)
    params = SamplingParams(max_tokens=12, greedy=True)
    requests = [engine.submit(ids, params, images=image) for ids, image in jobs]
    while engine.has_work():
        engine.step()
    for (ids, image), request in zip(jobs, requests):
        expected = generate(model, ids, 12, greedy=True, eos_id=tok.eod, images=image,
                            use_cache=False)
        assert request.output_ids == expected[len(ids):].tolist()
        assert request.images is None  # the features went with the prefill
    # the images matter: another image gives other tokens for the first question
    other = pixels(load_image(image_files[1], cfg.vision_image_size)[None])
    again = engine.generate([jobs[0][0]], [params])  # no images: placeholders embedded as ids
    with_other = generate(model, jobs[0][0], 12, greedy=True, eos_id=tok.eod, images=other)
    assert requests[0].output_ids != with_other[len(jobs[0][0]):].tolist()
    assert again[0].output_ids != requests[0].output_ids
    with pytest.raises(RequestError, match="image placeholder"):
        engine.submit(tok.encode("no placeholders"), params, images=jobs[0][1])


@contextmanager
def live_server(checkpoint: Path, **server_settings):
    """The tests' live server (serving.py) for the vision model; yields an openai client of it."""
    with serve_api_server(checkpoint, name="vlm", server_settings=server_settings,
                          max_running=8, max_batch_tokens=24) as (url, _, _):
        yield client(url, key="none")


def cli_generate_image(checkpoint: Path, image: Path, prompt: str, capsys) -> str:
    """What `trireme generate --image --greedy` prints (the question framed, then the answer)."""
    capsys.readouterr()
    assert trireme_main(["generate", "--checkpoint", str(checkpoint), "--image", str(image),
                         "--prompt", prompt, "--max-new-tokens", "20", "--greedy",
                         "--device", "cpu"]) == 0
    return capsys.readouterr().out[:-1]  # print's newline


def test_chat_with_images_equals_trireme_generate(vlm_checkpoint, image_files, capsys):
    jobs = [(QUESTIONS[i], image_files[i % 3]) for i in range(len(QUESTIONS))]
    with live_server(vlm_checkpoint, max_image_pixels=1000) as api:
        def ask(job, stream=False):
            question, path = job
            return api.chat.completions.create(
                model="vlm", messages=image_message(question, data_url(path)), max_tokens=20,
                temperature=0, stream=stream)

        with ThreadPoolExecutor(len(jobs)) as pool:  # batched together in the engine
            answers = list(pool.map(ask, jobs))
        for (question, path), answer in zip(jobs, answers):
            expected = cli_generate_image(vlm_checkpoint, path, question, capsys)
            # without a marker the image opens the question, as LLaVA's data has it
            framed = (f"USER: {question.replace('<image>', '')}\nASSISTANT:"
                      if "<image>" in question else f"USER: \n{question}\nASSISTANT:")
            assert framed + answer.choices[0].message.content == expected, question
            assert answer.usage.prompt_tokens == len(framed.encode()) + 16  # + the image's
            chunks = list(ask((question, path), stream=True))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert streamed == answer.choices[0].message.content
        # text-only chat with a vision model: the same framing, no image
        text = api.chat.completions.create(model="vlm", messages=[
            {"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
        assert text.usage.prompt_tokens == len(b"USER: hi\nASSISTANT:")


def bad_request(api, messages, match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match) as caught:
        api.chat.completions.create(model="vlm", messages=messages, max_tokens=3)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]


def test_bad_images_and_parts_are_400s(vlm_checkpoint, image_files, tmp_path):
    good = data_url(image_files[0])
    big = io.BytesIO()
    PIL.new("RGB", (40, 30)).save(big, format="PNG")  # padded to 40 x 40, over the limit of 1000
    big_url = f"data:image/png;base64,{base64.b64encode(big.getvalue()).decode()}"
    text = base64.b64encode(b"plain text, not an image").decode()
    with live_server(vlm_checkpoint, max_image_pixels=1000) as api:
        bad_request(api, image_message("q", "https://example.com/cat.png"), "does not fetch")
        bad_request(api, image_message("q", str(image_files[0])), "does not fetch URLs or read")
        bad_request(api, image_message("q", "data:image/png;base64,abc$%"), "base64")
        bad_request(api, image_message("q", f"data:image/png;base64,{text}"),
                    "not a readable image")
        bad_request(api, image_message("q", good.replace("image/png", "image/jpeg")),
                    "not a readable image")  # a PNG is not decoded as what it claims to be
        bad_request(api, image_message("q", big_url), "40 x 30, padded to 40 x 40 = 1600")
        thin = io.BytesIO()
        PIL.new("RGB", (100, 1)).save(thin, format="PNG")  # 100 pixels, but a 100 x 100 square
        thin_url = f"data:image/png;base64,{base64.b64encode(thin.getvalue()).decode()}"
        bad_request(api, image_message("q", thin_url), "100 x 1, padded to 100 x 100")
        two = image_message("q", good)
        two[0]["content"].append({"type": "image_url", "image_url": {"url": good}})
        bad_request(api, two, "2 images; this model takes 1")
        bad_request(api, [{"role": "user", "content": "<image> what?"}], "no image")
        bad_request(api, image_message("<image><image> q", good), "one image")
        bad_request(api, [{"role": "user", "content": "q"}, {
            "role": "assistant", "content": [{"type": "image_url", "image_url": {"url": good}}]},
            {"role": "user", "content": "q"}], "only user messages")
        bad_request(api, [{"role": "user", "content": [{"type": "audio"}]}], "part")
        answer = api.chat.completions.create(model="vlm", messages=image_message("q", good),
                                             max_tokens=3, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")  # still serving
    text_only = save_model(tmp_path / "text", vision=False)
    with live_server(text_only) as api:
        bad_request(api, image_message("q", good), "this model takes no images")
        answer = api.chat.completions.create(model="vlm", messages=[
            {"role": "user", "content": [{"type": "text", "text": "q"}]}], max_tokens=3)
        assert answer.usage.completion_tokens >= 1


def test_image_decodes_are_bounded_and_the_cli_checks_the_limit(vlm_checkpoint, image_files,
                                                                monkeypatch):
    running, most, lock = [0], [0], threading.Lock()
    parse = server_module.parse_chat

    def slow_parse(*args):  # counts the decodes in flight
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return parse(*args)

    monkeypatch.setattr(server_module, "parse_chat", slow_parse)
    good = data_url(image_files[0])
    with live_server(vlm_checkpoint) as api:
        def ask(_):
            return api.chat.completions.create(model="vlm", messages=image_message("q", good),
                                               max_tokens=1, temperature=0)

        with ThreadPoolExecutor(6) as pool:
            assert len(list(pool.map(ask, range(6)))) == 6
    assert most[0] == server_module.IMAGE_DECODES
    with pytest.raises(ConfigError, match="--max-image-pixels 0 must be > 0"):
        serve_main(["--checkpoint", str(vlm_checkpoint), "--max-image-pixels", "0"])


def test_a_vision_answer_stops_at_the_next_user_turn(vlm_checkpoint, image_files):
    loaded = load_for_inference(str(vlm_checkpoint), device="cpu")
    vision = VisionInputs.of(loaded.cfg.model)
    body = {"messages": image_message("q", data_url(image_files[0])), "stop": "x"}
    parsed = parse_chat(body, loaded.tokenizer, chat_format(loaded), loaded.cfg.model.seq_length,
                        vision)
    assert set(parsed.params.stop) == {"x", "\nUSER:"}  # the framing's turns: "USER: ...\n"


@pytest.mark.parametrize("args, match", [
    (["--prompt", "<image> what is <image> here?", "--image", "IMG"], "--prompt: one image"),
    (["--prompt", "<image> what is here?"], "marker but there is no --image"),
    (["--prompt", "what?", "--image", "/no/such.png"], "not a file); check the path\n"),
])
def test_generate_image_prompt_errors_are_one_line(vlm_checkpoint, image_files, capsys, args,
                                                   match):
    """As the server answers the same with a 400: two markers, or a marker and no image."""
    args = [str(image_files[0]) if a == "IMG" else a for a in args]
    capsys.readouterr()
    code = trireme_main(["generate", "--checkpoint", str(vlm_checkpoint), *args,
                         "--max-new-tokens", "3", "--greedy", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err, err
