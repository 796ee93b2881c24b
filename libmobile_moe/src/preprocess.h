// An app's 8-bit pixels -> the float32 C x S x S a bundle takes, by its manifest's input section: the C++ translation
// of mobile_moe/preprocess.py's eval_transform for an image file, held equal to it byte for byte by
// tests/device_bench/test_native_library.py (as bundle_routing.cpp is to bundle_routing.py).
//
// Python resizes a file's PIL image with Pillow (Image.resize, no reducing_gap) and centre-crops it, then scales to
// [0, 1] and normalises in float32 (torchvision's ToDtype and Normalize). The resize here is Pillow's own
// (libImaging/Resample.c of Pillow 13.0.0, the pinned release): separable two-pass convolution, coefficients
// normalised in double and rounded to 22-bit fixed point, each pass rounded and clamped to 8 bits, the passes in
// Pillow's order (pillow::resize() in preprocess.cpp). Grey bundles take Pillow's RGB -> L conversion
// (libImaging/Convert.c rgb2l).
#pragma once

#include <cstdint>
#include <vector>

#include "manifest_schema.h"

namespace mobile_moe::library {

struct Preprocessing {
  ResizePolicy policy = ResizePolicy::Stretch;  // mobile_moe/preprocess.py's policies (manifest_schema.h)
  int resize_to = 0, crop_to = 0;
  Interpolation interpolation = Interpolation::Bilinear;
  std::vector<double> mean, std;
};

// RGB8 pixels (`stride` bytes a row) -> C x S x S float32 by `pre` (C: 3, or 1 for a grey bundle).
std::vector<float> preprocess_rgb8(const uint8_t* rgb, int width, int height, int stride, int channels,
                                   int size, const Preprocessing& pre);

}  // namespace mobile_moe::library
