// SPDX-License-Identifier: MPL-2.0
use std::sync::{LazyLock, Mutex};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::prelude::*;
use gst_video::VideoRegionOfInterestMeta;
use gst_video::prelude::*;
use gst_video::subclass::prelude::*;
use pango::prelude::*;

use trtclassify_meta::Classification;
use trtclassify_meta::PARAM_NAME;

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "trtclassifyoverlay",
        gst::DebugColorFlags::empty(),
        Some("draws trtclassify's results on the video"),
    )
});

/// Formats that GStreamer's overlay blending writes into.
const FORMATS: &[gst_video::VideoFormat] = {
    use gst_video::VideoFormat::*;
    &[
        I420, Yv12, Nv12, Nv21, Y42b, Y444, Yuy2, Uyvy, Rgb, Bgr, Rgbx, Bgrx, Xrgb, Xbgr, Rgba,
        Bgra, Argb, Abgr,
    ]
};

/// Region outlines: opaque green, visible on most scenes; a pixel in Cairo's ARGB32 (a native
/// 0xAARRGGBB word, so BGRA bytes on little-endian machines).
const OUTLINE: [u8; 4] = 0xff00_ff00u32.to_ne_bytes();

#[derive(Debug, Clone)]
struct Settings {
    font_desc: Option<String>,
    show_confidence: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            font_desc: None,
            show_confidence: true,
        }
    }
}

/// A text to draw with its top-left corner at `x`, `y` (or above `above`, when it fits).
struct Label {
    x: i32,
    y: i32,
    /// Place the text just above this row when there is room (a region's top edge).
    above: bool,
    text: String,
}

#[derive(Default)]
pub struct TrtClassifyOverlay {
    settings: Mutex<Settings>,
}

impl TrtClassifyOverlay {
    /// What to draw on `buffer`: labels, and outlines (x, y, width, height) of regions.
    fn items(&self, buffer: &gst::BufferRef, settings: &Settings) -> (Vec<Label>, Vec<[i32; 4]>) {
        let line = |label: &str, confidence: f64| {
            if settings.show_confidence {
                format!("{label} {confidence:.2}")
            } else {
                label.to_owned()
            }
        };
        let mut labels = Vec::new();
        if let Some(top) = Classification::from_buffer(buffer)
            .as_ref()
            .and_then(|c| c.top())
        {
            labels.push(Label {
                x: 0,
                y: 0,
                above: false,
                text: line(&top.label, f64::from(top.confidence)),
            });
        }
        let mut outlines = Vec::new();
        for meta in buffer.iter_meta::<VideoRegionOfInterestMeta>() {
            let lines: Vec<String> = meta
                .params()
                .filter(|p| p.name() == PARAM_NAME)
                .filter_map(|p| {
                    Some(line(
                        &p.get::<String>("label").ok()?,
                        p.get::<f64>("confidence").ok()?,
                    ))
                })
                .collect();
            if lines.is_empty() {
                continue;
            }
            let (x, y, w, h) = meta.rect();
            let clamp = |v: u32| i32::try_from(v).unwrap_or(i32::MAX);
            outlines.push([clamp(x), clamp(y), clamp(w), clamp(h)]);
            labels.push(Label {
                x: clamp(x),
                y: clamp(y),
                above: true,
                text: lines.join("\n"),
            });
        }
        (labels, outlines)
    }

    /// The overlay rectangles for `labels` and `outlines` on a `width`×`height` frame.
    fn rectangles(
        &self,
        settings: &Settings,
        width: i32,
        height: i32,
        labels: &[Label],
        outlines: &[[i32; 4]],
    ) -> Result<Vec<gst_video::VideoOverlayRectangle>, glib::BoolError> {
        let mut rectangles = Vec::new();
        // Lines a fraction of the frame thick, so they show at 4K as at 360p.
        let thickness = (height / 240).max(2);
        for &[x, y, w, h] in outlines {
            // The four edges, clipped to the frame.
            let (x0, y0) = (x.clamp(0, width), y.clamp(0, height));
            let (x1, y1) = (
                x.saturating_add(w).clamp(0, width),
                y.saturating_add(h).clamp(0, height),
            );
            for (ex, ey, ew, eh) in [
                (x0, y0, x1 - x0, thickness),
                (x0, y1 - thickness, x1 - x0, thickness),
                (x0, y0, thickness, y1 - y0),
                (x1 - thickness, y0, thickness, y1 - y0),
            ] {
                let (ex, ey) = (ex.max(0), ey.max(0));
                let (ew, eh) = (ew.min(width - ex), eh.min(height - ey));
                if ew > 0 && eh > 0 {
                    let pixels = OUTLINE.repeat((ew * eh) as usize);
                    rectangles.push(rectangle(pixels, ex, ey, ew, eh)?);
                }
            }
        }
        if labels.is_empty() {
            return Ok(rectangles);
        }
        // The calling thread's font map (Pango keeps one per thread), so that the fonts are
        // loaded once per streaming thread, not per frame.
        let fonts = pangocairo::FontMap::default();
        let layout = pango::Layout::new(&fonts.create_context());
        let font = match &settings.font_desc {
            Some(desc) => pango::FontDescription::from_string(desc),
            None => {
                let mut font = pango::FontDescription::from_string("Sans Bold");
                font.set_absolute_size(f64::from((height / 28).max(10) * pango::SCALE));
                font
            }
        };
        layout.set_font_description(Some(&font));
        for label in labels {
            layout.set_text(&label.text);
            let (pixels, w, h) = render_text(&layout)?;
            let y = if label.above && label.y >= h {
                label.y - h
            } else {
                label.y
            };
            let x = label.x.clamp(0, (width - w).max(0));
            let y = y.clamp(0, (height - h).max(0));
            rectangles.push(rectangle(pixels, x, y, w, h)?);
        }
        Ok(rectangles)
    }
}

/// Text in white on a translucent black box, as premultiplied BGRA pixels (Cairo's ARGB32 on
/// little-endian machines), with its width and height.
fn render_text(layout: &pango::Layout) -> Result<(Vec<u8>, i32, i32), glib::BoolError> {
    let failed = |e: cairo::Error| glib::bool_error!("cannot draw a label: {e}");
    let (_, logical) = layout.pixel_extents();
    let pad = 3;
    let (w, h) = (logical.width() + 2 * pad, logical.height() + 2 * pad);
    let mut surface = cairo::ImageSurface::create(cairo::Format::ARgb32, w, h).map_err(failed)?;
    {
        let cr = cairo::Context::new(&surface).map_err(failed)?;
        cr.set_source_rgba(0.0, 0.0, 0.0, 0.6);
        cr.paint().map_err(failed)?;
        cr.move_to(f64::from(pad - logical.x()), f64::from(pad - logical.y()));
        cr.set_source_rgba(1.0, 1.0, 1.0, 1.0);
        pangocairo::functions::show_layout(&cr, layout);
    }
    surface.flush();
    let stride = surface.stride() as usize;
    let data = surface
        .data()
        .map_err(|e| glib::bool_error!("cannot read a label: {e}"))?;
    let mut pixels = Vec::with_capacity((w * h * 4) as usize);
    for row in data.chunks(stride).take(h as usize) {
        pixels.extend_from_slice(&row[..w as usize * 4]);
    }
    Ok((pixels, w, h))
}

/// An overlay rectangle of premultiplied pixels in Cairo's ARGB32 layout.
fn rectangle(
    pixels: Vec<u8>,
    x: i32,
    y: i32,
    w: i32,
    h: i32,
) -> Result<gst_video::VideoOverlayRectangle, glib::BoolError> {
    #[cfg(target_endian = "little")]
    let format = gst_video::VideoFormat::Bgra;
    #[cfg(target_endian = "big")]
    let format = gst_video::VideoFormat::Argb;
    let mut buffer = gst::Buffer::from_mut_slice(pixels);
    gst_video::VideoMeta::add(
        buffer.get_mut().expect("a new buffer"),
        gst_video::VideoFrameFlags::empty(),
        format,
        w as u32,
        h as u32,
    )?;
    Ok(gst_video::VideoOverlayRectangle::new_raw(
        &buffer,
        x,
        y,
        w as u32,
        h as u32,
        gst_video::VideoOverlayFormatFlags::PREMULTIPLIED_ALPHA,
    ))
}

#[glib::object_subclass]
impl ObjectSubclass for TrtClassifyOverlay {
    const NAME: &'static str = "GstTrtClassifyOverlay";
    type Type = super::TrtClassifyOverlay;
    type ParentType = gst_video::VideoFilter;
}

impl ObjectImpl for TrtClassifyOverlay {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            vec![
                glib::ParamSpecString::builder("font-desc")
                    .nick("Font")
                    .blurb(
                        "Pango font description of the labels, e.g. \"Sans Bold 24\"; \
                         unset: a bold sans-serif font 1/28 of the frame's height",
                    )
                    .mutable_playing()
                    .build(),
                glib::ParamSpecBoolean::builder("show-confidence")
                    .nick("Show confidence")
                    .blurb("Write each label's confidence after it")
                    .default_value(Settings::default().show_confidence)
                    .mutable_playing()
                    .build(),
            ]
        });
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut settings = self.settings.lock().unwrap();
        match pspec.name() {
            "font-desc" => settings.font_desc = value.get().expect("type checked upstream"),
            "show-confidence" => {
                settings.show_confidence = value.get().expect("type checked upstream")
            }
            _ => unimplemented!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        let settings = self.settings.lock().unwrap();
        match pspec.name() {
            "font-desc" => settings.font_desc.to_value(),
            "show-confidence" => settings.show_confidence.to_value(),
            _ => unimplemented!(),
        }
    }
}

impl GstObjectImpl for TrtClassifyOverlay {}

impl ElementImpl for TrtClassifyOverlay {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static METADATA: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "TrtClassify overlay",
                "Filter/Effect/Video/Overlay",
                "Draws trtclassify's results (frame and region labels, region outlines) on the video",
                "trtclassify developers",
            )
        });
        Some(&*METADATA)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            let caps = gst_video::VideoCapsBuilder::new()
                .format_list(FORMATS.iter().copied())
                .build();
            [gst::PadDirection::Src, gst::PadDirection::Sink]
                .into_iter()
                .map(|direction| {
                    let name = if direction == gst::PadDirection::Src {
                        "src"
                    } else {
                        "sink"
                    };
                    gst::PadTemplate::new(name, direction, gst::PadPresence::Always, &caps).unwrap()
                })
                .collect()
        });
        TEMPLATES.as_ref()
    }
}

impl BaseTransformImpl for TrtClassifyOverlay {
    const MODE: gst_base::subclass::BaseTransformMode =
        gst_base::subclass::BaseTransformMode::AlwaysInPlace;
    const PASSTHROUGH_ON_SAME_CAPS: bool = false;
    const TRANSFORM_IP_ON_PASSTHROUGH: bool = false;
}

impl VideoFilterImpl for TrtClassifyOverlay {
    fn transform_frame_ip(
        &self,
        frame: &mut gst_video::VideoFrameRef<&mut gst::BufferRef>,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        let settings = self.settings.lock().unwrap().clone();
        let (labels, outlines) = self.items(frame.buffer(), &settings);
        if labels.is_empty() && outlines.is_empty() {
            return Ok(gst::FlowSuccess::Ok);
        }
        let (width, height) = (frame.width() as i32, frame.height() as i32);
        let drawn = self
            .rectangles(&settings, width, height, &labels, &outlines)
            .and_then(|rectangles| gst_video::VideoOverlayComposition::new(rectangles.iter()))
            .and_then(|composition| composition.blend(frame));
        if let Err(e) = drawn {
            // The frame still goes on, without its labels.
            gst::warning!(CAT, imp = self, "cannot draw the results: {e}");
        }
        Ok(gst::FlowSuccess::Ok)
    }
}
