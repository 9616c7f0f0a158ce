"""The all-GPU image path (`image_decode="gpu"`, `pytest -m gpu`): JPEG files decoded by nvJPEG and
resized on the GPU give patches within transformers' own tolerance for its torchvision-backed
`Qwen2VLImageProcessor` (the tolerance its tests allow between its Pillow and torchvision
processors); packs mixing such files with Pillow-path images keep each image's patches; a file
nvJPEG rejects is decoded by Pillow; damaged files give what the CPU path gives (a truncated one
fails alone with Pillow's error, one with a garbage scan is decoded); and the bundled model
captions the same JPEG files with the same tokens either way. (A file neither decoder reads,
failing while its pack is encoded, is `tests/unit/test_gpu_decode_host.py`'s injected case.)"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from mmpipe.vision.gpu_decode import deferred_jpeg
from mmpipe.vision.preprocess import ImageProcessorConfig, patches_on_device, preprocess_image
from PIL import Image

from mmpipe import Pipeline, SamplingParams
from mmpipe.inputs import decode_encoded
from tests.helpers import random_image

pytestmark = pytest.mark.gpu
torchvision = pytest.importorskip("torchvision")
CUDA = torch.device("cuda")
BUNDLED = Path(__file__).parents[2] / "assets" / "mmpipe-tiny-scenes"
SCENES = Path(__file__).parents[2] / "assets" / "images"
CFG = ImageProcessorConfig.from_dir(str(BUNDLED))
SIZES = [(448, 448), (1000, 333), (57, 90), (3000, 2000), (640, 480), (29, 200)]


def jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour fields with some noise: what JPEG is for (pure noise would make every decoder
    differ by its rounding alone)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(3, max(2, height // 40), max(2, width // 40), generator=g) * 255
    smooth = torch.nn.functional.interpolate(coarse[None], size=(height, width), mode="bicubic")[0]
    noisy = (smooth + torch.randn(3, height, width, generator=g) * 6).clamp(0, 255).round().to(torch.uint8)
    return Image.fromarray(noisy.permute(1, 2, 0).numpy())


@pytest.mark.parametrize("size", SIZES)
def test_patches_match_transformers_torchvision_processor(size):
    """Resize and normalisation: transformers' torchvision-backed processor given the same decoded
    pixels gives the same patches (float rounding apart). Decoding: nvJPEG differs from Pillow's
    libjpeg-turbo (which transformers' processor decodes files with) by its own IDCT and chroma
    upsampling: a mean difference of 0.0013-0.015 (0.1-1 of 255 levels, the most for
    small images enlarged to min_pixels) and at most 0.13, above the 5e-3 mean transformers'
    tests allow between its two processors for small 4:2:0 images. Bounded here at twice that
    worst mean, and transformers' 0.1 element bound for all but one element in a thousand."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from transformers import Qwen2VLImageProcessor

    data = jpeg(photo_like(*size, seed=sum(size)))
    deferred = deferred_jpeg(data, "x.jpg", CFG)
    assert deferred is not None
    ours = patches_on_device([deferred], CUDA).float()
    processor = Qwen2VLImageProcessor.from_pretrained(str(BUNDLED))
    nvjpeg = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, device=CUDA)
    same_pixels = processor(images=[nvjpeg], return_tensors="pt", device="cuda")
    assert tuple(same_pixels["image_grid_thw"][0].tolist()) == deferred.grid_thw
    torch.testing.assert_close(ours, same_pixels["pixel_values"].to(CUDA).float(), atol=1e-5, rtol=1e-5)

    pillow = processor(images=[decode_encoded(data, "x.jpg")], return_tensors="pt", device="cuda")
    difference = (ours - pillow["pixel_values"].to(CUDA).float()).abs()
    print(f"{size}: mean {difference.mean().item():.2e}, max {difference.max().item():.3f}, "
          f"above 0.1: {(difference > 1e-1).float().mean().item():.2e}")
    assert difference.mean().item() <= 3e-2
    assert (difference > 1e-1).float().mean().item() <= 1e-3


def test_a_pack_mixing_gpu_decoded_and_pillow_images_keeps_each_images_patches():
    files = [jpeg(photo_like(320, 240, seed=1)), None, jpeg(photo_like(200, 300, seed=2)), None]
    pillow = [preprocess_image(random_image(100 + 30 * i, 90, seed=i), CFG) for i in range(4)]
    images = [deferred_jpeg(f, "x.jpg", CFG) if f is not None else pillow[i] for i, f in enumerate(files)]
    assert [im.pixels is None for im in images] == [True, False, True, False]
    pack = patches_on_device(images, CUDA)
    alone = torch.cat([patches_on_device([im], CUDA) for im in images])
    assert torch.equal(pack, alone)
    assert torch.equal(patches_on_device([images[1]], CUDA), pillow[1].pixel_values.to(CUDA))  # Pillow's, exact


def test_a_file_nvjpeg_rejects_is_decoded_by_pillow_bit_identically(monkeypatch):
    import torchvision.io

    data = jpeg(photo_like(300, 200, seed=3))

    def rejecting(encoded, **kwargs):  # nvJPEG refusing the file (an unsupported coding), batched or alone
        raise RuntimeError("nvjpeg: unsupported (injected)")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", rejecting)
    got = patches_on_device([deferred_jpeg(data, "x.jpg", CFG)], CUDA)
    want = preprocess_image(decode_encoded(data, "x.jpg"), CFG).pixel_values.to(CUDA)
    assert torch.equal(got, want)


def _chat(image) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]}]


@pytest.fixture(scope="module")
def pipes():
    cpu_path = Pipeline.from_pretrained(device="cuda")
    gpu_path = Pipeline.from_pretrained(device="cuda", image_decode="gpu")
    yield cpu_path, gpu_path
    cpu_path.close()
    gpu_path.close()


def test_the_bundled_model_captions_jpeg_files_alike_either_way(pipes, tmp_path):
    cpu_path, gpu_path = pipes
    files = []
    for k in range(6):
        path = tmp_path / f"scene_{k}.jpg"
        path.write_bytes(jpeg(Image.open(SCENES / f"scene_{k}.png").convert("RGB"), quality=95))
        files.append(str(path))
    greedy = SamplingParams(max_new_tokens=48)
    want = cpu_path.chat([_chat(f) for f in files], greedy)
    got = gpu_path.chat([_chat(f) for f in files], greedy)
    assert all(o.ok for o in want + got)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert gpu_path.stats()["vit"]["graph_runs"] > 0  # the ViT graphs served the GPU-decoded packs


def test_damaged_jpegs_give_what_the_cpu_path_gives(pipes, tmp_path):
    """A truncated file (no end-of-image marker) fails alone with Pillow's error, as on the CPU
    path; a file whose scan data is garbage but whose end is intact is decoded by both paths
    (Pillow decodes such files with a warning, nvJPEG or Pillow here), never a failed step."""
    cpu_path, gpu_path = pipes
    good = jpeg(photo_like(256, 256, seed=4))
    scan = good.index(b"\xff\xda") + 20  # the headers and the start of the scan
    files = {"good.jpg": good, "truncated.jpg": good[:len(good) // 2],
             "garbage.jpg": good[:scan] + bytes(range(256)) * 8 + b"\xff\xd9"}
    assert deferred_jpeg(files["garbage.jpg"], "x", CFG) is not None  # it takes the GPU path
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    batch = [_chat(str(tmp_path / name)) for name in ("good.jpg", "truncated.jpg", "garbage.jpg", "good.jpg")]
    greedy = SamplingParams(max_new_tokens=8)
    want = cpu_path.chat(batch, greedy)
    got = gpu_path.chat(batch, greedy)
    assert [o.ok for o in want] == [True, False, True, True]
    assert [o.ok for o in got] == [True, False, True, True]
    assert got[1].error == want[1].error and "truncated.jpg" in got[1].error
    stats = gpu_path.stats()
    assert stats["requests"]["running"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]
