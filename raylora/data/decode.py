"""Validating decode: one image-caption row → an RGB image and a caption, or a reason why not.

A job reads data nobody checked image by image. Every row goes through ``decode_row``
before any transform; what fails is dropped and counted under one reason, never crashes
the stage, and never silently changes what the run trains on. No Ray here: the counting
across actors lives in ``raylora.data.badrecords``.

Reasons (the keys of ``data.bad_records`` in ``raylora.json``):
  empty_image     zero bytes, or no image value at all
  not_an_image    bytes that no image decoder recognises
  corrupt_image   recognised, but decoding failed (truncated file, broken stream)
  too_many_pixels width × height above ``data.max_image_pixels`` (decompression bombs)
  too_small       shorter side below ``data.min_size`` with ``data.small_images: skip``
  missing_caption no caption, or only whitespace (kept as "" when caption dropout is on)
  caption_not_utf8 caption bytes that are not UTF-8
  bad_mask        data.masked_loss: a sidecar/column mask that does not decode, is not
                  greyscale (1, L, I;16) or is not the image's size
  missing_control data.control_images: no control image (sidecar or column) for the row,
                  or for any one of its data.control_inputs
  bad_control     data.control_images: a control image (any input's) that does not
                  decode, or is over data.max_image_pixels
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from raylora.data.formats import NOT_UTF8, control_infix

REASONS = (
    "empty_image", "not_an_image", "corrupt_image", "too_many_pixels", "too_small",
    "missing_caption", "caption_not_utf8", "bad_mask", "missing_control", "bad_control",
)
# Greyscale modes a mask may have (8-bit, bilevel, 16-bit). Colour is refused rather than
# guessed at: which channel, or which mix of them, would be the weight?
MASK_MODES = ("1", "L", "I;16", "I;16B", "I;16L", "I")
ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")


class BadRecord(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def open_image(value: Any, max_pixels: int) -> Image.Image:
    """Encoded bytes (or a Hugging Face ``{bytes, path}`` struct) → a fully decoded image,
    upright as a viewer shows it (``upright``).

    The pixel bound is checked from the header, before any pixel is decoded; PIL's own
    bomb check is set to the same bound (raised or lowered by the config, never disabled).
    """
    if isinstance(value, dict):
        if value.get("bytes") is None and value.get("path"):
            # datasets' Image() of files not embedded (``embed_external_files=False``)
            raise BadRecord("empty_image", f"no bytes, only the path {value['path']!r}")
        value = value.get("bytes")
    if value is None or not isinstance(value, (bytes, bytearray, memoryview)) or len(value) == 0:
        raise BadRecord("empty_image")
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            # PIL warns between MAX and 2×MAX pixels; the check below is the decision.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(bytes(value)))
    except Image.DecompressionBombError as exc:
        raise BadRecord("too_many_pixels", str(exc)) from None
    except UnidentifiedImageError:  # its message names a BytesIO object, not the data
        raise BadRecord("not_an_image", f"no image format PIL reads starts {bytes(value[:8])!r}") from None
    except (SyntaxError, ValueError) as exc:
        raise BadRecord("not_an_image", str(exc)) from None
    except (OSError, EOFError) as exc:
        # a format PIL knows, damaged in its header (a truncated WebP's "could not create
        # decoder object", a JPEG cut inside its header's "Truncated File Read"): it
        # escaped the stage and stopped the run, naming no file
        raise BadRecord("corrupt_image", str(exc)) from None
    w, h = img.size
    if w * h > max_pixels:
        raise BadRecord("too_many_pixels", f"{w}x{h} > data.max_image_pixels={max_pixels}")
    try:
        img.load()
    except Image.DecompressionBombError as exc:
        raise BadRecord("too_many_pixels", str(exc)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise BadRecord("corrupt_image", str(exc)) from None
    return upright(img)


# EXIF orientations 5-8 turn the stored image a quarter: its shown width is the stored height.
QUARTER_TURNS = (5, 6, 7, 8)


def orientation(img: Image.Image) -> int:
    """The EXIF Orientation tag (1: stored as shown; 2-8: mirrored and/or turned), 1 when
    there is none or it does not read. For a PNG not yet loaded, PIL decodes every pixel
    to look for EXIF after the image data: the header alone is ``header_orientation``."""
    try:
        value = img.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block: the pixels are all there is
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def header_orientation(img: Image.Image, data: bytes) -> int:
    """``orientation`` of an image only opened (``img``, its encoded bytes ``data``), no
    pixel decoded: what the bucket scan reads (82 ms a 2048² PNG through ``orientation``,
    0.01 ms its header). JPEG, WebP and TIFF hold their EXIF where PIL reads the header. A
    PNG may hold its orientation after the image data (an eXIf chunk, ImageMagick's
    "Raw profile type exif" text, XMP's tiff:Orientation), where PIL finds it only by
    decoding (``PngImageFile.getexif`` loads): those chunks are read by walking the chunk
    headers (``png_late_info``) and join what PIL parsed before the image data, as they do
    once the decode has read them; PIL's own getexif then reads the merged info."""
    if img.format != "PNG":
        return orientation(img)
    try:
        # a stand-in with no pixels to load: Image.getexif reads exif, raw profile and XMP
        # from .info in PIL's order of precedence, which this must not re-derive
        probe = Image.Image()
        probe.info = {**img.info, **png_late_info(data)}
        value = probe.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block: as orientation()
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def upright_size(img: Image.Image, data: bytes) -> tuple[int, int]:
    """``(width, height)`` that ``open_image`` gives an image only opened (``img``, its
    encoded bytes ``data``), read from its header: the stored size, turned a quarter by
    orientations 5-8 (``header_orientation``). A TIFF's stored size is its ImageWidth and
    ImageLength tags, not ``img.size``: Pillow ≥ 11.0 reports a TIFF's turned size at open
    (and turns its pixels on load), older ones the stored size, so turning ``img.size``
    again put every turned TIFF in the transposed bucket (Pillow 13 here)."""
    w, h = (img.tag_v2[256], img.tag_v2[257]) if img.format == "TIFF" else img.size
    return (h, w) if header_orientation(img, data) in QUARTER_TURNS else (w, h)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The info keys Image.getexif reads an orientation from, and the PNG text keywords that
# set them: only these text chunks are read (decompressed) by png_late_info.
EXIF_TEXT_KEYS = (b"exif", b"Raw profile type exif", b"XML:com.adobe.xmp")


def png_late_info(data: bytes) -> dict[str, Any]:
    """The ``info`` entries that PIL's PNG reader adds from the chunks after its first
    IDAT (image data) chunk once it has decoded it (``load_end``, up to IEND, or an
    animated PNG's next frame, fcTL), of those Image.getexif reads: an eXIf chunk's
    ``exif``, and the text chunks (tEXt, zTXt, iTXt) of ``EXIF_TEXT_KEYS``, each as PIL's
    ``chunk_*`` reader stores it. Chunk headers only, other chunks' data skipped."""
    if not data.startswith(PNG_SIGNATURE):
        return {}
    info: dict[str, Any] = {}
    pos, after_image = len(PNG_SIGNATURE), False
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IEND" or (after_image and kind == b"fcTL"):
            break
        if after_image and kind in (b"eXIf", b"tEXt", b"zTXt", b"iTXt"):
            body = data[pos + 8:pos + 8 + length]
            if kind == b"eXIf":
                info["exif"] = b"Exif\x00\x00" + body
            elif body.split(b"\0", 1)[0] in EXIF_TEXT_KEYS:
                info.update(_png_text(kind, body))
        after_image |= kind == b"IDAT"
        pos += 12 + length  # length, type, data, CRC
    return info


def _png_text(kind: bytes, body: bytes) -> dict[str, Any]:
    """A tEXt, zTXt or iTXt chunk's data → the info entries PIL's reader makes of it
    (PngImagePlugin ``chunk_tEXt`` / ``chunk_zTXt`` / ``chunk_iTXt``)."""
    from PIL.PngImagePlugin import MAX_TEXT_CHUNK

    def inflate(z: bytes) -> bytes:  # bounded as PIL's reader bounds it (a zip bomb)
        d = zlib.decompressobj()
        out = d.decompress(z, MAX_TEXT_CHUNK)
        if d.unconsumed_tail:
            raise ValueError("decompressed text chunk too large")
        return out

    key, _, value = body.partition(b"\0")
    name = key.decode("latin-1")
    if kind == b"tEXt":
        return {name: value if key == b"exif" else value.decode("latin-1", "replace")}
    if kind == b"zTXt":
        try:
            text = inflate(value[1:]) if value[:1] in (b"", b"\0") else b""
        except zlib.error:
            text = b""
        return {name: text.decode("latin-1", "replace")}
    if len(value) < 2:
        return {}
    compressed, method, rest = value[0], value[1], value[2:]
    parts = rest.split(b"\0", 2)
    if len(parts) < 3 or (compressed and method != 0):
        return {}
    text = parts[2]
    if compressed:
        try:
            text = inflate(text)
        except zlib.error:
            return {}
    out: dict[str, Any] = {"xmp": text} if key == b"XML:com.adobe.xmp" else {}
    try:
        out[name] = text.decode("utf-8")
    except UnicodeError:
        pass
    return out


def upright(img: Image.Image) -> Image.Image:
    """``img`` as every viewer, diffusers' ``load_image`` and its DreamBooth scripts show
    it: a phone photo stored landscape with Orientation 6 is portrait. Without this it
    trained sideways, in a landscape bucket, with SDXL's original size swapped and a mask
    drawn on the upright photo refused as the wrong size."""
    if orientation(img) == 1:
        return img
    return ImageOps.exif_transpose(img)


def to_rgb(img: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Any PIL mode → RGB, correctly: transparency (``with_alpha``: an alpha channel, a
    palette's, a colour key) over ``background`` (not black), 16-bit and 32-bit integer
    greyscale scaled (not clipped) to 8 bits, CMYK via PIL's conversion."""
    img = with_alpha(img)
    if img.mode == "RGBA":
        out = Image.new("RGB", img.size, tuple(background))
        out.paste(img.convert("RGB"), mask=img.getchannel("A"))
        return out
    img = grey8(img)
    return img if img.mode == "RGB" else img.convert("RGB")


def grey8(img: Image.Image) -> Image.Image:
    """16-bit and 32-bit integer (I;16, I) and float (F, 0-1) greyscale → 8-bit L, scaled,
    not clipped as PIL's convert clips them; any other mode unchanged."""
    mode = img.mode
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(img, dtype=np.float64)
        # "I" holds 16-bit PNGs on some PIL versions; larger ranges are scaled by their max.
        top = 65535.0 if mode.startswith("I;16") or a.max(initial=0) <= 65535 else float(a.max())
        return Image.fromarray(np.clip(np.rint(a * 255.0 / top), 0, 255).astype(np.uint8), "L")
    if mode == "F":
        a = np.asarray(img, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(a * 255.0), 0, 255).astype(np.uint8), "L")
    return img


def with_alpha(img: Image.Image) -> Image.Image:
    """``img`` as RGBA when it has any transparency, else unchanged: an alpha channel
    (``ALPHA_MODES``), a palette's (P with tRNS) or a colour key (PNG tRNS on a 1, L,
    I;16 or RGB image, what oxipng and pngcrush write for all-or-nothing alpha:
    ``info["transparency"]``, its pixels transparent). Only P's was read before: an RGB
    cut-out trained its key colour (magenta, say), not data.background_color, and gave
    data.masked_loss no mask. 16-bit grey is keyed on its 16-bit values, then scaled
    (``grey8``): PIL's convert ignores a 16-bit key."""
    if img.mode == "RGBA":
        return img
    if img.mode in ALPHA_MODES:
        return img.convert("RGBA")
    key = img.info.get("transparency")
    if key is None:
        return img
    if img.mode.startswith("I;16") or img.mode == "I":
        alpha = Image.fromarray(np.where(np.asarray(img) == key, 0, 255).astype(np.uint8), "L")
        out = grey8(img).convert("RGBA")
        out.putalpha(alpha)
        return out
    return img.convert("RGBA")


def decode_caption(value: Any, keep_empty: bool, rng: np.random.Generator | None = None) -> str:
    """A caption cell → str. Empty or missing: "" when ``keep_empty`` (caption dropout
    trains on the empty prompt anyway), else a bad record. A cell of several captions (a
    list, or their joined string: ``raylora.data.captions.caption_list``): one of them,
    drawn from ``rng`` (the preprocess stage's: a new one each read), the first without
    (the driver's check). Its str() trained as the caption before."""
    from raylora.data.captions import pick_caption

    value = pick_caption(value, rng)
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRecord("caption_not_utf8", str(exc)) from None
    if value is None or (isinstance(value, float) and np.isnan(value)):
        value = ""
    text = str(value)
    if text.startswith(NOT_UTF8):  # see raylora.data.formats.decode_text
        raise BadRecord("caption_not_utf8", repr(text[len(NOT_UTF8):][:40]))
    if not text.strip():
        if keep_empty:
            return ""
        raise BadRecord("missing_caption")
    # A WebDataset .txt or a CSV cell often ends in a newline: a caption folder's .txt is
    # read stripped, and the LLM text encoders (Qwen, Z-Image, Flux.2) tokenize "\n".
    return text.strip()


def decode_row(image: Any, caption: Any, *, max_pixels: int, min_size: int,
               small_images: str, keep_empty_captions: bool,
               background: tuple[int, int, int],
               rng: np.random.Generator | None = None) -> tuple[Image.Image, str]:
    """One row → (RGB image, caption), or ``BadRecord``. The caption is checked first: it
    is cheap, and a row without one is dropped without decoding its image. ``rng``: what
    one of several captions is drawn from (``decode_caption``)."""
    img, text = open_row(image, caption, max_pixels=max_pixels, min_size=min_size,
                         small_images=small_images, keep_empty_captions=keep_empty_captions,
                         rng=rng)
    return to_rgb(img, background), text


def open_row(image: Any, caption: Any, *, max_pixels: int, min_size: int, small_images: str,
             keep_empty_captions: bool, rng: np.random.Generator | None = None,
             ) -> tuple[Image.Image, str]:
    """``decode_row`` before the RGB conversion: the image in its own mode (its alpha
    channel is still there for ``decode_mask``)."""
    text = decode_caption(caption, keep_empty_captions, rng)
    img = open_image(image, max_pixels)
    if min_size and min(img.size) < min_size and small_images == "skip":
        raise BadRecord("too_small", f"{img.size[0]}x{img.size[1]} < data.min_size={min_size}")
    return img, text


def open_masked_row(image: Any, caption: Any, mask: Any, *, masks: bool, max_pixels: int,
                    min_size: int, small_images: str, keep_empty_captions: bool,
                    controls: list | None = None, rng: np.random.Generator | None = None,
                    ) -> tuple[Image.Image, str, Image.Image | None, list[Image.Image] | None]:
    """``open_row`` and, with ``masks`` (data.masked_loss), the row's loss mask
    (``decode_mask``, read before ``to_rgb`` composites the alpha channel away), and with
    ``controls`` (data.control_images: the row's encoded control images, one per input)
    those images (``decode_controls``): the one judgement of a row, in the preprocess
    stage and the driver's sample check. ``rng``: the stage's generator, which one of a
    row's several captions is drawn from (``decode_caption``)."""
    img, text = open_row(image, caption, max_pixels=max_pixels, min_size=min_size,
                         small_images=small_images, keep_empty_captions=keep_empty_captions,
                         rng=rng)
    return (img, text, decode_mask(img, mask, max_pixels) if masks else None,
            None if controls is None else decode_controls(img, controls, max_pixels))


def row_problem(row: dict, *, masks: bool, max_pixels: int, min_size: int, small_images: str,
                keep_empty_captions: bool, mask: Any = None,
                controls: list[str] | None = None) -> BadRecord | None:
    """Why ``open_masked_row`` would drop ``row`` (``{image, text}``): its ``BadRecord``
    (``.reason``), or None. The driver's check of rows a stage will decode (sampled rows,
    class rows, held-out rows), each with the options that stage decodes with; ``mask``:
    the row's loss mask, ``controls``: the row keys of its control images (or None)."""
    try:
        open_masked_row(row["image"], row["text"], mask, masks=masks, max_pixels=max_pixels,
                        min_size=min_size, small_images=small_images,
                        keep_empty_captions=keep_empty_captions,
                        controls=None if controls is None else [row.get(n) for n in controls])
    except BadRecord as exc:
        return exc
    return None


def missing_image(value: Any) -> bool:
    """A control image value that holds no image: what ``decode_controls`` refuses as
    ``missing_control`` before decoding anything (the bucket scan leaves such rows out)."""
    return value is None or (isinstance(value, (bytes, bytearray, memoryview)) and not len(value))


def decode_controls(img: Image.Image, values: list, max_pixels: int) -> list[Image.Image]:
    """A row's control images (the inputs of an edit sample, data.control_inputs of them),
    each ``decode_control``'d. Every input is looked for before any is decoded: a row
    lacking one is ``missing_control`` whatever the others hold. With several, the
    messages name the input (``input 2``)."""
    several = len(values) > 1
    for i, value in enumerate(values):
        if missing_image(value):
            raise BadRecord("missing_control", _missing_control(i, several))
    return [decode_control(img, v, max_pixels, f"input {i + 1}" if several else None)
            for i, v in enumerate(values)]


def _missing_control(i: int, several: bool) -> str:
    """Where input ``i``'s control image was looked for (one input: as it always read)."""
    if not several:
        return "no KEY.control.<ext> beside the image, or an empty data.control_column cell"
    return (f"input {i + 1}: no KEY{control_infix(i)}.<ext> beside the image (or in "
            f"data.control_uri's folder {i + 1}), or an empty cell in data.control_column's "
            f"column {i + 1}")


def decode_control(img: Image.Image, value: Any, max_pixels: int,
                   which: str | None = None) -> Image.Image:
    """A row's control image (the input of an edit pair; ``decode_controls`` has found
    it) in its own mode, resized to ``img``'s size when it is another (bilinear, as
    training images are resized; an edit pair's two images usually share a size, and
    ai-toolkit resizes the input to its target's too). ``BadRecord`` ``bad_control`` when
    it does not decode (``which``: the input, for the message, when there are several)."""
    try:
        control = open_image(value, max_pixels)
    except BadRecord as exc:
        what = f"control image ({which})" if which else "control image"
        raise BadRecord("bad_control", f"{what}: {exc}") from None
    if control.size != img.size:
        # a colour key made alpha first: resampling blends the key colour into its
        # neighbours, where no pixel matches the key any more (a fringe of it)
        control = with_alpha(control).resize(img.size, Image.Resampling.BILINEAR)
    return control


def decode_mask(img: Image.Image, value: Any, max_pixels: int) -> Image.Image | None:
    """A row's loss mask as an 8-bit greyscale image of ``img``'s size (255: full weight):
    the encoded sidecar/column ``value`` when there is one, else ``img``'s alpha channel,
    else None (the row trains unmasked). ``BadRecord("bad_mask")`` for a mask that does
    not decode, is not greyscale or is not the image's size: never stretched to fit."""
    if value is None or (isinstance(value, (bytes, bytearray, memoryview)) and not len(value)):
        rgba = with_alpha(img)
        return rgba.getchannel("A") if rgba.mode == "RGBA" else None
    try:
        mask = open_image(value, max_pixels)
    except BadRecord as exc:
        raise BadRecord("bad_mask", f"mask: {exc}") from None
    if mask.mode not in MASK_MODES:
        raise BadRecord("bad_mask", f"mask mode {mask.mode}: a mask is greyscale "
                        f"({', '.join(MASK_MODES[:3])})")
    if mask.size != img.size:
        raise BadRecord("bad_mask", f"mask {mask.size[0]}x{mask.size[1]}, image "
                        f"{img.size[0]}x{img.size[1]}: a mask is the image's size")
    if mask.mode in ("1", "L"):
        return mask.convert("L")
    # 16-bit: scaled to 8 bits, as to_rgb does greyscale images
    return grey8(mask)
