// SPDX-License-Identifier: MPL-2.0
//! Regions of interest: which parts of a frame are classified (`roi` mode), read from the
//! `GstVideoRegionOfInterestMeta`s that a detector upstream attached, and where each region's
//! result goes back: a `GstStructure` param on that region's meta, which readers of the ROI
//! meta (DL Streamer's `gvametaconvert` and `gvawatermark`, applications) find beside the
//! detection, and which `videoscale` and friends carry along with the region. With the
//! `analytics` feature, the detections of the analytics relation meta (`analytics`) are
//! regions too.

use gst_video::VideoRegionOfInterestMeta;

use crate::outputs::meta::ClassEntry;
use crate::preprocess::{Crop, Rect};

/// What parts of a frame are classified.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstTrtClassifyRoiMode")]
pub enum RoiMode {
    /// The whole frame only; ROI metas are ignored.
    #[default]
    #[enum_value(name = "Frame: the whole frame, ROI metas are ignored", nick = "frame")]
    Frame = 0,
    /// Each region that passes the filter; a frame without one passes unclassified.
    #[enum_value(
        name = "Regions: each region of interest (GstVideoRegionOfInterestMeta, and GstAnalyticsODMtd in builds with analytics) that passes roi-types and roi-min-size; frames without one pass unclassified",
        nick = "regions"
    )]
    Regions = 1,
    /// The whole frame, and each region that passes the filter.
    #[enum_value(name = "Both: the whole frame and each region", nick = "both")]
    Both = 2,
}

impl RoiMode {
    /// Whether the whole frame is classified.
    pub fn whole_frame(self) -> bool {
        self != RoiMode::Regions
    }

    /// Whether regions of interest are classified.
    pub fn regions(self) -> bool {
        self != RoiMode::Frame
    }
}

/// Which regions are classified.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RegionFilter {
    /// The region types (`roi_type`, a detector's label) to classify; empty: every type.
    pub types: Vec<String>,
    /// The smallest width and height, in pixels after clipping to the frame, of a region to
    /// classify: smaller ones hold too few pixels for a meaningful answer.
    pub min_width: u32,
    /// The smallest height of a region to classify, in pixels after clipping; 0 or 1: any.
    pub min_height: u32,
}

impl RegionFilter {
    /// `roi-types`: a comma-separated list; spaces around names are ignored.
    pub fn parse_types(list: &str) -> Vec<String> {
        list.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect()
    }

    fn accepts(&self, roi_type: &str, rect: &Rect) -> bool {
        (self.types.is_empty() || self.types.iter().any(|t| t == roi_type))
            && rect.w as u32 >= self.min_width.max(1)
            && rect.h as u32 >= self.min_height.max(1)
    }
}

/// A region of a frame to classify.
#[derive(Debug, Clone, PartialEq)]
pub struct Region {
    /// The place of its ROI meta among the buffer's ROI metas, which the result is attached
    /// to: ids are not unique (`gst_buffer_add_video_region_of_interest_meta` gives 0).
    /// `None` for a detection that has no ROI meta.
    pub meta_index: Option<usize>,
    /// The id of its `GstAnalyticsODMtd` in the buffer's analytics relation meta (the
    /// `analytics` feature, GStreamer 1.24+), to which its classification is related.
    pub detection: Option<u32>,
    /// The ROI meta's id (the detection's, when it has no ROI meta), reported with the result.
    pub id: i32,
    /// The ROI meta's type, a detector's label, which `RegionFilter::types` is matched against.
    pub roi_type: String,
    /// The region clipped to the frame.
    pub rect: Rect,
}

impl Region {
    /// The part of the frame to preprocess for this region.
    pub fn crop(&self) -> Crop {
        Crop::Region(self.rect)
    }
}

/// The regions of `buffer`'s ROI metas that `filter` accepts, clipped to the `width`×`height`
/// frame, in the order of the metas; with the `analytics` feature, then the detections of its
/// analytics relation meta. A detector that publishes a detection both ways (the same type and
/// rectangle) gets it classified once, with the result on both. A region wholly outside the
/// frame is left out.
pub fn regions_of(
    buffer: &gst::BufferRef,
    width: u32,
    height: u32,
    filter: &RegionFilter,
) -> Vec<Region> {
    #[cfg_attr(not(feature = "analytics"), allow(unused_mut))]
    let mut regions: Vec<Region> = buffer
        .iter_meta::<VideoRegionOfInterestMeta>()
        .enumerate()
        .filter_map(|(index, meta)| {
            let (x, y, w, h) = meta.rect();
            let clamp = |v: u32| i32::try_from(v).unwrap_or(i32::MAX);
            Some(Region {
                meta_index: Some(index),
                detection: None,
                id: meta.id(),
                roi_type: meta.roi_type().to_owned(),
                rect: clip(clamp(x), clamp(y), clamp(w), clamp(h), width, height)?,
            })
        })
        .collect();
    #[cfg(feature = "analytics")]
    for detection in crate::analytics::detections(buffer) {
        let (x, y, w, h) = (detection.x, detection.y, detection.w, detection.h);
        if let Some(rect) = clip(x, y, w, h, width, height) {
            add_detection(&mut regions, detection.id, detection.obj_type, rect);
        }
    }
    regions.retain(|r| filter.accepts(&r.roi_type, &r.rect));
    regions
}

/// Adds the detection `id` of type `obj_type` at `rect` (clipped to the frame) to `regions`
/// (those of the ROI metas, then the detections before it). A detection with the type and
/// rectangle of a ROI meta is the same object published both ways: that region gets the
/// detection's id instead of a second entry.
// Built for tests without the feature too: the rule is tested where GStreamer is older than
// 1.24.
#[cfg(any(test, feature = "analytics"))]
fn add_detection(regions: &mut Vec<Region>, id: u32, obj_type: String, rect: Rect) {
    match regions
        .iter_mut()
        .find(|r| r.detection.is_none() && r.rect == rect && r.roi_type == obj_type)
    {
        Some(mirror) => mirror.detection = Some(id),
        None => regions.push(Region {
            meta_index: None,
            detection: Some(id),
            id: i32::try_from(id).unwrap_or(i32::MAX),
            roi_type: obj_type,
            rect,
        }),
    }
}

/// A rectangle clipped to the `width`×`height` frame; `None` when nothing of it is inside.
fn clip(x: i32, y: i32, w: i32, h: i32, width: u32, height: u32) -> Option<Rect> {
    Crop::Region(Rect { x, y, w, h }).within(width, height)
}

pub use crate::meta::PARAM_NAME;

/// Adds a region's result to its ROI meta as a param structure named [`PARAM_NAME`]: the top
/// class in the fields DL Streamer's readers use (`label`, `label_id`, `confidence`), with
/// `model_name` and `element_id` telling classifiers in series apart, and the whole top-k as
/// arrays (`class-ids`, `labels`, `confidences`, as in `TrtClassifyMeta`). `index` is the
/// region's place among the buffer's ROI metas (`Region::meta_index`); a region whose meta is no
/// longer on the buffer is skipped.
pub fn attach(
    buffer: &mut gst::BufferRef,
    index: usize,
    model: &str,
    element: &str,
    classes: &[ClassEntry],
) {
    let Some(mut meta) = buffer
        .iter_meta_mut::<VideoRegionOfInterestMeta>()
        .nth(index)
    else {
        return;
    };
    let mut param = gst::Structure::builder(PARAM_NAME)
        .field("model_name", model)
        .field("element_id", element);
    if let Some(top) = classes.first() {
        param = param
            .field("label", &top.label)
            .field("label_id", top.class_id as i32)
            .field("confidence", f64::from(top.confidence));
    }
    meta.add_param(
        param
            .field(
                "class-ids",
                gst::Array::new(classes.iter().map(|c| c.class_id as i32)),
            )
            .field(
                "labels",
                gst::Array::new(classes.iter().map(|c| c.label.as_str())),
            )
            .field(
                "confidences",
                gst::Array::new(classes.iter().map(|c| f64::from(c.confidence))),
            )
            .build(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// x, y, width, height.
    type Xywh<T> = (T, T, T, T);

    fn buffer_with(rois: &[(&str, Xywh<u32>)]) -> gst::Buffer {
        gst::init().unwrap();
        let mut buffer = gst::Buffer::new();
        for (roi_type, rect) in rois {
            VideoRegionOfInterestMeta::add(buffer.get_mut().unwrap(), roi_type, *rect);
        }
        buffer
    }

    fn rects(regions: &[Region]) -> Vec<(&str, Xywh<i32>)> {
        regions
            .iter()
            .map(|r| {
                (
                    r.roi_type.as_str(),
                    (r.rect.x, r.rect.y, r.rect.w, r.rect.h),
                )
            })
            .collect()
    }

    #[test]
    fn regions_are_clipped_filtered_by_type_and_size() {
        let buffer = buffer_with(&[
            ("car", (10, 10, 20, 20)),
            ("person", (0, 0, 8, 30)),
            // Half outside the 64×48 frame: clipped to 14×8.
            ("car", (50, 40, 30, 30)),
            // Wholly outside: left out.
            ("car", (100, 100, 5, 5)),
        ]);
        let all = regions_of(&buffer, 64, 48, &RegionFilter::default());
        assert_eq!(
            rects(&all),
            [
                ("car", (10, 10, 20, 20)),
                ("person", (0, 0, 8, 30)),
                ("car", (50, 40, 14, 8))
            ]
        );
        let cars = RegionFilter {
            types: RegionFilter::parse_types(" car , truck,"),
            ..Default::default()
        };
        assert_eq!(cars.types, ["car", "truck"]);
        assert_eq!(
            rects(&regions_of(&buffer, 64, 48, &cars)),
            [("car", (10, 10, 20, 20)), ("car", (50, 40, 14, 8))]
        );
        let big = RegionFilter {
            min_width: 10,
            min_height: 10,
            ..Default::default()
        };
        assert_eq!(
            rects(&regions_of(&buffer, 64, 48, &big)),
            [("car", (10, 10, 20, 20))]
        );
    }

    fn rect(x: i32, y: i32, w: i32, h: i32) -> Rect {
        Rect { x, y, w, h }
    }

    #[test]
    fn a_detection_published_both_ways_is_one_region() {
        let buffer = buffer_with(&[("car", (4, 4, 10, 10)), ("person", (20, 20, 8, 8))]);
        let mut regions = regions_of(&buffer, 64, 48, &RegionFilter::default());
        // The car's ROI meta.
        add_detection(&mut regions, 7, "car".into(), rect(4, 4, 10, 10));
        // Its ROI meta is taken: a second car there is a region of its own.
        add_detection(&mut regions, 8, "car".into(), rect(4, 4, 10, 10));
        // The person's rectangle, but another type.
        add_detection(&mut regions, 9, "truck".into(), rect(20, 20, 8, 8));
        // An id beyond `i32`'s range is reported as its largest.
        add_detection(&mut regions, u32::MAX, "bike".into(), rect(0, 0, 2, 2));
        let found: Vec<_> = regions
            .iter()
            .map(|r| (r.meta_index, r.detection, r.id, r.roi_type.as_str(), r.rect))
            .collect();
        assert_eq!(
            found,
            [
                (Some(0), Some(7), 0, "car", rect(4, 4, 10, 10)),
                (Some(1), None, 0, "person", rect(20, 20, 8, 8)),
                (None, Some(8), 8, "car", rect(4, 4, 10, 10)),
                (None, Some(9), 9, "truck", rect(20, 20, 8, 8)),
                (None, Some(u32::MAX), i32::MAX, "bike", rect(0, 0, 2, 2)),
            ]
        );
    }

    #[cfg(feature = "analytics")]
    #[test]
    fn detections_are_regions_clipped_filtered_and_merged_with_roi_metas() {
        use crate::analytics::tests::detect;

        let mut buffer = buffer_with(&[("car", (4, 4, 10, 10))]);
        let b = buffer.get_mut().unwrap();
        let mirrored = detect(b, "car", (4, 4, 10, 10));
        let own = detect(b, "person", (-5, 20, 15, 40));
        detect(b, "car", (70, 0, 5, 5)); // outside the 64×48 frame
        let regions = regions_of(&buffer, 64, 48, &RegionFilter::default());
        let found: Vec<_> = regions
            .iter()
            .map(|r| (r.meta_index, r.detection, r.roi_type.as_str(), r.rect))
            .collect();
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
    fn a_result_lands_on_its_own_region_and_classifiers_in_series_add_up() {
        let mut buffer = buffer_with(&[("car", (0, 0, 4, 4)), ("car", (4, 4, 4, 4))]);
        let places: Vec<_> = regions_of(&buffer, 8, 8, &RegionFilter::default())
            .iter()
            .map(|r| (r.meta_index, r.detection))
            .collect();
        assert_eq!(places, [(Some(0), None), (Some(1), None)]);
        let entry = |label: &str, confidence| ClassEntry {
            class_id: 3,
            label: label.into(),
            confidence,
        };
        let buffer = buffer.make_mut();
        attach(buffer, 1, "colors.onnx", "c0", &[entry("red", 0.9)]);
        attach(buffer, 1, "types.onnx", "c1", &[entry("van", 0.6)]);
        let metas: Vec<_> = buffer.iter_meta::<VideoRegionOfInterestMeta>().collect();
        assert_eq!(
            metas[0].params().count(),
            0,
            "the other region is untouched"
        );
        let params: Vec<_> = metas[1].params().collect();
        assert_eq!(params.len(), 2);
        assert_eq!(params[0].name(), PARAM_NAME);
        assert_eq!(params[0].get::<String>("label").unwrap(), "red");
        assert_eq!(params[0].get::<i32>("label_id").unwrap(), 3);
        assert!((params[0].get::<f64>("confidence").unwrap() - 0.9).abs() < 1e-6);
        assert_eq!(
            params[0].get::<String>("model_name").unwrap(),
            "colors.onnx"
        );
        assert_eq!(params[1].get::<String>("label").unwrap(), "van");
        assert_eq!(params[1].get::<String>("element_id").unwrap(), "c1");
    }
}
