// SPDX-License-Identifier: MPL-2.0
//! `trtclassifyoverlay`: the frame's label, each classified region's outline and label are
//! drawn where they belong, and nothing else in the picture changes.

#[path = "../../../tests/common/mod.rs"]
mod common;

/// GStreamer, the classifier and the overlay, registered once.
fn init() {
    static INIT: std::sync::Once = std::sync::Once::new();
    common::init();
    INIT.call_once(|| gsttrtclassifyoverlay::plugin_register_static().expect("registers"));
}

use gst_video::VideoRegionOfInterestMeta;

const WIDTH: u32 = 320;
const HEIGHT: u32 = 240;
const BLUE: [u8; 3] = [0, 0, 255];
const RED: [u8; 3] = [255, 0, 0];
/// The region: x, y, width, height.
const BOX: (u32, u32, u32, u32) = (160, 120, 80, 60);

/// A blue frame with a red box and its ROI meta.
fn frame(index: u64) -> gst::Buffer {
    let mut buffer = common::solid_rgb(WIDTH, HEIGHT, BLUE, index);
    let b = buffer.get_mut().unwrap();
    let (x, y, w, h) = BOX;
    let rect = (x as i32, y as i32, w as i32, h as i32);
    common::fill_rgb(b, (WIDTH, HEIGHT), rect, RED);
    VideoRegionOfInterestMeta::add(b, "car", BOX);
    buffer
}

fn pixel(buffer: &gst::BufferRef, x: u32, y: u32) -> [u8; 3] {
    let map = buffer.map_readable().unwrap();
    let at = ((y * WIDTH + x) * 3) as usize;
    [map[at], map[at + 1], map[at + 2]]
}

/// The pixels of the area x0..x1, y0..y1 that differ from `was`: (near white, others).
fn changed(
    buffer: &gst::BufferRef,
    (x0, y0, x1, y1): (u32, u32, u32, u32),
    was: [u8; 3],
) -> (usize, usize) {
    let (mut white, mut other) = (0, 0);
    for y in y0..y1 {
        for x in x0..x1 {
            let p = pixel(buffer, x, y);
            if p.iter().all(|&v| v > 200) {
                white += 1;
            } else if p != was {
                other += 1;
            }
        }
    }
    (white, other)
}

fn harness(overlay: &str) -> gst_check::Harness {
    init();
    let mut h = gst_check::Harness::new_parse(&format!(
        "{} ! trtclassifyoverlay {overlay}",
        common::colors_element("roi=both model-instance-id=overlay-test")
    ));
    h.set_src_caps(common::rgb_caps(WIDTH as i32, HEIGHT as i32));
    h
}

#[test]
fn labels_and_outlines_are_drawn_where_the_results_are() {
    let mut h = harness("");
    h.push(frame(0)).unwrap();
    let out = h.pull().unwrap();
    // The frame's label ("blue 1.00") in the top-left corner: white glyphs on a darkened box.
    let (white, darkened) = changed(&out, (0, 0, 120, 20), BLUE);
    assert!(white > 20, "glyph pixels in the frame's label: {white}");
    assert!(darkened > 200, "label background pixels: {darkened}");
    // The region's outline, 2 pixels thick at 240 lines, in green; its inside is untouched.
    let (x, y, w, h) = BOX;
    assert_eq!(pixel(&out, x + w / 2, y), [0, 255, 0]);
    assert_eq!(pixel(&out, x, y + h / 2), [0, 255, 0]);
    assert_eq!(pixel(&out, x + w - 1, y + h - 1), [0, 255, 0]);
    assert_eq!(pixel(&out, x + w / 2, y + h / 2), RED);
    // Its label ("red 1.00") just above it.
    let (white, _) = changed(&out, (x, y - 12, x + w, y), BLUE);
    assert!(white > 10, "glyph pixels in the region's label: {white}");
    // Away from both, the picture is as it was.
    assert_eq!(changed(&out, (0, 40, 150, HEIGHT), BLUE), (0, 0));
    assert_eq!(changed(&out, (250, 0, WIDTH, 110), BLUE), (0, 0));
}

#[test]
fn a_region_without_a_result_and_a_frame_without_meta_pass_untouched() {
    init();
    // No classifier upstream: no result to draw, not even for the ROI meta.
    let mut h = gst_check::Harness::new("trtclassifyoverlay");
    h.set_src_caps(common::rgb_caps(WIDTH as i32, HEIGHT as i32));
    let input = frame(1);
    h.push(input.clone()).unwrap();
    let out = h.pull().unwrap();
    assert_eq!(
        out.map_readable().unwrap().as_slice(),
        input.map_readable().unwrap().as_slice()
    );
}

#[test]
fn labels_follow_the_font_and_leave_out_the_confidence_when_asked() {
    let mut small = harness("font-desc=\"Sans 6\" show-confidence=false");
    small.push(frame(2)).unwrap();
    let small = small.pull().unwrap();
    let mut big = harness("font-desc=\"Sans Bold 20\"");
    big.push(frame(2)).unwrap();
    let big = big.pull().unwrap();
    let area = |b: &gst::BufferRef| {
        let (white, other) = changed(b, (0, 0, WIDTH, 60), BLUE);
        white + other
    };
    assert!(
        area(&big) > 4 * area(&small),
        "a 20-point label with its confidence covers more than a 6-point one without: {} vs {}",
        area(&big),
        area(&small)
    );
}

/// The guide's MP4 line, as `pipelines/overlay-mp4.sh` runs it: the file decodes back to
/// every frame, with the label on it.
#[test]
fn an_mp4_with_the_labels_decodes_back_with_every_frame() {
    init();
    let Some(encoder) = ["x264enc", "openh264enc"]
        .into_iter()
        .find(|e| gst::ElementFactory::find(e).is_some())
    else {
        common::skipped("no H.264 encoder (x264enc, openh264enc)");
        return;
    };
    let path = std::env::temp_dir().join(format!("trtclassify-overlay-{}.mp4", std::process::id()));
    let encode = common::launch(&format!(
        "videotestsrc num-buffers=30 pattern=blue ! video/x-raw,width={WIDTH},height={HEIGHT},framerate=30/1 ! \
         {} ! trtclassifyoverlay ! videoconvert ! {encoder} ! h264parse ! mp4mux ! filesink location={}",
        common::colors_element("batch-size=8 model-instance-id=overlay-mp4"),
        path.display()
    ));
    common::run_to_eos(&encode).unwrap();
    let decode = common::launch(&format!(
        "filesrc location={} ! decodebin ! videoconvert ! video/x-raw,format=RGB ! appsink name=sink sync=false",
        path.display()
    ));
    let sink = common::appsink(&decode, "sink");
    let frames = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = frames.clone();
    sink.set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                kept.lock().unwrap().push(sample.buffer_owned().unwrap());
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    common::run_to_eos(&decode).unwrap();
    std::fs::remove_file(&path).unwrap();
    let frames = frames.lock().unwrap();
    assert_eq!(frames.len(), 30);
    // Lossy: near white glyphs in the label box, the far corner still near blue.
    for frame in frames.iter() {
        let (white, _) = changed(frame, (0, 0, 120, 20), BLUE);
        assert!(white > 20, "glyph pixels: {white}");
        let [r, g, b] = pixel(frame, WIDTH - 10, HEIGHT - 10);
        assert!(r < 40 && g < 40 && b > 200, "{r} {g} {b}");
    }
}
