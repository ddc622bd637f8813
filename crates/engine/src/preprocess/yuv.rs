// SPDX-License-Identifier: MPL-2.0
//! 8-bit 4:2:0 frames (NV12, I420) resized before their colour conversion.
//!
//! Each plane is resampled to the model's size where it is: luma from the crop, chroma from
//! the same crop in its own half-size grid and siting. Only the model-sized result is then
//! converted to RGB with the frame's matrix. Resampling and the colour matrix are both
//! linear, so this is the conversion of the whole frame followed by the resize, up to
//! rounding and clipping; but it converts a 224×224 picture instead of a 1280×720 one, and
//! reads each chroma sample once instead of upsampling it first.

use fast_image_resize as fr;
use fr::images::{TypedCroppedImage, TypedImage, TypedImageRef};
use fr::pixels::{InnerPixel, U8, U8x2};

use crate::compiler::spec::Rect;
use crate::frame::{FrameView, PixelFormat};

/// A plane's visible pixels; the row padding lies outside it, so the filter never reads it.
type Plane<'a, P> = TypedCroppedImage<'a, TypedImageRef<'a, P>>;

/// A plane's bytes and the bytes between its rows, checked to hold its rows.
#[derive(Clone, Copy)]
struct Raw<'a> {
    data: &'a [u8],
    stride: usize,
}

impl<'a> Raw<'a> {
    /// `data` with rows `stride` bytes apart: `rows` rows of `width` samples of `sample`
    /// bytes each, the last row's padding optional.
    fn new(
        data: &'a [u8],
        stride: i32,
        width: u32,
        rows: u32,
        sample: usize,
    ) -> Result<Self, String> {
        let row = width as usize * sample;
        if stride < 0 || (stride as usize) < row {
            return Err(format!(
                "a plane's stride of {stride} bytes is shorter than its rows of {row}"
            ));
        }
        let stride = stride as usize;
        if !stride.is_multiple_of(sample) {
            return Err(format!(
                "a plane's stride of {stride} bytes is not a whole number of {sample}-byte samples"
            ));
        }
        let needed = stride * (rows as usize - 1) + row;
        if data.len() < needed {
            return Err(format!(
                "a plane of {} bytes is shorter than its {rows} rows of {stride} bytes",
                data.len()
            ));
        }
        Ok(Raw { data, stride })
    }

    /// Whether the plane holds `rows` whole strides, as the resizer reads it.
    fn whole(&self, rows: u32) -> bool {
        self.data.len() >= self.stride * rows as usize
    }

    /// The plane as an image of `P` pixels, `size` of them visible; it holds whole strides.
    fn image<P: InnerPixel>(self, (width, height): (u32, u32)) -> Result<Plane<'a, P>, String> {
        let wide = (self.stride / P::size()) as u32;
        let base =
            TypedImageRef::from_buffer(wide, height, self.data).map_err(|e| e.to_string())?;
        TypedCroppedImage::new(base, 0, 0, width, height).map_err(|e| e.to_string())
    }
}

/// The chroma of a 4:2:0 frame.
enum Chroma<'a> {
    /// NV12: U and V interleaved in one plane.
    Interleaved(Raw<'a>),
    /// I420: U and V in planes of their own.
    Planar(Raw<'a>, Raw<'a>),
}

/// A 4:2:0 frame's planes, with its colour matrix and chroma siting.
pub(super) struct Yuv420<'a> {
    luma: Raw<'a>,
    chroma: Chroma<'a>,
    size: (u32, u32),
    cosited: (bool, bool),
    matrix: FixedMatrix,
}

/// The resizer and the planes at the model's size, kept between frames.
#[derive(Default)]
pub(super) struct Resized {
    resizer: fr::Resizer,
    y: Vec<u8>,
    /// U, or NV12's U and V interleaved.
    chroma: Vec<u8>,
    /// I420's V.
    v: Vec<u8>,
    /// A plane copied where the resizer cannot read it where it lies (see [`readable`]).
    copy: Vec<u8>,
}

impl<'a> Yuv420<'a> {
    /// The planes of an NV12 or I420 `frame`, to be converted to RGB (BGR if `bgr`); `None`
    /// for other formats.
    pub(super) fn of(frame: &FrameView<'a>, bgr: bool) -> Result<Option<Self>, String> {
        let format = frame.format;
        let interleaved = match format.format {
            PixelFormat::Nv12 => true,
            PixelFormat::I420 => false,
            _ => return Ok(None),
        };
        let (width, height) = (format.width, format.height);
        if width == 0 || height == 0 {
            return Err("a frame without pixels".into());
        }
        let (chroma_w, chroma_h) = (width.div_ceil(2), height.div_ceil(2));
        let plane = |i: usize, width: u32, rows: u32, sample: usize| match (
            frame.planes.get(i),
            frame.strides.get(i),
        ) {
            (Some(data), Some(&stride)) => Raw::new(data, stride, width, rows, sample),
            _ => Err(format!("the {:?} frame has no plane {i}", format.format)),
        };
        let luma = plane(0, width, height, 1)?;
        let chroma = if interleaved {
            Chroma::Interleaved(plane(1, chroma_w, chroma_h, 2)?)
        } else {
            Chroma::Planar(
                plane(1, chroma_w, chroma_h, 1)?,
                plane(2, chroma_w, chroma_h, 1)?,
            )
        };
        Ok(Some(Yuv420 {
            luma,
            chroma,
            size: (width, height),
            cosited: (format.colour.h_cosited, format.colour.v_cosited),
            matrix: FixedMatrix::new(&format.yuv_to_rgb(), bgr),
        }))
    }

    /// Resamples `src` of the frame to `dst_w × dst_h` and writes it as 8-bit RGB (or BGR)
    /// into `out`, rows `out_stride` bytes apart.
    pub(super) fn resize_to_rgb(
        &self,
        src: Rect,
        (dst_w, dst_h): (u32, u32),
        scratch: &mut Resized,
        out: &mut [u8],
        out_stride: usize,
    ) -> Result<(), String> {
        let dst = (dst_w, dst_h);
        let Resized {
            resizer,
            y,
            chroma,
            v,
            copy,
        } = scratch;
        let luma_crop = (src.x as f64, src.y as f64, src.w as f64, src.h as f64);
        let (plane, size) = readable::<U8>(self.luma, self.size, luma_crop, copy);
        resize(resizer, &plane.image::<U8>(size)?, luma_crop, dst, y)?;
        let chroma_size = (self.size.0.div_ceil(2), self.size.1.div_ceil(2));
        let crop = chroma_crop(src, self.cosited);
        let matrix = &self.matrix;
        let dst_w = dst_w as usize;
        let rows = y.chunks_exact(dst_w).zip(out.chunks_mut(out_stride));
        match self.chroma {
            Chroma::Interleaved(uv) => {
                let (plane, size) = readable::<U8x2>(uv, chroma_size, crop, copy);
                resize(resizer, &plane.image::<U8x2>(size)?, crop, dst, chroma)?;
                for ((ys, out), uv) in rows.zip(chroma.chunks_exact(2 * dst_w)) {
                    let pixels = ys
                        .iter()
                        .zip(uv.chunks_exact(2))
                        .zip(out.chunks_exact_mut(3));
                    for ((&y, uv), px) in pixels {
                        matrix.convert(y, uv[0], uv[1], px);
                    }
                }
            }
            Chroma::Planar(u_plane, v_plane) => {
                let (plane, size) = readable::<U8>(u_plane, chroma_size, crop, copy);
                resize(resizer, &plane.image::<U8>(size)?, crop, dst, chroma)?;
                let (plane, size) = readable::<U8>(v_plane, chroma_size, crop, copy);
                resize(resizer, &plane.image::<U8>(size)?, crop, dst, v)?;
                let planes = chroma.chunks_exact(dst_w).zip(v.chunks_exact(dst_w));
                for ((ys, out), (us, vs)) in rows.zip(planes) {
                    let pixels = ys.iter().zip(us).zip(vs).zip(out.chunks_exact_mut(3));
                    for (((&y, &u), &v), px) in pixels {
                        matrix.convert(y, u, v, px);
                    }
                }
            }
        }
        Ok(())
    }
}

/// The colour matrix in 16-bit fixed point, its rows in the output's channel order.
struct FixedMatrix([[i32; 4]; 3]);

impl FixedMatrix {
    /// `m` as [`FrameFormat::yuv_to_rgb`] gives it, for RGB output (BGR if `bgr`).
    ///
    /// [`FrameFormat::yuv_to_rgb`]: crate::frame::FrameFormat::yuv_to_rgb
    fn new(m: &[f32; 12], bgr: bool) -> Self {
        let fixed = |v: f32| (v * 65536.0).round() as i32;
        let row = |c: usize| {
            let r = &m[4 * c..4 * c + 4];
            // The rounding's half a level is in the offset.
            [fixed(r[0]), fixed(r[1]), fixed(r[2]), fixed(r[3] + 0.5)]
        };
        let order = if bgr { [2, 1, 0] } else { [0, 1, 2] };
        FixedMatrix(order.map(row))
    }

    /// One pixel's three channels from its Y, U and V, clipped to 0..=255.
    #[inline(always)]
    fn convert(&self, y: u8, u: u8, v: u8, px: &mut [u8]) {
        let (y, u, v) = (i32::from(y), i32::from(u), i32::from(v));
        for (out, [a, b, c, d]) in px.iter_mut().zip(&self.0) {
            *out = ((a * y + b * u + c * v + d) >> 16).clamp(0, 255) as u8;
        }
    }
}

/// The crop `(left, top, width, height)` in chroma samples of the luma crop `src`: luma
/// position X (pixel centres at k + 0.5) lies at X/2 in a chroma plane sited between luma
/// pixels, and at X/2 + 1/4 in one cosited with them (MPEG-2's horizontal siting), as
/// GStreamer's converter and the GPU kernel site them.
fn chroma_crop(src: Rect, (h_cosited, v_cosited): (bool, bool)) -> (f64, f64, f64, f64) {
    let shift = |cosited: bool| if cosited { 0.25 } else { 0.0 };
    (
        src.x as f64 / 2.0 + shift(h_cosited),
        src.y as f64 / 2.0 + shift(v_cosited),
        src.w as f64 / 2.0,
        src.h as f64 / 2.0,
    )
}

/// The plane `raw` of `size` as the resizer can read `crop` of it, with the size to read:
/// the plane where it lies, or a copy in `copy` without row padding. A cosited chroma crop
/// reaching the frame's right or bottom edge ends a quarter sample past the plane, which the
/// resizer refuses: the copy repeats the last column and row (the sample beyond is the
/// edge's, as the converter clamps it). A plane whose last row stops at its pixels is
/// copied too: the resizer reads whole strides.
fn readable<'p, P: InnerPixel>(
    raw: Raw<'p>,
    (width, height): (u32, u32),
    (left, top, w, h): (f64, f64, f64, f64),
    copy: &'p mut Vec<u8>,
) -> (Raw<'p>, (u32, u32)) {
    let past = left + w > width as f64 || top + h > height as f64;
    if !past && raw.whole(height) {
        return (raw, (width, height));
    }
    let (px, row) = (P::size(), width as usize * P::size());
    let edge = if past { px } else { 0 };
    copy.clear();
    for y in 0..height as usize {
        let line = &raw.data[y * raw.stride..y * raw.stride + row];
        copy.extend_from_slice(line);
        copy.extend_from_slice(&line[row - edge..]);
    }
    let stride = row + edge;
    if past {
        copy.extend_from_within(copy.len() - stride..);
    }
    let extra = u32::from(past);
    let plane = Raw { data: copy, stride };
    (plane, (width + extra, height + extra))
}

/// Resamples the `(left, top, width, height)` crop of `src` to `size` into `out` with
/// antialiased bilinear filtering, as the packed path does.
fn resize<P: fr::PixelTrait>(
    resizer: &mut fr::Resizer,
    src: &Plane<'_, P>,
    (left, top, width, height): (f64, f64, f64, f64),
    (dst_w, dst_h): (u32, u32),
    out: &mut Vec<u8>,
) -> Result<(), String> {
    out.resize(dst_w as usize * dst_h as usize * P::size(), 0);
    let mut dst = TypedImage::<P>::from_buffer(dst_w, dst_h, out).map_err(|e| e.to_string())?;
    // `use_alpha(false)`: the resizer would take NV12's V for the alpha of a two-channel
    // pixel and premultiply U by it.
    let options = fr::ResizeOptions::new()
        .resize_alg(fr::ResizeAlg::Convolution(fr::FilterType::Bilinear))
        .crop(left, top, width, height)
        .use_alpha(false);
    resizer
        .resize_typed(src, &mut dst, &options)
        .map_err(|e| e.to_string())
}
