"""Decoding media references into ``MediaItem``s (and encoding them, for tests and tasks).

A **media reference** is a string, as SGLang's ``image_data`` / ``audio_data`` carry them:

* a path of an existing file (read from the local disk of the process that decodes it);
* a ``data:<mime>;base64,<payload>`` URL;
* otherwise, a bare base64 string (standard alphabet, padding required, validated).

Images: any format pillow reads (PNG is the one we write: lossless, so the trainer and the
engine decode the same pixels), converted to RGB: ``[H, W, 3]`` uint8.

Audio, two formats (told apart by their magic bytes):

* **WAV** (``RIFF``/``WAVE``): 16-bit PCM, mono, ``AUDIO_SAMPLE_RATE`` (16 kHz). It becomes
  discretised log-mel bins ``[frames, n_mels]`` uint8 by ``mel_bins``: frames of
  ``AUDIO_N_FFT`` = 400 samples (25 ms) every ``AUDIO_HOP`` = 160 samples (10 ms), no padding
  (``frames = 1 + (samples - 400) // 160``; a clip shorter than 400 samples is refused), a
  periodic Hann window, the power spectrum of a real DFT (201 bins), ``n_mels`` triangular
  HTK-mel filters over 0..8 kHz, the natural log of ``power + 1e-10``, and the level
  ``round((ln + 23) * 255 / 33)`` clamped to [0, 255]. Every reduction (the DFT, the filter
  bank) uses the strict kernels (``StrictOps.linear``) and the log is ``log_strict``, so the
  bins are the same bits in every process whatever its thread count.
* **NPY** (``\\x93NUMPY``): a 2-D uint8 array ``[frames, n_mels]``: mel bins as they are.

Errors are ``MediaError`` naming what failed (the reference is shortened in messages).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import wave
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from posttrain.interface import MediaRef
from posttrain.models._config import ModelConfig
from posttrain.models._errors import MediaError
from posttrain.models._media import MediaItem, MediaKind
from posttrain.models._media_files import MediaFiles, read_media_file
from posttrain.models._ops import StrictOps, log_strict

AUDIO_SAMPLE_RATE = 16000
"""Sample rate (Hz) a WAV reference must have."""
AUDIO_N_FFT = 400
"""Samples per mel frame (25 ms at 16 kHz)."""
AUDIO_HOP = 160
"""Samples between frame starts (10 ms at 16 kHz)."""
_LOG_FLOOR, _LOG_SPAN = -23.0, 33.0  # ln-power range mapped onto the 256 levels
_MAX_PATH_CHARS = 4096


def _short(ref: str) -> str:
    return ref if len(ref) <= 48 else f"{ref[:40]}...({len(ref)} chars)"


def read_media_bytes(ref: str, *, field: str = "media", files: MediaFiles | None = None) -> bytes:
    """The bytes behind a reference: a file path (as ``files`` allows: ``_media_files``;
    default ``MediaFiles.trusted()``), a ``data:`` URL or bare base64."""
    files = MediaFiles.trusted() if files is None else files
    if not isinstance(ref, str) or not ref:
        raise MediaError(f"{field}: a media reference must be a non-empty string")
    if ref.startswith("data:"):
        head, sep, payload = ref.partition(",")
        if not sep or not head.endswith(";base64"):
            raise MediaError(f"{field}: data URL {_short(ref)!r} is not ';base64,'-encoded")
        return _b64(payload, field)
    if not files.any_path:  # an engine: a refusal says nothing about the disk
        data = read_media_file(ref, files) if files.allowed_dir is not None else None
        if data is not None:
            return data
        try:
            return _b64(ref, field)
        except MediaError:
            raise MediaError(
                f"{field}: not valid base64, and this file-path media is not allowed (an engine "
                "reads only regular files inside its --allowed-media-dir)"
            ) from None
    if len(ref) <= _MAX_PATH_CHARS:
        path = Path(ref)
        try:
            is_file = path.is_file()
        except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte
            is_file = False
        if is_file:
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise MediaError(f"{field}: cannot read {ref!r}: {exc}") from exc
            if size > files.max_bytes:
                raise MediaError(
                    f"{field}: {ref!r} is {size} bytes, more than a media file may be "
                    f"({files.max_bytes})"
                )
            data = read_media_file(ref, files)
            if data is None:
                raise MediaError(
                    f"{field}: cannot read {ref!r} as a regular file of at most "
                    f"{files.max_bytes} bytes within {files.timeout_s:g} s"
                )
            return data
    return _b64(ref, field)


def _b64(payload: str, field: str) -> bytes:
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(
            f"{field}: {_short(payload)!r} is neither an existing file nor valid base64 ({exc})"
        ) from exc
    if not data:
        raise MediaError(f"{field}: the reference decodes to no bytes")
    return data


def decode_image(
    ref: str,
    *,
    field: str = "image_data",
    max_pixels: int | None = None,
    files: MediaFiles | None = None,
) -> MediaItem:
    """An image reference -> ``MediaItem(IMAGE, [H, W, 3] uint8)`` (RGB).

    ``max_pixels``: refuse a larger image from its header, before its pixels are decoded.
    """
    from PIL import Image, UnidentifiedImageError

    raw = read_media_bytes(ref, field=field, files=files)
    try:
        with Image.open(io.BytesIO(raw)) as img:
            w, h = img.size
            if max_pixels is not None and w * h > max_pixels:
                raise MediaError(
                    f"{field}: a {h}x{w} image has more pixels than the model's context can "
                    f"take ({max_pixels})"
                )
            rgb = img.convert("RGB")
            width, height = rgb.size
            pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    except MediaError:
        raise
    # DecompressionBombError: a header claiming far more pixels than PIL allows; SyntaxError:
    # PIL's report of a broken PNG chunk found while decoding.
    except (UnidentifiedImageError, Image.DecompressionBombError, SyntaxError, OSError,
            ValueError) as exc:  # fmt: skip
        raise MediaError(f"{field}: {_short(ref)!r} is not a readable image ({exc})") from exc
    return MediaItem(MediaKind.IMAGE, pixels.reshape(height, width, 3).clone())


def decode_audio(
    ref: str,
    *,
    num_mel_bins: int,
    field: str = "audio_data",
    max_frames: int | None = None,
    files: MediaFiles | None = None,
) -> MediaItem:
    """An audio reference (WAV or NPY, see the module doc) -> ``MediaItem(AUDIO, [frames,
    num_mel_bins] uint8)``. ``max_frames``: refuse a longer clip before computing its bins."""
    raw = read_media_bytes(ref, field=field, files=files)
    if raw[:4] == b"RIFF" and raw[8:12] == b"WAVE":
        samples = _read_wav(raw, field)
        frames = 1 + (samples.shape[0] - AUDIO_N_FFT) // AUDIO_HOP
        if max_frames is not None and frames > max_frames:
            raise MediaError(
                f"{field}: {samples.shape[0]} samples make {frames} mel frames, more than the "
                f"model's context can take ({max_frames})"
            )
        return MediaItem(MediaKind.AUDIO, mel_bins(samples, num_mel_bins=num_mel_bins))
    if raw[:6] == b"\x93NUMPY":
        mel = _read_npy(raw, field)
        if max_frames is not None and mel.shape[0] > max_frames:
            raise MediaError(
                f"{field}: {mel.shape[0]} mel frames, more than the model's context can take "
                f"({max_frames})"
            )
        if mel.shape[1] != num_mel_bins:
            raise MediaError(
                f"{field}: the .npy holds {mel.shape[1]} mel bins per frame, the audio tower "
                f"takes {num_mel_bins}"
            )
        return MediaItem(MediaKind.AUDIO, mel)
    raise MediaError(f"{field}: {_short(ref)!r} is neither a WAV (RIFF/WAVE) nor a .npy file")


def _read_wav(raw: bytes, field: str) -> Tensor:
    try:
        with wave.open(io.BytesIO(raw), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise MediaError(f"{field}: unreadable WAV ({exc})") from exc
    if channels != 1 or width != 2 or rate != AUDIO_SAMPLE_RATE:
        raise MediaError(
            f"{field}: WAV must be mono 16-bit PCM at {AUDIO_SAMPLE_RATE} Hz, got "
            f"{channels} channel(s), {8 * width}-bit, {rate} Hz"
        )
    if len(frames) % 2:
        raise MediaError(f"{field}: WAV data has an odd number of bytes")
    pcm = torch.frombuffer(bytearray(frames), dtype=torch.int16) if frames else torch.zeros(0)
    return pcm.float() / 32768.0


def _read_npy(raw: bytes, field: str) -> Tensor:
    import numpy as np
    from numpy.lib import format as npy_format

    buf = io.BytesIO(raw)
    try:  # the header alone first: its shape is bounded by the bytes that follow it
        major, _ = npy_format.read_magic(buf)
        read_header = (
            npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
        )
        shape, _, dtype = read_header(buf)
    except (ValueError, OSError, EOFError, TypeError, SyntaxError) as exc:
        raise MediaError(f"{field}: unreadable .npy header ({exc})") from None
    count = math.prod(int(d) for d in shape)
    available = len(raw) - buf.tell()
    if dtype.itemsize == 0 or count * dtype.itemsize != available:
        raise MediaError(
            f"{field}: the .npy header declares shape {list(shape)} ({count} values of "
            f"{dtype.itemsize} byte(s)) but {available} data bytes follow; refused before "
            "allocating"
        )
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise MediaError(f"{field}: unreadable .npy ({exc})") from exc
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.size == 0:
        raise MediaError(
            f"{field}: a .npy of mel bins must be a non-empty 2-D uint8 array, got "
            f"{arr.dtype} {list(arr.shape)}"
        )
    return torch.from_numpy(np.ascontiguousarray(arr).copy())


def _mel_filters(num_mel_bins: int) -> Tensor:
    """``[n_mels, n_fft//2 + 1]`` triangular HTK-mel filters over 0..Nyquist (fp64 -> fp32)."""
    n_freq = AUDIO_N_FFT // 2 + 1
    freqs = torch.linspace(0, AUDIO_SAMPLE_RATE / 2, n_freq, dtype=torch.float64)

    def mel(f: Tensor) -> Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    top = mel(torch.tensor(AUDIO_SAMPLE_RATE / 2, dtype=torch.float64))
    edges_mel = torch.linspace(0.0, float(top), num_mel_bins + 2, dtype=torch.float64)
    edges = 700.0 * (10 ** (edges_mel / 2595.0) - 1.0)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None, :] - lo) / (mid - lo)
    down = (hi - freqs[None, :]) / (hi - mid)
    return torch.clamp(torch.minimum(up, down), min=0.0).float()


def mel_bins(samples: Tensor, *, num_mel_bins: int) -> Tensor:
    """Mono samples in [-1, 1] (fp32, 16 kHz) -> discretised log-mel ``[frames, n_mels]`` uint8."""
    if num_mel_bins <= 0:
        raise MediaError(f"num_mel_bins={num_mel_bins} must be positive")
    n = int(samples.shape[0])
    if n < AUDIO_N_FFT:
        raise MediaError(
            f"audio has {n} samples, fewer than one frame of {AUDIO_N_FFT} ({AUDIO_N_FFT / 16} ms)"
        )
    if not bool(torch.isfinite(samples).all()):
        raise MediaError("audio samples hold NaN or Inf")
    frames = samples.float().unfold(0, AUDIO_N_FFT, AUDIO_HOP)  # [F, n_fft]
    k = torch.arange(AUDIO_N_FFT, dtype=torch.float64)
    window = (0.5 - 0.5 * torch.cos(2 * math.pi * k / AUDIO_N_FFT)).float()
    bins = torch.arange(AUDIO_N_FFT // 2 + 1, dtype=torch.float64)
    angle = 2 * math.pi * bins[:, None] * k[None, :] / AUDIO_N_FFT
    dft = torch.cat([torch.cos(angle), -torch.sin(angle)]).float()  # [2 * n_freq, n_fft]
    spec = StrictOps.linear(frames * window, dft)
    re, im = spec.chunk(2, dim=-1)
    power = re * re + im * im
    mel = StrictOps.linear(power, _mel_filters(num_mel_bins))
    ln = log_strict(mel + 1e-10)
    levels = torch.round((ln - _LOG_FLOOR) * (255.0 / _LOG_SPAN))
    return levels.clamp(0, 255).to(torch.uint8)


def encode_png_base64(image: Tensor) -> str:
    """``[H, W, 3]`` uint8 -> base64 of a PNG (lossless: decodes to the same pixels)."""
    from PIL import Image

    item = MediaItem(MediaKind.IMAGE, image)
    h, w, _ = item.data.shape
    img = Image.frombytes("RGB", (w, h), item.data.contiguous().numpy().tobytes())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_wav_base64(samples: Tensor) -> str:
    """Mono samples in [-1, 1] -> base64 of a 16-bit PCM WAV at ``AUDIO_SAMPLE_RATE``."""
    pcm = torch.round(samples.float().clamp(-1.0, 1.0) * 32767.0).to(torch.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(AUDIO_SAMPLE_RATE)
        w.writeframes(pcm.numpy().tobytes())
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_npy_base64(mel: Tensor) -> str:
    """``[frames, n_mels]`` uint8 mel bins -> base64 of a ``.npy`` file."""
    import numpy as np

    item = MediaItem(MediaKind.AUDIO, mel)
    buf = io.BytesIO()
    np.save(buf, item.data.numpy(), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_media(
    config: ModelConfig,
    *,
    images: Sequence[str] = (),
    audio: Sequence[str] = (),
    files: MediaFiles | None = None,
) -> list[MediaItem]:
    """Decode SGLang-style references for ``config``'s model: ``images`` (``image_data``) then
    ``audio`` (``audio_data``), in that order; ready for ``expand_media_tokens``. ``files``:
    which file paths may be read (``MediaFiles``; default: trusted, any regular file).

    A model without the matching tower refuses the field (``MediaError`` naming
    ``image_data[i]`` / ``audio_data[i]``), as does an item that does not fit the tower.
    """
    out: list[MediaItem] = []
    for kind, refs in ((MediaKind.IMAGE, images), (MediaKind.AUDIO, audio)):
        for i, ref in enumerate(refs):
            field = f"{kind.request_field}[{i}]"
            try:
                if kind is MediaKind.IMAGE:
                    if not config.has_vision_tower:
                        raise MediaError(f"{field}: the model has no vision tower (text-only)")
                    p = config.vision_patch_size
                    cap = config.max_position_embeddings * p * p
                    item = decode_image(ref, field=field, max_pixels=cap, files=files)
                else:
                    if not config.has_audio_tower:
                        raise MediaError(f"{field}: the model has no audio tower")
                    item = decode_audio(
                        ref,
                        num_mel_bins=config.audio_num_mel_bins,
                        field=field,
                        max_frames=config.max_position_embeddings,
                        files=files,
                    )
                try:
                    item.num_tokens(config)
                except MediaError as exc:
                    raise MediaError(f"{field}: {exc}") from exc
            except MediaError as exc:
                raise MediaError(str(exc), kind=kind.value) from exc.__cause__
            out.append(item)
    return out


def decode_media_refs(config: ModelConfig, refs: Sequence[MediaRef]) -> list[MediaItem]:
    """``decode_media`` of a prompt's ``MediaRef``s (``Sample.media``, ``Prompt.media``): its
    images, then its audio, as an engine gets them in ``image_data`` / ``audio_data``."""
    return decode_media(
        config,
        images=[m.ref for m in refs if m.kind is MediaKind.IMAGE],
        audio=[m.ref for m in refs if m.kind is MediaKind.AUDIO],
    )
