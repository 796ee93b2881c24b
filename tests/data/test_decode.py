"""Raw images for the device pipeline (mobile_moe/data/decode.py): which files the GPU takes, read from the JPEG frame
header; every other kind decoded by the one decoder; a batch padded into one canvas; the GPU's decoder
(torchvision.io.decode_jpeg, run here on the CPU) giving PIL's pixels within JPEG decoders' known differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FILE_KINDS, write_image_kind
from PIL import Image

from mobile_moe.data import decode
from mobile_moe.data.image_files import UnreadableImage, read_image


def smooth_pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A photo-like (h, w, 3) uint8 image: JPEG is made for smooth content, not for noise."""
    coarse = np.random.default_rng(seed).integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC))


@pytest.fixture
def files(tmp_path):
    return {kind: write_image_kind(tmp_path / f"{kind}.img", kind, smooth_pixels(30, 44)) for kind in FILE_KINDS}


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_the_frame_header_says_which_files_a_gpu_decodes(files, kind):
    frame = decode.jpeg_frame(files[kind].read_bytes())
    if kind == "png":
        assert frame is None
    else:
        assert (frame.height, frame.width) == (30, 44) and frame.gpu_decodable == FILE_KINDS[kind]


BROKEN = [b"", b"\xff\xd8", b"\xff\xd8\xff\xda\x00\x02", b"\xff\xd8\xff\xe0\x00\x01", b"\xff\xd8\x00"]


@pytest.mark.parametrize("data", BROKEN)
def test_a_broken_header_is_no_frame(data):
    assert decode.jpeg_frame(data) is None


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_every_kind_reaches_the_canvas_with_pils_pixels(files, kind):
    """Baseline JPEGs travel as bytes and are decoded by the GPU's decoder (on the CPU here); the rest in the worker
    by PIL. Both give PIL's pixels: libjpeg-turbo's IDCT and upsampling in either, at most a level or two apart."""
    folder = decode.FolderFiles([(str(path), label) for label, path in enumerate(files.values())])
    raw = decode.RawImages(folder, max_side=64)
    position = list(files).index(kind)
    image, label, name = raw[position]
    encoded = name is not None
    assert encoded == FILE_KINDS[kind] and label == position
    batch = decode.collate([raw[position], raw[0]])
    canvas, sizes, refused = decode.on_device(batch, torch.device("cpu"))
    assert sizes.tolist() == [[30, 44], [30, 44]] and canvas.dtype == torch.uint8 and refused == 0
    pil = torch.from_numpy(np.array(read_image(files[kind]))).permute(2, 0, 1)
    difference = (canvas[0].int() - pil.int()).abs()
    assert difference.max() <= (2 if encoded else 0)


def test_a_batch_of_sizes_is_padded_at_the_top_left():
    small, large = torch.full((3, 4, 6), 7, dtype=torch.uint8), torch.full((3, 9, 5), 9, dtype=torch.uint8)
    batch = decode.collate([(small, 0), (large, 1)])
    assert batch.canvas.shape == (2, 3, 9, 6) and batch.sizes.tolist() == [[4, 6], [9, 5]]
    assert (batch.canvas[0, :, :4, :6] == 7).all() and batch.canvas[0, :, 4:].eq(0).all()
    assert (batch.canvas[1, :, :, :5] == 9).all() and batch.canvas[1, :, :, 5:].eq(0).all()
    assert batch.labels.tolist() == [0, 1] and batch.encoded == [] and len(batch.blob) == 0


def test_a_file_gone_since_the_check_is_one_line(files):
    folder = decode.FolderFiles([(str(files["baseline"].with_name("gone.jpg")), 0)])
    with pytest.raises(UnreadableImage, match=r"cannot read image .*gone\.jpg: No such file"):
        decode.RawImages(folder, max_side=64)[0]


def test_an_image_larger_than_the_limit_is_fitted_in_the_worker(files):
    """One large photo does not size every image's slot: past the limit it is decoded here and shrunk."""
    folder = decode.FolderFiles([(str(files["baseline"]), 0)])
    image, _, name = decode.RawImages(folder, max_side=22)[0]
    assert name is None and image.shape == (3, 15, 22)
    assert decode.Fitted(22)(read_image(files["png"])).shape == (3, 15, 22)
    assert decode.source_side_limit(0.08, 224) == 792 and decode.source_side_limit(1.0, 32) == 64


def test_a_file_the_device_refuses_falls_back_alone_is_counted_and_a_damaged_one_named(files, monkeypatch):
    """nvJPEG fails a whole batch for one file it refuses, without naming it: decode_jpegs then sends each file to
    the device alone, and only the refused one to the host decoder, counted. Bytes no JPEG decoder takes (a PNG's)
    are refused on the CPU as well; a damaged JPEG, which the host cannot read either, is named in one line."""
    import torchvision.io

    calls = []
    decode_jpeg = torchvision.io.decode_jpeg

    def recorded(pieces, **kwargs):
        calls.append(len(pieces) if isinstance(pieces, list) else 1)
        return decode_jpeg(pieces, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", recorded)
    good, png = (torch.frombuffer(bytearray(files[k].read_bytes()), dtype=torch.uint8) for k in ("baseline", "png"))
    images, refused = decode.decode_jpegs([good, png, good], ["good", "png", "good again"], torch.device("cpu"))
    assert calls == [3, 1, 1, 1] and refused == 1
    for image, kind in zip(images, ("baseline", "png", "baseline"), strict=True):
        assert image.equal(torch.from_numpy(np.array(read_image(files[kind]))).permute(2, 0, 1))
    damaged = good.clone()
    damaged[200:] = 0  # the header kept: it still reads as GPU-decodable
    with pytest.raises(UnreadableImage, match="cannot read damaged"):
        decode.decode_jpegs([good, damaged], ["good", "damaged"], torch.device("cpu"))


def test_a_16_bit_png_reads_as_its_8_bit_equivalent(tmp_path):
    """PIL's convert clips 16-bit values at 255 (a 16-bit PNG read as white); the one decoder keeps the high byte."""
    values = (np.arange(32 * 48).reshape(32, 48) * 40).astype(np.uint16)  # 0 .. 61,400
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)  # PIL writes (and reads back) mode "I;16"
    pixels = np.array(read_image(path))
    assert pixels.shape == (32, 48, 3) and (pixels == (values >> 8)[..., None]).all()


def sideways_jpeg(path, pixels: np.ndarray, orientation: int = 6):
    """`pixels` as a camera stores a portrait photo: the sensor's landscape pixels and an EXIF orientation tag."""
    exif = Image.Exif()
    exif[0x0112] = orientation  # 6: the viewer turns the stored image 90 degrees clockwise
    Image.fromarray(pixels).save(path, format="JPEG", quality=95, exif=exif.tobytes())
    return path


def test_an_exif_rotated_jpeg_reads_upright_on_every_path(tmp_path):
    """What a viewer shows: the one decoder turns it (PIL's exif_transpose), and the device pipeline leaves it to the
    worker, since nvJPEG ignores the tag; an upright photo with EXIF still travels to the GPU as bytes."""
    stored = smooth_pixels(30, 44)
    sideways = sideways_jpeg(tmp_path / "sideways.jpg", stored)
    upright = sideways_jpeg(tmp_path / "upright.jpg", stored, orientation=1)
    plain = np.array(Image.open(upright).convert("RGB"))  # the stored pixels, as decoded
    turned = np.array(read_image(sideways))
    assert turned.shape == (44, 30, 3) and (turned == np.rot90(plain, k=-1)).all()
    frame = decode.jpeg_frame(sideways.read_bytes())
    assert frame.gpu_decodable and frame.app1
    raw = decode.RawImages(decode.FolderFiles([(str(sideways), 0), (str(upright), 1)]), max_side=64)
    (image, _, name), (_, _, upright_name) = raw[0], raw[1]
    assert name is None and (image.permute(1, 2, 0).numpy() == turned).all()  # decoded, turned, in the worker
    assert upright_name is not None  # bytes for the GPU


def test_a_jpeg_turned_by_its_xmp_alone_reads_upright_and_stays_off_the_gpu(tmp_path):
    """An orientation in XMP and no Exif block: PIL turns it (Image.getexif reads XMP's tiff:Orientation), nvJPEG
    would not, so the worker decodes it; the GPU would have decoded it sideways, and a refused file's host decode
    would have answered another size than the header its crop was drawn for."""
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    path = tmp_path / "turned.jpg"
    Image.fromarray(smooth_pixels(30, 44)).save(path, format="JPEG", quality=95, xmp=xmp)
    data = path.read_bytes()
    frame = decode.jpeg_frame(data)
    assert frame.gpu_decodable and frame.app1 and not decode.device_decodes(frame, data)
    assert np.array(read_image(path)).shape == (44, 30, 3)


@pytest.mark.parametrize("header", [b"Exif\0\0II*\0\xff\xff\xff\x7f", b"Exif\0\0MM\0*\0\0\0\x08\xff\xff", b"Exif\0\0"])
def test_a_damaged_exif_block_never_crashes_the_decoder(tmp_path, header, recwarn):
    pixels = smooth_pixels(30, 44)
    good = sideways_jpeg(tmp_path / "good.jpg", pixels, orientation=1).read_bytes()
    app1 = b"\xff\xe1" + (len(header) + 2).to_bytes(2, "big") + header
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(good[:2] + app1 + good[2:])
    try:
        assert read_image(broken).size in ((44, 30), (30, 44))
    except UnreadableImage as refusal:  # one line naming the file is the other answer
        assert "broken.jpg" in str(refusal)
    decode.RawImages(decode.FolderFiles([(str(broken), 0)]), max_side=64)[0]  # answers or refuses, never crashes
    assert not [str(w.message) for w in recwarn]  # nothing for stderr
