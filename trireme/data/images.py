"""Images for a vision-language model: decode, pad to a square, resize, normalize.

    load_image(path, size)   -> uint8 [size, size, 3]   (Pillow: any format it reads, RGB)
    decode_image(data, size) -> the same from a file's bytes (a served request's upload)
    pixels(images)           -> float32 [b, 3, size, size] = (x / 255 - mean) / std per channel

A non-square image is first padded to a square with the mean colour (centred, as LLaVA-1.5
does), so nothing is cut off or stretched, then resized with bicubic filtering. The mean and
standard deviation are CLIP's, which the CLIP vision towers (and LLaVA) were trained with.

Every problem with a file is a one-line DataError naming it: missing, not an image (or a
truncated one), or too large to decode safely (Pillow's decompression-bomb limit).
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch

from trireme.errors import DataError

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's per-channel mean (RGB, 0..1)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)  # and standard deviation


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("images need Pillow: pip install 'trireme[vision]'") from None
    return Image


def load_image(path: str | os.PathLike[str], size: int, where: str = "",
               hint: str = "") -> np.ndarray:
    """uint8 [size, size, 3]: the image at `path`, padded to a square and resized (module doc).
    `where` (e.g. "data.jsonl:12: ") starts the error messages, `hint` ends a "not found"."""
    path = str(path)
    if not os.path.isfile(path):
        raise DataError(f"{where}image {path!r} not found (or not a file); check the path"
                        + (f" ({hint})" if hint else ""))
    return _square(_decode(path, f"{where}image {path!r}"), size)


def decode_image(data: bytes, size: int, where: str = "image", max_pixels: int = 0,
                 formats: tuple[str, ...] | None = None) -> np.ndarray:
    """uint8 [size, size, 3] from the bytes of an image file (a request's upload), as
    `load_image`. `max_pixels` (> 0) refuses an image whose padded square, max(w, h)^2 pixels
    (what `_square` allocates), is larger, before its pixels are decoded;
    `formats` (Pillow names, e.g. ("PNG", "JPEG")) are the only ones tried."""
    return _square(_decode(io.BytesIO(data), where, max_pixels, formats), size)


def _decode(source, what: str, max_pixels: int = 0, formats: tuple[str, ...] | None = None):
    """The RGB Pillow image of `source` (a path or a file object); one-line DataErrors."""
    image_module = _pillow()
    try:
        with image_module.open(source, formats=formats) as image:
            width, height = image.size  # from the header: nothing decoded yet
            side = max(width, height)  # _square pads to side x side before resizing
            if max_pixels and side * side > max_pixels:
                raise DataError(f"{what} is {width} x {height}, padded to {side} x {side} = "
                                f"{side * side} pixels, over the limit of {max_pixels}; "
                                "downscale it first")
            return image.convert("RGB")
    except image_module.DecompressionBombError as e:
        raise DataError(f"{what} is too large to decode safely ({e}); downscale it first"
                        ) from None
    except (OSError, SyntaxError, ValueError) as e:  # UnidentifiedImageError is an OSError
        reason = "unknown format" if isinstance(e, image_module.UnidentifiedImageError) else e
        raise DataError(f"{what} is not a readable image ({reason}); replace or remove it"
                        ) from None


def _square(image, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: `image` padded to a square with the mean colour, then resized."""
    image_module = _pillow()
    width, height = image.size
    side = max(width, height)
    if width != height:  # pad to a square with the mean colour, the image centred
        fill = tuple(int(round(255 * m)) for m in IMAGE_MEAN)
        square = image_module.new("RGB", (side, side), fill)
        square.paste(image, ((side - width) // 2, (side - height) // 2))
        image = square
    if side != size:
        image = image.resize((size, size), image_module.Resampling.BICUBIC)
    return np.asarray(image, dtype=np.uint8)  # [size, size, 3]


def pixels(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """float32 [b, 3, S, S] normalized pixels from uint8 [b, S, S, 3] images."""
    x = torch.tensor(np.asarray(images), dtype=torch.float32).div_(255.0)  # [b, S, S, 3]
    mean, std = torch.tensor(IMAGE_MEAN), torch.tensor(IMAGE_STD)
    return ((x - mean) / std).permute(0, 3, 1, 2).contiguous()  # [b, 3, S, S]
