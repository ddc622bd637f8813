// SPDX-License-Identifier: MPL-2.0
//! Video frames as the engines read them, without GStreamer: the pixel formats the element
//! takes, a frame's format and colorimetry, and a view of its planes in memory.
//!
//! The plugin makes these of GStreamer's video frames (`video.rs` there); a program without
//! GStreamer makes them of its own images.

use std::any::Any;

/// The pixel formats the engines read: those of the element's caps, named as GStreamer
/// names them (`Debug` prints the same names in errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PixelFormat {
    /// Packed 8-bit R, G, B.
    Rgb,
    /// Packed 8-bit B, G, R.
    Bgr,
    /// Packed 8-bit R, G, B, alpha.
    Rgba,
    /// Packed 8-bit B, G, R, alpha.
    Bgra,
    /// Packed 8-bit R, G, B, padding.
    Rgbx,
    /// Packed 8-bit B, G, R, padding.
    Bgrx,
    /// Packed 8-bit padding, R, G, B.
    Xrgb,
    /// Packed 8-bit padding, B, G, R.
    Xbgr,
    /// 8-bit Y plane, then interleaved U, V at half size (what decoders give).
    Nv12,
    /// 8-bit Y, U and V planes, U and V at half size.
    I420,
    /// As NV12 with 16-bit samples holding 10 bits at the top (NVDEC's 10-bit output).
    P01010le,
    /// 8-bit grey.
    Gray8,
}

impl PixelFormat {
    /// Every format, in the order of the element's caps.
    pub const ALL: [PixelFormat; 12] = [
        PixelFormat::Rgb,
        PixelFormat::Bgr,
        PixelFormat::Rgba,
        PixelFormat::Bgra,
        PixelFormat::Rgbx,
        PixelFormat::Bgrx,
        PixelFormat::Xrgb,
        PixelFormat::Xbgr,
        PixelFormat::Nv12,
        PixelFormat::I420,
        PixelFormat::P01010le,
        PixelFormat::Gray8,
    ];

    /// The number of planes a frame of this format has.
    pub fn planes(self) -> usize {
        match self {
            PixelFormat::Nv12 | PixelFormat::P01010le => 2,
            PixelFormat::I420 => 3,
            _ => 1,
        }
    }

    /// For packed RGB formats: bytes per pixel and the byte offsets of R, G and B in a pixel.
    pub fn packed_rgb(self) -> Option<(usize, [usize; 3])> {
        match self {
            PixelFormat::Rgb => Some((3, [0, 1, 2])),
            PixelFormat::Bgr => Some((3, [2, 1, 0])),
            PixelFormat::Rgba | PixelFormat::Rgbx => Some((4, [0, 1, 2])),
            PixelFormat::Bgra | PixelFormat::Bgrx => Some((4, [2, 1, 0])),
            PixelFormat::Xrgb => Some((4, [1, 2, 3])),
            PixelFormat::Xbgr => Some((4, [3, 2, 1])),
            PixelFormat::Nv12 | PixelFormat::I420 | PixelFormat::P01010le | PixelFormat::Gray8 => {
                None
            }
        }
    }
}

/// How a YUV frame's values map to colours (unused for RGB and grey).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Colour {
    /// The matrix's Kr and Kb; `None`: BT.709 from 720 lines up, else BT.601, as GStreamer
    /// assumes.
    pub kr_kb: Option<(f64, f64)>,
    /// Full range (0–255) rather than studio range (16–235).
    pub full_range: bool,
    /// Chroma samples sit on the first luma column (horizontally cosited).
    pub h_cosited: bool,
    /// Chroma samples sit on the first luma row (vertically cosited).
    pub v_cosited: bool,
}

/// A frame's format, size and colorimetry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FrameFormat {
    /// The pixel format.
    pub format: PixelFormat,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// How YUV values map to colours.
    pub colour: Colour,
}

impl FrameFormat {
    /// Rows of the affine map from Y, U, V on the 8-bit scale (P010's samples read as
    /// value / 256) to R, G, B in 0..255: `rgb[c] = m[4c..4c + 4] · (y, u, v, 1)`, from the
    /// frame's colorimetry (matrix and range) as GStreamer's converter applies it. The CPU
    /// and GPU preprocessing both convert with it.
    pub fn yuv_to_rgb(&self) -> [f32; 12] {
        let (kr, kb) = self.colour.kr_kb.unwrap_or(if self.height >= 720 {
            (0.2126, 0.0722)
        } else {
            (0.299, 0.114)
        });
        let (kr, kb) = (kr as f32, kb as f32);
        let kg = 1.0 - kr - kb;
        // Y' = ys·(Y − y0), U' = cs·(U − 128), V' = cs·(V − 128).
        let (ys, y0, cs) = if self.colour.full_range {
            (1.0, 0.0, 1.0)
        } else {
            (255.0 / 219.0, 16.0, 255.0 / 224.0)
        };
        let rv = 2.0 * (1.0 - kr) * cs;
        let bu = 2.0 * (1.0 - kb) * cs;
        let gu = -2.0 * kb * (1.0 - kb) / kg * cs;
        let gv = -2.0 * kr * (1.0 - kr) / kg * cs;
        let row = |u: f32, v: f32| [ys, u, v, -ys * y0 - 128.0 * (u + v)];
        let [r, g, b] = [row(0.0, rv), row(gu, gv), row(bu, 0.0)];
        [
            r[0], r[1], r[2], r[3], g[0], g[1], g[2], g[3], b[0], b[1], b[2], b[3],
        ]
    }
}

/// A source that packs a frame's pixels itself, for formats the engines do not convert (the
/// plugin: GStreamer's own converter, which reads every raw format).
pub trait PackedSource {
    /// Calls `f` with the frame as packed pixels of `to` (`Rgb`, `Bgr` or `Gray8`), rows
    /// `width × channels` bytes apart without padding. `cache` keeps what the source makes
    /// for one format and size (a converter, a buffer) from one frame to the next: each CPU
    /// preprocessor keeps one.
    fn with_packed(
        &self,
        to: PixelFormat,
        cache: &mut Option<Box<dyn Any + Send>>,
        f: &mut dyn FnMut(&[u8]),
    ) -> Result<(), String>;
}

/// A video frame in host memory, as the engines read it.
pub struct FrameView<'a> {
    /// Format, size and colorimetry.
    pub format: FrameFormat,
    /// Each plane's bytes, from its first row to the end of its last.
    pub planes: Vec<&'a [u8]>,
    /// Bytes between rows, one per plane.
    pub strides: Vec<i32>,
    /// Packs the frame where the engines would not (see [`PackedSource`]); `None` for the
    /// formats they convert themselves: packed RGB to RGB or BGR, grey to grey.
    pub packed: Option<Box<dyn PackedSource + 'a>>,
}

impl std::fmt::Debug for FrameView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameView")
            .field("format", &self.format)
            .field("strides", &self.strides)
            .finish_non_exhaustive()
    }
}

impl<'a> FrameView<'a> {
    /// A frame of packed RGB pixels (`width × height × 3` bytes, no row padding).
    pub fn rgb(width: u32, height: u32, pixels: &'a [u8]) -> Self {
        Self::packed_frame(PixelFormat::Rgb, width, height, pixels)
    }

    /// A one-plane frame of `format` with rows of `width` pixels and no padding.
    pub fn packed_frame(format: PixelFormat, width: u32, height: u32, pixels: &'a [u8]) -> Self {
        let bytes_per_pixel = format.packed_rgb().map_or(1, |(n, _)| n);
        FrameView {
            format: FrameFormat {
                format,
                width,
                height,
                colour: Colour::default(),
            },
            planes: vec![pixels],
            strides: vec![(width as usize * bytes_per_pixel) as i32],
            packed: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rgb_of(m: &[f32; 12], yuv: [f32; 3]) -> [f32; 3] {
        std::array::from_fn(|c| {
            m[4 * c] * yuv[0] + m[4 * c + 1] * yuv[1] + m[4 * c + 2] * yuv[2] + m[4 * c + 3]
        })
    }

    #[test]
    fn bt709_limited_range_maps_black_white_and_red() {
        let mut nv12 = FrameFormat {
            format: PixelFormat::Nv12,
            width: 1920,
            height: 1080,
            colour: Colour {
                kr_kb: Some((0.2126, 0.0722)),
                ..Default::default()
            },
        };
        let m = nv12.yuv_to_rgb();
        let near = |a: [f32; 3], b: [f32; 3]| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1.0);
        assert!(near(rgb_of(&m, [16.0, 128.0, 128.0]), [0.0; 3]));
        assert!(near(rgb_of(&m, [235.0, 128.0, 128.0]), [255.0; 3]));
        // BT.709 red in limited range: Y 63, Cb 102, Cr 240.
        let red = rgb_of(&m, [63.0, 102.0, 240.0]);
        assert!(near(red, [255.0, 0.0, 0.0]), "{red:?}");
        // Without a matrix, 1080 lines are BT.709 too.
        nv12.colour.kr_kb = None;
        assert_eq!(nv12.yuv_to_rgb(), m);
    }
}
