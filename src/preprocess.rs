// SPDX-License-Identifier: MPL-2.0
//! CPU preprocessing: any supported video frame to the model's float input.
//!
//! Colour conversion: frames already packed in the model's channel order are read where they
//! are; other packed RGB formats have their bytes picked; anything else goes through the
//! frame's `PackedSource`, which in the plugin is GStreamer's own `GstVideoConverter` (the code
//! behind `videoconvert`, reading every raw format with its strides and colorimetry). The crop, resize and letterbox border use fast_image_resize (antialiased
//! bilinear, as PIL and torchvision resize for training, and as the GPU kernels do); then the
//! per-channel normalisation `(pixel × scale − mean[c]) / std[c]`, through a 256-entry table
//! per channel, writes the model's layout.

use std::any::Any;

use fast_image_resize as fr;

use crate::engine::frame::{FrameFormat, FrameView, PixelFormat};

pub use crate::engine::compiler::spec::{
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
        let fail = |reason: String| PreprocessError::Convert {
            format: format.format,
            width: format.width,
            height: format.height,
            reason,
        };
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
    /// training), then normalisation and layout.
    fn fit(
        &mut self,
        pixels: &[u8],
        format: FrameFormat,
        crops: &[Crop],
        out: &mut [f32],
    ) -> Result<(), PreprocessError> {
        let (width, height) = (format.width, format.height);
        let fail = |reason: String| PreprocessError::Convert {
            format: format.format,
            width,
            height,
            reason,
        };
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
    for y in 0..h {
        let row = &data[y * stride..y * stride + w * c];
        match input.layout {
            Layout::Nhwc => {
                for (dst, (i, p)) in out[y * w * c..(y + 1) * w * c]
                    .iter_mut()
                    .zip(row.iter().enumerate())
                {
                    *dst = table[i % c][*p as usize];
                }
            }
            Layout::Nchw => {
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
    use gst_video::prelude::*;

    fn init() {
        let _ = gst::init();
    }

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

    /// A solid frame in `format` converted and normalised; returns the NCHW output.
    fn solid(
        format: gst_video::VideoFormat,
        rgb: [u8; 3],
        options: PreprocessOptions,
        layout: Layout,
    ) -> Vec<f32> {
        init();
        // Draw the colour in RGB, then let a converter produce the test format, as upstream would.
        let rgb_info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, 64, 48)
            .build()
            .unwrap();
        let mut rgb_buf = gst::Buffer::with_size(rgb_info.size()).unwrap();
        {
            let mut f =
                gst_video::VideoFrameRef::from_buffer_ref_writable(rgb_buf.make_mut(), &rgb_info)
                    .unwrap();
            let stride = f.plane_stride()[0] as usize;
            let data = f.plane_data_mut(0).unwrap();
            for y in 0..48 {
                for x in 0..64 {
                    data[y * stride + x * 3..y * stride + x * 3 + 3].copy_from_slice(&rgb);
                }
            }
        }
        let info = gst_video::VideoInfo::builder(format, 64, 48)
            .build()
            .unwrap();
        let mut buf = gst::Buffer::with_size(info.size()).unwrap();
        {
            let conv = gst_video::VideoConverter::new(&rgb_info, &info, None).unwrap();
            let src =
                gst_video::VideoFrameRef::from_buffer_ref_readable(&rgb_buf, &rgb_info).unwrap();
            let mut dst =
                gst_video::VideoFrameRef::from_buffer_ref_writable(buf.make_mut(), &info).unwrap();
            conv.frame_ref(&src, &mut dst);
        }
        let input = InputSpec {
            layout,
            channels: 3,
            height: 8,
            width: 8,
        };
        let mut pre = Preprocessor::new(options, input).unwrap();
        let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(&buf, &info).unwrap();
        let mut out = vec![f32::NAN; input.frame_len()];
        pre.run(
            &crate::video::view(&frame).unwrap(),
            &[Crop::Whole],
            &mut out,
        )
        .unwrap();
        out
    }

    #[test]
    fn every_format_normalises_to_the_same_values() {
        let expected = [
            (200.0 / 255.0 - 0.485) / 0.229,
            (100.0 / 255.0 - 0.456) / 0.224,
            (50.0 / 255.0 - 0.406) / 0.225,
        ];
        use gst_video::VideoFormat::*;
        for format in [Rgb, Bgr, Rgba, Bgra, Rgbx, Bgrx, Xrgb, Xbgr, Nv12, I420] {
            let out = solid(
                format,
                [200, 100, 50],
                PreprocessOptions::default(),
                Layout::Nchw,
            );
            // RGB formats are exact; YUV formats go through a lossy 8-bit 4:2:0 round trip.
            let levels = if matches!(format, Nv12 | I420) {
                4.0
            } else {
                0.5
            };
            let tol = levels / 255.0 / 0.224;
            for c in 0..3 {
                for v in &out[c * 64..(c + 1) * 64] {
                    assert!(
                        (v - expected[c]).abs() < tol,
                        "{format:?} channel {c}: {v} vs {}",
                        expected[c]
                    );
                }
            }
        }
    }

    #[test]
    fn bgr_order_and_nhwc_layout() {
        let options = PreprocessOptions {
            mean: vec![0.0],
            std: vec![1.0],
            channel_order: ChannelOrder::Bgr,
            ..Default::default()
        };
        let out = solid(
            gst_video::VideoFormat::Rgb,
            [255, 0, 51],
            options,
            Layout::Nhwc,
        );
        for px in out.chunks(3) {
            assert!(
                (px[0] - 0.2).abs() < 1e-6 && px[1].abs() < 1e-6 && (px[2] - 1.0).abs() < 1e-6,
                "{px:?}"
            );
        }
    }

    /// A region's model input is that of a frame made of the region's pixels alone, for
    /// each crop of one run (the colour conversion shared), and crops outside are refused.
    #[test]
    fn a_region_is_classified_as_if_it_were_the_frame() {
        init();
        let gray = |w: u32, h: u32, at: &dyn Fn(u32, u32) -> u8| {
            let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Gray8, w, h)
                .build()
                .unwrap();
            let mut buf = gst::Buffer::with_size(info.size()).unwrap();
            {
                let mut f =
                    gst_video::VideoFrameRef::from_buffer_ref_writable(buf.make_mut(), &info)
                        .unwrap();
                let stride = f.plane_stride()[0] as usize;
                let data = f.plane_data_mut(0).unwrap();
                for y in 0..h {
                    for x in 0..w {
                        data[y as usize * stride + x as usize] = at(x, y);
                    }
                }
            }
            (buf, info)
        };
        let pattern = |x: u32, y: u32| ((x * 7 + y * 13) % 256) as u8;
        let (frame_buf, frame_info) = gray(64, 48, &pattern);
        let frame =
            gst_video::VideoFrameRef::from_buffer_ref_readable(&frame_buf, &frame_info).unwrap();
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 8,
            width: 8,
        };
        for resize in [
            ResizeMode::Stretch,
            ResizeMode::Letterbox,
            ResizeMode::CenterCrop,
        ] {
            let options = PreprocessOptions {
                resize,
                ..Default::default()
            };
            let mut pre = Preprocessor::new(options, input).unwrap();
            let regions = [
                Rect {
                    x: 5,
                    y: 3,
                    w: 21,
                    h: 9,
                },
                Rect {
                    x: 40,
                    y: 30,
                    w: 24,
                    h: 18,
                },
            ];
            let crops: Vec<Crop> = regions.iter().map(|&r| Crop::Region(r)).collect();
            let mut out = vec![f32::NAN; 2 * input.frame_len()];
            pre.run(&crate::video::view(&frame).unwrap(), &crops, &mut out)
                .unwrap();
            for (r, got) in regions.iter().zip(out.chunks(input.frame_len())) {
                let (alone_buf, alone_info) = gray(r.w as u32, r.h as u32, &|x, y| {
                    pattern(x + r.x as u32, y + r.y as u32)
                });
                let alone =
                    gst_video::VideoFrameRef::from_buffer_ref_readable(&alone_buf, &alone_info)
                        .unwrap();
                let mut want = vec![f32::NAN; input.frame_len()];
                pre.run(
                    &crate::video::view(&alone).unwrap(),
                    &[Crop::Whole],
                    &mut want,
                )
                .unwrap();
                // Inside, the same values; the edge pixels' filter also reads the frame's
                // pixels around the region (as for center-crop), where the region alone has
                // none.
                let (_, dst) = geometry((r.w, r.h), (8, 8), resize);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let (y, x) = (((i / 8) % 8) as i32, (i % 8) as i32);
                    let edge = y == dst.y
                        || x == dst.x
                        || y == dst.y + dst.h - 1
                        || x == dst.x + dst.w - 1;
                    let tolerance = if edge { 1.0 } else { 1e-6 };
                    assert!(
                        (g - w).abs() <= tolerance,
                        "{resize:?} {r:?}: value {i} is {g}, alone {w}"
                    );
                }
            }
            let outside = Crop::Region(Rect {
                x: 64,
                y: 0,
                w: 5,
                h: 5,
            });
            let err = pre
                .run(
                    &crate::video::view(&frame).unwrap(),
                    &[outside],
                    &mut out[..input.frame_len()],
                )
                .unwrap_err();
            assert!(err.to_string().contains("outside the 64x48 frame"), "{err}");
        }
    }

    #[test]
    fn letterbox_border_is_the_mean() {
        init();
        // A white 64x16 frame letterboxed into 8x8: rows 0-2 and 5-7 are border.
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Gray8, 64, 16)
            .build()
            .unwrap();
        let mut buf = gst::Buffer::with_size(info.size()).unwrap();
        buf.make_mut().map_writable().unwrap().fill(255);
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 8,
            width: 8,
        };
        let options = PreprocessOptions {
            resize: ResizeMode::Letterbox,
            ..Default::default()
        };
        let mut pre = Preprocessor::new(options, input).unwrap();
        let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(&buf, &info).unwrap();
        let mut out = vec![f32::NAN; input.frame_len()];
        pre.run(
            &crate::video::view(&frame).unwrap(),
            &[Crop::Whole],
            &mut out,
        )
        .unwrap();
        for c in 0..3 {
            let plane = &out[c * 64..(c + 1) * 64];
            assert!(plane[0].abs() < 0.03, "border of channel {c}: {}", plane[0]);
            assert!(
                plane[4 * 8 + 4] > 2.0,
                "picture of channel {c}: {}",
                plane[36]
            );
        }
    }
}
