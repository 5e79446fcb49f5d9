#!/usr/bin/env bash
# Installs localserve where the .deb does not fit (other distributions): the same tree as the
# package (lib.sh, files.txt) and then the package's own postinst. Run as root.
#
#   packaging/install.sh [--from SPEC] [--torch SPEC] [--pip-args "ARGS"] [--enable]
#   packaging/install.sh --uninstall [--purge]
#
#   --from SPEC      what to install: a wheel, a source folder or a requirement from PyPI
#                    (localserve==0.1.0); default: a wheel built from this source tree
#   --torch SPEC     the torch to install, a pip requirement (default: torch, PyPI's CUDA build)
#   --pip-args ARGS  more arguments for pip (an index, --find-links to an offline wheelhouse)
#   --enable         also enable and start localserve.service (default: enable nothing)
#   --uninstall      remove what this installed; keeps /etc/localserve and /var/lib/localserve
#   --purge          with --uninstall: remove those two as well
#
# DESTDIR=DIR installs into DIR as a staging root instead of /: no root needed, and nothing
# touches the running system (no user, directories, byte code or systemctl).
#
# Units go to /usr/lib/systemd/{system,user}, where the package puts them: one file list for
# both, and /etc/systemd/system stays the admin's (`systemctl edit localserve` drop-ins there
# outlive a reinstall). A reinstall replaces /opt/localserve and never overwrites the config.
set -euo pipefail
umask 022
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
DESTDIR=${DESTDIR:-}

usage() {
    sed -n '2,22s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    exit 0
}

# hook NAME ARGS...: the .deb's maintainer script NAME, on the running system only.
hook() {
    [ -z "$DESTDIR" ] || return 0
    sh "$PACKAGING_DIR/hooks/$1" "${@:2}"
}

install_localserve() {
    local from=$1 torch=$2
    shift 2
    local upgrade=""
    make_workdir
    [ -n "$from" ] || from=$(build_wheel "$WORK/dist")
    # The postinst tells an upgrade (restart a running daemon) by a previous version.
    [ ! -e "$DESTDIR$PREFIX/bin/localserve" ] || upgrade=previous
    make_venv "$DESTDIR" "$from" "$torch" "$@"
    install_files "$DESTDIR" keep-config
    hook postinst configure ${upgrade:+"$upgrade"}
    if [ -n "$DESTDIR" ]; then
        echo "staged in $DESTDIR; on the target, run packaging/hooks/postinst configure as root"
    fi
}

uninstall_localserve() {
    local purge=$1
    hook prerm remove
    remove_files "$DESTDIR" "$purge"
    rm -rf "$DESTDIR$PREFIX"
    hook postrm remove
    if [ -n "$purge" ]; then
        rm -rf "$DESTDIR/etc/localserve"
        hook postrm purge
    fi
}

main() {
    local from="" torch=torch pip_args=() enable="" uninstall="" purge=""
    while [ $# -gt 0 ]; do
        case $1 in
            --from) from=$2; shift 2 ;;
            --torch) torch=$2; shift 2 ;;
            --pip-args) read -ra pip_args <<<"$2"; shift 2 ;;
            --enable) enable=1; shift ;;
            --uninstall) uninstall=1; shift ;;
            --purge) purge=1; shift ;;
            -h|--help) usage ;;
            *) die "unknown argument: $1 (see --help)" ;;
        esac
    done
    [ -z "$purge" ] || [ -n "$uninstall" ] || die "--purge goes with --uninstall"
    if [ -z "$DESTDIR" ]; then
        [ "$(id -u)" = 0 ] || die "run as root (or set DESTDIR=DIR for a staging install)"
        # Two owners of the same files would undo each other.
        [ "$(dpkg-query -W -f='${db:Status-Status}' localserve 2>/dev/null)" != installed ] \
            || die "the localserve .deb is installed: use apt"
    fi

    if [ -n "$uninstall" ]; then
        uninstall_localserve "$purge"
        return
    fi
    install_localserve "$from" "$torch" "${pip_args[@]}"
    if [ -n "$enable" ] && [ -z "$DESTDIR" ]; then
        systemctl enable --now localserve.service
    fi
}

main "$@"
