# shellcheck shell=bash
# What build-deb.sh and install.sh share (bash, sourced by both): they lay out the same
# tree, the app in a virtual environment under /opt/localserve plus the paths in files.txt,
# once into a staging root that becomes the .deb, once into / (or DESTDIR).

PREFIX=/opt/localserve
PACKAGING_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SOURCE_DIR=$(dirname "$PACKAGING_DIR")
# The interpreter the installed venv runs on. The venv's bin/python is a symlink to it, so it
# must be the target system's python3, never a development venv's.
VENV_PYTHON=${VENV_PYTHON:-/usr/bin/python3}

die() {
    echo "${0##*/}: $*" >&2
    exit 1
}

# make_workdir: a scratch folder in WORK (TMPDIR), removed however the script ends.
make_workdir() {
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
}

# build_wheel OUTDIR: builds the sdist, then the wheel from the unpacked sdist (what
# `python -m build` does by default): a clean tree, so nothing stale from a build/ folder
# gets in. Prints the wheel's path. PYTHON needs the `build` module.
build_wheel() {
    local out=$1
    "${PYTHON:-python3}" -m build --outdir "$out" "$SOURCE_DIR" >&2 \
        || die "building the wheel failed (PYTHON=${PYTHON:-python3} needs 'pip install build'), or pass --wheel"
    ls "$out"/localserve-*.whl
}

# wheel_version WHEEL: the version in a wheel's file name (NAME-VERSION-TAGS.whl).
wheel_version() {
    local name
    name=$(basename "$1")
    name=${name#localserve-}
    echo "${name%%-*}"
}

# make_venv ROOT WHEEL TORCH [PIP ARGS...]: the app and all its dependencies in a fresh venv
# at ROOT/opt/localserve, made to run from /opt/localserve. TORCH is a pip requirement: which
# build of torch to bundle (the plain `torch` is PyPI's CUDA build).
make_venv() {
    local root=$1 wheel=$2 torch=$3
    shift 3
    local venv=$root$PREFIX
    # --clear: a reinstall replaces the whole environment, as a package upgrade would.
    "$VENV_PYTHON" -m venv --clear "$venv" || die "$VENV_PYTHON -m venv failed (Debian: apt install python3-venv)"
    # --no-compile: byte code records its source path (the staging path here); the
    # postinst compiles on the target instead.
    "$venv/bin/python" -m pip install --no-compile --disable-pip-version-check "$@" "$torch" "$wheel" >&2
    [ -z "$root" ] || relocate_venv "$venv"
}

# relocate_venv VENV: makes a venv built at VENV run from PREFIX. A venv names its own path in
# the shebangs of bin/*, in bin/activate* and in pyvenv.cfg; those are text, so one
# search-and-replace over the text files covers them (and any other file naming it).
relocate_venv() {
    local venv=$1 pattern
    # ensurepip compiled pip and setuptools while creating the venv: drop that byte code too.
    find "$venv" -name __pycache__ -type d -prune -exec rm -rf {} +
    pattern=$(printf '%s' "$venv" | sed 's/[][\.*^$|]/\\&/g')
    grep -rlIZF -- "$venv" "$venv" | xargs -0 -r sed -i "s|$pattern|$PREFIX|g"
    if grep -rlF -- "$venv" "$venv" >&2; then
        die "binary files above still name the staging path $venv"
    fi
}

# manifest: the lines of files.txt without comments: KIND MODE SOURCE DESTINATION.
manifest() {
    grep -v -e '^#' -e '^[[:space:]]*$' "$PACKAGING_DIR/files.txt"
}

# install_files ROOT [keep-config]: puts the paths of files.txt under ROOT; with keep-config,
# a conffile that is already there stays as the admin left it.
install_files() {
    local root=$1 keep_config=${2:-} kind mode src dest
    while read -r kind mode src dest; do
        mkdir -p "$root$(dirname "$dest")"
        if [ "$kind" = link ]; then
            ln -sfn "$src" "$root$dest"
        elif [ "$kind" = conffile ] && [ -n "$keep_config" ] && [ -e "$root$dest" ]; then
            echo "keeping $root$dest (compare with $SOURCE_DIR/$src)" >&2
        else
            install -m "$mode" "$SOURCE_DIR/$src" "$root$dest" || die "missing $SOURCE_DIR/$src"
        fi
    done < <(manifest)
}

# remove_files ROOT [purge]: the reverse of install_files; conffiles go only with purge.
remove_files() {
    local root=$1 purge=${2:-} kind mode src dest
    while read -r kind mode src dest; do
        if [ "$kind" != conffile ] || [ -n "$purge" ]; then
            rm -f "$root$dest"
        fi
    done < <(manifest)
}

# conffiles: the destinations marked conffile, one per line (DEBIAN/conffiles).
conffiles() {
    manifest | awk '$1 == "conffile" { print $4 }'
}
