#!/usr/bin/env bash
# Packages the plugin as a .deb that installs it into the system's GStreamer plugin folder, so
# that gst-launch-1.0 and applications find it without GST_PLUGIN_PATH.
#
#   scripts/deb.sh            cargo build --release, then target/debian/gst-plugin-trtclassify_<version>_<arch>.deb
#   scripts/deb.sh debug      package the debug build instead (what CI checks)
#   sudo apt-get install ./target/debian/gst-plugin-trtclassify_*.deb
#
# The package holds the two plugins (trtclassify, trtclassifyoverlay), the engine tool (trtclassify-engine), the colour model with its
# labels (under /usr/share/gst-plugin-trtclassify) and the README. The GPU libraries are not
# dependencies: they are loaded at run time where they exist (backend=auto falls back to the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
profile=${1:-release}
if [ "$profile" = release ]; then
    cargo build --locked --release
else
    cargo build --locked
fi
version=$(awk -F'"' '/^version *=/ { print $2; exit }' Cargo.toml)
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
built=target/$profile
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
chmod 755 "$stage"
plugins=$stage/usr/lib/$multiarch/gstreamer-1.0
install -Dm644 -t "$plugins" "$built/libgsttrtclassify.so" "$built/libgsttrtclassifyoverlay.so"
install -Dm755 "$built/trtclassify-engine" "$stage/usr/bin/trtclassify-engine"
install -Dm644 -t "$stage/usr/share/gst-plugin-trtclassify/models" models/colors.onnx models/colors.txt
install -Dm644 README.md "$stage/usr/share/doc/gst-plugin-trtclassify/README.md"
# The README's links into docs/ hold in the installed copy.
install -Dm644 -t "$stage/usr/share/doc/gst-plugin-trtclassify/docs" docs/guide.md docs/scaling.md \
    docs/bad-inputs.md
strip --strip-unneeded "$plugins"/*.so "$stage/usr/bin/trtclassify-engine"
# The GStreamer libraries the plugin links (GStreamer 1.20 is the oldest it supports); the
# C library and the others through the shared-library dependencies of the GStreamer ones.
depends="libc6, libgcc-s1, libgstreamer1.0-0 (>= 1.20), libgstreamer-plugins-base1.0-0 (>= 1.20)"
# The overlay's plugin draws with Pango and Cairo; the classifier's does not link them.
depends="$depends, libpangocairo-1.0-0, libcairo2"
mkdir -p "$stage/DEBIAN"
cat > "$stage/DEBIAN/control" <<CONTROL
Package: gst-plugin-trtclassify
Version: $version
Architecture: $arch
Maintainer: trtclassify developers <trtclassify@example.invalid>
Depends: $depends
Recommends: gstreamer1.0-plugins-base, gstreamer1.0-plugins-good
Suggests: gstreamer1.0-plugins-bad
Section: video
Priority: optional
Installed-Size: $(du -sk "$stage/usr" | cut -f1)
Description: GStreamer image-classification element (trtclassify)
 Classifies video frames with an ONNX image classifier, batched, on the CPU (built in) or on
 NVIDIA GPUs (loaded at run time), and attaches the top-k classes to every buffer as
 metadata. Also trtclassifyoverlay, which draws the results on the video.
CONTROL
mkdir -p target/debian
deb=target/debian/gst-plugin-trtclassify_${version}_${arch}.deb
dpkg-deb --root-owner-group --build "$stage" "$deb" >/dev/null
echo "$deb"
