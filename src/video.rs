// SPDX-License-Identifier: MPL-2.0
//! GStreamer's video frames as the engines read them (`engine::frame`): the format and
//! colorimetry of a `VideoInfo`, the planes of a mapped frame, and GStreamer's own converter
//! for the CPU preprocessing's colour conversion.

use std::any::Any;

use gst_video::prelude::*;

use crate::engine::frame::{Colour, FrameFormat, FrameView, PackedSource, PixelFormat};

/// The engines' name of a GStreamer video format; `None` for one the element does not take.
pub fn pixel_format(format: gst_video::VideoFormat) -> Option<PixelFormat> {
    use gst_video::VideoFormat as F;
    Some(match format {
        F::Rgb => PixelFormat::Rgb,
        F::Bgr => PixelFormat::Bgr,
        F::Rgba => PixelFormat::Rgba,
        F::Bgra => PixelFormat::Bgra,
        F::Rgbx => PixelFormat::Rgbx,
        F::Bgrx => PixelFormat::Bgrx,
        F::Xrgb => PixelFormat::Xrgb,
        F::Xbgr => PixelFormat::Xbgr,
        F::Nv12 => PixelFormat::Nv12,
        F::I420 => PixelFormat::I420,
        F::P01010le => PixelFormat::P01010le,
        F::Gray8 => PixelFormat::Gray8,
        _ => return None,
    })
}

/// GStreamer's video format of one of the engines' pixel formats.
pub fn video_format(format: PixelFormat) -> gst_video::VideoFormat {
    use gst_video::VideoFormat as F;
    match format {
        PixelFormat::Rgb => F::Rgb,
        PixelFormat::Bgr => F::Bgr,
        PixelFormat::Rgba => F::Rgba,
        PixelFormat::Bgra => F::Bgra,
        PixelFormat::Rgbx => F::Rgbx,
        PixelFormat::Bgrx => F::Bgrx,
        PixelFormat::Xrgb => F::Xrgb,
        PixelFormat::Xbgr => F::Xbgr,
        PixelFormat::Nv12 => F::Nv12,
        PixelFormat::I420 => F::I420,
        PixelFormat::P01010le => F::P01010le,
        PixelFormat::Gray8 => F::Gray8,
    }
}

/// The format, size and colorimetry of frames of `info`, or why the engines cannot read them.
pub fn frame_format(info: &gst_video::VideoInfo) -> Result<FrameFormat, String> {
    let format = pixel_format(info.format())
        .ok_or_else(|| format!("the engines do not read {:?} frames", info.format()))?;
    let colorimetry = info.colorimetry();
    let site = info.chroma_site();
    Ok(FrameFormat {
        format,
        width: info.width(),
        height: info.height(),
        colour: Colour {
            kr_kb: colorimetry.matrix().kr_kb().ok(),
            full_range: colorimetry.range() == gst_video::VideoColorRange::Range0_255,
            h_cosited: site.contains(gst_video::VideoChromaSite::H_COSITED),
            v_cosited: site.contains(gst_video::VideoChromaSite::V_COSITED),
        },
    })
}

/// A mapped frame as the engines read it: its planes where they are, and GStreamer's
/// converter for the CPU preprocessing.
pub fn view<'a>(
    frame: &'a gst_video::VideoFrameRef<&'a gst::BufferRef>,
) -> Result<FrameView<'a>, String> {
    let format = frame_format(frame.info())?;
    let planes = (0..frame.n_planes())
        .map(|p| frame.plane_data(p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot read a frame: {e}"))?;
    Ok(FrameView {
        format,
        planes,
        strides: frame.plane_stride().to_vec(),
        packed: Some(Box::new(Converted(frame))),
    })
}

/// A frame that GStreamer's converter (the code behind `videoconvert`) packs: it reads every
/// raw format with its strides and colorimetry.
struct Converted<'a>(&'a gst_video::VideoFrameRef<&'a gst::BufferRef>);

/// The converter for one input format and size and one packed format, with the buffer it
/// writes; made again when the caps change.
struct Converter {
    in_info: gst_video::VideoInfo,
    to: PixelFormat,
    converter: gst_video::VideoConverter,
    packed_info: gst_video::VideoInfo,
    packed: gst::Buffer,
}

impl Converter {
    fn new(in_info: &gst_video::VideoInfo, to: PixelFormat) -> Result<Self, String> {
        let (width, height) = (in_info.width(), in_info.height());
        let channels = if to == PixelFormat::Gray8 { 1 } else { 3 };
        // Rows without padding, as the engine's resize reads them; the same rate, aspect and
        // interlacing as the input: the converter only changes colour, and at the frame's
        // own size it is exact (no resampling).
        let packed_info = gst_video::VideoInfo::builder(video_format(to), width, height)
            .fps(in_info.fps())
            .par(in_info.par())
            .interlace_mode(in_info.interlace_mode())
            .stride(&[width as i32 * channels])
            .build()
            .map_err(|e| e.to_string())?;
        let mut config = gst_video::VideoConverterConfig::new();
        config.set_dither_method(gst_video::VideoDitherMethod::None);
        config.set_threads(1);
        let converter = gst_video::VideoConverter::new(in_info, &packed_info, Some(config))
            .map_err(|e| e.to_string())?;
        let packed = gst::Buffer::with_size(packed_info.size()).map_err(|e| e.to_string())?;
        Ok(Converter {
            in_info: in_info.clone(),
            to,
            converter,
            packed_info,
            packed,
        })
    }
}

impl PackedSource for Converted<'_> {
    fn with_packed(
        &self,
        to: PixelFormat,
        cache: &mut Option<Box<dyn Any + Send>>,
        f: &mut dyn FnMut(&[u8]),
    ) -> Result<(), String> {
        let info = self.0.info();
        let fits = |c: &Converter| &c.in_info == info && c.to == to;
        let cached = cache.as_mut().and_then(|c| c.downcast_mut::<Converter>());
        let converter = match cached {
            Some(c) if fits(c) => c,
            _ => {
                let made = cache.insert(Box::new(Converter::new(info, to)?));
                made.downcast_mut::<Converter>().expect("just made")
            }
        };
        let packed = converter.packed.make_mut();
        let mut dest =
            gst_video::VideoFrameRef::from_buffer_ref_writable(packed, &converter.packed_info)
                .map_err(|e| e.to_string())?;
        converter.converter.frame_ref(self.0, &mut dest);
        drop(dest);
        let pixels = converter.packed.map_readable().map_err(|e| e.to_string())?;
        f(pixels.as_slice());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engines' table of packed formats (bytes per pixel, where R, G and B are) is
    /// GStreamer's, and every format of the element's caps has a name there.
    #[test]
    fn packed_formats_match_gstreamer() {
        gst::init().unwrap();
        for format in PixelFormat::ALL {
            let info = gst_video::VideoFormatInfo::from_format(video_format(format));
            assert_eq!(pixel_format(info.format()), Some(format));
            assert_eq!(format.planes(), info.n_planes() as usize, "{format:?}");
            match format.packed_rgb() {
                Some((stride, offsets)) => {
                    assert_eq!(stride as i32, info.pixel_stride()[0], "{format:?}");
                    let poffset = info.poffset();
                    assert_eq!(
                        offsets,
                        [0, 1, 2].map(|c| poffset[c] as usize),
                        "{format:?}"
                    );
                }
                None => assert!(info.is_yuv() || info.is_gray(), "{format:?}"),
            }
        }
    }
}
