"""NVDEC capability queries: the ctypes layout, argument checks, and the driver's answers on a GPU."""

from __future__ import annotations

import ctypes

import pytest

from flashcodec import nvcuvid


def test_caps_struct_matches_the_sdk_layout():
    # cuviddec.h: 3 ints + 3 reserved (24 bytes), 4 bytes of flags/mask, 3 uints, 2 ushorts, 4 bytes, 10 reserved uints.
    assert ctypes.sizeof(nvcuvid._CUVIDDECODECAPS) == 88
    assert nvcuvid._CUVIDDECODECAPS.nMaxWidth.offset == 28
    assert nvcuvid._CUVIDDECODECAPS.reserved3.offset == 48


def test_bad_arguments_raise_before_touching_the_driver():
    with pytest.raises(ValueError, match="chroma_format must be one of"):
        nvcuvid.decoder_caps("h264", "411")
    with pytest.raises(ValueError, match="bit_depth"):
        nvcuvid.decoder_caps("h264", "420", 7)


def test_codec_without_an_nvdec_entry_is_unsupported():
    caps = nvcuvid.decoder_caps("prores", "422", 10)
    assert not caps.is_supported and caps.num_engines == 0 and not caps.fits(64, 64)


def test_fits_checks_every_limit():
    caps = nvcuvid.DecoderCaps("h264", "420", 8, True, 7, 4096, 4096, 65536, 48, 16)
    assert caps.fits(1920, 1080) and caps.fits(4096, 4096)
    assert not caps.fits(4097, 64) and not caps.fits(32, 64) and not caps.fits(64, 8)
    small_mb = nvcuvid.DecoderCaps("h264", "420", 8, True, 7, 4096, 4096, 8160, 48, 16)
    assert small_mb.fits(1920, 1080) and not small_mb.fits(4096, 2304)  # 36864 macroblocks > 8160


def test_without_a_driver_it_says_which_library_is_missing():
    try:
        ctypes.CDLL("libcuda.so.1")
        ctypes.CDLL("libnvcuvid.so.1")
    except OSError:
        assert nvcuvid.num_gpus() == 0
        with pytest.raises(nvcuvid.NvcuvidError, match=r"lib(cuda|nvcuvid)\.so\.1"):
            nvcuvid.decoder_caps("h264")
    else:
        pytest.skip("the NVIDIA driver and video decoder are installed here")


@pytest.mark.cuda
def test_driver_reports_h264_decode():
    caps = nvcuvid.decoder_caps("h264", "420", 8, device=0)
    assert caps.is_supported and caps.num_engines >= 1 and caps.fits(1920, 1080)
    assert nvcuvid.decoder_caps("h264", "420", 8, device=0) is caps  # cached
    with pytest.raises(nvcuvid.NvcuvidError, match="no CUDA device"):
        nvcuvid.decoder_caps("h264", device=nvcuvid.num_gpus())
