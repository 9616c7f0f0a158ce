"""mmpipe.video_reader: exact frame counts and rates, frames bit-identical to a plain sequential
PyAV decode for every codec and container (with and without seeking), few frames decoded when
sampling a long clip, every kind of source, and errors that name the source and the problem."""

from __future__ import annotations

import base64
import logging
import pathlib
import urllib.parse
from fractions import Fraction

import numpy as np
import pytest
import torch

from mmpipe.errors import InputError, VideoLoadError
from mmpipe.video_reader import VideoFile, VideoInfo
from tests.video_helpers import keyframe_indices, make_audio, make_video, reference_frames

NTSC = Fraction(30000, 1001)
# name: (file, codec, width, height, fps, frames, keyframe interval)
CLIPS = {
    "h264-mp4": ("clip.mp4", "libx264", 64, 48, NTSC, 40, 12),  # B-frames: decode order != display order
    "h264-mkv": ("clip.mkv", "libx264", 64, 48, 25, 30, 10),
    "hevc-mkv": ("hevc.mkv", "libx265", 64, 48, 24, 36, 12),
    "mpeg4-avi": ("clip.avi", "mpeg4", 80, 64, 25, 36, 10),
    "vp9-webm": ("clip.webm", "libvpx-vp9", 96, 64, 30, 30, 10),
    "mjpeg-mkv": ("mjpeg.mkv", "mjpeg", 97, 61, 24, 20, None),  # odd size, yuvj444p, all keyframes
    "mjpeg-mov": ("mjpeg.mov", "mjpeg", 97, 61, 24, 20, None),
    "h264-raw": ("clip.h264", "libx264", 64, 48, 25, 24, 8),  # an elementary stream: no timestamps
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, tuple[str, list[np.ndarray]]]:
    """Each clip's path and its frames as a sequential PyAV decode gives them."""
    folder = tmp_path_factory.mktemp("videos")
    out = {}
    for name, (file, codec, width, height, fps, count, gop) in CLIPS.items():
        path = make_video(folder / file, count, width, height, fps, codec=codec, gop=gop, seed=len(out))
        out[name] = (path, reference_frames(path))
    return out


@pytest.fixture(scope="module")
def mp4(clips) -> tuple[str, list[np.ndarray]]:
    return clips["h264-mp4"]


def read_all(video: VideoFile, indices: list[int]) -> list[np.ndarray]:
    return video.read(indices, lambda frame: frame)


def assert_frames(got: list[np.ndarray], reference: list[np.ndarray], indices: list[int]) -> None:
    assert len(got) == len(indices)
    for frame, index in zip(got, indices):
        assert frame.dtype == np.uint8 and frame.shape == reference[index].shape, index
        assert np.array_equal(frame, reference[index]), f"frame {index} differs from the sequential decode"


@pytest.mark.parametrize("name", list(CLIPS))
def test_info_gives_exact_frames_rate_size_and_codec(clips, name):
    _, codec, width, height, fps, count, _ = CLIPS[name]
    path, reference = clips[name]
    assert len(reference) == count
    assert len({frame.tobytes() for frame in reference}) == count  # every frame tells itself apart
    with VideoFile(path) as video:
        info = video.info
    assert isinstance(info, VideoInfo)
    assert (info.total_frames, info.height, info.width) == (count, height, width)
    assert info.fps == pytest.approx(float(fps), rel=1e-9)
    assert info.codec == {"libx264": "h264", "libx265": "hevc", "libvpx-vp9": "vp9"}.get(codec, codec)
    assert info.duration == pytest.approx(count / float(fps), abs=1.5 / float(fps))


@pytest.mark.parametrize("name", list(CLIPS))
def test_read_gives_the_frames_a_sequential_decode_gives(clips, name):
    path, reference = clips[name]
    count = len(reference)
    scattered = [0, 1, 4, count // 2 - 1, count // 2 + 3, count - 2, count - 1]
    with VideoFile(path) as video:
        assert_frames(read_all(video, scattered), reference, scattered)
        backwards = [2, count // 3, count - 3]  # behind where the decoder is: starts again
        assert_frames(read_all(video, backwards), reference, backwards)
        everything = list(range(count))
        decoded = video.frames_decoded
        assert_frames(read_all(video, everything), reference, everything)
        assert video.frames_decoded - decoded == count  # one pass, no frame decoded twice


@pytest.mark.parametrize("name", ["h264-mp4", "hevc-mkv", "mpeg4-avi", "vp9-webm", "mjpeg-mov"])
def test_each_frame_alone_after_a_seek_is_exact(clips, name):
    """Every index read on its own, in an order that seeks forward past keyframes and back."""
    path, reference = clips[name]
    count = len(reference)
    order = list(range(0, count, 3)) + list(range(count - 1, -1, -5)) + list(range(1, count, 7))
    with VideoFile(path) as video:
        for index in order:
            assert_frames(read_all(video, [index]), reference, [index])
        assert video.seeks > 0


def test_sampling_a_long_clip_seeks_instead_of_decoding_everything(tmp_path):
    path = make_video(tmp_path / "long.mp4", 300, 160, 96, 30, gop=30)
    assert keyframe_indices(path) == list(range(0, 300, 30))
    wanted = [10, 100, 150, 200, 290]
    with VideoFile(path) as video:
        assert video.info.total_frames == 300
        before = video.frames_decoded
        got = read_all(video, wanted)
        decoded = video.frames_decoded - before
        assert video.seeks >= 3
    # From the keyframe at or before each: 0..10, 90..100, 150, 180..200, 270..290.
    assert decoded == 11 + 11 + 1 + 21 + 21, decoded
    reference = reference_frames(path)
    assert_frames(got, reference, wanted)


def test_each_is_called_once_per_index_in_order_with_an_rgb_frame(mp4):
    path, reference = mp4
    calls: list[tuple[int, tuple[int, ...]]] = []

    def each(frame: np.ndarray) -> int:
        assert frame.flags.c_contiguous and frame.dtype == np.uint8
        calls.append((len(calls), frame.shape))
        return int(np.flatnonzero([np.array_equal(frame, ref) for ref in reference])[0])

    with VideoFile(path) as video:
        assert video.read([3, 3, 9, 30], each) == [3, 3, 9, 30]  # a repeated index: the same frame again
        assert video.read([], each) == []
    assert calls == [(k, (48, 64, 3)) for k in range(4)]


def test_codec_threads_give_the_same_frames(mp4):
    path, reference = mp4
    wanted = [0, 7, 19, 33, 39]
    with VideoFile(path, threads=3) as video:
        assert_frames(read_all(video, wanted), reference, wanted)


def test_gpu_decoding_without_a_gpu_says_so_and_decodes_on_the_cpu(mp4, caplog):
    path, reference = mp4
    with caplog.at_level(logging.INFO, logger="mmpipe"), VideoFile(path, device="gpu") as video:
        got = read_all(video, [0, 20, 39])
    if torch.cuda.is_available():  # NVDEC: the same pictures, converted to RGB from its own NV12 layout
        for frame, i in zip(got, [0, 20, 39]):
            off = {j: np.abs(frame.astype(int) - reference[j]).mean() for j in (i - 1, i, i + 1) if 0 <= j < 40}
            assert min(off, key=off.get) == i and off[i] < 6, off
    else:
        assert "NVDEC decoding unavailable" in caplog.text and "decoding on the CPU" in caplog.text
        assert_frames(got, reference, [0, 20, 39])
    with pytest.raises(ValueError, match="device must be 'cpu' or 'gpu'"):
        VideoFile(path, device="cuda")


def test_a_rotated_video_comes_out_upright(tmp_path):
    """A phone's portrait video: the display matrix turns it 90 degrees clockwise (FFmpeg's
    rotation -90, 'rotate=90' in old tools); info gives the displayed size."""
    path = make_video(tmp_path / "portrait.mp4", 12, 64, 48, 25, rotation=-90)
    reference = reference_frames(path)
    with VideoFile(path) as video:
        assert (video.info.height, video.info.width) == (64, 48)
        got = read_all(video, [0, 5, 11])
    for frame, index in zip(got, [0, 5, 11]):
        assert np.array_equal(frame, np.rot90(reference[index], k=-1))  # clockwise


def test_an_edit_list_that_drops_frames_is_counted_as_played(tmp_path):
    """An mp4 whose first frames fall before time zero: its edit list drops them, its header
    still counts them; the count and the frames are those a player shows."""
    path = make_video(tmp_path / "edited.mp4", 30, 64, 48, 24, gop=10, first_pts=-5)
    reference = reference_frames(path)
    assert len(reference) == 25
    with VideoFile(path) as video:
        assert video.info.total_frames == 25
        assert_frames(read_all(video, [0, 12, 24]), reference, [0, 12, 24])


# ---------------------------------------------------------------- sources


def test_every_source_kind_reads_the_same_frames(mp4, tmp_path):
    path, reference = mp4
    data = pathlib.Path(path).read_bytes()
    spaced = tmp_path / "a b%.mp4"
    spaced.write_bytes(data)
    encoded = base64.b64encode(data).decode()
    sources = [path, pathlib.Path(path), "file://" + urllib.parse.quote(str(spaced)),
               "file://localhost" + urllib.parse.quote(str(spaced)), data, bytearray(data), memoryview(data),
               "data:video/mp4;base64," + encoded, "data:;base64," + encoded,
               "data:application/octet-stream;base64," + encoded]
    for source in sources:
        with VideoFile(source) as video:
            assert video.info.total_frames == 40
            assert_frames(read_all(video, [0, 21, 39]), reference, [0, 21, 39])


@pytest.mark.parametrize(("source", "problem"), [
    ("data:text/plain;base64,aGVsbG8=", "data URI has media type 'text/plain', not a video"),
    ("data:video/mp4,plain", "data URI is not base64-encoded"),
    ("data:video/mp4;base64,@@@@", "data URI payload is not valid base64"),
    ("http://example.com/a.mp4", "URLs are not fetched; download the file and pass its path"),
    ("https://example.com/a.mp4", "URLs are not fetched"),
    ("rtsp://camera/stream", "URLs are not fetched"),
    ("file://otherhost/a.mp4", "a file URI names a host ('otherhost')"),
])
def test_refused_sources_say_why(source, problem):
    with pytest.raises(VideoLoadError) as caught:
        VideoFile(source)
    assert str(caught.value).startswith("video ") and problem in str(caught.value)


# ---------------------------------------------------------------- errors


def error_of(source, indices=None) -> str:
    with pytest.raises(VideoLoadError) as caught, VideoFile(source) as video:
        if indices is not None:
            video.read(indices, lambda frame: frame)
    assert isinstance(caught.value, InputError)
    return str(caught.value)


def test_missing_directory_and_empty_files_are_named(tmp_path):
    missing = tmp_path / "nope.mp4"
    assert error_of(str(missing)) == f"video {str(missing)!r}: no such file"
    assert "no such file (" + str(missing) + ")" in error_of("file://" + str(missing))
    assert error_of(str(tmp_path)) == f"video {str(tmp_path)!r}: is a directory, not a video file"
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    assert error_of(str(empty)) == f"video {str(empty)!r}: is empty (0 bytes)"
    assert error_of(b"") == "video bytes (0 bytes): is empty (0 bytes)"


def test_random_bytes_are_not_a_video(tmp_path):
    noise = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    expected = "not a recognised video container (corrupt or not a video file)"
    assert error_of(noise) == f"video bytes (5000 bytes): {expected}"
    path = tmp_path / "noise.mp4"
    path.write_bytes(noise)
    assert error_of(str(path)) == f"video {str(path)!r}: {expected}"


def test_an_audio_file_has_no_video_stream(tmp_path):
    path = make_audio(tmp_path / "tone.wav")
    assert error_of(path) == f"video {path!r}: has no video stream (it holds audio)"


def test_a_codec_ffmpeg_cannot_decode_is_named(clips):
    """An AVI whose FourCC no decoder knows."""
    data = pathlib.Path(clips["mpeg4-avi"][0]).read_bytes()
    assert data.count(b"FMP4") == 2
    message = error_of(data.replace(b"FMP4", b"QQZZ"))
    assert message.startswith(f"video bytes ({len(data)} bytes): its video codec cannot be decoded")


@pytest.mark.parametrize("file", ["cut.mp4", "cut.mkv"])
def test_a_truncated_file_names_the_first_frame_it_lacks(tmp_path, file):
    """Cut in half: the header still tells the full length; the frames before the cut read
    exactly (none near the cut is taken for another: B-frames leave gaps there), every one from
    some point on is named as missing."""
    options = {"movflags": "faststart"} if file.endswith(".mp4") else None  # mp4: index first
    whole = make_video(tmp_path / ("whole" + file[-4:]), 60, 64, 48, 24, gop=10, container_options=options)
    reference = reference_frames(whole)
    data = pathlib.Path(whole).read_bytes()
    cut = tmp_path / file
    cut.write_bytes(data[: len(data) // 2])
    readable = []
    with VideoFile(str(cut)) as video:
        assert video.info.total_frames == 60
        for index in range(60):
            try:
                assert_frames(read_all(video, [index]), reference, [index])
                readable.append(index)
            except VideoLoadError as exc:
                assert f"frame {index} of 60 could not be decoded" in str(exc)
    assert 15 <= len(readable) < 30 and readable == list(range(len(readable)))
    message = error_of(str(cut), [3, 58])
    assert message == f"video {str(cut)!r}: frame 58 of 60 could not be decoded (the file ends early or is corrupt)"


def test_indices_out_of_range_or_unordered_are_refused(mp4):
    path, _ = mp4
    assert error_of(path, [0, 40]) == (f"video {path!r}: frame index 40 is out of range "
                                       "(the video has 40 frames, 0 to 39)")
    assert "frame index -1 is out of range" in error_of(path, [-1])
    with VideoFile(path) as video, pytest.raises(ValueError, match="increasing order"):
        video.read([5, 2], lambda frame: frame)


def test_a_closed_file_is_not_read(mp4):
    video = VideoFile(mp4[0])
    video.close()
    video.close()
    with pytest.raises(ValueError, match="is closed"):
        video.read([0], lambda frame: frame)
