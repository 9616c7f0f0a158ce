"""Turning what users pass in into RGB images and chat prompts.

Images may be a path (str or PathLike), a `file://` URI (`file:///abs/a%20b.png` or
`file://localhost/...`: percent-decoded, taken as a local path), raw `bytes`, a `data:` URI, a
`PIL.Image`, or an HxWx3 uint8 numpy array; network URLs (http, https, ftp, ...) are refused,
never fetched. Whatever the file holds, the result is an upright RGB image: EXIF orientation
applied, transparency composited on white, grayscale/CMYK/16-bit/palette converted, the first
frame of an animation. Anything that cannot be read raises `ImageLoadError` naming the input.

In a chat message an image part is `{"type": "image", SOURCE, SIZE...}` with exactly one source
key, as Qwen's and transformers' docs write them: `image` (any source above), `url` (a data URI,
a local path or a file:// URI), `path` (a local path) or `base64` (a base64 payload without the
`data:` prefix, or a data URI); and optionally Qwen's `qwen_vl_utils` size keys, `min_pixels` /
`max_pixels`, or `resized_height` with `resized_width` (`ImageSize`: they override the
pipeline's limits for that image; mmpipe.vision.preprocess applies them). An unknown key is an
error naming the accepted ones. `{"type": "image_url", "image_url": {"url": ...}}` (OpenAI's
form) is accepted too. `parse_conversation` pulls each image out as a `ChatImage` (source plus
size), decoded later on a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Sequence, Union
from urllib.parse import unquote

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmpipe.errors import ImageLoadError, InputError
from mmpipe.video_parts import ChatVideo, video_of_part
from mmpipe.vision.preprocess import ImageSize

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Image.Image, np.ndarray]

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_TRANSPARENT_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
# A PIL image passed in by the caller may be lazily opened and shared by several requests; its
# file handle and decoder state are not safe to use from several threads at once.
_pil_lock = threading.Lock()


@dataclass(frozen=True)
class Base64Image:
    """A bare base64 payload (an image part's `base64` key): decoded like a data URI's."""

    payload: str


def describe_source(source: Any) -> str:
    """A short, human-readable name for an image input, used in error messages."""
    if isinstance(source, Base64Image):
        return f"base64 payload ({len(source.payload)} chars)"
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.startswith("data:"):
            head = text.split(",", 1)[0]
            return f"data URI ({head[5:] or 'no media type'}, {len(text)} chars)"
        return repr(text if len(text) <= 200 else text[:197] + "...")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"bytes ({len(source)} bytes)"
    if isinstance(source, Image.Image):
        return f"PIL image ({source.mode}, {source.width}x{source.height})"
    if isinstance(source, np.ndarray):
        return f"array {tuple(source.shape)} {source.dtype}"
    return f"object of type {type(source).__name__}"


def load_image(source: ImageSource) -> Image.Image:
    """Decode any supported image input into an upright RGB `PIL.Image`."""
    name = describe_source(source)
    if isinstance(source, Image.Image):
        with _pil_lock:
            rgb = _decode(source, name)
            if rgb is source:
                rgb = source.copy()  # never hand out the caller's object to be read concurrently
    elif isinstance(source, np.ndarray):
        rgb = _decode(_from_array(source, name), name)
    else:
        return decode_encoded(_read_bytes(source, name), source)
    return _nonempty(rgb, name)


def encoded_bytes(source: ImageSource) -> bytes | None:
    """The encoded file of a source given as a path, a file:// or data: URI, base64 or bytes (read,
    with the same errors as `load_image`); None for sources that are already decoded (a PIL image,
    an array)."""
    if isinstance(source, (Image.Image, np.ndarray)):
        return None
    return _read_bytes(source, describe_source(source))


def decode_encoded(data: bytes, source: ImageSource, name: str | None = None) -> Image.Image:
    """`load_image` of a source whose `encoded_bytes` are `data` (`name`: its `describe_source`,
    where the source itself is no longer kept)."""
    name = describe_source(source) if name is None else name
    return _nonempty(_decode(_open(data, name), name), name)


def _nonempty(rgb: Image.Image, name: str) -> Image.Image:
    if rgb.width == 0 or rgb.height == 0:
        raise ImageLoadError(f"image {name}: has no pixels ({rgb.width}x{rgb.height})")
    return rgb


def _decode(image: Image.Image, name: str) -> Image.Image:
    try:
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)
        image.load()
        image = ImageOps.exif_transpose(image)
        return to_rgb(image)
    except ImageLoadError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageLoadError(f"image {name}: cannot decode ({_reason(exc)})") from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB: alpha over white, 16/32-bit rescaled to 8 bits."""
    mode = image.mode
    if mode in _TRANSPARENT_MODES or (mode in ("P", "L", "RGB", "1") and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode == "RGB":
        return image
    if mode.startswith("I;16") or mode in ("I", "F"):
        return Image.fromarray(_high_depth_to_uint8(image), mode="L").convert("RGB")
    return image.convert("RGB")


def _high_depth_to_uint8(image: Image.Image) -> np.ndarray:
    """16-bit and 32-bit grayscale to 8 bits, keeping the full range visible."""
    values = np.asarray(image).astype(np.float64)
    if image.mode == "F":
        scale = 255.0 if float(values.max(initial=0.0)) <= 1.0 else 1.0
    elif image.mode.startswith("I;16") or float(values.max(initial=0.0)) > 255:
        scale = 255.0 / 65535.0
    else:
        scale = 1.0
    return np.clip(np.rint(values * scale), 0, 255).astype(np.uint8)


def _read_bytes(source: Any, name: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, Base64Image):
        data = _decode_base64("".join(source.payload.split()), name, "base64 payload")
    elif isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, str) and text.startswith("data:"):
            data = _decode_data_uri(text, name)
        elif isinstance(text, str) and text[:6].lower() == "file:/":
            local = _file_uri_path(text, name)
            data = _read_file(local, name, f" ({local})")
        elif isinstance(text, str) and _URL.match(text):
            raise ImageLoadError(f"image {name}: URLs are not fetched; download the file and pass its path")
        else:
            data = _read_file(text, name)
    else:
        raise ImageLoadError(f"image {name}: unsupported input; pass a path, a file:// URI, bytes, a data: URI, "
                             "a PIL.Image or an HxWx3 uint8 array")
    if not data:
        raise ImageLoadError(f"image {name}: is empty (0 bytes)")
    return data


def _read_file(path: str, name: str, shown: str = "") -> bytes:
    """`shown`: the local path a file:// URI named, for the error messages."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise ImageLoadError(f"image {name}: no such file{shown}") from None
    except IsADirectoryError:
        raise ImageLoadError(f"image {name}: is a directory, not an image file{shown}") from None
    except OSError as exc:
        raise ImageLoadError(f"image {name}: cannot read ({_reason(exc)})") from exc


def _file_uri_path(uri: str, name: str) -> str:
    """The local path of `file:///abs/path`, `file://localhost/abs/path` or `file:/abs/path`,
    percent-decoded (`%20` is a space). Everything after the host is the path: a `?` or `#`
    stands for itself."""
    rest = uri[5:]
    if rest.startswith("//"):
        host, slash, path = rest[2:].partition("/")
        if host.lower() not in ("", "localhost"):
            raise ImageLoadError(f"image {name}: a file URI names a host ({host!r}), not a local file; write "
                                 "file:///absolute/path (three slashes) or pass the path itself")
        path = slash + path
    else:
        path = rest
    if not path.startswith("/"):
        raise ImageLoadError(f"image {name}: a file URI needs an absolute path (file:///absolute/path)")
    return unquote(path)


def _decode_data_uri(uri: str, name: str) -> bytes:
    match = _DATA_URI.match(uri)
    if match is None:
        raise ImageLoadError(f"image {name}: malformed data URI (expected 'data:[<type>][;base64],<data>')")
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/") and mime != "application/octet-stream":
        raise ImageLoadError(f"image {name}: data URI has media type {mime!r}, not an image")
    payload = uri[match.end():]
    if not match.group("b64"):
        raise ImageLoadError(f"image {name}: data URI is not base64-encoded")
    return _decode_base64(payload, name, "data URI payload")


def _decode_base64(payload: str, name: str, what: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageLoadError(f"image {name}: {what} is not valid base64 ({exc})") from exc


def _open(data: bytes, name: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageLoadError(f"image {name}: not a recognised image format (corrupt or not an image)") from None
    except Image.DecompressionBombError as exc:
        raise ImageLoadError(f"image {name}: too many pixels ({exc})") from exc
    except (OSError, ValueError) as exc:
        raise ImageLoadError(f"image {name}: cannot open ({_reason(exc)})") from exc


def _from_array(array: np.ndarray, name: str) -> Image.Image:
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise ImageLoadError(f"image {name}: arrays must be uint8 of shape HxW, HxWx3 or HxWx4")
    return Image.fromarray(np.ascontiguousarray(array))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text or type(exc).__name__


# ---------------------------------------------------------------- chat messages

IMAGE_SOURCE_KEYS = ("image", "url", "path", "base64")
IMAGE_SIZE_KEYS = ("min_pixels", "max_pixels", "resized_height", "resized_width")
_IMAGE_KEYS = ("type", *IMAGE_SOURCE_KEYS, *IMAGE_SIZE_KEYS)
_IMAGE_KEYS_TEXT = ("'type', one source ('image', 'url', 'path' or 'base64'), "
                    + ", ".join(repr(key) for key in IMAGE_SIZE_KEYS))
_TEXT_KEYS = ("type", "text")


@dataclass(frozen=True)
class ChatImage:
    """An image pulled out of a conversation: what to read it from (anything `load_image` reads)
    and its own size keys (None: the pipeline's limits)."""

    source: Any
    size: ImageSize | None = None


@dataclass
class ParsedConversation:
    """A conversation with its images pulled out, in the order they appear."""

    template_messages: list[dict[str, Any]]  # images and videos replaced by {"type": ...} markers
    images: list[ChatImage | ChatVideo]  # images and videos in order, read later


def parse_conversation(conversation: Sequence[dict[str, Any]], where: str = "conversation") -> ParsedConversation:
    """Validate a list of {"role", "content"} messages and separate the images and videos from
    the text."""
    if isinstance(conversation, dict) or not isinstance(conversation, (list, tuple)):
        raise InputError(f"{where}: must be a list of messages like {{'role': 'user', 'content': ...}}")
    if not conversation:
        raise InputError(f"{where}: has no messages")
    messages: list[dict[str, Any]] = []
    images: list[ChatImage | ChatVideo] = []
    for index, message in enumerate(conversation):
        here = f"{where}, message {index}"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InputError(f"{here}: must be a dict with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role:
            raise InputError(f"{here}: 'role' must be a non-empty string")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, (list, tuple)):
            raise InputError(f"{here}: 'content' must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for part_index, part in enumerate(content):
            image = _image_of_part(part, f"{here}, part {part_index}")
            if image is not None:
                images.append(image)
                parts.append({"type": "video" if isinstance(image, ChatVideo) else "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        messages.append({"role": role, "content": parts})
    return ParsedConversation(messages, images)


def _image_of_part(part: Any, where: str) -> ChatImage | ChatVideo | None:
    if isinstance(part, str):
        raise InputError(f"{where}: parts must be dicts, e.g. {{'type': 'text', 'text': ...}}")
    if not isinstance(part, dict):
        raise InputError(f"{where}: parts must be dicts with a 'type'")
    kind = part.get("type")
    if kind == "text":
        _check_keys(part, _TEXT_KEYS, "a text part", "'type', 'text'", where)
        if not isinstance(part.get("text"), str):
            raise InputError(f"{where}: a text part needs a string 'text'")
        return None
    if kind == "image":
        _check_keys(part, _IMAGE_KEYS, "an image part", _IMAGE_KEYS_TEXT, where)
        return ChatImage(_image_source(part, where), _image_size(part, where))
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InputError(f"{where}: an image_url part needs 'image_url': {{'url': ...}}")
        return ChatImage(url)
    video = video_of_part(part, where)
    if video is not None:
        return video
    raise InputError(f"{where}: unsupported part type {kind!r} (use 'text', 'image' or 'video')")


def _check_keys(part: dict[str, Any], accepted: tuple[str, ...], what: str, accepted_text: str,
                where: str) -> None:
    """A key set to None counts as absent (a dataset's rows often carry every column)."""
    unknown = [key for key, value in part.items() if key not in accepted and value is not None]
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        raise InputError(f"{where}: unknown key {names} in {what}; accepted: {accepted_text}")


def _image_source(part: dict[str, Any], where: str) -> Any:
    given = [key for key in IMAGE_SOURCE_KEYS if part.get(key) is not None]
    if not given:
        raise InputError(f"{where}: an image part needs one source: 'image' (path, file:// URI, bytes, PIL "
                         "image or data URI), 'url', 'path' or 'base64'")
    if len(given) > 1:
        raise InputError(f"{where}: an image part has {' and '.join(repr(k) for k in given)}; give exactly one "
                         "image source")
    key = given[0]
    value = part[key]
    if key == "url" and not isinstance(value, str):
        raise InputError(f"{where}: 'url' must be a string (a data URI, a local path or a file:// URI), "
                         f"got {type(value).__name__}")
    if key == "path" and not isinstance(value, (str, os.PathLike)):
        raise InputError(f"{where}: 'path' must be a string or a path, got {type(value).__name__}")
    if key == "base64":
        if not isinstance(value, str):
            raise InputError(f"{where}: 'base64' must be a string, got {type(value).__name__}")
        return value if value.startswith("data:") else Base64Image(value)
    return value


def _image_size(part: dict[str, Any], where: str) -> ImageSize | None:
    options = {key: part[key] for key in IMAGE_SIZE_KEYS if part.get(key) is not None}
    if not options:
        return None
    try:
        return ImageSize(**options)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
