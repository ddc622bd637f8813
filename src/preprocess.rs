// SPDX-License-Identifier: MPL-2.0
//! CPU preprocessing: any supported video frame to the model's float input.
//!
//! Colour conversion goes through GStreamer's own `GstVideoConverter` (the code behind
//! `videoconvert`), which reads every raw format with its strides and colorimetry into packed
//! RGB or grey; the crop, resize and letterbox border use fast_image_resize (antialiased
//! bilinear, as PIL and torchvision resize for training, and as the GPU kernels do); then the
//! per-channel normalisation `(pixel × scale − mean[c]) / std[c]`, through a 256-entry table
//! per channel, writes the model's layout.

use fast_image_resize as fr;
use gst_video::prelude::*;

/// How frames are fitted to the model's input size.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstTrtClassifyResizeMode")]
pub enum ResizeMode {
    /// Scales the frame to the input size, ignoring its aspect ratio.
    #[default]
    #[enum_value(
        name = "Stretch: scale to the input size, ignoring the aspect ratio",
        nick = "stretch"
    )]
    Stretch = 0,
    /// Keeps the aspect ratio and fills the rest with the mean colour, which normalises to about 0.
    #[enum_value(
        name = "Letterbox: keep the aspect ratio, pad the rest with the mean colour",
        nick = "letterbox"
    )]
    Letterbox = 1,
    /// Keeps the aspect ratio and cuts the middle of the frame to the input's proportions.
    #[enum_value(
        name = "Center crop: keep the aspect ratio, crop the middle of the frame",
        nick = "center-crop"
    )]
    CenterCrop = 2,
}

/// Order of the colour channels the model expects.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstTrtClassifyChannelOrder")]
pub enum ChannelOrder {
    /// Red, green, blue along the channel axis.
    #[default]
    #[enum_value(name = "RGB", nick = "rgb")]
    Rgb = 0,
    /// Blue, green, red along the channel axis.
    #[enum_value(name = "BGR", nick = "bgr")]
    Bgr = 1,
}

/// Memory layout of the model's image input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Planar: `[batch, channels, height, width]`.
    Nchw,
    /// Interleaved: `[batch, height, width, channels]`.
    Nhwc,
}

/// The model's image input, batch axis left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputSpec {
    /// Where the channel axis is.
    pub layout: Layout,
    /// Colour channels: 1 (grey) or 3.
    pub channels: usize,
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
}

impl Layout {
    /// The 4-D shape of `batch` images of `channels` × `height` × `width` in this layout.
    pub fn shape(self, batch: usize, channels: usize, height: usize, width: usize) -> [usize; 4] {
        match self {
            Layout::Nchw => [batch, channels, height, width],
            Layout::Nhwc => [batch, height, width, channels],
        }
    }
}

impl InputSpec {
    /// Values in one preprocessed frame.
    pub fn frame_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    /// The model input's shape for `batch` frames.
    pub fn batch_shape(&self, batch: usize) -> [usize; 4] {
        self.layout
            .shape(batch, self.channels, self.height, self.width)
    }
}

/// How frames become model input: `(pixel × scale − mean[c]) / std[c]` after the fit to size.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessOptions {
    /// Multiplies the 0..=255 pixel values before `mean` and `std`: 1/255 maps them to 0..=1.
    pub scale: f32,
    /// One value, or one per channel in the model's channel order.
    pub mean: Vec<f32>,
    /// One value, or one per channel in the model's channel order; all > 0.
    pub std: Vec<f32>,
    /// The order of the colour channels the model takes.
    pub channel_order: ChannelOrder,
    /// How frames are fitted to the input size.
    pub resize: ResizeMode,
}

impl Default for PreprocessOptions {
    fn default() -> Self {
        Self {
            scale: 1.0 / 255.0,
            mean: vec![0.485, 0.456, 0.406],
            std: vec![0.229, 0.224, 0.225],
            channel_order: ChannelOrder::Rgb,
            resize: ResizeMode::Stretch,
        }
    }
}

impl PreprocessOptions {
    /// The letterbox border's value in a channel of mean `mean`: the mean colour rounded to
    /// a pixel value, which normalises to about zero (the CPU and GPU paths share it).
    pub fn border_value(&self, mean: f32) -> u8 {
        (mean / self.scale).round().clamp(0.0, 255.0) as u8
    }

    /// Mean and std with one value per model channel. A single value applies to every channel;
    /// for a one-channel model, three values are averaged (the grey of an RGB mean).
    pub fn per_channel(&self, channels: usize) -> Result<(Vec<f32>, Vec<f32>), String> {
        let fit = |name: &str, values: &[f32]| -> Result<Vec<f32>, String> {
            match values.len() {
                n if n == channels => Ok(values.to_vec()),
                1 => Ok(vec![values[0]; channels]),
                3 if channels == 1 => Ok(vec![values.iter().sum::<f32>() / 3.0]),
                n => Err(format!(
                    "{name} has {n} values but the model takes {channels} channel(s): give 1 or {channels}"
                )),
            }
        };
        Ok((fit("mean", &self.mean)?, fit("std", &self.std)?))
    }
}

/// A rectangle in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    /// Left edge, in pixels; negative where a region starts left of the frame.
    pub x: i32,
    /// Top edge, in pixels; negative where a region starts above the frame.
    pub y: i32,
    /// Width in pixels.
    pub w: i32,
    /// Height in pixels.
    pub h: i32,
}

/// The part of a frame that one model input is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Crop {
    /// The whole frame.
    #[default]
    Whole,
    /// A rectangle of the frame, in the frame's pixels (a region of interest).
    Region(Rect),
}

impl Crop {
    /// The rectangle of a `width`×`height` frame this crop reads: a region is clipped to the
    /// frame; `None` when nothing of it is left. A region's own aspect ratio is what
    /// `ResizeMode` then keeps or stretches.
    pub fn within(&self, width: u32, height: u32) -> Option<Rect> {
        let (fw, fh) = (
            i64::from(width).min(i64::from(i32::MAX)),
            i64::from(height).min(i64::from(i32::MAX)),
        );
        let (x0, y0, x1, y1) = match *self {
            Crop::Whole => (0, 0, fw, fh),
            Crop::Region(r) => (
                i64::from(r.x).clamp(0, fw),
                i64::from(r.y).clamp(0, fh),
                (i64::from(r.x) + i64::from(r.w)).clamp(0, fw),
                (i64::from(r.y) + i64::from(r.h)).clamp(0, fh),
            ),
        };
        (x1 > x0 && y1 > y0).then(|| Rect {
            x: x0 as i32,
            y: y0 as i32,
            w: (x1 - x0) as i32,
            h: (y1 - y0) as i32,
        })
    }
}

/// Where the pixels of `crop` in a frame of size `frame` are read from (in the frame's
/// coordinates) and where they land in a model input of size `dst`; `None` when the crop
/// leaves nothing of the frame.
pub fn crop_geometry(
    frame: (u32, u32),
    crop: Crop,
    dst: (i32, i32),
    mode: ResizeMode,
) -> Option<(Rect, Rect)> {
    let area = crop.within(frame.0, frame.1)?;
    let (mut src, dst) = geometry((area.w, area.h), dst, mode);
    src.x += area.x;
    src.y += area.y;
    Some((src, dst))
}

/// Where the frame is read from and where it lands in the model input.
pub fn geometry(src: (i32, i32), dst: (i32, i32), mode: ResizeMode) -> (Rect, Rect) {
    let (sw, sh) = src;
    let (dw, dh) = dst;
    let full_src = Rect {
        x: 0,
        y: 0,
        w: sw,
        h: sh,
    };
    let full_dst = Rect {
        x: 0,
        y: 0,
        w: dw,
        h: dh,
    };
    match mode {
        ResizeMode::Stretch => (full_src, full_dst),
        ResizeMode::Letterbox => {
            let scale = f64::min(dw as f64 / sw as f64, dh as f64 / sh as f64);
            let w = ((sw as f64 * scale).round() as i32).clamp(1, dw);
            let h = ((sh as f64 * scale).round() as i32).clamp(1, dh);
            (
                full_src,
                Rect {
                    x: (dw - w) / 2,
                    y: (dh - h) / 2,
                    w,
                    h,
                },
            )
        }
        ResizeMode::CenterCrop => {
            let scale = f64::max(dw as f64 / sw as f64, dh as f64 / sh as f64);
            let w = ((dw as f64 / scale).round() as i32).clamp(1, sw);
            let h = ((dh as f64 / scale).round() as i32).clamp(1, sh);
            (
                Rect {
                    x: (sw - w) / 2,
                    y: (sh - h) / 2,
                    w,
                    h,
                },
                full_dst,
            )
        }
    }
}

/// Why a frame cannot be made into the model's input.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// GStreamer's converter cannot read the frame, or a buffer does not map.
    #[error("cannot convert {format:?} {width}x{height} to the model input: {reason}")]
    Convert {
        /// The frame's video format.
        format: gst_video::VideoFormat,
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

/// Colour conversion for one input format and size, made again when the caps change.
struct Converter {
    in_info: gst_video::VideoInfo,
    /// `None` when the frames already are tightly packed pixels of the wanted format.
    converter: Option<gst_video::VideoConverter>,
    packed_info: gst_video::VideoInfo,
    packed: gst::Buffer,
}

/// The CPU preprocessing for one model input, keeping its tables and buffers between frames.
pub struct Preprocessor {
    options: PreprocessOptions,
    input: InputSpec,
    /// `table[c][p]` is the normalised value of pixel value `p` in channel `c`.
    table: Vec<[f32; 256]>,
    converter: Option<Converter>,
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
            converter: None,
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
        frame: &gst_video::VideoFrameRef<&gst::BufferRef>,
        crops: &[Crop],
        out: &mut [f32],
    ) -> Result<(), PreprocessError> {
        let info = frame.info();
        let fail = |reason: String| PreprocessError::Convert {
            format: info.format(),
            width: info.width(),
            height: info.height(),
            reason,
        };
        if self.converter.as_ref().is_none_or(|c| &c.in_info != info) {
            self.converter = Some(self.make_converter(info).map_err(fail)?);
        }
        let converter = self.converter.as_mut().expect("just made");

        // 1. Colour: packed pixels of the model's channel order, at the frame's own size. The
        //    size stays, so no resampling happens here (GStreamer's converter is exact then).
        let converted;
        let pixels: &[u8] = match &converter.converter {
            None => frame.plane_data(0).map_err(|e| fail(e.to_string()))?,
            Some(c) => {
                let packed = converter.packed.make_mut();
                let mut dest = gst_video::VideoFrameRef::from_buffer_ref_writable(
                    packed,
                    &converter.packed_info,
                )
                .map_err(|e| fail(e.to_string()))?;
                c.frame_ref(frame, &mut dest);
                drop(dest);
                converted = converter
                    .packed
                    .map_readable()
                    .map_err(|e| fail(e.to_string()))?;
                converted.as_slice()
            }
        };

        // 2. Size: crop, scale and place with fast_image_resize (antialiased bilinear, as
        //    PIL and torchvision resize for training); 3. normalisation and layout.
        let pixel_type = match self.input.channels {
            1 => fr::PixelType::U8,
            _ => fr::PixelType::U8x3,
        };
        let src_image = fr::images::ImageRef::new(info.width(), info.height(), pixels, pixel_type)
            .map_err(|e| fail(e.to_string()))?;
        let frame_len = self.input.frame_len();
        assert_eq!(
            out.len(),
            crops.len() * frame_len,
            "one model input per crop"
        );
        for (crop, out) in crops.iter().zip(out.chunks_exact_mut(frame_len)) {
            let (src, dst) = crop_geometry(
                (info.width(), info.height()),
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
                    width: info.width(),
                    height: info.height(),
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

    fn make_converter(&self, in_info: &gst_video::VideoInfo) -> Result<Converter, String> {
        let format = match (self.input.channels, self.options.channel_order) {
            (1, _) => gst_video::VideoFormat::Gray8,
            (_, ChannelOrder::Rgb) => gst_video::VideoFormat::Rgb,
            (_, ChannelOrder::Bgr) => gst_video::VideoFormat::Bgr,
        };
        let (width, height) = (in_info.width(), in_info.height());
        let channels = self.input.channels as i32;
        // Rows without padding, as fast_image_resize reads them.
        let stride = [width as i32 * channels];
        // Same rate, aspect and interlacing as the input: the converter only changes colour.
        let packed_info = gst_video::VideoInfo::builder(format, width, height)
            .fps(in_info.fps())
            .par(in_info.par())
            .interlace_mode(in_info.interlace_mode())
            .stride(&stride)
            .build()
            .map_err(|e| e.to_string())?;
        let already_packed = in_info.format() == format && in_info.stride()[0] == stride[0];
        let converter = if already_packed {
            None
        } else {
            let mut config = gst_video::VideoConverterConfig::new();
            config.set_dither_method(gst_video::VideoDitherMethod::None);
            config.set_threads(1);
            Some(
                gst_video::VideoConverter::new(in_info, &packed_info, Some(config))
                    .map_err(|e| e.to_string())?,
            )
        };
        let packed = gst::Buffer::with_size(packed_info.size()).map_err(|e| e.to_string())?;
        Ok(Converter {
            in_info: in_info.clone(),
            converter,
            packed_info,
            packed,
        })
    }
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
        pre.run(&frame, &[Crop::Whole], &mut out).unwrap();
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
            pre.run(&frame, &crops, &mut out).unwrap();
            for (r, got) in regions.iter().zip(out.chunks(input.frame_len())) {
                let (alone_buf, alone_info) = gray(r.w as u32, r.h as u32, &|x, y| {
                    pattern(x + r.x as u32, y + r.y as u32)
                });
                let alone =
                    gst_video::VideoFrameRef::from_buffer_ref_readable(&alone_buf, &alone_info)
                        .unwrap();
                let mut want = vec![f32::NAN; input.frame_len()];
                pre.run(&alone, &[Crop::Whole], &mut want).unwrap();
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
                .run(&frame, &[outside], &mut out[..input.frame_len()])
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
        pre.run(&frame, &[Crop::Whole], &mut out).unwrap();
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
