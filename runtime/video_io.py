"""Videos sent inline: a chat part's {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}
(vLLM's) decoded with PyAV (the optional extra `video`: pip install 'llmc[video]') into RGB frames for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL (runtime/multimodal.py's videos).

The frames are sampled as vLLM's video loader samples them: `num_frames` (vLLM's --media-io-kwargs
'{"video": {"num_frames": N}}', default 32) spread uniformly over the video (numpy's linspace from the first frame
to the last, truncated to ints), or every frame where the video has no more (or num_frames is -1). The metadata is
vLLM's: the stream's frame rate, the indices of the frames kept, the frame count and duration, which Qwen3-VL's
frame timestamps are computed from. http(s) URLs are refused by name (nothing is fetched), as images' are.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from llmc.errors import RequestError

DEFAULT_NUM_FRAMES = 32  # vLLM's VideoMediaIO default
MAX_VIDEO_BYTES = 20 * 1024 * 1024  # a video sent inline (a data URL), decoded (an image's cap)
MAX_FRAME_BYTES = 1024**3  # the sampled frames as RGB bytes


def have_decoder() -> bool:
    """Whether PyAV is installed (the extra `video`)."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def load_video_url(url, where: str, num_frames: int = DEFAULT_NUM_FRAMES) -> tuple[np.ndarray, dict]:
    """A data URL's video (data:video/...;base64,...) → (frames, uint8 [n, height, width, 3] RGB; vLLM's metadata
    {fps, frames_indices, total_num_frames, duration, video_backend}); RequestError naming `where` for an http(s)
    URL, another kind of URL, one over MAX_VIDEO_BYTES, or a container PyAV cannot decode."""
    from llmc.runtime.multimodal import inline_data  # (multimodal imports this module lazily too)

    header, data = inline_data(url, where, "video", "video/mp4", MAX_VIDEO_BYTES)
    if header.lower().startswith("data:video/jpeg"):  # vLLM's comma-separated JPEG frames
        raise RequestError(f"{where}: data:video/jpeg (frames as JPEG images) is not supported; send a video "
                           "container (data:video/mp4, video/webm, ...)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{where}: not base64 ({e})") from None
    return decode_video(raw, where, num_frames)


def decode_video(raw: bytes, where: str, num_frames: int = DEFAULT_NUM_FRAMES) -> tuple[np.ndarray, dict]:
    """A video container's bytes → (its frames sampled to `num_frames`, vLLM's metadata); see load_video_url."""
    try:
        import av
    except ImportError:
        raise RequestError(f"{where}: video_url parts need PyAV to decode the video, which is not installed; "
                           "pip install 'llmc[video]'") from None
    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.video:
                raise RequestError(f"{where}: not a readable video (the container holds no video stream)")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        if total <= 0:
            raise RequestError(f"{where}: not a readable video (it has no frames)")
        indices = sampled_indices(total, num_frames)
        if len(indices) * stream.height * stream.width * 3 > MAX_FRAME_BYTES:
            raise RequestError(f"{where}: {len(indices)} frames of {stream.width}x{stream.height} are over "
                               f"{MAX_FRAME_BYTES // 1024**3} GiB decoded; lower num_frames (--media-io-kwargs) or "
                               "send a smaller video")
        wanted, frames = set(indices), {}
        with av.open(io.BytesIO(raw), mode="r") as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index > indices[-1]:
                    break
                if index in wanted:
                    frames[index] = frame.to_ndarray(format="rgb24")
        kept = [i for i in indices if i in frames]  # frames the container promised but did not hold are dropped
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV's own errors (av.error.InvalidDataError, ...) and FFmpeg's
        raise RequestError(f"{where}: not a readable video ({type(e).__name__}: {e})") from None
    if not kept:
        raise RequestError(f"{where}: not a readable video (no frame of it could be decoded)")
    fps = float(rate) if rate else 0.0
    metadata = {"total_num_frames": total, "fps": fps or None, "duration": total / fps if fps else None,
                "video_backend": "pyav", "frames_indices": kept}
    return np.stack([frames[i] for i in kept]), metadata


def sampled_indices(total: int, num_frames: int) -> list[int]:
    """vLLM's uniform sampling: every frame where num_frames is -1 or the video has fewer than num_frames, else
    num_frames indices from 0 to total - 1 (linspace, truncated)."""
    if num_frames == -1 or total < num_frames:
        return list(range(total))
    return np.linspace(0, total - 1, num_frames, dtype=int).tolist()
