// SPDX-License-Identifier: MPL-2.0
//! GStreamer's analytics metadata (`GstAnalyticsRelationMeta`, GStreamer 1.24+; the
//! `analytics` cargo feature). Reads the detections (`GstAnalyticsODMtd`) that a detector
//! upstream put on a frame, as it put them (`regions` clips them and merges them with the ROI
//! metas into the regions classified with `roi=regions|both`), and writes results where
//! GStreamer's analytics elements and applications look: one `GstAnalyticsClsMtd` per
//! classifier for the whole frame, and one per classifier for each classified detection,
//! related to it (detection `RELATE_TO` classification, as trackers relate their
//! `GstAnalyticsTrackingMtd`). Classifiers in series each add their own, so all results stay.

use gst_analytics::prelude::*;
use gst_analytics::{AnalyticsODMtd, AnalyticsRelationMeta, RelTypes};

use crate::outputs::meta::ClassEntry;

/// A detection (`GstAnalyticsODMtd`) of a buffer's analytics relation meta, as the detector
/// put it: its rectangle may reach outside the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detection {
    /// Its id in the relation meta, which results are related to ([`attach`]).
    pub id: u32,
    /// Its type, a detector's label; empty when it has none.
    pub obj_type: String,
    /// Its left edge, in pixels of the frame.
    pub x: i32,
    /// Its top edge.
    pub y: i32,
    /// Its width.
    pub w: i32,
    /// Its height.
    pub h: i32,
}

/// The detections of `buffer`'s relation meta, in its order; one without a location is left
/// out.
pub fn detections(buffer: &gst::BufferRef) -> Vec<Detection> {
    let Some(meta) = buffer.meta::<AnalyticsRelationMeta>() else {
        return Vec::new();
    };
    meta.iter::<AnalyticsODMtd>()
        .filter_map(|detection| {
            let at = detection.location().ok()?;
            Some(Detection {
                id: detection.id(),
                obj_type: detection
                    .obj_type()
                    .map_or_else(String::new, |q| q.as_str().to_string()),
                x: at.x,
                y: at.y,
                w: at.w,
                h: at.h,
            })
        })
        .collect()
}

/// Adds `classes` (top-k, best first: labels as class quarks, confidences as levels) to
/// `buffer`'s relation meta, which is added when the buffer has none, and relates them to the
/// detection `detection` when given. Nothing is added when no class passed the threshold.
/// Returns the new `GstAnalyticsClsMtd`'s id.
pub fn attach(
    buffer: &mut gst::BufferRef,
    detection: Option<u32>,
    classes: &[ClassEntry],
) -> Result<Option<u32>, glib::BoolError> {
    if classes.is_empty() {
        return Ok(None);
    }
    if buffer.meta::<AnalyticsRelationMeta>().is_none() {
        AnalyticsRelationMeta::add(buffer);
    }
    let mut meta = buffer
        .meta_mut::<AnalyticsRelationMeta>()
        .expect("added above");
    let levels: Vec<f32> = classes.iter().map(|c| c.confidence).collect();
    let quarks: Vec<glib::Quark> = classes
        .iter()
        .map(|c| glib::Quark::from_str(&c.label))
        .collect();
    let id = meta.add_cls_mtd(&levels, &quarks)?.id();
    if let Some(detection) = detection {
        meta.set_relation(RelTypes::RELATE_TO, detection, id)?;
    }
    Ok(Some(id))
}

// `regions`' tests add detections with `detect` too.
#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn entry(label: &str, confidence: f32) -> ClassEntry {
        ClassEntry {
            class_id: 0,
            label: label.into(),
            confidence,
        }
    }

    /// Adds a detection of `obj_type` at x, y, w, h; returns its id.
    pub(crate) fn detect(
        buffer: &mut gst::BufferRef,
        obj_type: &str,
        (x, y, w, h): (i32, i32, i32, i32),
    ) -> u32 {
        if buffer.meta::<AnalyticsRelationMeta>().is_none() {
            AnalyticsRelationMeta::add(buffer);
        }
        let mut meta = buffer.meta_mut::<AnalyticsRelationMeta>().unwrap();
        meta.add_od_mtd(glib::Quark::from_str(obj_type), x, y, w, h, 0.9)
            .unwrap()
            .id()
    }

    #[test]
    fn detections_are_read_as_the_detector_put_them() {
        gst::init().unwrap();
        let mut buffer = gst::Buffer::new();
        assert_eq!(detections(&buffer), [], "no relation meta");
        let b = buffer.get_mut().unwrap();
        let car = detect(b, "car", (4, 4, 10, 10));
        // Reaching outside any frame: not clipped here.
        let person = detect(b, "person", (-5, 20, 150, 40));
        let found = |id, obj_type: &str, x, y, w, h| Detection {
            id,
            obj_type: obj_type.into(),
            x,
            y,
            w,
            h,
        };
        assert_eq!(
            detections(&buffer),
            [
                found(car, "car", 4, 4, 10, 10),
                found(person, "person", -5, 20, 150, 40)
            ]
        );
    }

    #[test]
    fn results_are_related_to_their_detection_and_add_up_in_series() {
        gst::init().unwrap();
        let mut buffer = gst::Buffer::new();
        let b = buffer.get_mut().unwrap();
        let car = detect(b, "car", (0, 0, 8, 8));
        let frame = attach(b, None, &[entry("street", 0.7), entry("park", 0.2)])
            .unwrap()
            .unwrap();
        let colour = attach(b, Some(car), &[entry("red", 0.9)]).unwrap().unwrap();
        let kind = attach(b, Some(car), &[entry("van", 0.6)]).unwrap().unwrap();
        assert_eq!(attach(b, Some(car), &[]).unwrap(), None);

        let meta = buffer.meta::<AnalyticsRelationMeta>().unwrap();
        let related: Vec<u32> = meta
            .iter_direct_related::<gst_analytics::AnalyticsClassificationMtd>(
                car,
                RelTypes::RELATE_TO,
            )
            .map(|c| c.id())
            .collect();
        assert_eq!(related, [colour, kind]);
        let whole = meta
            .mtd::<gst_analytics::AnalyticsClassificationMtd>(frame)
            .unwrap();
        assert_eq!(whole.len(), 2);
        assert_eq!(whole.quark(0).as_str(), "street");
        assert!((whole.level(0) - 0.7).abs() < 1e-6);
        assert_eq!(whole.quark(1).as_str(), "park");
        assert_eq!(meta.relation(car, frame), RelTypes::NONE);
    }
}
