// SPDX-License-Identifier: MPL-2.0
//! Many live cameras into `trtclassify` for a while, as a camera server runs them: the
//! benchmark of the overload policy, of live model updates and of long runs (bench/gpu/live.sh
//! runs it on the GPU host; here it runs on the CPU with test sources).
//!
//! cargo run --release --example live_cameras -- [OPTIONS]
//!
//!   --streams N       cameras (default 4)
//!   --seconds S       how long they run (default 20)
//!   --source DESC     a launch fragment that makes one camera's raw video, `{i}` its number
//!                     and `{offset}` its phase in ns (cameras do not tick together); default
//!                     a live 320x240 30 fps test source
//!   --loop            the source ends in a demuxer named `demux{i}`: it plays again from the
//!                     start at its end (segment seeks), so that a file plays for `--seconds`
//!   --element PROPS   the element's properties (onnx-location and the rest)
//!   --swap A,B        every `--every` seconds, onnx-location goes to the other of A and B on
//!                     every element (a live model update); the elements start with A
//!   --every S         (default 30)
//!   --regions K       K regions of interest a frame (a detector's boxes, 48 to 328 pixels
//!                     wide, other places and sizes each frame) attached before the element,
//!                     for secondary classification (`roi=regions` in --element)
//!   --decode-only     no element: the cameras alone, the yardstick of the run with it
//!   --label L         the first column of the table row
//!
//! Prints the run's figures and one markdown table row: frames in and out (and lost), the
//! share of frames classified per camera (least, median, most), how late frames left against
//! the time they were due (p99: median and worst camera), time in the element (worst p99),
//! the longest gap between two frames of a camera after the first 2 s, model updates applied,
//! engine batches, and the process's memory (RSS) and GPU memory (where nvidia-smi runs) at
//! the first minute's sample and at the end. With `--regions`, a line of the regions
//! classified (crops a second) too.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gst::prelude::*;
use gst_video::VideoRegionOfInterestMeta;
use gsttrtclassify::meta::Classification;

/// What one camera's frames did.
#[derive(Default)]
struct Camera {
    frames_in: u64,
    frames_out: u64,
    fresh: u64,
    /// Regions classified, over the fresh frames.
    regions: u64,
    last_out: Option<Instant>,
    /// The longest time between two frames out, after the first two seconds.
    longest_gap: Duration,
}

struct Args {
    streams: usize,
    seconds: u64,
    source: String,
    looped: bool,
    element: String,
    swap: Option<(String, String)>,
    every: u64,
    regions: usize,
    decode_only: bool,
    label: String,
}

fn args() -> Args {
    let mut a = Args {
        streams: 4,
        seconds: 20,
        source: "videotestsrc is-live=true pattern=ball ! \
                 video/x-raw,width=320,height=240,framerate=30/1"
            .into(),
        looped: false,
        element: "onnx-location=models/colors.onnx".into(),
        swap: None,
        every: 30,
        regions: 0,
        decode_only: false,
        label: "live".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--streams" => a.streams = value().parse().expect("a number of streams"),
            "--seconds" => a.seconds = value().parse().expect("seconds"),
            "--source" => a.source = value(),
            "--loop" => a.looped = true,
            "--element" => a.element = value(),
            "--swap" => {
                let v = value();
                let (x, y) = v.split_once(',').expect("--swap A,B");
                a.swap = Some((x.into(), y.into()));
            }
            "--every" => a.every = value().parse().expect("seconds"),
            "--regions" => a.regions = value().parse().expect("a number of regions"),
            "--decode-only" => a.decode_only = true,
            "--label" => a.label = value(),
            other => panic!("unknown option {other}"),
        }
    }
    a
}

/// The process's resident memory in MiB.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// GPU 0's memory in use in MiB, where nvidia-smi runs.
fn gpu_mib() -> Option<f64> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

/// Attaches `k` boxes to frame `n` of a `width`×`height` stream: sizes from 48 to 328
/// pixels wide, tall or wide, spread over the frame, each frame in other places, as a
/// detector's boxes on a busy scene.
fn attach_regions(buffer: &mut gst::BufferRef, n: u64, k: usize, width: u32, height: u32) {
    for j in 0..k as u64 {
        let w = (48 + (j * 97 + n * 13) % 8 * 40) as u32;
        let h = (w as u64 * (3 + (j + n) % 4) / 4) as u32;
        let (w, h) = (w.min(width), h.min(height));
        let x = ((j * u64::from(width) / k as u64 + n * 7) % u64::from(width - w + 1)) as u32;
        let y = ((j * 131 + n * 5) % u64::from(height - h + 1)) as u32;
        let kind = if j % 3 == 0 { "person" } else { "car" };
        VideoRegionOfInterestMeta::add(buffer, kind, (x, y, w, h)).set_id(j as i32);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    let a = args();
    gst::init().expect("GStreamer");
    gsttrtclassify::plugin_register_static().expect("the plugin");
    let branches: Vec<String> = (0..a.streams)
        .map(|i| {
            let source = a.source.replace("{i}", &i.to_string()).replace(
                "{offset}",
                &(i as u64 * 33_333_333 / a.streams as u64).to_string(),
            );
            let element = match a.decode_only {
                true => "identity".to_owned(),
                false => format!("trtclassify {}", a.element),
            };
            format!("{source} ! {element} name=c{i} ! fakesink sync=false async=false")
        })
        .collect();
    let pipeline = gst::parse::launch(&branches.join(" "))
        .expect("the pipeline")
        .downcast::<gst::Pipeline>()
        .expect("a pipeline");
    let started = Instant::now();
    let cameras: Vec<Arc<Mutex<Camera>>> = (0..a.streams).map(|_| Default::default()).collect();
    let elements: Vec<gst::Element> = (0..a.streams)
        .map(|i| pipeline.by_name(&format!("c{i}")).expect("the element"))
        .collect();
    for (element, camera) in elements.iter().zip(&cameras) {
        let into = camera.clone();
        let regions = a.regions;
        element.static_pad("sink").unwrap().add_probe(
            gst::PadProbeType::BUFFER,
            move |pad, info| {
                let n = {
                    let mut c = into.lock().unwrap();
                    c.frames_in += 1;
                    c.frames_in
                };
                let size = pad
                    .current_caps()
                    .and_then(|caps| gst_video::VideoInfo::from_caps(&caps).ok())
                    .map(|v| (v.width(), v.height()));
                if let (true, Some(buffer), Some((w, h))) = (regions > 0, info.buffer_mut(), size) {
                    attach_regions(buffer.make_mut(), n, regions, w, h);
                }
                gst::PadProbeReturn::Ok
            },
        );
        let out = camera.clone();
        element
            .static_pad("src")
            .unwrap()
            .add_probe(gst::PadProbeType::BUFFER, move |_, info| {
                let result = info
                    .buffer()
                    .and_then(|b| Classification::from_buffer(b))
                    .filter(|c| c.fresh);
                let now = Instant::now();
                let mut c = out.lock().unwrap();
                c.frames_out += 1;
                c.fresh += u64::from(result.is_some());
                c.regions += result.map_or(0, |r| r.regions.len() as u64);
                if let Some(last) = c.last_out
                    && now.duration_since(started) > Duration::from_secs(2)
                {
                    c.longest_gap = c.longest_gap.max(now - last);
                }
                c.last_out = Some(now);
                gst::PadProbeReturn::Ok
            });
    }
    let bus = pipeline.bus().unwrap();
    if pipeline.set_state(gst::State::Paused).expect("PAUSED") == gst::StateChangeSuccess::Async {
        let _ = bus.timed_pop_filtered(
            gst::ClockTime::from_seconds(120),
            &[gst::MessageType::AsyncDone, gst::MessageType::Error],
        );
    }
    let segment_seek = |i: usize, flags: gst::SeekFlags| {
        if let Some(demux) = pipeline.by_name(&format!("demux{i}")) {
            demux
                .seek_simple(flags | gst::SeekFlags::SEGMENT, gst::ClockTime::ZERO)
                .is_ok()
        } else {
            false
        }
    };
    if a.looped {
        // Each demuxer plays its file as a segment, to be played again at its end: once it
        // has found its streams, before the cameras start.
        let ready = Instant::now() + Duration::from_secs(30);
        for i in 0..a.streams {
            while !segment_seek(i, gst::SeekFlags::FLUSH) {
                assert!(Instant::now() < ready, "demux{i} takes no seek");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        for camera in &cameras {
            *camera.lock().unwrap() = Camera::default();
        }
    }
    pipeline.set_state(gst::State::Playing).expect("PLAYING");
    let playing = Instant::now();
    let (mut memory, mut next_sample) = (Vec::new(), playing);
    let (mut next_swap, mut to_b) = (playing + Duration::from_secs(a.every), true);
    let end = playing + Duration::from_secs(a.seconds);
    let mut eos_sent = false;
    loop {
        let now = Instant::now();
        if now >= next_sample {
            memory.push((now.duration_since(playing).as_secs(), rss_mib(), gpu_mib()));
            next_sample += Duration::from_secs(10);
        }
        if let Some((ma, mb)) = &a.swap
            && now >= next_swap
            && now < end
        {
            let model = if to_b { mb } else { ma };
            for element in &elements {
                element.set_property("onnx-location", model);
            }
            to_b = !to_b;
            next_swap += Duration::from_secs(a.every);
        }
        if now >= end && !eos_sent {
            // A demuxer playing segments never ends by itself: sent to its file's end with a
            // plain seek, it ends its stream (EOS), and the elements let their frames out.
            for i in 0..a.streams {
                if let Some(demux) = pipeline.by_name(&format!("demux{i}")) {
                    let end = demux
                        .query_duration::<gst::ClockTime>()
                        .unwrap_or(gst::ClockTime::ZERO);
                    demux.seek_simple(gst::SeekFlags::empty(), end).ok();
                }
            }
            pipeline.send_event(gst::event::Eos::new());
            eos_sent = true;
        }
        let Some(msg) = bus.timed_pop(gst::ClockTime::from_mseconds(50)) else {
            continue;
        };
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => {
                eprintln!(
                    "error from {:?}: {} ({:?})",
                    msg.src().map(|s| s.name()),
                    e.error(),
                    e.debug()
                );
                std::process::exit(1);
            }
            gst::MessageView::Warning(w) => {
                eprintln!(
                    "warning from {:?}: {}",
                    msg.src().map(|s| s.name()),
                    w.error()
                )
            }
            // The pipeline says it when every demuxer has played its segment: all play again.
            gst::MessageView::SegmentDone(_) if !eos_sent => {
                for i in 0..a.streams {
                    segment_seek(i, gst::SeekFlags::empty());
                }
            }
            _ => (),
        }
    }
    memory.push((playing.elapsed().as_secs(), rss_mib(), gpu_mib()));
    let stats: Vec<gst::Structure> = elements
        .iter()
        .map(|e| match a.decode_only {
            true => gst::Structure::new_empty("decode-only"),
            false => e.property::<gst::Structure>("stats"),
        })
        .collect();
    pipeline.set_state(gst::State::Null).expect("NULL");
    report(&a, &cameras, &stats, &memory, playing.elapsed());
}

fn report(
    a: &Args,
    cameras: &[Arc<Mutex<Camera>>],
    stats: &[gst::Structure],
    memory: &[(u64, f64, Option<f64>)],
    ran: Duration,
) {
    let cams: Vec<_> = cameras.iter().map(|c| c.lock().unwrap()).collect();
    let (frames_in, frames_out): (u64, u64) = (
        cams.iter().map(|c| c.frames_in).sum(),
        cams.iter().map(|c| c.frames_out).sum(),
    );
    let shares: Vec<f64> = cams
        .iter()
        .map(|c| c.fresh as f64 / c.frames_out.max(1) as f64)
        .collect();
    let ms = |s: &gst::Structure, f: &str| s.get::<u64>(f).unwrap_or(0) as f64 / 1e6;
    let late_p99: Vec<f64> = stats.iter().map(|s| ms(s, "lateness-p99")).collect();
    let in_p99: Vec<f64> = stats.iter().map(|s| ms(s, "latency-p99")).collect();
    let gap = cams.iter().map(|c| c.longest_gap).max().unwrap_or_default();
    let updates = stats
        .iter()
        .map(|s| s.get::<u64>("model-updates").unwrap_or(0))
        .min()
        .unwrap_or(0);
    let s0 = &stats[0];
    let classified: u64 = cams.iter().map(|c| c.fresh).sum();
    println!(
        "{} cameras for {:.0?}: {frames_in} frames in, {frames_out} out, {classified} classified ({:.0} a second); engine: {} batches, fill {:.2}, {:.1} ms a batch, {} rebuilds",
        cams.len(),
        ran,
        classified as f64 / ran.as_secs_f64(),
        s0.get::<u64>("batches").unwrap_or(0),
        s0.get::<f64>("mean-batch-fill").unwrap_or(0.0),
        ms(s0, "batch-time"),
        s0.get::<u64>("engine-rebuilds").unwrap_or(0),
    );
    if a.regions > 0 {
        let regions: u64 = cams.iter().map(|c| c.regions).sum();
        println!(
            "regions: {} a frame attached, {regions} classified ({:.0} a second), {:.0} frames a second out",
            a.regions,
            regions as f64 / ran.as_secs_f64(),
            frames_out as f64 / ran.as_secs_f64(),
        );
    }
    println!("memory (s, RSS MiB, GPU MiB): {memory:?}");
    let first = memory
        .iter()
        .find(|m| m.0 >= 60)
        .or(memory.first())
        .copied()
        .unwrap_or_default();
    let last = memory.last().copied().unwrap_or_default();
    let gpu = |m: Option<f64>| m.map_or("–".into(), |v| format!("{v:.0}"));
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!(
        "| camera run | cameras | s | frames in | out | lost | classified per camera (least / median / most) | late p99 ms (median / worst camera) | in element p99 ms (worst) | longest gap ms | model updates | RSS MiB (at {} s / end) | GPU MiB (at {} s / end) |",
        first.0, first.0
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {frames_in} | {frames_out} | {} | {:.1}% / {:.1}% / {:.1}% | {:.0} / {:.0} | {:.0} | {:.0} | {updates} | {:.0} / {:.0} | {} / {} |",
        a.label,
        cams.len(),
        ran.as_secs(),
        frames_in - frames_out,
        100.0 * min(&shares),
        100.0 * median(shares.clone()),
        100.0 * max(&shares),
        median(late_p99.clone()),
        max(&late_p99),
        max(&in_p99),
        gap.as_secs_f64() * 1e3,
        first.1,
        last.1,
        gpu(first.2),
        gpu(last.2),
    );
}
