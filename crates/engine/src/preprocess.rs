// SPDX-License-Identifier: MPL-2.0
//! CPU preprocessing: any supported video frame to the model's float input.
//!
//! Colour conversion: frames already packed in the model's channel order are read where they
//! are; other packed RGB formats have their bytes picked; anything else goes through the
//! frame's `PackedSource`, which in the plugin is GStreamer's own `GstVideoConverter` (the code
//! behind `videoconvert`, reading every raw format with its strides and colorimetry). The
//! crop, resize and letterbox border use fast_image_resize (antialiased bilinear, as PIL and
//! torchvision resize for training, and as the GPU kernels do), except for pixels already at
//! the model's size, which are read where they lie; then the per-channel normalisation
//! `(pixel × scale − mean[c]) / std[c]`, through a 256-entry table per channel, writes the
//! model's layout.

use std::any::Any;

use fast_image_resize as fr;

use crate::frame::{FrameFormat, FrameView, PixelFormat};

pub use crate::compiler::spec::{
    ChannelOrder, Crop, InputSpec, Layout, PreprocessOptions, Rect, ResizeMode, crop_geometry,
    geometry,
};

/// Why a frame cannot be made into the model's input.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// The frame cannot be converted to the model's colours, or a buffer does not map.
    #[error("cannot convert {format:?} {width}x{height} to the model input: {reason}")]
    Convert {
        /// The frame's pixel format.
        format: PixelFormat,
        /// The frame's width in pixels.
        width: u32,
        /// The frame's height in pixels.
        height: u32,
        /// What failed, for the message.
        reason: String,
    },
    /// A region of interest has no pixel inside the frame.
    #[error("the region {x},{y} {w}x{h} lies outside the {width}x{height} frame")]
    OutsideFrame {
        /// The region's left edge, in the frame's pixels.
        x: i32,
        /// The region's top edge, in the frame's pixels.
        y: i32,
        /// The region's width in pixels.
        w: i32,
        /// The region's height in pixels.
        h: i32,
        /// The frame's width in pixels.
        width: u32,
        /// The frame's height in pixels.
        height: u32,
    },
}

impl PreprocessError {
    /// The frame of `format` cannot be converted, for `reason`.
    fn convert(format: FrameFormat, reason: String) -> Self {
        PreprocessError::Convert {
            format: format.format,
            width: format.width,
            height: format.height,
            reason,
        }
    }
}

/// The CPU preprocessing for one model input, keeping its tables and buffers between frames.
pub struct Preprocessor {
    options: PreprocessOptions,
    input: InputSpec,
    /// `table[c][p]` is the normalised value of pixel value `p` in channel `c`.
    table: Vec<[f32; 256]>,
    /// What a frame's [`PackedSource`] keeps between frames (GStreamer's converter).
    source_cache: Option<Box<dyn Any + Send>>,
    /// Packed pixels of the model's channel order, where the engine converts them itself.
    packed: Vec<u8>,
    resizer: fr::Resizer,
    /// The frame at the model's size, packed pixels in the model's channel order.
    resized: Vec<u8>,
    /// Letterbox borders get the mean colour, which normalises to zero: padding then looks
    /// like "no information" to the model rather than like black.
    border: Vec<u8>,
}

impl Preprocessor {
    /// Precomputes the normalisation for `input`; fails if `mean` or `std` do not fit its channels.
    pub fn new(options: PreprocessOptions, input: InputSpec) -> Result<Self, String> {
        let (mean, std) = options.per_channel(input.channels)?;
        let table = mean
            .iter()
            .zip(&std)
            .map(|(m, s)| std::array::from_fn(|p| (p as f32 * options.scale - m) / s))
            .collect();
        let border = mean.iter().map(|&m| options.border_value(m)).collect();
        Ok(Self {
            border,
            options,
            input,
            table,
            source_cache: None,
            packed: Vec::new(),
            resizer: fr::Resizer::new(),
            resized: vec![0; input.frame_len()],
        })
    }

    /// The model input it writes.
    pub fn input(&self) -> &InputSpec {
        &self.input
    }

    /// Writes the model input for each of `crops` of `frame` into `out`, one after the other
    /// (`input.frame_len()` values each). The colour conversion runs once for all of them.
    pub fn run(
        &mut self,
        frame: &FrameView,
        crops: &[Crop],
        out: &mut [f32],
    ) -> Result<(), PreprocessError> {
        let format = frame.format;
        let fail = |reason| PreprocessError::convert(format, reason);
        let frame_len = self.input.frame_len();
        assert_eq!(
            out.len(),
            crops.len() * frame_len,
            "one model input per crop"
        );
        // 1. Colour: packed pixels of the model's channel order, at the frame's own size. The
        //    size stays, so no resampling happens here (a converter is exact then).
        let wanted = match (self.input.channels, self.options.channel_order) {
            (1, _) => PixelFormat::Gray8,
            (_, ChannelOrder::Rgb) => PixelFormat::Rgb,
            (_, ChannelOrder::Bgr) => PixelFormat::Bgr,
        };
        let row = format.width as usize * self.input.channels;
        if format.format == wanted && frame.strides.first() == Some(&(row as i32)) {
            let pixels = frame.planes[0]
                .get(..row * format.height as usize)
                .ok_or_else(|| fail("a plane shorter than its rows".into()))?;
            return self.fit(pixels, format, crops, out);
        }
        if let Some(source) = &frame.packed {
            let mut cache = self.source_cache.take();
            let mut fitted = Ok(());
            let converted = source.with_packed(wanted, &mut cache, &mut |pixels| {
                fitted = self.fit(pixels, format, crops, out);
            });
            self.source_cache = cache;
            converted.map_err(fail)?;
            return fitted;
        }
        let mut packed = std::mem::take(&mut self.packed);
        let result = pack(frame, wanted, &mut packed)
            .map_err(fail)
            .and_then(|()| self.fit(&packed, format, crops, out));
        self.packed = packed;
        result
    }

    /// Steps 2 and 3 for packed pixels of the model's channel order: crop, scale and place
    /// with fast_image_resize (antialiased bilinear, as PIL and torchvision resize for
    /// training) unless the crop is at the model's size already, then normalisation and
    /// layout.
    fn fit(
        &mut self,
        pixels: &[u8],
        format: FrameFormat,
        crops: &[Crop],
        out: &mut [f32],
    ) -> Result<(), PreprocessError> {
        let (width, height) = (format.width, format.height);
        let fail = |reason| PreprocessError::convert(format, reason);
        let pixel_type = match self.input.channels {
            1 => fr::PixelType::U8,
            _ => fr::PixelType::U8x3,
        };
        let src_image = fr::images::ImageRef::new(width, height, pixels, pixel_type)
            .map_err(|e| fail(e.to_string()))?;
        let frame_len = self.input.frame_len();
        for (crop, out) in crops.iter().zip(out.chunks_exact_mut(frame_len)) {
            let (src, dst) = crop_geometry(
                (width, height),
                *crop,
                (self.input.width as i32, self.input.height as i32),
                self.options.resize,
            )
            .ok_or_else(|| {
                let Crop::Region(r) = *crop else {
                    unreachable!("a whole frame has pixels")
                };
                PreprocessError::OutsideFrame {
                    x: r.x,
                    y: r.y,
                    w: r.w,
                    h: r.h,
                    width,
                    height,
                }
            })?;
            let (input_w, input_h) = (self.input.width as i32, self.input.height as i32);
            if (src.w, src.h, dst.w, dst.h) == (input_w, input_h, input_w, input_h) {
                // Pixels already at the model's size: no resampling, so none of its copy.
                let row = width as usize * self.input.channels;
                let start = src.y as usize * row + src.x as usize * self.input.channels;
                normalise(&pixels[start..], row, &self.input, &self.table, out);
                continue;
            }
            if dst.w as usize != self.input.width || dst.h as usize != self.input.height {
                for (i, p) in self.resized.iter_mut().enumerate() {
                    *p = self.border[i % self.border.len()];
                }
            }
            let mut dst_image = fr::images::Image::from_slice_u8(
                self.input.width as u32,
                self.input.height as u32,
                &mut self.resized,
                pixel_type,
            )
            .map_err(|e| fail(e.to_string()))?;
            let mut dst_view = fr::images::CroppedImageMut::new(
                &mut dst_image,
                dst.x as u32,
                dst.y as u32,
                dst.w as u32,
                dst.h as u32,
            )
            .map_err(|e| fail(e.to_string()))?;
            let options = fr::ResizeOptions::new()
                .resize_alg(fr::ResizeAlg::Convolution(fr::FilterType::Bilinear))
                .crop(src.x as f64, src.y as f64, src.w as f64, src.h as f64);
            self.resizer
                .resize(&src_image, &mut dst_view, &options)
                .map_err(|e| fail(e.to_string()))?;
            normalise(
                &self.resized,
                self.input.width * self.input.channels,
                &self.input,
                &self.table,
                out,
            );
        }
        Ok(())
    }
}

/// Packs `frame` as `to` (RGB, BGR or grey) into `out` without a converter: packed RGB
/// formats by picking their bytes, grey by dropping row padding. Other conversions need the
/// frame's [`PackedSource`] (in the plugin, GStreamer's converter).
fn pack(frame: &FrameView, to: PixelFormat, out: &mut Vec<u8>) -> Result<(), String> {
    let format = frame.format;
    let (width, height) = (format.width as usize, format.height as usize);
    let stride = *frame.strides.first().ok_or("a frame without planes")? as usize;
    let plane = frame.planes.first().ok_or("a frame without planes")?;
    let rows = |bytes: usize| (0..height).map(move |y| plane.get(y * stride..y * stride + bytes));
    out.clear();
    match (format.format.packed_rgb(), to) {
        (Some((size, [r, g, b])), PixelFormat::Rgb | PixelFormat::Bgr) => {
            let order = if to == PixelFormat::Rgb {
                [r, g, b]
            } else {
                [b, g, r]
            };
            out.reserve(width * height * 3);
            for row in rows(width * size) {
                let row = row.ok_or("a plane shorter than its rows")?;
                for pixel in row.chunks_exact(size) {
                    out.extend(order.map(|c| pixel[c]));
                }
            }
        }
        (None, PixelFormat::Gray8) if format.format == PixelFormat::Gray8 => {
            for row in rows(width) {
                out.extend_from_slice(row.ok_or("a plane shorter than its rows")?);
            }
        }
        _ => {
            return Err(format!(
                "no conversion of {:?} to {to:?} without a converter (give the frame a PackedSource)",
                format.format
            ));
        }
    }
    Ok(())
}

/// Packed 8-bit pixels (`channels` per pixel, rows `stride` bytes apart) to normalised floats
/// in the model's layout.
fn normalise(data: &[u8], stride: usize, input: &InputSpec, table: &[[f32; 256]], out: &mut [f32]) {
    let (c, h, w) = (input.channels, input.height, input.width);
    let out = &mut out[..c * h * w];
    let rows = (0..h).map(|y| &data[y * stride..y * stride + w * c]);
    match input.layout {
        Layout::Nhwc => {
            for (row, out) in rows.zip(out.chunks_exact_mut(w * c)) {
                for (dst, (i, p)) in out.iter_mut().zip(row.iter().enumerate()) {
                    *dst = table[i % c][*p as usize];
                }
            }
        }
        Layout::Nchw if c == 3 => {
            // One pass over the packed pixels, the three planes written side by side.
            let (plane0, rest) = out.split_at_mut(h * w);
            let (plane1, plane2) = rest.split_at_mut(h * w);
            let planes = (plane0.chunks_exact_mut(w))
                .zip(plane1.chunks_exact_mut(w))
                .zip(plane2.chunks_exact_mut(w));
            for (((out0, out1), out2), row) in planes.zip(rows) {
                let pixels = out0.iter_mut().zip(out1.iter_mut()).zip(out2.iter_mut());
                for (((v0, v1), v2), p) in pixels.zip(row.chunks_exact(3)) {
                    *v0 = table[0][p[0] as usize];
                    *v1 = table[1][p[1] as usize];
                    *v2 = table[2][p[2] as usize];
                }
            }
        }
        Layout::Nchw => {
            for (y, row) in rows.enumerate() {
                for (ch, table) in table.iter().enumerate() {
                    let plane = &mut out[ch * h * w + y * w..ch * h * w + (y + 1) * w];
                    for (dst, p) in plane.iter_mut().zip(row.iter().skip(ch).step_by(c)) {
                        *dst = table[*p as usize];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letterbox_and_crop_keep_the_aspect_ratio() {
        let (s, d) = geometry((1920, 1080), (224, 224), ResizeMode::Letterbox);
        assert_eq!(
            s,
            Rect {
                x: 0,
                y: 0,
                w: 1920,
                h: 1080
            }
        );
        assert_eq!(
            d,
            Rect {
                x: 0,
                y: 49,
                w: 224,
                h: 126
            }
        );
        let (s, d) = geometry((1920, 1080), (224, 224), ResizeMode::CenterCrop);
        assert_eq!(
            s,
            Rect {
                x: 420,
                y: 0,
                w: 1080,
                h: 1080
            }
        );
        assert_eq!(
            d,
            Rect {
                x: 0,
                y: 0,
                w: 224,
                h: 224
            }
        );
        let (s, d) = geometry((640, 480), (320, 240), ResizeMode::Stretch);
        assert_eq!((s.w, s.h, d.w, d.h), (640, 480, 320, 240));
    }

    #[test]
    fn mean_and_std_fit_the_channel_count() {
        let o = PreprocessOptions::default();
        assert_eq!(o.per_channel(3).unwrap().0, vec![0.485, 0.456, 0.406]);
        let (m, s) = o.per_channel(1).unwrap();
        assert!((m[0] - 0.449).abs() < 1e-6 && (s[0] - 0.226).abs() < 1e-6);
        let o = PreprocessOptions {
            mean: vec![0.5, 0.5],
            ..Default::default()
        };
        assert!(o.per_channel(3).unwrap_err().contains("mean has 2 values"));
    }

    /// Packed RGB formats are converted by picking their bytes: each gives the RGB frame's
    /// input; YUV without a converter is refused, naming the format.
    #[test]
    fn packed_formats_convert_without_a_converter() {
        let (w, h) = (16u32, 8u32);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 4,
            width: 4,
        };
        let mut pre = Preprocessor::new(PreprocessOptions::default(), input).unwrap();
        let mut want = vec![f32::NAN; input.frame_len()];
        pre.run(&FrameView::rgb(w, h, &rgb), &[Crop::Whole], &mut want)
            .unwrap();
        for format in [PixelFormat::Bgr, PixelFormat::Xrgb, PixelFormat::Bgra] {
            let (size, offsets) = format.packed_rgb().unwrap();
            let mut pixels = vec![0u8; (w * h) as usize * size];
            for (p, px) in rgb.chunks_exact(3).zip(pixels.chunks_exact_mut(size)) {
                for c in 0..3 {
                    px[offsets[c]] = p[c];
                }
            }
            let frame = FrameView::packed_frame(format, w, h, &pixels);
            let mut got = vec![f32::NAN; input.frame_len()];
            pre.run(&frame, &[Crop::Whole], &mut got).unwrap();
            assert_eq!(got, want, "{format:?}");
        }
        let nv12 = vec![128u8; (w * h * 3 / 2) as usize];
        let mut frame = FrameView::packed_frame(PixelFormat::Nv12, w, h, &nv12);
        frame.planes = vec![&nv12[..(w * h) as usize], &nv12[(w * h) as usize..]];
        frame.strides = vec![w as i32, w as i32];
        let err = pre
            .run(&frame, &[Crop::Whole], &mut want)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Nv12 16x8"), "{err}");
    }

    /// Pixels at the model's size (a whole frame, or a region of that size in a larger
    /// frame) are normalised where they lie, in every resize mode (none resamples them): each
    /// value is its pixel's, in either layout, for RGB and for a 1-channel model's grey.
    #[test]
    fn pixels_at_the_models_size_are_normalised_where_they_lie() {
        let (w, h) = (7usize, 5usize);
        let pixel = |x: usize, y: usize, c: usize| ((x * 31 + y * 17 + c * 101) % 256) as u8;
        // The region of the 7x5 input at (3, 2) in a 12x9 frame, and the whole 7x5 frame.
        for (frame_w, frame_h, x0, y0) in [(12, 9, 3, 2), (w, h, 0, 0)] {
            let crop = match (x0, y0) {
                (0, 0) => Crop::Whole,
                _ => Crop::Region(Rect {
                    x: x0 as i32,
                    y: y0 as i32,
                    w: w as i32,
                    h: h as i32,
                }),
            };
            for channels in [3, 1] {
                let packed: Vec<u8> = (0..frame_h * frame_w * channels)
                    .map(|i| {
                        let (at, c) = (i / channels, i % channels);
                        pixel(at % frame_w, at / frame_w, c)
                    })
                    .collect();
                let format = match channels {
                    3 => PixelFormat::Rgb,
                    _ => PixelFormat::Gray8,
                };
                let frame =
                    FrameView::packed_frame(format, frame_w as u32, frame_h as u32, &packed);
                for resize in [
                    ResizeMode::Stretch,
                    ResizeMode::Letterbox,
                    ResizeMode::CenterCrop,
                ] {
                    let options = PreprocessOptions {
                        resize,
                        ..Default::default()
                    };
                    let (mean, std) = options.per_channel(channels).unwrap();
                    let value = |p: u8, c: usize| (p as f32 * options.scale - mean[c]) / std[c];
                    for layout in [Layout::Nchw, Layout::Nhwc] {
                        let input = InputSpec {
                            layout,
                            channels,
                            height: h,
                            width: w,
                        };
                        let mut pre = Preprocessor::new(options.clone(), input).unwrap();
                        let mut got = vec![f32::NAN; input.frame_len()];
                        pre.run(&frame, &[crop], &mut got).unwrap();
                        for (y, x, c) in (0..h).flat_map(|y| {
                            (0..w).flat_map(move |x| (0..channels).map(move |c| (y, x, c)))
                        }) {
                            let at = match layout {
                                Layout::Nchw => (c * h + y) * w + x,
                                Layout::Nhwc => (y * w + x) * channels + c,
                            };
                            let want = value(pixel(x + x0, y + y0, c), c);
                            assert_eq!(
                                got[at], want,
                                "{format:?} {resize:?} {layout:?} {crop:?}: x {x} y {y} channel {c}"
                            );
                        }
                    }
                }
            }
        }
    }
}
