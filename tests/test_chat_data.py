"""Chat fine-tuning data (trireme.data.conversations): conversations rendered as `trireme serve`
renders them, the assistant's words the only ones with a loss, and a run that trains on them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trireme.cli import main as trireme_main
from trireme.config import load_config
from trireme.data.chat import ChatFormat, chat_segments
from trireme.data.conversations import ConversationDataset, chat_datasets, is_chat
from trireme.data.tokenizer import load_tokenizer
from trireme.serving.openai_api import parse_chat
from trireme.training.train import train

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                       {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]},
]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def preprocess(tmp_path, records, *flags: str) -> str:
    prefix = str(tmp_path / "chat")
    code = trireme_main(["preprocess", "--chat", "--input", write_jsonl(tmp_path / "in.jsonl",
                         records), "--output-prefix", prefix, "--tokenizer", "bytes", *flags])
    assert code == 0
    return prefix


def trained_text(ds: ConversationDataset, doc: int, tok) -> tuple[str, str]:
    """(the sample's whole text, the text of the tokens that have a loss) of one document."""
    ids, keep = ds.sample(doc)
    eod = tok.eod
    return (tok.decode([i for i in ids if i != eod]),
            tok.decode([i if i != eod else ord("$") for i in ids[keep]]))


@pytest.mark.parametrize("template", ["plain", "jinja"])
def test_only_the_answers_have_a_loss_and_prompts_are_what_serve_sends(tmp_path, template):
    tok = load_tokenizer("bytes")
    flags = []
    if template == "jinja":
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        flags = ["--chat-template", str(tmp_path / "t.jinja")]
    prefix = preprocess(tmp_path, CHATS, *flags)
    assert is_chat(prefix)
    marker = json.loads(open(prefix + ".chat.json").read())
    assert marker["template"] == (flags[1] if flags else "plain")  # the file (said "tokenizer")
    train_ds, _ = chat_datasets(prefix, seq_length=96, seed=0, split="100,0,0", eod=tok.eod,
                                mask_prompt=True, want_valid=False)
    whole, trained = trained_text(train_ds, 0, tok)
    chat = ChatFormat(TEMPLATE if template == "jinja" else None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    served = chat.render(messages)  # what trireme serve continues
    assert whole.startswith(served)
    if template == "plain":
        assert whole == served + " Hello." and trained == " Hello.$"  # the eod ends the answer
        assert trained_text(train_ds, 1, tok)[1] == " 4$ 6$"  # every answer ends with eod
    else:
        assert whole == served + "Hello.<|end|>" and trained == "Hello.<|end|>"
        assert trained_text(train_ds, 1, tok)[1] == "4<|end|>6<|end|>"
    unmasked = ConversationDataset(train_ds.indexed, train_ds.documents, 96, 0, tok.eod, False)
    ids, keep = unmasked.sample(0)
    assert keep.sum() == len(whole.encode()) + (template == "plain")  # all but the padding


def test_segments_join_to_the_render_and_bad_conversations_are_refused():
    plain = ChatFormat(None)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    segments = chat_segments(plain, messages)
    assert [t for _, t in segments] == [False, True, False, True]
    assert "".join(s for s, _ in segments) == plain.render(messages, add_generation_prompt=False)
    for bad in ([{"role": "user", "content": "a"}],
                [{"role": "assistant", "content": "b"}, {"role": "user", "content": "a"}]):
        with pytest.raises(ValueError):
            chat_segments(plain, bad)
    rewriting = ChatFormat("{{ messages | length }}:{% for m in messages %}{{ m.content }}"
                           "{% endfor %}")  # changes what it wrote before at each turn
    with pytest.raises(ValueError, match="--chat-template plain"):
        chat_segments(rewriting, messages)


def test_message_shapes_and_inputs(tmp_path, capsys):
    """Text parts are joined as serve joins them; an empty answer, a compressed or Parquet
    input and a template that does not compile are one-line errors; loop controls work."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "c"}]}
    prefix = preprocess(tmp_path, [parts])
    tok = load_tokenizer("bytes")
    ds, _ = chat_datasets(prefix, seq_length=32, seed=0, split="100,0,0", eod=tok.eod,
                          mask_prompt=True, want_valid=False)
    assert trained_text(ds, 0, tok)[0] == "user: ab\nassistant: c"
    empty = {"messages": [{"role": "user", "content": "a"},
                          {"role": "assistant", "content": "  "}]}
    bad_inputs = [(write_jsonl(tmp_path / "e.jsonl", [empty]), "an assistant message, is empty"),
                  (str(tmp_path / "x.jsonl.gz"), "reads plain JSONL"),
                  (str(tmp_path / "x.parquet"), "reads plain JSONL")]
    for source, words in bad_inputs:
        code = trireme_main(["preprocess", "--chat", "--input", source, "--output-prefix",
                             str(tmp_path / "bad"), "--tokenizer", "bytes"])
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, err
    (tmp_path / "gen.jinja").write_text("{% generation %}x{% endgeneration %}")
    code = trireme_main(["preprocess", "--chat", "--input", write_jsonl(tmp_path / "g.jsonl",
                         CHATS), "--output-prefix", str(tmp_path / "g"), "--tokenizer", "bytes",
                         "--chat-template", str(tmp_path / "gen.jinja")])
    err = capsys.readouterr().err
    assert code == 2 and "does not compile" in err and err.count("\n") == 1
    looping = ChatFormat("{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
                         "{% endif %}{{ m.content }}{% endfor %}{{ strftime_now('%Y') }}")
    assert looping.render(CHATS[0]["messages"]).startswith("HiHello.2")


def test_conversations_that_train_nothing_are_counted(tmp_path):
    long_prompt = {"messages": [{"role": "user", "content": "x" * 40},
                                {"role": "assistant", "content": "y"}]}
    prefix = preprocess(tmp_path, [long_prompt, CHATS[0]])
    ds, _ = chat_datasets(prefix, seq_length=38, seed=0, split="100,0,0", eod=256,
                          mask_prompt=True, want_valid=False)  # prompts of 57 and 36 tokens
    assert ds.untrained() == 1 and ds.too_long() == 2


def test_bad_lines_name_file_and_line(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [CHATS[0], {"messages": [
        {"role": "robot", "content": "x"}]}])
    code = trireme_main(["preprocess", "--chat", "--input", source, "--output-prefix",
                         str(tmp_path / "out"), "--tokenizer", "bytes"])
    err = capsys.readouterr().err
    assert code == 2 and f"{source}:2: message 0" in err and err.count("\n") == 1
    assert not list(tmp_path.glob("out*"))  # nothing half-written
    code = trireme_main(["preprocess", "--chat", "--input", source, "--output-prefix",
                         str(tmp_path / "out"), "--tokenizer", "bytes", "--skip-bad-lines"])
    assert code == 0 and "wrote 1 conversation (" in capsys.readouterr().out
    source = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [
        {"from": "bot", "value": "x"}, {"from": "gpt", "value": "y"}]}])
    code = trireme_main(["preprocess", "--chat", "--input", source, "--output-prefix",
                         str(tmp_path / "out"), "--tokenizer", "bytes"])
    err = capsys.readouterr().err  # ShareGPT's roles named (only OpenAI's were)
    assert code == 2 and "{'from': one of human, gpt, system" in err, err


def test_a_lone_surrogate_escape_is_a_bad_line(tmp_path, capsys):
    """JSON's "\\ud800" decodes to text no tokenizer takes: a `tokenizers` tokenizer raised a
    TypeError traceback, the bytes one an encoder message; both now name file and line."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["hi there"] * 5, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    bad = {"messages": [{"role": "user", "content": "a \ud800 b"},
                        {"role": "assistant", "content": "ok"}]}
    source = write_jsonl(tmp_path / "in.jsonl", [CHATS[0], bad])
    for out, tokenizer in (("a", "bytes"), ("b", str(tmp_path / "tokenizer.json"))):
        args = ["preprocess", "--chat", "--input", source, "--output-prefix",
                str(tmp_path / out), "--tokenizer", tokenizer]
        assert trireme_main(args) == 2
        err = capsys.readouterr().err
        assert f"{source}:2: invalid UTF-8" in err and err.count("\n") == 1, err
        assert not list(tmp_path.glob(f"{out}.*"))
        assert trireme_main([*args, "--skip-bad-lines"]) == 0
        assert "skipped 1 bad line: 1 invalid UTF-8" in capsys.readouterr().out


def test_merged_chat_data_stays_chat_data(tmp_path, capsys):
    """`trireme data merge` of chat datasets wrote no P.chat.json: the merge trained as plain
    text (prompts with a loss, conversations run together); chat with text is refused."""
    chat = preprocess(tmp_path, CHATS)
    text = tmp_path / "t"
    assert trireme_main(["preprocess", "--input", write_jsonl(tmp_path / "t.jsonl", [
        {"text": "plain"}]), "--output-prefix", str(text), "--tokenizer", "bytes",
        "--no-progress"]) == 0
    merged = str(tmp_path / "m")
    assert trireme_main(["data", "merge", "--input", chat, chat, "--output-prefix",
                         merged]) == 0
    assert is_chat(merged)
    marker = json.loads(open(merged + ".chat.json").read())
    assert marker["template"] == "plain" and marker["conversations"] == 2 * len(CHATS)
    capsys.readouterr()
    code = trireme_main(["data", "merge", "--input", chat, f"{text}_text_document",
                         "--output-prefix", str(tmp_path / "mixed")])
    err = capsys.readouterr().err
    assert code == 2 and "is not chat data" in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("mixed*"))
    assert trireme_main(["data", "merge", "--input", f"{text}_text_document",
                         "--output-prefix", merged]) == 0  # text over the chat merge
    assert not is_chat(merged)


def test_a_run_fine_tunes_on_chat_data(tmp_path, capsys):
    records = [{"messages": [{"role": "user", "content": f"say {w}"},
                             {"role": "assistant", "content": f"{w} {w} {w}"}]}
               for w in ("cat", "dog", "sun", "sea", "red", "tea", "owl", "ink")] * 4
    prefix = preprocess(tmp_path, records)
    cfg = load_config("tiny", [
        f"data.path={prefix}", "data.tokenizer=bytes", f"run.dir={tmp_path}/run",
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.seq_length=24", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.steps=30", "train.log_interval=5", "train.eval_interval=0",
        "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false",
        "schedule.warmup_steps=2", "optimizer.lr=1e-2"])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert "are longer than model.seq_length + 1 = 25 tokens" in capsys.readouterr().err
    # ("user: say cat\nassistant: cat cat cat" + eod: 37 tokens)
    train_ds, _ = chat_datasets(prefix, seq_length=8, seed=0, split="100,0,0", eod=256,
                                mask_prompt=True, want_valid=False)
    assert train_ds.too_long() == 32 and np.all([len(train_ds.sample(d)[0]) == 9
                                                 for d in range(3)])


def test_a_tokenizers_own_template_and_special_tokens(tmp_path):
    """--chat-template auto takes tokenizer_config.json's template; its special tokens in the
    rendered text become their single ids, and the end-of-turn token is trained."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["hello there, how are you? fine thanks"] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "tok"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>"}))
    prefix = str(tmp_path / "chat")
    assert trireme_main(["preprocess", "--chat", "--input", write_jsonl(
        tmp_path / "in.jsonl", CHATS), "--output-prefix", prefix, "--tokenizer",
        str(folder / "tokenizer.json")]) == 0
    tok = load_tokenizer(str(folder / "tokenizer.json"))
    ds, _ = chat_datasets(prefix, seq_length=64, seed=0, split="100,0,0", eod=tok.eod,
                          mask_prompt=True, want_valid=False)
    ids, keep = ds.sample(0)
    start, end = hf.token_to_id("<|im_start|>"), hf.token_to_id("<|im_end|>")
    assert list(ids[:1]) == [start] and np.count_nonzero(ids == start) == 3
    assert tok.decode(ids[keep]) == "Hello.<|im_end|>\n" and end in ids[keep]


def test_prompts_are_the_ids_serve_sends_with_a_space_marking_tokenizer(tmp_path):
    """A SentencePiece-style tokenizer marks the start of every text it encodes: encoded piece
    by piece, each answer would start with an extra marker. The whole conversation is encoded
    once and cut, so every prompt's ids are those of serve's prompt for those messages."""
    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    hf.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    hf.train_from_iterator(["the capital of france is paris and two plus two is four"] * 20,
                           trainers.BpeTrainer(vocab_size=120, special_tokens=[
                               "<unk>", "</s>", "[INST]", "[/INST]"]))
    folder = tmp_path / "tok"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
                "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    messages = [{"role": "user", "content": "capital of france"},
                {"role": "assistant", "content": "paris"},
                {"role": "user", "content": "two plus two"},
                {"role": "assistant", "content": "four"}]
    prefix = str(tmp_path / "chat")
    assert trireme_main(["preprocess", "--chat", "--input", write_jsonl(
        tmp_path / "in.jsonl", [{"messages": messages}]), "--output-prefix", prefix,
        "--tokenizer", str(folder / "tokenizer.json")]) == 0
    tok = load_tokenizer(str(folder / "tokenizer.json"))
    chat = ChatFormat(template)
    ds, _ = chat_datasets(prefix, seq_length=64, seed=0, split="100,0,0", eod=tok.eod,
                          mask_prompt=True, want_valid=False)
    first, end = ds.indexed.document_indices[0:2]
    sequences = [list(ds.indexed[i]) for i in range(int(first), int(end))]
    for k, i in enumerate((1, 3)):  # the prompts before each answer, as serve encodes them
        assert sum(sequences[: 2 * k + 1], []) == tok.encode(chat.render(messages[:i]))
    assert sum(sequences, []) == tok.encode(chat.render(messages, add_generation_prompt=False))


def test_plain_multi_turn_prompts_are_what_serve_sends(tmp_path):
    """With the plain template each trained answer ends with eod, and serve builds the history
    the same way: the ids before the second answer are serve's prompt for those messages."""
    tok = load_tokenizer("bytes")
    messages = CHATS[1]["conversations"]
    prefix = preprocess(tmp_path, [CHATS[1]])
    ds, _ = chat_datasets(prefix, seq_length=64, seed=0, split="100,0,0", eod=tok.eod,
                          mask_prompt=True, want_valid=False)
    first, end = ds.indexed.document_indices[0:2]
    sequences = [list(ds.indexed[i]) for i in range(int(first), int(end))]
    roles = {"human": "user", "gpt": "assistant"}
    as_messages = [{"role": roles[m["from"]], "content": m["value"]} for m in messages[:3]]
    served = parse_chat({"messages": as_messages}, tok, ChatFormat(None), context=64)
    assert served.prompt_ids == sequences[0] + sequences[1] + sequences[2]
    assert sequences[1][-1] == tok.eod
