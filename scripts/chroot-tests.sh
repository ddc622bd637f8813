#!/usr/bin/env bash
# Runs the README's set-up and tests on another distribution, in a chroot, with the
# `analytics` feature (GStreamer's analytics metadata, 1.24+, which Debian 12's GStreamer 1.22
# cannot build):
#
#   sudo scripts/chroot-tests.sh trixie                     # Debian 13, GStreamer 1.26
#   sudo scripts/chroot-tests.sh noble                      # Ubuntu 24.04, GStreamer 1.24
#   sudo scripts/chroot-tests.sh trixie --test analytics    # cargo test arguments of your own
#
# The first run makes the chroot (debootstrap from the distribution's archive, then the
# README's install line inside it, as written, and plugins-bad's development package for the
# analytics library: about 600 MB and some minutes); later runs reuse it. The repository,
# ~/.cargo and ~/.rustup are bind-mounted, so the host's Rust toolchain builds inside (it
# needs glibc 2.36; trixie has 2.41, noble 2.39); the build goes to target/<suite> so that it
# does not disturb the host's. Inside, the README's test command: cargo build && cargo test.
# Mounts live in a private mount namespace and vanish with the script. CHROOT_DIR moves the
# chroots (default /var/tmp/trtclassify-<suite>).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
suite=${1:-}
case "$suite" in
    trixie) mirror=http://deb.debian.org/debian debootstrap=(--variant=minbase) ;;
    noble)
        # Debian 12's debootstrap knows noble's layout under an older release's script.
        mirror=http://archive.ubuntu.com/ubuntu
        debootstrap=(--variant=minbase --components=main,universe
            --keyring=/var/tmp/trtclassify-ubuntu-keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg)
        ;;
    *) echo "usage: $0 trixie|noble [cargo test arguments]" >&2; exit 2 ;;
esac
shift
root=${CHROOT_DIR:-/var/tmp}/trtclassify-$suite
[ "$(id -u)" = 0 ] || { echo "$0: needs root (debootstrap, chroot, mount)" >&2; exit 1; }

# The README's install line, as on the host (see .ci/run), plus the analytics library's
# headers, which are in plugins-bad's development package. Run again when the line changes.
install=$(awk '/<!-- install -->/ { f = 1; next } /<!-- \/install -->/ { f = 0 } f && !/^```/' \
    "$repo/README.md")
install="${install//sudo /} && apt-get install -y --no-install-recommends libgstreamer-plugins-bad1.0-dev"
if [ "$(cat "$root/.trtclassify-ready" 2>/dev/null)" != "$install" ]; then
    command -v debootstrap >/dev/null || apt-get install -y --no-install-recommends debootstrap
    if [ "$suite" = noble ] && [ ! -e /var/tmp/trtclassify-ubuntu-keyring/usr ]; then
        # Debian 12 does not package Ubuntu's archive keys: noble's own keyring package,
        # pinned by its SHA-256, verifies what debootstrap fetches.
        deb=$(mktemp)
        curl -fsSL -o "$deb" \
            http://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
        echo "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8  $deb" | sha256sum -c -
        dpkg -x "$deb" /var/tmp/trtclassify-ubuntu-keyring
        rm -f "$deb"
    fi
    script=/usr/share/debootstrap/scripts/$suite
    [ -e "$script" ] || script=/usr/share/debootstrap/scripts/gutsy
    [ -e "$root/etc/os-release" ] ||
        debootstrap "${debootstrap[@]}" "$suite" "$root" "$mirror" "$script"
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
        bash -euo pipefail -c "$install"
    echo "$install" > "$root/.trtclassify-ready"
fi

# The invoking user's toolchain and crates (under sudo, SUDO_USER's); the build inside runs as
# that user too, so that target/ and ~/.cargo get no root-owned files.
uid=${SUDO_UID:-$(id -u)} gid=${SUDO_GID:-$(id -g)}
home=$(getent passwd "$uid" | cut -d: -f6)
cargo_home=${CARGO_HOME:-$home/.cargo}
rustup_home=${RUSTUP_HOME:-$home/.rustup}
# Crates come through the host's cargo (its network and certificates); the chroot builds
# offline.
setpriv --reuid="$uid" --regid="$gid" --clear-groups env HOME="$home" CARGO_HOME="$cargo_home" \
    RUSTUP_HOME="$rustup_home" "$cargo_home/bin/cargo" fetch --locked --manifest-path "$repo/Cargo.toml"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--locked)
# Inside: what the build needs from the host, then the tests, with the analytics feature.
unshare --mount --propagation private bash -euo pipefail -s -- "$root" "$repo" "$cargo_home" \
    "$rustup_home" "$uid:$gid" "$home" "$suite" "${args[@]}" <<'INSIDE'
root=$1 repo=$2 cargo_home=$3 rustup_home=$4 user=$5 home=$6 suite=$7
shift 7
for dir in "$repo" "$cargo_home" "$rustup_home"; do
    mkdir -p "$root$dir"
    mount --bind "$dir" "$root$dir"
done
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/tmp"
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot --userspec="$user" "$root" /usr/bin/env -i HOME="$home" PATH="$cargo_home/bin:/usr/bin:/bin" \
    CARGO_HOME="$cargo_home" RUSTUP_HOME="$rustup_home" CARGO_NET_OFFLINE=true \
    CARGO_TARGET_DIR="$repo/target/$suite" \
    bash -euo pipefail -c 'cd "$0"; . /etc/os-release; echo "GStreamer $(pkg-config --modversion gstreamer-1.0) on $PRETTY_NAME"
        # cargo build first, as in the README: the Python test loads the built plugin.
        cargo build --locked --features gst-plugin-trtclassify/analytics
        cargo test --features gst-plugin-trtclassify/analytics "$@"' "$repo" "$@"
INSIDE
