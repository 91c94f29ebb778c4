"""Chat messages to text: the tokenizer's chat template when there is one, else a plain one; the
prompt `trireme serve` continues, and the segments a chat dataset trains on (`chat_segments`).

The template is looked for as "chat_template" in a tokenizer_config.json (or a
chat_template.jinja file) in the tokenizer's folder or the checkpoint's folder (and its parent,
the run's checkpoint root). It is Jinja, rendered in Jinja's immutable sandbox (a template from a
downloaded model is code from a stranger) with `messages`, `add_generation_prompt=True`,
`bos_token` and `eos_token`, as Hugging Face renders it; the eos_token (tokenizer_config.json's)
also ends a chat answer, as a stop string.

The plain template, for checkpoints without one (models trained with trireme on raw text):

    system: You are terse.
    user: Hello!
    assistant: Hi.
    user: And now?
    assistant:

one line per message, "role: content", ending with "assistant:" for the model to continue
(`trireme serve` puts the end-of-document id after an earlier answer instead of its newline,
as chat data trains it: trireme.data.conversations.plain_prompt_ids).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from trireme.data.jsonl import unicode_clean
from trireme.errors import ConfigError, TriremeError

ROLES = ("system", "developer", "user", "assistant", "tool")


def find_chat_template(folders: list[Path]) -> str | None:
    """The first chat template found in `folders` (module docstring), or None."""
    for folder in folders:
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, AttributeError):
                raise ConfigError(f"{config} is not a JSON object; fix or remove it") from None
            if isinstance(template, list):  # named templates: take the default one
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            if isinstance(template, str) and template:
                return template
    return None


def find_special_token(folders: list[Path], name: str) -> str:
    """tokenizer_config.json's `name` ("eos_token", "bos_token": a string or {"content": ...})
    from the first folder that has one, else ""."""
    for folder in folders:
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                value = json.loads(config.read_text(encoding="utf-8")).get(name)
            except (json.JSONDecodeError, AttributeError):
                return ""
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                return value
    return ""


def template_eos(folders: list[Path], tokenizer, spec: str) -> str:
    """The eos_token a template renders (and serving stops at): tokenizer_config.json's, else,
    for a real tokenizer (not bytes), the text of its end-of-document id. Preprocessing and
    serving both take it from here, so trained answers end as served ones stop."""
    eos = find_special_token(folders, "eos_token")
    if not eos and spec not in ("bytes", ""):
        eos = tokenizer.decode([tokenizer.eod])
    return eos


def generation_eos_ids(folders: list[Path]) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an id or a list: e.g. Llama 3's end of text and
    end of turn) from the first folder that has the file, else ()."""
    for folder in folders:
        config = folder / "generation_config.json"
        if config.is_file():
            try:
                ids = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
                return ()
            ids = [ids] if isinstance(ids, int) else ids
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                return tuple(ids)
            return ()
    return ()


def plain_chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True
                      ) -> str:
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + ("assistant:" if add_generation_prompt else "")


class ChatFormat:
    """Renders a list of {"role", "content"} messages into the prompt text."""

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.template = None
        self.source = "plain"
        self.text = template  # the template's source (None: the plain one)
        if template is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise ConfigError("the checkpoint's tokenizer has a chat template, which needs "
                                  "jinja2: pip install jinja2") from None
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now  # as Hugging Face renders templates
            try:
                self.template = env.from_string(template)
            except Exception as e:  # jinja2's TemplateSyntaxError, e.g. an unknown tag
                raise ConfigError(f"the chat template does not compile ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0]})") from None
            self.source = "tokenizer"
        self.bos_token, self.eos_token = bos_token, eos_token
        # a model tuned on the template ends its turn with the eos token: its text ends the answer
        self.stop = (eos_token,) if self.template is not None and eos_token else ()

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return plain_chat_prompt(messages, add_generation_prompt)
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except TriremeError:
            raise
        except Exception as e:  # the template's own checks (roles, order) fail this way
            raise TriremeError(f"the chat template refused these messages: {e}") from None


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise(message: str) -> None:
    raise TriremeError(str(message))


def chat_segments(chat: ChatFormat, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The text of a conversation as (text, trained) segments: the assistant messages trained,
    everything else (system, user, tool turns, the template's framing) not; messages after the
    last assistant one are left out. The segments joined are what `render` writes for the
    conversation, and each prompt segment ends where `render` of the messages before an
    assistant turn ends, so a model trained on them continues a served prompt the same way.

    The plain template: "role: content\n" lines; an assistant turn's segment is " content\n"
    after the prompt's "assistant:" (the caller ends the last one with the end-of-document id
    instead of its newline). A template: rendered turn by turn, each render must extend the
    one before (ValueError otherwise: e.g. a template that rewrites earlier turns)."""
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message to train on")
    if messages[0]["role"] == "assistant":
        raise ValueError("the conversation starts with an assistant message (no prompt)")
    for i, message in enumerate(messages):
        if not unicode_clean(message["content"]):
            raise ValueError(f"invalid UTF-8 (a lone surrogate escape in message {i})")
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = chat.render(messages[:i], add_generation_prompt=True)
        full = chat.render(messages[: i + 1], add_generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError(f"the chat template does not render message {i} as a continuation "
                             "of the ones before (preprocess with --chat-template plain)")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    return segments
