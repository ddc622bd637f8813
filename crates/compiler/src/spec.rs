// SPDX-License-Identifier: MPL-2.0
//! What a model's image input is and how frames are fitted to it: the description that the
//! compiler, the runtimes and the preprocessing of every backend share.

/// How frames are fitted to the model's input size.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default)]
#[repr(u32)]
pub enum ResizeMode {
    /// Scales the frame to the input size, ignoring its aspect ratio.
    #[default]
    Stretch = 0,
    /// Keeps the aspect ratio and fills the rest with the mean colour, which normalises to about 0.
    Letterbox = 1,
    /// Keeps the aspect ratio and cuts the middle of the frame to the input's proportions.
    CenterCrop = 2,
}

/// Order of the colour channels the model expects.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default)]
#[repr(u32)]
pub enum ChannelOrder {
    /// Red, green, blue along the channel axis.
    #[default]
    Rgb = 0,
    /// Blue, green, red along the channel axis.
    Bgr = 1,
}

/// Memory layout of the model's image input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
