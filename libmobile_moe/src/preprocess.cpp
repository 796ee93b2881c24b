// preprocess.h: an app's 8-bit pixels -> the float32 C x S x S a bundle takes, Pillow's resize step for step.
#include "preprocess.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "errors.h"
#include "manifest_schema.h"

namespace mobile_moe::library {

namespace pillow {

constexpr int kPrecisionBits = 32 - 8 - 2;

double bilinear(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

double bicubic(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// One axis: for each output position its first input position, its count, and ksize fixed-point coefficients
// (Resample.c precompute_coeffs + normalize_coeffs_8bpc).
struct Coefficients {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> weights;
};

Coefficients coefficients(int in_size, int out_size, bool bicubic_filter) {
  const double support_of_filter = bicubic_filter ? 2.0 : 1.0;
  const double scale = static_cast<double>(static_cast<float>(in_size)) / out_size;  // box (0, in) as floats
  const double filterscale = std::max(scale, 1.0);
  const double support = support_of_filter * filterscale;
  Coefficients c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.weights.assign(static_cast<size_t>(out_size) * c.ksize, 0);
  std::vector<double> k(c.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    xmin = std::max(xmin, 0);
    int xmax = std::min(static_cast<int>(center + support + 0.5), in_size) - xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double position = (x + xmin - center + 0.5) * ss;
      ww += k[x] = bicubic_filter ? bicubic(position) : bilinear(position);
    }
    for (int x = 0; x < xmax; ++x)
      if (ww != 0.0) k[x] /= ww;
    for (int x = 0; x < c.ksize; ++x) {
      const double value = x < xmax ? k[x] : 0.0;
      c.weights[static_cast<size_t>(xx) * c.ksize + x] =
          value < 0 ? static_cast<int32_t>(-0.5 + value * (1 << kPrecisionBits))
                    : static_cast<int32_t>(0.5 + value * (1 << kPrecisionBits));
    }
    c.first[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

uint8_t clip8(int32_t value) {
  return static_cast<uint8_t>(std::clamp(value >> kPrecisionBits, 0, 255));
}

// An interleaved 8-bit image of `channels` channels, tightly packed.
struct Image {
  int width = 0, height = 0, channels = 0;
  std::vector<uint8_t> pixels;
  uint8_t at(int x, int y, int c) const { return pixels[(static_cast<size_t>(y) * width + x) * channels + c]; }
};

// One horizontal pass: each of `out`'s rows from row `row_offset` + y of `in` (Resample.c ResampleHorizontal_8bpc).
Image horizontal(const Image& in, int width, int rows, int row_offset, const Coefficients& across) {
  Image out{width, rows, in.channels, {}};
  out.pixels.resize(static_cast<size_t>(width) * rows * in.channels);
  for (int y = 0; y < rows; ++y)
    for (int x = 0; x < width; ++x) {
      const int32_t* k = &across.weights[static_cast<size_t>(x) * across.ksize];
      for (int ch = 0; ch < in.channels; ++ch) {
        int32_t sum = 1 << (kPrecisionBits - 1);
        for (int i = 0; i < across.count[x]; ++i) sum += in.at(across.first[x] + i, y + row_offset, ch) * k[i];
        out.pixels[(static_cast<size_t>(y) * width + x) * in.channels + ch] = clip8(sum);
      }
    }
  return out;
}

// One vertical pass: output row y from `in`'s rows first[y] - row_offset on (ResampleVertical_8bpc, bounds shifted).
Image vertical(const Image& in, int height, int row_offset, const Coefficients& down) {
  Image out{in.width, height, in.channels, {}};
  out.pixels.resize(static_cast<size_t>(in.width) * height * in.channels);
  for (int y = 0; y < height; ++y) {
    const int32_t* k = &down.weights[static_cast<size_t>(y) * down.ksize];
    for (int x = 0; x < in.width; ++x)
      for (int ch = 0; ch < in.channels; ++ch) {
        int32_t sum = 1 << (kPrecisionBits - 1);
        for (int i = 0; i < down.count[y]; ++i) sum += in.at(x, down.first[y] - row_offset + i, ch) * k[i];
        out.pixels[(static_cast<size_t>(y) * in.width + x) * in.channels + ch] = clip8(sum);
      }
  }
  return out;
}

// Pillow's Image.resize((width, height), BILINEAR or BICUBIC) with the default box (Pillow 13's Resample.c
// ImagingResampleInner): the vertical pass first when the height shrinks by more than twice what the width does, else
// the horizontal pass first, over only the rows the vertical pass reads.
Image resize(const Image& in, int width, int height, bool bicubic_filter) {
  if (in.width == width && in.height == height) return in;
  const bool need_horizontal = width != in.width, need_vertical = height != in.height;
  const bool horizontal_first = !(in.height - height > 0 && in.height - height > (in.width - width) * 2);
  const Coefficients across = coefficients(in.width, width, bicubic_filter);
  const Coefficients down = coefficients(in.height, height, bicubic_filter);
  if (!horizontal_first) {
    Image shrunk = need_vertical ? vertical(in, height, 0, down) : in;
    return need_horizontal ? horizontal(shrunk, width, height, 0, across) : shrunk;
  }
  if (!need_horizontal) return vertical(in, height, 0, down);
  const int first_row = down.first[0];
  const int last_row = down.first[height - 1] + down.count[height - 1];
  Image rows = horizontal(in, width, last_row - first_row, first_row, across);
  return need_vertical ? vertical(rows, height, first_row, down) : rows;
}

}  // namespace pillow

// torchvision's resize to a shorter side (v2.Resize(int)): the longer side int(size * long / short), as
// torchvision/transforms/v2/functional/_geometry.py _compute_resized_output_size computes it.
// Sizes computed in 64 bits; UsageError where the result is beyond what resize() makes (kMaxResizedPixels).
constexpr int64_t kMaxResizedPixels = int64_t{1} << 28;  // 768 MiB of RGB: beyond any phone's photo, cropped

static void shorter_side_to(int size, int width, int height, int* out_width, int* out_height) {
  const bool wide = width >= height;
  const int short_side = wide ? height : width, long_side = wide ? width : height;
  const auto new_long = static_cast<int64_t>(static_cast<double>(size) * long_side / short_side);
  if (new_long * size > kMaxResizedPixels)
    throw UsageError("a " + std::to_string(width) + " x " + std::to_string(height) + " image resized to " +
                     std::to_string(size) + " on its shorter side (the manifest's input.resize.resize_to) would be " +
                     std::to_string(wide ? new_long : size) + " x " + std::to_string(wide ? size : new_long) +
                     " pixels, more than the " + std::to_string(kMaxResizedPixels) + " this library resizes; crop " +
                     "the image nearer to square first");
  *out_width = static_cast<int>(wide ? new_long : size);
  *out_height = static_cast<int>(wide ? size : new_long);
}

std::vector<float> preprocess_rgb8(const uint8_t* rgb, int width, int height, int stride, int channels,
                                   int size, const Preprocessing& pre) {
  pillow::Image image{width, height, channels, {}};
  image.pixels.resize(static_cast<size_t>(width) * height * channels);
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x) {
      const uint8_t* pixel = rgb + static_cast<size_t>(y) * stride + static_cast<size_t>(x) * 3;
      uint8_t* out = &image.pixels[(static_cast<size_t>(y) * width + x) * channels];
      if (channels == 3) std::copy_n(pixel, 3, out);
      else *out = static_cast<uint8_t>((pixel[0] * 19595 + pixel[1] * 38470 + pixel[2] * 7471 + 0x8000) >> 16);
    }
  const bool bicubic_filter = pre.interpolation == Interpolation::Bicubic;
  int left = 0, top = 0;
  if (pre.policy == ResizePolicy::ResizeCenterCrop) {
    int resized_width = 0, resized_height = 0;
    shorter_side_to(pre.resize_to, width, height, &resized_width, &resized_height);
    image = pillow::resize(image, resized_width, resized_height, bicubic_filter);
    // torchvision's center_crop: int(round((side - crop) / 2.0)), Python's round (halves to even)
    left = static_cast<int>(std::nearbyint((resized_width - size) / 2.0));
    top = static_cast<int>(std::nearbyint((resized_height - size) / 2.0));
  } else {
    image = pillow::resize(image, size, size, bicubic_filter);
  }
  std::vector<float> chw(static_cast<size_t>(channels) * size * size);
  const float scale = static_cast<float>(1.0 / 255.0);
  for (int ch = 0; ch < channels; ++ch) {
    const float mean = static_cast<float>(pre.mean[ch]), std_dev = static_cast<float>(pre.std[ch]);
    for (int y = 0; y < size; ++y)
      for (int x = 0; x < size; ++x) {
        const float value = static_cast<float>(image.at(x + left, y + top, ch)) * scale;
        chw[(static_cast<size_t>(ch) * size + y) * size + x] = (value - mean) / std_dev;
      }
  }
  return chw;
}

}  // namespace mobile_moe::library
