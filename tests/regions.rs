// SPDX-License-Identifier: MPL-2.0
//! `roi=regions` and `roi=both`: frames carry coloured boxes with a
//! `GstVideoRegionOfInterestMeta` each, as a detector upstream would attach them, and each box
//! must get its own colour from the colour model, on its ROI meta, in the frame's meta and
//! in the JSON lines.

mod common;

use common::{rgb_caps, rgb_of};
use gst::prelude::*;
use gst_video::VideoRegionOfInterestMeta;
use gsttrtclassify::meta::Classification;
use gsttrtclassify::regions::PARAM_NAME;

const WIDTH: u32 = 64;
const HEIGHT: u32 = 48;

/// x, y, width, height.
type Xywh = (u32, u32, u32, u32);

/// A box of frame `index`: its ROI type, its rectangle and its colour's name.
struct Box {
    roi_type: &'static str,
    rect: Xywh,
    colour: &'static str,
}

/// The boxes of frame `index`: their colours rotate with the index, so that a result given
/// to another frame or another box shows; odd coordinates, and one box half outside the frame.
fn boxes(index: u64) -> Vec<Box> {
    let colours = ["red", "green", "blue", "yellow", "white"];
    let pick = |k: usize| colours[(index as usize + k) % colours.len()];
    vec![
        Box {
            roi_type: "car",
            rect: (3, 5, 17, 13),
            colour: pick(0),
        },
        Box {
            roi_type: "person",
            rect: (37, 3, 11, 23),
            colour: pick(1),
        },
        Box {
            roi_type: "car",
            rect: (29, 31, 21, 11),
            colour: pick(2),
        },
        // Half outside: classified as clipped, 10×8.
        Box {
            roi_type: "car",
            rect: (54, 40, 20, 20),
            colour: pick(3),
        },
    ]
}

/// Paints frame `index`'s boxes on an RGB frame and attaches their ROI metas.
fn paint(buffer: &mut gst::BufferRef, index: u64) {
    for (k, b) in boxes(index).iter().enumerate() {
        let (x, y, w, h) = b.rect;
        let rect = (x as i32, y as i32, w as i32, h as i32);
        common::fill_rgb(buffer, (WIDTH, HEIGHT), rect, rgb_of(b.colour));
        // Ids as a tracker gives them; the element goes by the metas' order, not their ids.
        VideoRegionOfInterestMeta::add(buffer, b.roi_type, b.rect).set_id(100 + k as i32);
    }
}

/// Frame `index`: its boxes on black.
fn frame(index: u64) -> gst::Buffer {
    let mut buffer = common::solid_rgb(WIDTH, HEIGHT, [0, 0, 0], index);
    paint(buffer.get_mut().unwrap(), index);
    buffer
}

fn harness(extra: &str) -> gst_check::Harness {
    common::init();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = gst_check::Harness::new_parse(&common::colors_element(&format!(
        "{extra} model-instance-id=regions-test-{id}"
    )));
    h.set_src_caps(rgb_caps(WIDTH as i32, HEIGHT as i32));
    h
}

/// The `classification` params on each ROI meta of `buffer`, in meta order: (roi type,
/// labels of the params in order).
fn roi_labels(buffer: &gst::BufferRef) -> Vec<(String, Vec<String>)> {
    buffer
        .iter_meta::<VideoRegionOfInterestMeta>()
        .map(|m| {
            let labels = m
                .params()
                .filter(|p| p.name() == PARAM_NAME)
                .map(|p| {
                    let confidence = p.get::<f64>("confidence").unwrap();
                    assert!(confidence > 0.9, "{p}");
                    p.get::<String>("label").unwrap()
                })
                .collect();
            (m.roi_type().to_owned(), labels)
        })
        .collect()
}

#[test]
fn each_region_gets_its_own_colour_across_batches() {
    // Four regions a frame in batches of 3: a frame's regions straddle batches.
    let mut h = harness("roi=regions batch-size=3 batch-timeout=-1");
    for i in 0..6 {
        h.push(frame(i)).unwrap();
    }
    h.push_event(gst::event::Eos::new());
    for i in 0..6 {
        let buffer = h.pull().expect("every frame leaves");
        assert_eq!(buffer.offset(), i, "in order");
        let want: Vec<(String, Vec<String>)> = boxes(i)
            .iter()
            .map(|b| (b.roi_type.to_owned(), vec![b.colour.to_owned()]))
            .collect();
        assert_eq!(roi_labels(&buffer), want, "frame {i}");

        let result = Classification::from_buffer(&buffer).unwrap();
        assert!(result.fresh);
        assert!(
            result.classes.is_empty(),
            "roi=regions: no whole-frame result"
        );
        let got: Vec<(&str, Xywh, &str)> = result
            .regions
            .iter()
            .map(|r| (r.roi_type.as_str(), r.rect, r.classes[0].label.as_str()))
            .collect();
        let mut want: Vec<(&str, Xywh, &str)> = boxes(i)
            .iter()
            .map(|b| (b.roi_type, b.rect, b.colour))
            .collect();
        want[3].1 = (54, 40, 10, 8);
        assert_eq!(got, want, "frame {i}");
        let ids: Vec<i32> = buffer
            .iter_meta::<VideoRegionOfInterestMeta>()
            .map(|m| m.id())
            .collect();
        let result_ids: Vec<i32> = result.regions.iter().map(|r| r.id).collect();
        assert_eq!(result_ids, ids, "results name their ROI metas");
        assert_eq!(ids, [100, 101, 102, 103]);
    }
}

#[test]
fn both_classifies_the_frame_and_types_and_sizes_filter_regions() {
    let mut h = harness("roi=both roi-types=car roi-min-width=12 roi-min-height=10");
    h.push(frame(0)).unwrap();
    let buffer = h.pull().unwrap();
    let result = Classification::from_buffer(&buffer).unwrap();
    assert_eq!(
        result.top().unwrap().label,
        "black",
        "the frame is mostly black"
    );
    let boxes = boxes(0);
    assert_eq!(
        roi_labels(&buffer),
        [
            ("car".to_owned(), vec![boxes[0].colour.to_owned()]),
            // Not a car.
            ("person".to_owned(), vec![]),
            ("car".to_owned(), vec![boxes[2].colour.to_owned()]),
            // A car, but 10×8 once clipped: below the minimum size.
            ("car".to_owned(), vec![]),
        ]
    );
    assert_eq!(result.regions.len(), 2);
}

#[test]
fn frames_without_regions_pass_in_order_with_nothing_classified() {
    let mut h = harness("roi=regions batch-size=4 batch-timeout=-1");
    let plain = |i: u64| {
        let mut b = common::solid_rgb(WIDTH, HEIGHT, [0, 0, 0], i);
        b.make_mut().set_offset(i);
        b
    };
    h.push(frame(0)).unwrap();
    h.push(plain(1)).unwrap();
    h.push(frame(2)).unwrap();
    h.push_event(gst::event::Eos::new());
    let mut regions = Vec::new();
    for i in 0..3 {
        let buffer = h.pull().unwrap();
        assert_eq!(buffer.offset(), i);
        let result = Classification::from_buffer(&buffer).unwrap();
        assert!(result.classes.is_empty());
        regions.push(result.regions.len());
    }
    assert_eq!(regions, [4, 0, 4]);
}

#[test]
fn a_second_classifier_adds_its_result_beside_the_first() {
    common::init();
    let element = |name: &str| {
        common::colors_element(&format!(
            "name={name} roi=regions model-instance-id=regions-series-{name}"
        ))
    };
    let mut h = gst_check::Harness::new_parse(&format!("{} ! {}", element("a"), element("b")));
    h.set_src_caps(rgb_caps(WIDTH as i32, HEIGHT as i32));
    h.push(frame(1)).unwrap();
    let buffer = h.pull().unwrap();
    assert_eq!(
        buffer.iter_meta::<VideoRegionOfInterestMeta>().count(),
        boxes(1).len(),
        "one ROI meta per box"
    );
    for (meta, b) in buffer
        .iter_meta::<VideoRegionOfInterestMeta>()
        .zip(boxes(1))
    {
        let params: Vec<(String, String)> = meta
            .params()
            .map(|p| {
                (
                    p.get::<String>("element_id").unwrap(),
                    p.get::<String>("label").unwrap(),
                )
            })
            .collect();
        assert_eq!(
            params,
            [
                ("a".to_owned(), b.colour.to_owned()),
                ("b".to_owned(), b.colour.to_owned())
            ]
        );
    }
}

#[test]
fn regions_of_yuv_frames_from_a_pipeline_with_json_lines() {
    common::init();
    let dir = std::env::temp_dir().join(format!("trtclassify-regions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lines_path = dir.join("results.jsonl");
    let _ = std::fs::remove_file(&lines_path);
    // A probe paints the boxes and attaches their metas, as a detector would; videoconvert
    // makes I420 of it, whose chroma at the boxes' odd edges is shared with the background.
    let pipeline = common::launch(&format!(
        "videotestsrc num-buffers=5 pattern=black ! video/x-raw,format=RGB,width={WIDTH},height={HEIGHT} \
         ! identity name=detector ! videoconvert ! video/x-raw,format=I420 \
         ! {} ! appsink name=sink",
        common::colors_element(&format!(
            "roi=regions results-location={} model-instance-id=regions-yuv",
            lines_path.display()
        ))
    ));
    let detector = pipeline.by_name("detector").unwrap();
    detector
        .static_pad("src")
        .unwrap()
        .add_probe(gst::PadProbeType::BUFFER, |_, info| {
            if let Some(gst::PadProbeData::Buffer(buffer)) = info.data.as_mut() {
                let index = buffer.offset();
                paint(buffer.make_mut(), index);
            }
            gst::PadProbeReturn::Ok
        });
    let sink = common::appsink(&pipeline, "sink");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen_in = seen.clone();
    sink.set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let buffer = sample.buffer().unwrap();
                seen_in
                    .lock()
                    .unwrap()
                    .push((buffer.offset(), roi_labels(buffer)));
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    common::run_to_eos(&pipeline).unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 5);
    for (index, labels) in seen.iter() {
        let want: Vec<(String, Vec<String>)> = boxes(*index)
            .iter()
            .map(|b| (b.roi_type.to_owned(), vec![b.colour.to_owned()]))
            .collect();
        assert_eq!(labels, &want, "frame {index}");
    }
    let text = std::fs::read_to_string(&lines_path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for (i, line) in lines.iter().enumerate() {
        let regions = line["regions"].as_array().expect("a regions list");
        let labels: Vec<&str> = regions
            .iter()
            .map(|r| r["topk"][0]["label"].as_str().unwrap())
            .collect();
        let want: Vec<&str> = boxes(i as u64).iter().map(|b| b.colour).collect();
        assert_eq!(labels, want, "line {i}");
        assert_eq!(regions[1]["roi_type"], "person");
        assert_eq!(regions[1]["width"], 11);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
