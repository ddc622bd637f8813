// SPDX-License-Identifier: MPL-2.0
//! The `analytics` feature (GStreamer 1.24+; `scripts/chroot-tests.sh` runs these on 1.24 and
//! 1.26): results as `GstAnalyticsClsMtd`s in the analytics relation meta, and detections
//! (`GstAnalyticsODMtd`) as regions to classify, each result related to its detection.
#![cfg(feature = "analytics")]

mod common;

use common::{rgb_caps, rgb_of};
use gst_analytics::prelude::*;
use gst_analytics::{AnalyticsClassificationMtd, AnalyticsODMtd, AnalyticsRelationMeta, RelTypes};
use gst_video::VideoRegionOfInterestMeta;
use gsttrtclassify::meta::Classification;

const WIDTH: u32 = 64;
const HEIGHT: u32 = 48;

/// The classes of a ClsMtd: (label, confidence), best first.
fn classes(
    mtd: &gst_analytics::AnalyticsMtdRef<'_, AnalyticsClassificationMtd>,
) -> Vec<(String, f32)> {
    (0..mtd.len())
        .map(|i| (mtd.quark(i).as_str().to_string(), mtd.level(i)))
        .collect()
}

/// The ClsMtds of `buffer` related to no detection: whole-frame results, in the order the
/// classifiers added them.
fn frame_results(buffer: &gst::BufferRef) -> Vec<Vec<(String, f32)>> {
    let Some(meta) = buffer.meta::<AnalyticsRelationMeta>() else {
        return Vec::new();
    };
    let detections: Vec<u32> = meta.iter::<AnalyticsODMtd>().map(|d| d.id()).collect();
    meta.iter::<AnalyticsClassificationMtd>()
        .filter(|c| {
            detections
                .iter()
                .all(|&d| meta.relation(d, c.id()) == RelTypes::NONE)
        })
        .map(|c| classes(&c))
        .collect()
}

/// For each detection of `buffer`: its type and the top labels of the ClsMtds related to it.
fn detection_results(buffer: &gst::BufferRef) -> Vec<(String, Vec<String>)> {
    let meta = buffer
        .meta::<AnalyticsRelationMeta>()
        .expect("a relation meta");
    meta.iter::<AnalyticsODMtd>()
        .map(|d| {
            let labels = meta
                .iter_direct_related::<AnalyticsClassificationMtd>(d.id(), RelTypes::RELATE_TO)
                .map(|c| {
                    assert!(c.level(0) > 0.9, "{:?}", classes(&c));
                    c.quark(0).as_str().to_string()
                })
                .collect();
            (d.obj_type().unwrap().as_str().to_string(), labels)
        })
        .collect()
}

#[test]
fn whole_frames_get_one_cls_mtd_per_classifier_in_series() {
    common::init();
    let element = |name: &str| {
        common::colors_element(&format!(
            "name={name} top-k=3 batch-size=2 model-instance-id=analytics-series-{name}"
        ))
    };
    let mut h = gst_check::Harness::new_parse(&format!("{} ! {}", element("a"), element("b")));
    h.set_src_caps(rgb_caps(WIDTH as i32, HEIGHT as i32));
    let colours = ["red", "blue", "yellow", "white", "green"];
    for (i, colour) in colours.iter().enumerate() {
        h.push(common::solid_rgb(WIDTH, HEIGHT, rgb_of(colour), i as u64))
            .unwrap();
    }
    h.push_event(gst::event::Eos::new());
    for colour in colours {
        let buffer = h.pull().unwrap();
        let results = frame_results(&buffer);
        assert_eq!(results.len(), 2, "one per classifier: {results:?}");
        // The custom meta holds the last classifier's result: the same classes.
        let custom = Classification::from_buffer(&buffer).unwrap();
        for result in &results {
            assert_eq!(result.len(), 3, "top-k=3");
            assert_eq!(result[0].0, colour);
            assert_eq!(
                custom.classes.len(),
                result.len(),
                "the custom meta's classes"
            );
            for ((label, level), entry) in result.iter().zip(&custom.classes) {
                assert_eq!(*label, entry.label);
                assert!((level - entry.confidence).abs() < 1e-6);
            }
        }
    }
}

/// A box of a frame: its type, x, y, w, h and colour.
type Box = (&'static str, (i32, i32, i32, i32), &'static str);

/// Frame `index`'s boxes; colours rotate with the index. The first is also published as a ROI
/// meta (as DL Streamer does); the last lies half outside the frame.
fn boxes(index: u64) -> [Box; 3] {
    let colours = ["red", "green", "blue", "yellow", "white"];
    let pick = |k: usize| colours[(index as usize + k) % colours.len()];
    [
        ("car", (3, 5, 17, 13), pick(0)),
        ("person", (37, 3, 11, 23), pick(1)),
        ("car", (-6, 30, 20, 30), pick(2)),
    ]
}

fn frame(index: u64) -> gst::Buffer {
    let mut buffer = common::solid_rgb(WIDTH, HEIGHT, [0, 0, 0], index);
    let b = buffer.get_mut().unwrap();
    for (_, rect, colour) in boxes(index) {
        common::fill_rgb(b, (WIDTH, HEIGHT), rect, rgb_of(colour));
    }
    {
        let mut meta = AnalyticsRelationMeta::add(b);
        for (kind, (x, y, w, h), _) in boxes(index) {
            meta.add_od_mtd(glib::Quark::from_str(kind), x, y, w, h, 0.8)
                .unwrap();
        }
    }
    let (kind, (x, y, w, h), _) = boxes(index)[0];
    VideoRegionOfInterestMeta::add(b, kind, (x as u32, y as u32, w as u32, h as u32));
    buffer
}

#[test]
fn each_detection_gets_its_colour_related_to_it() {
    common::init();
    let mut h = gst_check::Harness::new_parse(&common::colors_element(
        "roi=regions batch-size=2 batch-timeout=-1 model-instance-id=analytics-detections",
    ));
    h.set_src_caps(rgb_caps(WIDTH as i32, HEIGHT as i32));
    for i in 0..5 {
        h.push(frame(i)).unwrap();
    }
    h.push_event(gst::event::Eos::new());
    for i in 0..5 {
        let buffer = h.pull().unwrap();
        assert_eq!(buffer.offset(), i);
        let expected: Vec<(String, Vec<String>)> = boxes(i)
            .iter()
            .map(|(kind, _, colour)| (kind.to_string(), vec![colour.to_string()]))
            .collect();
        assert_eq!(detection_results(&buffer), expected, "frame {i}");
        assert!(
            frame_results(&buffer).is_empty(),
            "roi=regions: no whole-frame result"
        );
        // The box published both ways was classified once, and its ROI meta has it too.
        let custom = Classification::from_buffer(&buffer).unwrap();
        assert_eq!(custom.regions.len(), 3);
        let roi = buffer.meta::<VideoRegionOfInterestMeta>().unwrap();
        let param = roi.params().next().expect("a classification param");
        assert_eq!(param.get::<String>("label").unwrap(), boxes(i)[0].2);
    }
}

#[test]
fn type_filters_apply_to_detections_and_roi_both_adds_the_frame() {
    common::init();
    let mut h = gst_check::Harness::new_parse(&common::colors_element(
        "roi=both roi-types=person model-instance-id=analytics-both",
    ));
    h.set_src_caps(rgb_caps(WIDTH as i32, HEIGHT as i32));
    h.push(frame(2)).unwrap();
    let buffer = h.pull().unwrap();
    let results = detection_results(&buffer);
    assert_eq!(
        results,
        [
            ("car".to_owned(), vec![]),
            ("person".to_owned(), vec![boxes(2)[1].2.to_owned()]),
            ("car".to_owned(), vec![]),
        ]
    );
    let frame = frame_results(&buffer);
    assert_eq!(frame.len(), 1);
    assert_eq!(frame[0][0].0, "black", "the frame is mostly black");
}
