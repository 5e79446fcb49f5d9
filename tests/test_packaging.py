"""Packaging (issue 9): the sdist and wheel build without downloads; the wheel installs into a
fresh virtual environment and its `localserve` runs the real model; packaging/build-deb.sh
makes a self-contained .deb from the sdist's tree (installed, run and purged for real where
the test can overlay / in a mount namespace); packaging/install.sh stages the same tree.

The .deb tests bundle torch==2.13.0, the CPU build the test environment installs itself
(scripts/test.sh): never an unpinned torch, which is PyPI's CUDA build, gigabytes of it."""

from __future__ import annotations

import configparser
import contextlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import STORIES_HF

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# The CPU kernel libraries setup.py builds on this machine's architecture.
BUILT_VARIANTS = ["avx512_vnni", "avx2"] if platform.machine().lower() in ("x86_64", "amd64") else ["generic"]
TORCH = "torch==2.13.0"
PROMPT = "Once upon a time"
# The files.txt entries: (kind, mode, source, destination).
MANIFEST = [tuple(line.split()) for line in (ROOT / "packaging" / "files.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Runs cmd (ten minutes at most: a build, a venv, a model run); a failure shows its output."""
    kwargs.setdefault("timeout", 600)
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{cmd} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def offline_env(home: Path) -> dict[str, str]:
    """No hub, no real registry (LOCALSERVE_HOME in tmp), no daemon (a closed port)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "LOCALSERVE_HOME": str(home), "LOCALSERVE_URL": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist, and the wheel built from it (`python -m build`'s default: a clean tree, so
    the wheel also proves the sdist complete); --no-isolation uses the installed setuptools
    and wheel instead of downloading them."""
    out = tmp_path_factory.mktemp("dist")
    # The kernels compiled from these sources in the editable install the suite runs in
    # (scripts/test.sh): packaged as they are rather than compiled a second time (minutes).
    built = all((ROOT / "kernels" / f"_cpu_{name}.so").is_file() for name in BUILT_VARIANTS)
    env = {**os.environ, "LOCALSERVE_PREBUILT_KERNELS": str(ROOT / "kernels")} if built else None
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)], env=env)
    [sdist] = out.glob("localserve-*.tar.gz")
    [wheel] = out.glob("localserve-*.whl")
    return sdist, wheel


@pytest.fixture(scope="module")
def source_tree(dists: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The unpacked sdist: what a packager builds the .deb from."""
    out = tmp_path_factory.mktemp("sdist")
    with tarfile.open(dists[0]) as tar:
        tar.extractall(out, filter="tar")
    return out / f"localserve-{VERSION}"


@pytest.fixture(scope="module")
def hf_continuation() -> str:
    """transformers' greedy continuation of PROMPT: the text `localserve run --raw` prints."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STORIES_HF)
    model = AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=16)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_wheel_has_the_mapped_packages_data_and_entry_point(dists: tuple[Path, Path]) -> None:
    wheel = dists[1]
    # The CPU kernels are compiled into it: a platform wheel, one library per instruction set.
    assert wheel.name.startswith(f"localserve-{VERSION}-") and not wheel.name.endswith("-none-any.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(whl.read(f"localserve-{VERSION}.dist-info/entry_points.txt").decode())
    assert {f"localserve/kernels/_cpu_{name}.so" for name in BUILT_VARIANTS} <= names
    assert not [name for name in names if "/csrc/" in name]  # sources stay in the sdist
    assert {f"localserve/models/{p.name}" for p in (ROOT / "models").glob("*.py")} <= names
    assert {f"localserve/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")} <= names
    assert {"localserve/demo/stories260K.gguf", "localserve/demo/LICENSE"} <= names  # the built-in demo model
    assert entry_points["console_scripts"]["localserve"] == "localserve.cli.main:main"


def test_sdist_carries_what_builds_the_packages(dists: tuple[Path, Path]) -> None:
    with tarfile.open(dists[0]) as tar:
        members = {m.name.removeprefix(f"localserve-{VERSION}/"): m for m in tar.getmembers()}
    for script in ("build-deb.sh", "install.sh", "hooks/postinst", "hooks/prerm", "hooks/postrm"):
        assert members[f"packaging/{script}"].mode & 0o111, f"packaging/{script} is not executable"
    assert {"packaging/lib.sh", "packaging/files.txt", "tests/conftest.py", "scripts/test.sh",
            "setup.py", "kernels/csrc/int8_matmul.cpp", "kernels/csrc/api.h", "kernels/csrc/simd.h",
            "localserve/demo/stories260K.gguf", "localserve/demo/LICENSE"} <= members.keys()
    assert {source for kind, _, source, _ in MANIFEST if kind != "link"} <= members.keys()
    assert not [name for name in members if "__pycache__" in name]


def test_maintainer_scripts_are_posix_sh() -> None:
    for hook in (ROOT / "packaging" / "hooks").iterdir():
        assert hook.read_text().startswith("#!/bin/sh\n")
        run(["sh", "-n", str(hook)])


@pytest.mark.slow
def test_every_package_of_the_source_tree_is_packaged() -> None:
    """pyproject's explicit package list names every folder with an __init__.py (a missing
    one is left out of the wheel: its imports then fail only where it is installed)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"localserve": ROOT / "localserve", "localserve.kernels": ROOT / "kernels",
               "localserve.models": ROOT / "models"}
    found = {".".join([root, *init.parent.relative_to(folder).parts])
             for root, folder in folders.items() for init in folder.rglob("__init__.py")}
    assert listed == found


def test_wheel_runs_in_a_fresh_venv(dists: tuple[Path, Path], hf_continuation: str, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(dists[1])])
    # The dependencies (torch, ...) from this test environment: a plain path line in a .pth
    # file, which does not run that folder's own .pth files, so the editable install's import
    # hook for the source tree stays off.
    site = run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    (Path(site.stdout.strip()) / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    found = run([str(venv / "bin" / "python"), "-c", "import localserve; print(localserve.__file__)"], cwd=tmp_path)
    package = Path(found.stdout.strip()).parent
    assert package.is_relative_to(venv), f"localserve imported from {package}, not the fresh venv"
    assert all((package / "kernels" / f"_cpu_{name}.so").is_file() for name in BUILT_VARIANTS)
    variant = run([str(venv / "bin" / "python"), "-c", "from localserve.kernels import cpu_library; "
                   "print(cpu_library.variant())"], cwd=tmp_path)
    assert variant.stdout.strip() in BUILT_VARIANTS  # loaded without compiling anything
    # Each library is its own variant's build (they compile the same sources).
    names = run([str(venv / "bin" / "python"), "-c", "from localserve.kernels import cpu_library as c; "
                 f"print(*[c.load(v).ls_variant().decode() for v in {BUILT_VARIANTS}])"], cwd=tmp_path)
    assert names.stdout.split() == BUILT_VARIANTS

    env = offline_env(tmp_path / "home")
    version = run([str(venv / "bin" / "localserve"), "--version"], cwd=tmp_path, env=env)
    assert version.stdout.strip() == f"localserve, version {VERSION}"
    result = run([str(venv / "bin" / "localserve"), "run", str(STORIES_HF), PROMPT, "--raw", "--max-tokens", "16",
                  "--device", "cpu"], cwd=tmp_path, env=env)
    assert result.stdout.strip() == hf_continuation
    demo = run([str(venv / "bin" / "localserve"), "run", "demo", PROMPT, "--max-tokens", "16", "--device", "cpu"],
               cwd=tmp_path, env=env)  # the built-in model, from the wheel's package data
    assert demo.stdout.startswith(", there was a little girl named Lily")


def deb_listing(deb: Path) -> dict[str, str]:
    """`dpkg-deb -c`: path -> "perms owner" (+ " -> target" for a link)."""
    listing = {}
    for line in run(["dpkg-deb", "-c", str(deb)]).stdout.splitlines():
        perms, owner, _size, _date, _time, name = line.split(maxsplit=5)
        name, _, target = name.partition(" -> ")
        listing[name.rstrip("/")] = f"{perms} {owner}" + (f" -> {target}" if target else "")
    return listing


@pytest.fixture(scope="module")
def deb(dists: tuple[Path, Path], source_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """build-deb.sh from the sdist's tree, with its staging folder in a known TMPDIR."""
    if not shutil.which("dpkg-deb"):
        pytest.skip("dpkg-deb is not installed (not a Debian system)")
    if subprocess.run(["/usr/bin/python3", "-c", "import ensurepip"], capture_output=True, timeout=60).returncode:
        pytest.skip("/usr/bin/python3 cannot make virtual environments (apt install python3-venv)")
    out = tmp_path_factory.mktemp("deb")
    (out / "tmp").mkdir()
    result = run(["bash", str(source_tree / "packaging" / "build-deb.sh"), "--out", str(out), "--wheel", str(dists[1]),
                  "--torch", TORCH], env={**os.environ, "TMPDIR": str(out / "tmp")})
    path = Path(result.stdout.strip())
    assert path.parent == out and path.is_file()
    yield path
    shutil.rmtree(out)  # about 200 MB


@pytest.mark.slow
def test_deb_lays_out_the_tree(deb: Path, tmp_path: Path) -> None:
    arch = run(["dpkg", "--print-architecture"]).stdout.strip()
    assert deb.name == f"localserve_{VERSION}_{arch}.deb"
    listing = deb_listing(deb)
    for kind, mode, source, destination in MANIFEST:
        if kind == "link":
            assert listing["." + destination] == f"lrwxrwxrwx root/root -> {source}"
        else:
            assert listing["." + destination] == f"{stat.filemode(0o100000 | int(mode, 8))} root/root"
    assert listing["./opt/localserve/bin/localserve"].startswith("-rwxr-xr-x root/root")
    assert not [name for name in listing if name.endswith(".pyc")], "byte code would name the staging path"

    tree = tmp_path / "x"
    run(["dpkg-deb", "-x", str(deb), str(tree)])
    assert (tree / "opt/localserve/bin/localserve").read_text().startswith("#!/opt/localserve/bin/python")
    assert "VIRTUAL_ENV=/opt/localserve\n" in (tree / "opt/localserve/bin/activate").read_text()
    assert os.readlink(tree / "opt/localserve/bin/python3") == "/usr/bin/python3"
    # No file names the staging folder (build-deb.sh's mktemp under TMPDIR).
    staging = deb.parent / "tmp"
    leaks = subprocess.run(["grep", "-rlF", str(staging), str(tree)], capture_output=True, text=True, timeout=120)
    assert leaks.returncode == 1, f"files naming the staging path {staging}:\n{leaks.stdout[:2000]}"

    info = run(["dpkg-deb", "-I", str(deb)]).stdout
    for script in ("postinst", "prerm", "postrm", "conffiles", "control"):
        assert f" {script} " in info
    fields = dict(line.split(": ", 1) for line in run(["dpkg-deb", "-f", str(deb)]).stdout.splitlines()
                  if not line.startswith(" "))
    assert fields["Package"] == "localserve" and fields["Version"] == VERSION and fields["Architecture"] == arch
    assert fields["Depends"] == "python3 (>= 3.11), python3 (<< 3.12)"
    assert int(fields["Installed-Size"]) > 100_000  # KiB: torch and friends are inside
    assert set(run(["dpkg-deb", "-I", str(deb), "conffiles"]).stdout.split()) == {
        destination for kind, _, _, destination in MANIFEST if kind == "conffile"}
    shutil.rmtree(tree)  # about 900 MB


@pytest.mark.slow
def test_install_sh_stages_the_same_tree(deb: Path, dists: tuple[Path, Path], source_tree: Path,
                                        tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    config = dest / "etc/localserve/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("# the admin's\n")
    install = ["bash", str(source_tree / "packaging" / "install.sh")]
    env = {**os.environ, "DESTDIR": str(dest)}
    run([*install, "--from", str(dists[1]), "--torch", TORCH], env=env)

    staged = {"./" + str(path.relative_to(dest)): path for path in sorted(dest.rglob("*"))}
    listing = {name: entry for name, entry in deb_listing(deb).items() if name != "."}
    assert staged.keys() == listing.keys()
    for name, path in staged.items():
        mode = stat.filemode(path.lstat().st_mode)
        target = f" -> {os.readlink(path)}" if path.is_symlink() else ""
        assert listing[name].replace(" root/root", "") == mode + target, name
    assert config.read_text() == "# the admin's\n", "install.sh overwrote the config"

    run([*install, "--uninstall"], env=env)
    left = {str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir()}
    assert left == {"etc/localserve/config.toml", "etc/localserve/localserve.env"}
    run([*install, "--uninstall", "--purge"], env=env)
    assert not [p for p in dest.rglob("*") if not p.is_dir()]


# A private mount namespace with a copy-on-write overlay of / at $WORK/root: what happens in
# there (dpkg -i, a new user, /opt/localserve) lands in $WORK/upper, never on the real system.
OVERLAY = r"""
set -eu
mount --make-rprivate /
mkdir -p "$WORK/upper" "$WORK/work" "$WORK/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$WORK/upper,workdir=$WORK/work" "$WORK/root"
"""


def remove_overlay(work: Path) -> None:
    """Deletes the overlay's layers, and its mount point only with rmdir: the mounts die with
    the namespace, but were one left, a recursive delete through it would reach the real /dev."""
    for layer in ("upper", "work"):
        shutil.rmtree(work / layer, ignore_errors=True)
    for folder in (work / "root", work):
        with contextlib.suppress(OSError):
            folder.rmdir()


def cannot_overlay_root(work: Path) -> str | None:
    """Why the throwaway overlay of / is impossible here, if it is."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("unshare", "chroot", "dpkg"):
        if not shutil.which(tool):
            return f"needs {tool}"
    probe = subprocess.run(["unshare", "-m", "--fork", "sh", "-c", OVERLAY], capture_output=True, text=True,
                           env={**os.environ, "WORK": str(work)}, timeout=60)
    remove_overlay(work)
    return f"failed here: {probe.stderr.strip()}" if probe.returncode else None


E2E = OVERLAY + r"""
for d in proc dev sys; do mount --rbind "/$d" "$WORK/root/$d"; done
mkdir -p "$WORK/root/mnt/deb" "$WORK/root/mnt/stories"
mount --bind "$(dirname "$DEB")" "$WORK/root/mnt/deb"
mount --bind "$STORIES" "$WORK/root/mnt/stories"
exec chroot "$WORK/root" /bin/sh -eu -c '
deb=/mnt/deb/$(basename "$DEB")
dpkg -i "$deb"
echo "user: $(id -un localserve) $(stat -c "%U %a" /var/lib/localserve)"
echo "env: $(stat -c "%U %a" /etc/localserve/localserve.env)"
echo "pyc: $(find /opt/localserve -name "*.pyc" | head -1)"
cd / && localserve --version
echo "text: $(HF_HUB_OFFLINE=1 LOCALSERVE_HOME=/tmp/lshome LOCALSERVE_URL=http://127.0.0.1:9 \
    localserve run /mnt/stories "Once upon a time" --raw --max-tokens 16 --device cpu)"
dpkg -r localserve
echo "removed: $(ls /opt/localserve 2>/dev/null | wc -l) $(ls /etc/localserve | tr "\n" " ")"
dpkg -P localserve
echo "purged: $(ls -d /var/lib/localserve /etc/localserve 2>/dev/null | wc -l)"
'
"""


@pytest.mark.slow
def test_deb_installs_runs_and_purges(deb: Path, hf_continuation: str, tmp_path: Path) -> None:
    """dpkg -i, the postinst (user, folders, byte code), the model, remove, purge: in a chroot
    on an overlay of this system, so the real system stays untouched."""
    work = tmp_path / "overlay"
    if reason := cannot_overlay_root(work):
        pytest.skip(f"a throwaway overlay of / {reason}")
    try:
        out = run(["unshare", "-m", "--fork", "sh", "-c", E2E],
                  env={**os.environ, "WORK": str(work), "DEB": str(deb), "STORIES": str(STORIES_HF)}).stdout
    finally:
        remove_overlay(work)  # the installed tree, about 900 MB
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines["user"] == "localserve localserve 750"
    assert lines["env"] == "root 600"
    assert lines["pyc"].startswith("/opt/localserve/lib/")
    assert f"localserve, version {VERSION}" in out
    assert lines["text"].strip() == hf_continuation
    # remove: the code goes (byte code too), the config stays; purge: config and state go.
    assert lines["removed"] == "0 config.toml localserve.env "
    assert lines["purged"] == "0"
