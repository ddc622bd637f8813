// SPDX-License-Identifier: MPL-2.0
//! CPU preprocessing: any supported video frame to the model's float input.
//!
//! Colour conversion: frames already packed in the model's channel order are read where they
//! are; other packed RGB formats have their bytes picked; NV12 and I420 are resized first and
//! converted at the model's size (`yuv`); anything else goes through the frame's
//! `PackedSource`, which in the plugin is GStreamer's own `GstVideoConverter` (the code
//! behind `videoconvert`, reading every raw format with its strides and colorimetry). The
//! crop, resize and letterbox border use fast_image_resize (antialiased bilinear, as PIL and
//! torchvision resize for training, and as the GPU kernels do), except for pixels already at
//! the model's size, which are read where they lie; then the per-channel normalisation
//! `(pixel × scale − mean[c]) / std[c]`, through a 256-entry table per channel, writes the
//! model's layout.

mod yuv;

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
    /// A 4:2:0 frame's planes at the model's size, before their conversion.
    yuv_planes: yuv::Resized,
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
            yuv_planes: yuv::Resized::default(),
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
        if self.input.channels == 3
            && let Some(yuv) = yuv::Yuv420::of(frame, wanted == PixelFormat::Bgr).map_err(fail)?
        {
            return self.fit_yuv(&yuv, format, crops, out);
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
            let (src, dst) = self.place(format, *crop)?;
            let (input_w, input_h) = (self.input.width as i32, self.input.height as i32);
            if (src.w, src.h, dst.w, dst.h) == (input_w, input_h, input_w, input_h) {
                // Pixels already at the model's size: no resampling, so none of its copy.
                let row = width as usize * self.input.channels;
                let start = src.y as usize * row + src.x as usize * self.input.channels;
                normalise(&pixels[start..], row, &self.input, &self.table, out);
                continue;
            }
            self.fill_border(dst);
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

    /// Steps 1 and 2 together for an NV12 or I420 frame: each crop's planes resampled to
    /// the model's size, then converted to RGB (see `yuv`); then normalisation and layout.
    fn fit_yuv(
        &mut self,
        frame: &yuv::Yuv420,
        format: FrameFormat,
        crops: &[Crop],
        out: &mut [f32],
    ) -> Result<(), PreprocessError> {
        let row = self.input.width * 3;
        let frame_len = self.input.frame_len();
        for (crop, out) in crops.iter().zip(out.chunks_exact_mut(frame_len)) {
            let (src, dst) = self.place(format, *crop)?;
            self.fill_border(dst);
            let at = dst.y as usize * row + dst.x as usize * 3;
            frame
                .resize_to_rgb(
                    src,
                    (dst.w as u32, dst.h as u32),
                    &mut self.yuv_planes,
                    &mut self.resized[at..],
                    row,
                )
                .map_err(|reason| PreprocessError::convert(format, reason))?;
            normalise(&self.resized, row, &self.input, &self.table, out);
        }
        Ok(())
    }

    /// Where `crop` of a frame of `format` is read from and where it lands in the model
    /// input; an error for a region outside the frame, or a frame without pixels.
    fn place(&self, format: FrameFormat, crop: Crop) -> Result<(Rect, Rect), PreprocessError> {
        let (width, height) = (format.width, format.height);
        crop_geometry(
            (width, height),
            crop,
            (self.input.width as i32, self.input.height as i32),
            self.options.resize,
        )
        .ok_or_else(|| match crop {
            Crop::Region(r) => PreprocessError::OutsideFrame {
                x: r.x,
                y: r.y,
                w: r.w,
                h: r.h,
                width,
                height,
            },
            Crop::Whole => PreprocessError::convert(format, "a frame without pixels".into()),
        })
    }

    /// Letterbox borders around `dst` where it does not fill the model input.
    fn fill_border(&mut self, dst: Rect) {
        if dst.w as usize != self.input.width || dst.h as usize != self.input.height {
            for (i, p) in self.resized.iter_mut().enumerate() {
                *p = self.border[i % self.border.len()];
            }
        }
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
        Layout::Nhwc if c == 3 => {
            for (row, out) in rows.zip(out.chunks_exact_mut(w * c)) {
                for (v, p) in out.chunks_exact_mut(3).zip(row.chunks_exact(3)) {
                    v[0] = table[0][p[0] as usize];
                    v[1] = table[1][p[1] as usize];
                    v[2] = table[2][p[2] as usize];
                }
            }
        }
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
    /// input; P010 without a converter is refused, naming the format.
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
        let p010 = vec![128u8; (w * h * 3) as usize];
        let mut frame = FrameView::packed_frame(PixelFormat::P01010le, w, h, &p010);
        frame.planes = vec![&p010[..(w * h * 2) as usize], &p010[(w * h * 2) as usize..]];
        frame.strides = vec![w as i32 * 2, w as i32 * 2];
        let err = pre
            .run(&frame, &[Crop::Whole], &mut want)
            .unwrap_err()
            .to_string();
        assert!(err.contains("P01010le 16x8"), "{err}");
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

    /// A 4:2:0 frame's planes (`width × height`, chroma at half size, rounded up).
    struct Yuv {
        width: u32,
        height: u32,
        y: Vec<u8>,
        u: Vec<u8>,
        v: Vec<u8>,
    }

    /// A plane of `f(x, y)` for each sample.
    fn plane(width: u32, height: u32, f: &dyn Fn(u32, u32) -> u32) -> Vec<u8> {
        (0..height)
            .flat_map(|y| (0..width).map(move |x| (x, y)))
            .map(|(x, y)| f(x, y).min(255) as u8)
            .collect()
    }

    impl Yuv {
        /// Ramps in all three planes, none leaving the RGB cube for frames up to 96×64
        /// (where clipping before and after the resize would differ).
        fn ramps(width: u32, height: u32) -> Self {
            let (cw, ch) = (width.div_ceil(2), height.div_ceil(2));
            Yuv {
                width,
                height,
                y: plane(width, height, &|x, y| 60 + x + y / 2),
                u: plane(cw, ch, &|x, _| 104 + x),
                v: plane(cw, ch, &|_, y| 148 - y),
            }
        }

        /// Flat grey luma under steep chroma ramps (3 levels a sample, U across and V down):
        /// a quarter chroma sample's shift moves blue or red by 1.2 levels or more.
        fn chroma_ramps(width: u32, height: u32) -> Self {
            let (cw, ch) = (width.div_ceil(2), height.div_ceil(2));
            Yuv {
                width,
                height,
                y: plane(width, height, &|_, _| 126),
                u: plane(cw, ch, &|x, _| 80 + 3 * x),
                v: plane(cw, ch, &|_, y| 92 + 3 * y),
            }
        }

        /// The planes laid out as `format` with `pad` bytes after each row.
        fn planes(&self, format: PixelFormat, pad: usize) -> (Vec<Vec<u8>>, Vec<i32>) {
            let padded = |plane: &[u8], row: usize| -> Vec<u8> {
                plane
                    .chunks_exact(row)
                    .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0xEE, pad)))
                    .collect()
            };
            let (w, cw) = (self.width as usize, self.width.div_ceil(2) as usize);
            let luma = padded(&self.y, w);
            match format {
                PixelFormat::Nv12 => {
                    let uv: Vec<u8> = (self.u.iter().zip(&self.v))
                        .flat_map(|(&u, &v)| [u, v])
                        .collect();
                    let strides = vec![(w + pad) as i32, (2 * cw + pad) as i32];
                    (vec![luma, padded(&uv, 2 * cw)], strides)
                }
                _ => {
                    let strides = vec![(w + pad) as i32, (cw + pad) as i32, (cw + pad) as i32];
                    (
                        vec![luma, padded(&self.u, cw), padded(&self.v, cw)],
                        strides,
                    )
                }
            }
        }

        /// The frame converted to packed RGB at its own size, as the preprocessing used to
        /// before resizing: chroma interpolated linearly at each luma pixel (sited as
        /// GStreamer's converter and the GPU kernel site it), each pixel converted with
        /// `format`'s matrix.
        fn to_rgb(&self, format: &FrameFormat) -> Vec<u8> {
            let m = format.yuv_to_rgb();
            let (cw, ch) = (
                self.width.div_ceil(2) as i64,
                self.height.div_ceil(2) as i64,
            );
            let pos = |v: u32, cosited: bool| {
                if cosited {
                    v as f32 * 0.5
                } else {
                    (v as f32 - 0.5) * 0.5
                }
            };
            let chroma = |plane: &[u8], x: u32, y: u32| -> f32 {
                let (cx, cy) = (
                    pos(x, format.colour.h_cosited),
                    pos(y, format.colour.v_cosited),
                );
                let (x0, y0) = (cx.floor(), cy.floor());
                let (fx, fy) = (cx - x0, cy - y0);
                let at = |i: i64, j: i64| {
                    let (i, j) = (i.clamp(0, cw - 1), j.clamp(0, ch - 1));
                    f32::from(plane[(j * cw + i) as usize])
                };
                let (x0, y0) = (x0 as i64, y0 as i64);
                (1.0 - fy) * ((1.0 - fx) * at(x0, y0) + fx * at(x0 + 1, y0))
                    + fy * ((1.0 - fx) * at(x0, y0 + 1) + fx * at(x0 + 1, y0 + 1))
            };
            let mut rgb = Vec::new();
            for y in 0..self.height {
                for x in 0..self.width {
                    let yuv = [
                        f32::from(self.y[(y * self.width + x) as usize]),
                        chroma(&self.u, x, y),
                        chroma(&self.v, x, y),
                    ];
                    for c in 0..3 {
                        let v = m[4 * c] * yuv[0]
                            + m[4 * c + 1] * yuv[1]
                            + m[4 * c + 2] * yuv[2]
                            + m[4 * c + 3];
                        rgb.push(v.clamp(0.0, 255.0).round() as u8);
                    }
                }
            }
            rgb
        }
    }

    /// How far the model input of `picture` (NV12 and I420, rows padded or not) lies from
    /// that of the same picture converted to RGB first, in 8-bit levels: the largest and
    /// mean distance, and each channel's mean offset inside the picture (the edge pixels'
    /// filters read clamped chroma differently). Checks that the layouts agree.
    fn off_from_rgb_first(
        picture: &Yuv,
        colour: crate::frame::Colour,
        resize: ResizeMode,
        crop: Crop,
        what: &str,
    ) -> (f32, f32, [f32; 3]) {
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 24,
            width: 20,
        };
        let plane_len = 24 * 20;
        let options = PreprocessOptions {
            resize,
            ..Default::default()
        };
        let level = 1.0 / 255.0 / 0.225;
        let mut pre = Preprocessor::new(options, input).unwrap();
        let (width, height) = (picture.width, picture.height);
        let format = FrameFormat {
            format: PixelFormat::Rgb,
            width,
            height,
            colour,
        };
        let rgb = picture.to_rgb(&format);
        let rgb_frame = FrameView {
            format,
            ..FrameView::rgb(width, height, &rgb)
        };
        let mut want = vec![f32::NAN; input.frame_len()];
        pre.run(&rgb_frame, &[crop], &mut want).unwrap();
        let mut inputs = Vec::new();
        for (yuv_format, pad) in [
            (PixelFormat::Nv12, 0),
            (PixelFormat::I420, 0),
            (PixelFormat::Nv12, 6),
            (PixelFormat::I420, 3),
        ] {
            let (planes, strides) = picture.planes(yuv_format, pad);
            let frame = FrameView {
                format: FrameFormat {
                    format: yuv_format,
                    ..format
                },
                planes: planes.iter().map(Vec::as_slice).collect(),
                strides,
                packed: None,
            };
            let mut values = vec![f32::NAN; input.frame_len()];
            pre.run(&frame, &[crop], &mut values).unwrap();
            inputs.push(values);
        }
        // Interleaved or planar chroma, padded rows or not: the same values.
        for (i, (format, pad)) in [("I420", 0), ("NV12", 6), ("I420", 3)].iter().enumerate() {
            assert!(
                inputs[i + 1] == inputs[0],
                "{what}: {format} padded by {pad} differs from NV12"
            );
        }
        let got = inputs.swap_remove(0);
        let (_, dst) = crop_geometry((width, height), crop, (20, 24), resize).unwrap();
        let (mut max, mut sum, mut bias, mut inside) = (0.0f32, 0.0, [0.0f32; 3], 0.0);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let off = (g - w) / level;
            max = max.max(off.abs());
            sum += off.abs();
            let (c, y, x) = (i / plane_len, (i % plane_len / 20) as i32, (i % 20) as i32);
            let (x0, y0) = (dst.x, dst.y);
            if y > y0 && y < y0 + dst.h - 1 && x > x0 && x < x0 + dst.w - 1 {
                bias[c] += off;
                inside += f32::from(u8::from(c == 0));
            }
        }
        (max, sum / got.len() as f32, bias.map(|b| b / inside))
    }

    /// NV12 and I420 frames, resized in YUV and converted at the model's size, give the
    /// model input of the same frame converted to RGB first and then resized: within 2.5
    /// levels (rounding to 8 bits after each stage) and 0.75 on average, for every siting,
    /// crop, resize mode and size, odd and one-pixel ones included; row padding and layout
    /// do not matter.
    #[test]
    fn yuv_frames_resized_then_converted_match_converted_then_resized() {
        let region = Crop::Region(Rect {
            x: 7,
            y: 3,
            w: 13,
            h: 11,
        });
        let sizes = [(96, 64), (33, 25), (20, 24), (1, 1), (1, 7), (9, 1), (3, 2)];
        for (width, height) in sizes {
            let picture = Yuv::ramps(width, height);
            let crops = match width >= 20 {
                true => vec![Crop::Whole, region],
                false => vec![Crop::Whole],
            };
            for (h_cosited, v_cosited) in
                [(true, false), (false, false), (true, true), (false, true)]
            {
                let colour = crate::frame::Colour {
                    h_cosited,
                    v_cosited,
                    ..Default::default()
                };
                for resize in [
                    ResizeMode::Stretch,
                    ResizeMode::Letterbox,
                    ResizeMode::CenterCrop,
                ] {
                    for &crop in &crops {
                        let what = format!(
                            "{width}x{height} cosited {h_cosited}/{v_cosited} {resize:?} {crop:?}"
                        );
                        let (max, mean, _) =
                            off_from_rgb_first(&picture, colour, resize, crop, &what);
                        assert!(
                            max <= 2.5 && mean <= 0.75,
                            "{what}: off by {max:.2} levels at most, {mean:.2} on average"
                        );
                    }
                }
            }
        }
    }

    /// Crops of one call are each what they are alone: the planes' buffers and the copies
    /// of edge chroma carry nothing from one crop to the next.
    #[test]
    fn yuv_crops_of_one_call_are_each_what_they_are_alone() {
        let picture = Yuv::ramps(33, 25);
        let format = FrameFormat {
            format: PixelFormat::I420,
            width: 33,
            height: 25,
            colour: crate::frame::Colour {
                h_cosited: true,
                v_cosited: true,
                ..Default::default()
            },
        };
        let input = InputSpec {
            layout: Layout::Nhwc,
            channels: 3,
            height: 6,
            width: 5,
        };
        // The whole frame (its chroma copied with repeated edges), a region inside, one at
        // the bottom right corner.
        let crops = [
            Crop::Whole,
            Crop::Region(Rect {
                x: 4,
                y: 5,
                w: 9,
                h: 7,
            }),
            Crop::Region(Rect {
                x: 20,
                y: 14,
                w: 13,
                h: 11,
            }),
        ];
        for yuv_format in [PixelFormat::Nv12, PixelFormat::I420] {
            let (planes, strides) = picture.planes(yuv_format, 2);
            let frame = FrameView {
                format: FrameFormat {
                    format: yuv_format,
                    ..format
                },
                planes: planes.iter().map(Vec::as_slice).collect(),
                strides,
                packed: None,
            };
            let options = PreprocessOptions {
                resize: ResizeMode::Letterbox,
                ..Default::default()
            };
            let mut pre = Preprocessor::new(options, input).unwrap();
            let mut together = vec![f32::NAN; 3 * input.frame_len()];
            pre.run(&frame, &crops, &mut together).unwrap();
            for (crop, got) in crops.iter().zip(together.chunks(input.frame_len())) {
                let mut alone = vec![f32::NAN; input.frame_len()];
                pre.run(&frame, &[*crop], &mut alone).unwrap();
                assert!(got == alone, "{yuv_format:?} {crop:?}: differs from alone");
            }
        }
    }

    /// The chroma lands where the frame's siting puts it, up to the frame's edges: on steep
    /// chroma ramps the colours inside are those of the frame converted first, on average
    /// to 0.6 levels (rounding on these regular ramps moves them by up to 0.45; a quarter
    /// sample's shift would move them by 1.2 levels or more).
    #[test]
    fn yuv_chroma_is_resized_at_its_siting() {
        for (width, height) in [(64, 48), (63, 47), (30, 20)] {
            let picture = Yuv::chroma_ramps(width, height);
            for (h_cosited, v_cosited) in
                [(true, false), (false, false), (true, true), (false, true)]
            {
                let colour = crate::frame::Colour {
                    h_cosited,
                    v_cosited,
                    ..Default::default()
                };
                let region = Crop::Region(Rect {
                    x: 5,
                    y: 3,
                    w: 24,
                    h: 16,
                });
                for crop in [Crop::Whole, region] {
                    let what = format!("{width}x{height} cosited {h_cosited}/{v_cosited} {crop:?}");
                    let (_, _, bias) =
                        off_from_rgb_first(&picture, colour, ResizeMode::Stretch, crop, &what);
                    assert!(
                        bias.iter().all(|b| b.abs() <= 0.6),
                        "{what}: inside, off by {bias:.2?} levels on average (R, G, B)"
                    );
                }
            }
        }
    }

    /// A 4:2:0 frame whose planes do not hold their rows, whose stride is shorter than a
    /// row, whose NV12 chroma rows split a U, V pair, or that has no pixels, is an error
    /// naming the frame, not a read past the plane or a panic; a plane whose last row stops
    /// at its pixels is read as the padded one.
    #[test]
    fn malformed_yuv_frames_are_errors() {
        let picture = Yuv::ramps(16, 8);
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 4,
            width: 4,
        };
        let mut pre = Preprocessor::new(PreprocessOptions::default(), input).unwrap();
        let mut out = vec![0.0; input.frame_len()];
        // Cosited: whole frames copy their chroma with repeated edges, regions do not; both
        // must check the same.
        let format = FrameFormat {
            format: PixelFormat::I420,
            width: 16,
            height: 8,
            colour: crate::frame::Colour {
                h_cosited: true,
                ..Default::default()
            },
        };
        let region = Crop::Region(Rect {
            x: 0,
            y: 0,
            w: 8,
            h: 4,
        });
        let mut errors = |frame: &FrameView, wanted: &str| {
            for crop in [Crop::Whole, region] {
                let err = pre.run(frame, &[crop], &mut out).unwrap_err().to_string();
                let name = format!("{:?} 16x8", frame.format.format);
                assert!(
                    err.contains(&name) && err.contains(wanted),
                    "{crop:?}: {err}"
                );
            }
        };
        let (planes, strides) = picture.planes(PixelFormat::I420, 0);
        let short = FrameView {
            format,
            planes: vec![&planes[0], &planes[1][..10], &planes[2]],
            strides: strides.clone(),
            packed: None,
        };
        errors(
            &short,
            "a plane of 10 bytes is shorter than its 4 rows of 8 bytes",
        );
        let narrow = FrameView {
            format,
            planes: planes.iter().map(Vec::as_slice).collect(),
            strides: vec![12, 8, 8],
            packed: None,
        };
        errors(&narrow, "stride of 12 bytes is shorter than its rows of 16");
        let missing = FrameView {
            format,
            planes: planes[..2].iter().map(Vec::as_slice).collect(),
            strides: strides[..2].to_vec(),
            packed: None,
        };
        errors(&missing, "the I420 frame has no plane 2");
        // NV12's interleaved chroma rows must hold whole U, V pairs.
        let nv12 = FrameFormat {
            format: PixelFormat::Nv12,
            ..format
        };
        let (planes, _) = picture.planes(PixelFormat::Nv12, 1);
        let odd = FrameView {
            format: nv12,
            planes: planes.iter().map(Vec::as_slice).collect(),
            strides: vec![17, 17],
            packed: None,
        };
        errors(
            &odd,
            "stride of 17 bytes is not a whole number of 2-byte samples",
        );
        // A frame without pixels, in YUV and in RGB.
        for format in [PixelFormat::Nv12, PixelFormat::Rgb] {
            let empty = FrameView::packed_frame(format, 0, 0, &[]);
            let err = pre.run(&empty, &[Crop::Whole], &mut out).unwrap_err();
            assert!(err.to_string().contains("a frame without pixels"), "{err}");
        }
        // Rows padded to 24 bytes, the last plane rows' padding cut off: the same values.
        let (planes, strides) = picture.planes(PixelFormat::Nv12, 8);
        let padded = FrameView {
            format: nv12,
            planes: planes.iter().map(Vec::as_slice).collect(),
            strides: strides.clone(),
            packed: None,
        };
        let cut = FrameView {
            format: nv12,
            planes: planes.iter().map(|p| &p[..p.len() - 8]).collect(),
            strides,
            packed: None,
        };
        for crop in [Crop::Whole, region] {
            let mut want = vec![f32::NAN; input.frame_len()];
            pre.run(&padded, &[crop], &mut want).unwrap();
            let mut got = vec![f32::NAN; input.frame_len()];
            pre.run(&cut, &[crop], &mut got).unwrap();
            assert!(got == want, "{crop:?}: the cut last rows read otherwise");
        }
    }
}
