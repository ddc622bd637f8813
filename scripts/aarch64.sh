#!/usr/bin/env bash
# Cross-builds the plugin for aarch64 (Jetson, ARM servers) on an x86_64 Debian 12 / Ubuntu
# machine, and runs the CPU-backend tests of the built binaries under qemu-user.
#
#   scripts/aarch64.sh          build the plugin, run the CPU-backend tests under qemu
#   scripts/aarch64.sh build    build only: target/aarch64-unknown-linux-gnu/debug/libgsttrtclassify.so
#   scripts/aarch64.sh smoke    build, then the element's and the engine's tests (CI)
#
# The classifier's plugin only, not the overlay's (crates/overlay): its Pango and Cairo would
# need their arm64 -dev packages too. Debug builds: dependencies are optimised (opt-level 2, see
# Cargo.toml), so tract runs fast enough under qemu, and the build is quicker than release.
#
# Debian's arm64 runtime packages install beside the machine's own (multiarch), but its
# GStreamer -dev packages cannot (libgstreamer-plugins-base1.0-dev is not Multi-Arch: same):
# installing them would remove the x86_64 ones. So only their pkg-config files and library
# links are unpacked, into target/aarch64-sysroot, and point at the arm64 runtime libraries.
# The RTSP server's runtime library is not Multi-Arch: same either (installing its arm64
# package removes the x86_64 one and the -dev and GIR packages that need it), so it is
# unpacked there too, and the tests find it under qemu through the guest's library path.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
export DEBIAN_FRONTEND=noninteractive
target=aarch64-unknown-linux-gnu
sudo=$([ "$(id -u)" = 0 ] || echo sudo)

# 1. The cross compiler, qemu, and GStreamer's arm64 runtime (libraries and the plugins the
#    tests use: videotestsrc, videoconvert, appsrc/appsink).
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $sudo dpkg --add-architecture arm64
fi
$sudo apt-get update
$sudo apt-get install -y --no-install-recommends \
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static \
    libgstreamer1.0-0:arm64 libgstreamer-plugins-base1.0-0:arm64 \
    gstreamer1.0-plugins-base:arm64
rustup target add "$target"

# 2. pkg-config files and .so links of the -dev packages, and the RTSP server's runtime
#    library, unpacked, not installed.
sysroot=$PWD/target/aarch64-sysroot
runtime=$sysroot/root/usr/lib/aarch64-linux-gnu
unpacked="libgstreamer1.0-dev:arm64 libgstreamer-plugins-base1.0-dev:arm64
    libgstrtspserver-1.0-dev:arm64 libgstrtspserver-1.0-0:arm64 libglib2.0-dev:arm64
    liborc-0.4-dev:arm64"
# .done holds the packages unpacked: a sysroot of another list is unpacked again.
if [ "$(cat "$sysroot/.done" 2>/dev/null)" != "$unpacked" ]; then
    rm -rf "$sysroot"
    mkdir -p "$sysroot/debs" "$sysroot/root" "$sysroot/lib"
    # shellcheck disable=SC2086 # a list of packages
    (cd "$sysroot/debs" && apt-get download $unpacked)
    for deb in "$sysroot"/debs/*.deb; do dpkg -x "$deb" "$sysroot/root"; done
    # libfoo.so -> libfoo.so.0 (relative, in the package) becomes a link to the arm64
    # library, for the linker: the one unpacked here (the RTSP server's), else the installed.
    for link in "$runtime"/*.so; do
        target_lib=$runtime/$(readlink "$link")
        [ -e "$target_lib" ] || target_lib=/usr/lib/aarch64-linux-gnu/$(readlink "$link")
        ln -sf "$target_lib" "$sysroot/lib/$(basename "$link")"
    done
    echo "$unpacked" > "$sysroot/.done"
fi
export PKG_CONFIG_ALLOW_CROSS=1
export PKG_CONFIG_LIBDIR=$sysroot/root/usr/lib/aarch64-linux-gnu/pkgconfig:$sysroot/root/usr/share/pkgconfig:$sysroot/stubs
# pkg-config insists on the Requires.private of those files (libpcre2-8, libffi, zlib, ...),
# which only a static link uses: empty stand-ins satisfy it for this dynamic link.
mkdir -p "$sysroot/stubs"
modules="gstreamer-1.0 gstreamer-base-1.0 gstreamer-video-1.0 gstreamer-app-1.0 gstreamer-check-1.0
    gstreamer-rtsp-server-1.0 gstreamer-net-1.0 gio-2.0 gobject-2.0 glib-2.0"
for _ in $(seq 30); do
    # shellcheck disable=SC2086 # a list of modules
    missing=$({ pkg-config --exists --print-errors $modules 2>&1 || true; } |
        sed -n "s/^Package '\([^']*\)', required by .*/\1/p" | sort -u)
    [ -n "$missing" ] || break
    for module in $missing; do
        printf 'Name: %s\nDescription: stand-in for a static-only dependency\nVersion: 999\n' \
            "$module" > "$sysroot/stubs/$module.pc"
    done
done
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C link-arg=-L$sysroot/lib -C link-arg=-Wl,-rpath-link,/usr/lib/aarch64-linux-gnu"
# The test binaries run under qemu; GStreamer scans its plugins in-process (its scanner
# helper is an arm64 program that the kernel cannot start without binfmt_misc).
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -E LD_LIBRARY_PATH=$runtime"
export GST_REGISTRY_FORK=no
export GST_REGISTRY=$PWD/target/aarch64-registry.bin
export GST_PLUGIN_SYSTEM_PATH=/usr/lib/aarch64-linux-gnu/gstreamer-1.0

features=(--locked --target "$target")
cargo build "${features[@]}" -p gst-plugin-trtclassify --lib
file "target/$target/debug/libgsttrtclassify.so"
[ "${1:-}" = build ] && exit 0

# 3. The CPU backend's tests, built for aarch64, run under qemu: the element, the engine
#    against onnxruntime's outputs, regions of interest, the CUDA tests (which must skip
#    cleanly: no CUDA under qemu) and the unit tests, the compiler's and the CPU runtime's
#    included. CI runs the first two; the unit tests take about 10 minutes under qemu.
tests=(--test element --test engine)
[ "${1:-}" = smoke ] || tests+=(--test regions --test cuda --lib)
log=$(mktemp)
cargo test "${features[@]}" -p gst-plugin-trtclassify "${tests[@]}" 2>&1 | tee "$log"
[ "${1:-}" = smoke ] ||
    cargo test "${features[@]}" -p trtclassify-compiler -p trtclassify-cpu --lib 2>&1 | tee -a "$log"
awk '/^SKIPPED / { s++ } /^test result:/ { p += $4; f += $6; i += $8 } END { printf "aarch64 under qemu: %d passed, %d failed, %d skipped\n", p - s, f, i + s }' "$log"
rm -f "$log"
