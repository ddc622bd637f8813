// SPDX-License-Identifier: MPL-2.0
//! GStreamer's analytics metadata (`GstAnalyticsRelationMeta`, GStreamer 1.24+; the
//! `analytics` cargo feature). Detections (`GstAnalyticsODMtd`) that a detector upstream put
//! on a frame are regions to classify (with `roi=regions|both`), and results go where
//! GStreamer's analytics elements and applications look: one `GstAnalyticsClsMtd` per
//! classifier for the whole frame, and one per classifier for each classified detection,
//! related to it (detection `RELATE_TO` classification, as trackers relate their
//! `GstAnalyticsTrackingMtd`). Classifiers in series each add their own, so all results stay.

use gst_analytics::prelude::*;
use gst_analytics::{AnalyticsODMtd, AnalyticsRelationMeta, RelTypes};

use crate::outputs::meta::ClassEntry;
use crate::regions::{Region, clip};

/// Adds the detections of `buffer`'s relation meta, clipped to the `width`×`height` frame, to
/// `regions` (those of its ROI metas). A detection with the type and rectangle of a ROI meta
/// is the same object published both ways: that region gets the detection's id instead of a
/// second entry.
pub fn add_detections(buffer: &gst::BufferRef, width: u32, height: u32, regions: &mut Vec<Region>) {
    let Some(meta) = buffer.meta::<AnalyticsRelationMeta>() else {
        return;
    };
    for detection in meta.iter::<AnalyticsODMtd>() {
        let Ok(at) = detection.location() else {
            continue;
        };
        let Some(rect) = clip(at.x, at.y, at.w, at.h, width, height) else {
            continue;
        };
        let roi_type = detection
            .obj_type()
            .map_or_else(String::new, |q| q.as_str().to_string());
        match regions
            .iter_mut()
            .find(|r| r.detection.is_none() && r.rect == rect && r.roi_type == roi_type)
        {
            Some(mirror) => mirror.detection = Some(detection.id()),
            None => regions.push(Region {
                meta_index: None,
                detection: Some(detection.id()),
                id: i32::try_from(detection.id()).unwrap_or(i32::MAX),
                roi_type,
                rect,
            }),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::regions::{RegionFilter, regions_of};
    use gst_video::VideoRegionOfInterestMeta;

    fn entry(label: &str, confidence: f32) -> ClassEntry {
        ClassEntry {
            class_id: 0,
            label: label.into(),
            confidence,
        }
    }

    /// Adds a detection of `obj_type` at x, y, w, h; returns its id.
    fn detect(
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
    fn detections_are_regions_and_a_detection_published_twice_is_one() {
        gst::init().unwrap();
        let mut buffer = gst::Buffer::new();
        let b = buffer.get_mut().unwrap();
        VideoRegionOfInterestMeta::add(b, "car", (4, 4, 10, 10));
        let mirrored = detect(b, "car", (4, 4, 10, 10));
        let own = detect(b, "person", (-5, 20, 15, 40));
        detect(b, "car", (70, 0, 5, 5)); // outside the 64×48 frame
        let regions = regions_of(&buffer, 64, 48, &RegionFilter::default());
        let found: Vec<_> = regions
            .iter()
            .map(|r| (r.meta_index, r.detection, r.roi_type.as_str(), r.rect))
            .collect();
        let rect = |x, y, w, h| crate::preprocess::Rect { x, y, w, h };
        assert_eq!(
            found,
            [
                (Some(0), Some(mirrored), "car", rect(4, 4, 10, 10)),
                (None, Some(own), "person", rect(0, 20, 10, 28)),
            ]
        );
        let people = RegionFilter {
            types: vec!["person".into()],
            ..Default::default()
        };
        assert_eq!(regions_of(&buffer, 64, 48, &people).len(), 1);
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
