#!/usr/bin/env bash
# Builds localserve_<version>_<arch>.deb: the app and all its dependencies, torch included, in
# a virtual environment under /opt/localserve (self-contained: nothing from pip at install
# time), plus the systemd units, sysusers/tmpfiles entries and config of files.txt.
#
#   packaging/build-deb.sh [--out DIR] [--wheel PATH] [--torch SPEC] [--pip-args "ARGS"]
#
#   --out DIR        where the .deb goes (default: dist/)
#   --wheel PATH     the localserve wheel to package (default: built with PYTHON -m build)
#   --torch SPEC     the torch to bundle, a pip requirement (default: torch, PyPI's CUDA build;
#                    for CPU hosts e.g. --torch torch==2.13.0 --pip-args "--extra-index-url
#                    $TORCH_CPU_INDEX", PyTorch's CPU wheel index as pytorch.org's selector gives it)
#   --pip-args ARGS  more arguments for pip (an index, --find-links to an offline wheelhouse)
#
# Prints the .deb's path. Runs as any user: dpkg-deb --root-owner-group makes root own the
# files in the package. Environment: PYTHON (builds the wheel), VENV_PYTHON (the target's
# python3, default /usr/bin/python3), DEB_MAINTAINER.
set -euo pipefail
# Files in the package get the builder's permissions: no private ones from a strict umask.
umask 022
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,17s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    exit 0
}

# deb_version VERSION: PEP 440 to Debian ordering: a pre-release (1.0rc1, 1.0.dev2) sorts
# before its release in Debian only when written with a tilde (1.0~rc1).
deb_version() {
    sed -E 's/\.?(a|b|rc|dev)([0-9]*)/~\1\2/' <<<"$1"
}

# depends: the venv is tied to the minor version of python3 it was built with (lib/python3.X,
# compiled extensions for cp3X), so the package needs exactly that python3.
depends() {
    "$VENV_PYTHON" -c 'import sys; v = sys.version_info
print(f"python3 (>= {v[0]}.{v[1]}), python3 (<< {v[0]}.{v[1] + 1})")'
}

# write_debian_dir ROOT VERSION ARCH: DEBIAN/control, conffiles and the maintainer scripts.
write_debian_dir() {
    local root=$1 version=$2 arch=$3
    mkdir -p "$root/DEBIAN"
    cat >"$root/DEBIAN/control" <<EOF
Package: localserve
Version: $(deb_version "$version")
Architecture: $arch
Maintainer: ${DEB_MAINTAINER:-localserve maintainers <localserve@localhost>}
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Depends: $(depends)
Recommends: g++
Section: misc
Priority: optional
Description: serve quantized LLMs over an OpenAI-compatible HTTP API
 A single-node daemon with a paged KV cache and continuous batching, for one GPU
 or a plain CPU, run by systemd. Its Python dependencies, torch included, live in
 a virtual environment under /opt/localserve. A C++ compiler builds a faster CPU
 kernel (and Triton's launchers on CUDA) at first use.
EOF
    conffiles >"$root/DEBIAN/conffiles"
    install -m 0755 "$PACKAGING_DIR"/hooks/{postinst,prerm,postrm} "$root/DEBIAN/"
}

main() {
    local out=dist wheel="" torch=torch pip_args=()
    while [ $# -gt 0 ]; do
        case $1 in
            --out) out=$2; shift 2 ;;
            --wheel) wheel=$2; shift 2 ;;
            --torch) torch=$2; shift 2 ;;
            --pip-args) read -ra pip_args <<<"$2"; shift 2 ;;
            -h|--help) usage ;;
            *) die "unknown argument: $1 (see --help)" ;;
        esac
    done
    command -v dpkg-deb >/dev/null || die "needs dpkg-deb"
    mkdir -p "$out"
    out=$(cd "$out" && pwd)

    make_workdir
    [ -n "$wheel" ] || wheel=$(build_wheel "$WORK/dist")
    [ -f "$wheel" ] || die "no wheel at $wheel"

    local version arch deb root=$WORK/root
    version=$(wheel_version "$wheel")
    arch=$(dpkg --print-architecture)
    make_venv "$root" "$wheel" "$torch" "${pip_args[@]}"
    install_files "$root"
    write_debian_dir "$root" "$version" "$arch"

    # zstd: a fast compressor for a package of about a GB unpacked (dpkg >= 1.21.18 reads it).
    deb=$out/localserve_$(deb_version "$version")_$arch.deb
    dpkg-deb --root-owner-group -Zzstd --build "$root" "$deb" >&2
    echo "$deb"
}

main "$@"
