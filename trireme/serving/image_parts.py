"""Images in chat requests: OpenAI content parts to prompt ids and pixels for a vision model.

A user message's `content` may be a list of parts,

    {"type": "text", "text": "What is in the image?"}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0..."}}

Only base64 data URLs of PNG or JPEG images are taken: the server never fetches a URL or reads a
file on a client's behalf (that would let any client make it reach hosts or files its operator
did not mean to expose). An image is decoded with Pillow under a pixel limit (checked from the
header, before the pixels are decoded) and then padded, resized and normalized exactly as
`trireme generate --image` does (trireme.data.images).

A LLaVA-style model is trained on one image per sample, so a request carries one image at most.
The conversation is framed as training framed it (trireme.data.multimodal): "USER: {text}\\n
ASSISTANT: {answer}\\nUSER: ...\\nASSISTANT:", the image at the `<image>` marker if the text has
one, else before the first turn, expanded to the model's number of image placeholder tokens; so
one user message with an image and a question is the prompt `trireme generate --image IMAGE
--prompt QUESTION` builds. System (developer) messages go before the next user turn's text.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

import numpy as np
import torch

from trireme.config import ModelConfig
from trireme.data.images import decode_image, pixels
from trireme.data.multimodal import conversation_prompt_ids
from trireme.errors import DataError, TriremeError
from trireme.models.vision import num_image_tokens

MAX_IMAGES = 1  # per request: LLaVA-style models are trained with one image per sample
VISION_STOP = ("\nUSER:",)  # the framing's next user turn ends an answer (a stop string)
MAX_IMAGE_PIXELS = 4096 * 4096  # default limit of a decoded image (--max-image-pixels)
DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.DOTALL | re.IGNORECASE)
FORMATS = {"png": ("PNG",), "jpeg": ("JPEG",), "jpg": ("JPEG",)}


class ImagePartError(TriremeError):
    """A content part or image the server refuses (an HTTP 400 naming the part)."""


@dataclass(frozen=True)
class VisionInputs:
    """What turning a chat into a vision model's prompt needs to know about the model."""

    image_id: int  # the placeholder token id
    image_tokens: int  # placeholders per image
    image_size: int  # pixels per side the encoder takes
    max_pixels: int = MAX_IMAGE_PIXELS

    @classmethod
    def of(cls, cfg: ModelConfig, max_pixels: int = MAX_IMAGE_PIXELS) -> VisionInputs | None:
        """The inputs of `cfg`'s model; None for a model without a vision encoder."""
        if not cfg.vision_layers:
            return None
        return cls(cfg.image_token_id, num_image_tokens(cfg), cfg.vision_image_size, max_pixels)


def image_url(part: dict, where: str) -> str:
    """The URL string of an {"type": "image_url", "image_url": {"url": ...}} part."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str):
        raise ImagePartError(f"{where}: an image_url part needs {{\"image_url\": {{\"url\": "
                             "\"data:image/png;base64,...\"}}")
    return url


def decode_data_url(url: str, size: int, max_pixels: int, where: str) -> np.ndarray:
    """uint8 [size, size, 3] from a base64 PNG / JPEG data URL (module docstring)."""
    match = DATA_URL.fullmatch(url.strip())
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ImagePartError(f"{where}: image_url {shown!r} is not a base64 PNG or JPEG data URL "
                             "(data:image/png;base64,...); this server does not fetch URLs or "
                             "read files")
    try:
        data = base64.b64decode("".join(match.group(2).split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImagePartError(f"{where}: the image's base64 data is malformed ({e})") from None
    try:
        return decode_image(data, size, f"{where}: the image", max_pixels,
                            FORMATS[match.group(1).lower()])
    except DataError as e:
        raise ImagePartError(str(e)) from None


def vision_prompt(messages: list[tuple[str, str]], urls: list[str], tokenizer,
                  vision: VisionInputs) -> tuple[list[int], torch.Tensor | None]:
    """Prompt ids and pixels [k, 3, S, S] (None without images) of (role, text) messages and
    the image URLs of their parts (module docstring)."""
    if len(urls) > MAX_IMAGES:
        raise ImagePartError(f"the request has {len(urls)} images; this model takes "
                             f"{MAX_IMAGES} per request")
    images = [decode_data_url(url, vision.image_size, vision.max_pixels, "messages")
              for url in urls]
    try:
        ids = conversation_prompt_ids(tokenizer, conversation_turns(messages), vision.image_id,
                                      vision.image_tokens, image=bool(images))
    except ValueError as e:
        raise ImagePartError(f"messages: {e}") from None
    return ids, pixels(np.stack(images)) if images else None


def conversation_turns(messages: list[tuple[str, str]]) -> list[str]:
    """Texts of the user, assistant, ..., user turns; system text joins the next user turn."""
    turns: list[str] = []
    roles: list[str] = []
    system: list[str] = []
    for role, text in messages:
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user" and roles[-1:] != ["user"]:
            turns.append("\n".join([*system, text]))
            roles.append(role)
            system = []
        elif role == "assistant" and roles[-1:] == ["user"] and not system:
            turns.append(text)
            roles.append(role)
        else:
            raise ImagePartError(f"messages: a vision model takes user and assistant turns in "
                                 f"turn (system first), not {role!r} here")
    if roles[-1:] != ["user"] or system:
        raise ImagePartError("messages: the last message must be the user's")
    return turns
