"""What is on disk: a sqlite-utils catalogue of models over the blob store.

The catalogue (``registry.db``, WAL mode, so the daemon and the CLI can use it at
once) has a ``models`` row per ``name:tag`` and a ``files`` row per file of a model
(its plain file name, role and blob digest). Every change is one transaction, and a
model is added only after all its blobs are in the store, so no partial model is ever
listed. Each model also gets a folder of symlinks (``models/<key>/<file name>`` ->
blob) that the engine opens like any checkpoint folder or .gguf file.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlite_utils

from ..errors import LocalserveError
from .blobs import BlobStore, check_digest
from .builtin import BUILTIN, BuiltinModel
from .settings import ModelSettings
from .names import ModelName, parse_name

ROLES = ("weights", "projector", "config", "tokenizer", "template", "license", "settings", "other")
# A model's own defaults (a Modelfile's PARAMETER, SYSTEM, TEMPLATE, MESSAGE): settings.py.
SETTINGS_FILE = "settings.json"
MAX_SETTINGS_BYTES = 8 << 20


class UnknownModelError(LocalserveError):
    """No model of that name is in the registry."""


def check_file_name(name: str) -> str:
    """A file name inside a model: plain, no separators, nothing that climbs out."""
    if (not isinstance(name, str) or not name or len(name) > 255 or name in (".", "..")
            or "/" in name or "\\" in name or "\0" in name or name != name.strip()):
        raise LocalserveError(f"{str(name)[:80]!r} is not an acceptable file name inside a model")
    return name


def _check_files(files: list[ModelFile]) -> None:
    """What each of a model's files must be in the catalogue: a plain name, a well-formed
    digest (its blob's name in the store), a known role."""
    for file in files:
        check_file_name(file.name)
        check_digest(file.digest)
        if file.role not in ROLES:
            raise LocalserveError(f"unknown file role {str(file.role)[:80]!r}")


@dataclass(slots=True)
class ModelFile:
    name: str  # a plain file name, as the checkpoint calls it
    digest: str
    size: int
    role: str = "other"


@dataclass(slots=True)
class ModelRecord:
    name: ModelName
    format: str  # gguf, gptq, awq, hf (safetensors)
    architecture: str
    quantization: str
    parameters: int
    active_parameters: int
    context_length: int
    size: int  # bytes of all its files
    source: str
    files: list[ModelFile] = field(default_factory=list)
    license: str | None = None
    created: str = ""
    last_used: str | None = None

    @property
    def entry(self) -> str:
        """What the engine opens: the .gguf file for a GGUF model (a split one's first part),
        else the folder (an HF checkpoint, or a GGUF model with its vision projector)."""
        weights = [f.name for f in self.files if f.role == "weights"]
        if self.format == "gguf" and weights and not any(f.role == "projector" for f in self.files):
            return sorted(weights)[0]
        return ""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["name"] = str(self.name)
        return data


def _catalogue_problem(path: Path, exc: sqlite3.DatabaseError) -> str:
    if isinstance(exc, sqlite3.OperationalError):  # the file is sqlite's, the disk or its permissions refuse
        return f"cannot use the registry {path}: {exc}"
    return f"{path} is not a localserve registry ({exc}); move it away and localserve starts a new one"


def _home_problem(home: Path, exc: OSError) -> str:
    if isinstance(exc, FileExistsError) and exc.filename == str(home):
        reason = "it is a file, not a folder"
    else:
        reason = exc.strerror or str(exc)
        if exc.filename is not None and exc.filename != str(home):
            reason += f": {exc.filename}"
    return (f"cannot use {home} as localserve's home ({reason}); set LOCALSERVE_HOME to a folder this user "
            "can write")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Registry:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.links = home / "models"
        self._settings: dict[str, ModelSettings] = {}  # by blob digest: a blob's content never changes
        with self._disk_failures_explained():
            self._open()

    def _open(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobStore(self.home / "blobs")
        # One connection, used by one thread at a time (the daemon's event loop, or the CLI).
        self.db = sqlite_utils.Database(sqlite3.connect(self.home / "registry.db", check_same_thread=False))
        self.db.enable_wal()
        self.db.conn.execute("PRAGMA busy_timeout = 10000")  # the daemon and the CLI may write at once
        new = "models" not in self.db.table_names()
        with self._transaction():
            self.db["models"].create({
                "id": str, "name": str, "tag": str, "format": str, "architecture": str, "quantization": str,
                "parameters": int, "active_parameters": int, "context_length": int, "size": int, "source": str,
                "license": str, "created": str, "last_used": str,
            }, pk="id", if_not_exists=True)
            if "license" not in self.db["models"].columns_dict:  # a catalogue from before licenses were kept
                self.db["models"].add_column("license", str)
            self.db["files"].create({"model": str, "name": str, "role": str, "digest": str, "size": int},
                                    pk=("model", "name"), foreign_keys=[("model", "models", "id")],
                                    if_not_exists=True)
            self.db["files"].create_index(["digest"], if_not_exists=True)
        for model in BUILTIN.values():
            self._refresh_builtin(model, new)

    @contextmanager
    def _disk_failures_explained(self) -> Iterator[None]:
        """A home or catalogue the disk refuses (a file where the folder should be, no
        permission, a full disk, a registry.db that is no sqlite file) ends as one line
        that names it: the user's to fix, not a bug."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            raise LocalserveError(_catalogue_problem(self.home / "registry.db", exc)) from exc
        except OSError as exc:
            raise LocalserveError(_home_problem(self.home, exc)) from exc

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction of the catalogue (rolled back on any error)."""
        with self._disk_failures_explained(), self.db.conn:
            yield

    # -- reading ------------------------------------------------------------------------

    def list(self) -> list[ModelRecord]:
        return [self._record(row) for row in self.db["models"].rows_where(order_by="name, tag")]

    def get(self, name: str | ModelName) -> ModelRecord:
        parsed = parse_name(name) if isinstance(name, str) else name
        row = self._row(parsed)
        if row is None:
            raise UnknownModelError(f"model {str(parsed)!r} is not in the registry (see `localserve list`; "
                                    "`localserve pull` adds one)")
        record = self._record(row)
        try:  # every command that names a model (show, run, rm, cp) refuses a damaged row alike
            _check_files(record.files)
        except LocalserveError as exc:
            raise LocalserveError(f"model {str(parsed)!r} has a damaged catalogue row: {exc}") from None
        return record

    def _row(self, name: ModelName) -> dict[str, Any] | None:
        """The catalogue row of ``name``; a built-in model removed earlier comes back."""
        rows = list(self.db["models"].rows_where("id = ?", [str(name)]))
        if not rows and name in BUILTIN:
            self._add_builtin(BUILTIN[name])
            rows = list(self.db["models"].rows_where("id = ?", [str(name)]))
        return rows[0] if rows else None

    def _add_builtin(self, model: BuiltinModel) -> None:
        files = [ModelFile(path.name, self.blobs.add_file(path), path.stat().st_size, role)
                 for path, role in ((model.path, "weights"), (model.license_path, "license"))]
        files.append(self.settings_file(model.settings))
        self.add(ModelRecord(
            name=model.name, format="gguf", architecture=model.architecture, quantization=model.quantization,
            parameters=model.parameters, active_parameters=model.parameters, context_length=model.context_length,
            size=sum(f.size for f in files), source=model.source, files=files, license=model.license))

    def _refresh_builtin(self, model: BuiltinModel, new: bool) -> None:
        """A new registry gets the built-in models; an older one gets their current files
        and settings (a newer localserve's demo), unless the user replaced the name with
        a model of their own (``localserve create demo``)."""
        rows = list(self.db["models"].rows_where("id = ?", [str(model.name)]))
        if new or (rows and rows[0]["source"] == model.source and not self._settings_are(rows[0], model.settings)):
            self._add_builtin(model)

    def _settings_are(self, row: dict[str, Any], settings: ModelSettings) -> bool:
        try:
            return self.settings(self._record(row)) == settings
        except LocalserveError:
            return False  # unreadable: replaced by the built-in's

    def _record(self, row: dict[str, Any]) -> ModelRecord:
        files = [ModelFile(f["name"], f["digest"], f["size"], f["role"])
                 for f in self.db["files"].rows_where("model = ?", [row["id"]], order_by="name")]
        fields = {key: value for key, value in row.items() if key not in ("id", "name", "tag")}
        return ModelRecord(name=ModelName(row["name"], row["tag"]), files=files, **fields)

    def settings(self, record: ModelRecord) -> ModelSettings:
        """The model's own defaults (none unless it was made with a Modelfile, or is built in)."""
        stored = [f for f in record.files if f.role == "settings"]
        if not stored:
            return ModelSettings()
        digest, where = stored[0].digest, f"{record.name}'s settings"
        if digest not in self._settings:  # read once: the daemon looks a model up at every request
            if stored[0].size > MAX_SETTINGS_BYTES:
                raise LocalserveError(f"{where}: {stored[0].size:,} bytes, more than settings take")
            try:
                data = self.blobs.path(digest).read_bytes()
            except OSError as exc:
                raise LocalserveError(f"{where}: cannot read them ({exc})") from None
            self._settings[digest] = ModelSettings.from_json(data, where)
        return self._settings[digest]

    def settings_file(self, settings: ModelSettings) -> ModelFile:
        """``settings`` stored as a blob, as a model's file."""
        data = settings.to_json()
        return ModelFile(SETTINGS_FILE, self.blobs.add_bytes(data), len(data), "settings")

    def path(self, name: str | ModelName) -> Path:
        """The checkpoint path the engine opens (re-linked if its folder went missing)."""
        record = self.get(name)
        folder = self._link_folder(record.name)
        if not all((folder / f.name).exists() for f in record.files):
            self._link(record)
        return folder / record.entry if record.entry else folder

    def touch(self, name: ModelName) -> None:
        with self._transaction():
            self.db["models"].update(str(name), {"last_used": _now()})

    # -- changing -----------------------------------------------------------------------

    def add(self, record: ModelRecord) -> ModelRecord:
        """Register ``record`` (replacing a model of the same name); its blobs must be stored."""
        _check_files(record.files)
        for file in record.files:
            if not self.blobs.has(file.digest):
                raise LocalserveError(f"{file.name}: blob {file.digest} is not in the store")
        record.created = record.created or _now()
        model_id = str(record.name)
        row = {key: value for key, value in record.as_dict().items() if key not in ("files", "name")}
        with self._transaction():
            orphans = self._delete_rows(model_id)
            self.db["models"].insert({"id": model_id, "name": record.name.name, "tag": record.name.tag, **row})
            self.db["files"].insert_all({"model": model_id, "name": f.name, "role": f.role, "digest": f.digest,
                                         "size": f.size} for f in record.files)
        self.forget_unused(orphans)
        self._link(record)
        return record

    def copy(self, source: str, destination: str) -> ModelRecord:
        """Another name for the same blobs (``localserve cp``)."""
        record = self.get(source)
        record.name = parse_name(destination)
        record.created = ""
        return self.add(record)

    def remove(self, name: str) -> list[str]:
        """Unregister ``name``; deletes the blobs no other model uses and returns them."""
        record = self.get(name)
        with self._transaction():
            candidates = self._delete_rows(str(record.name))
        orphans = [d for d in candidates if not self._referenced(d)]
        self.blobs.remove(orphans)
        self._unlink(record.name)
        return orphans

    def forget_unused(self, digests: Iterable[str]) -> None:
        """Delete the blobs among ``digests`` that no model uses (after a failed pull)."""
        self.blobs.remove([d for d in set(digests) if not self._referenced(d)])

    def _delete_rows(self, model_id: str) -> set[str]:
        digests = {row["digest"] for row in self.db["files"].rows_where("model = ?", [model_id])}
        self.db["files"].delete_where("model = ?", [model_id])
        self.db["models"].delete_where("id = ?", [model_id])
        return digests

    def _referenced(self, digest: str) -> bool:
        return self.db["files"].count_where("digest = ?", [digest]) > 0

    # -- the symlink folders --------------------------------------------------------------

    def _link_folder(self, name: ModelName) -> Path:
        # Hashed, so a name never becomes a path; the hash names the folder for good.
        return self.links / hashlib.sha256(str(name).encode()).hexdigest()[:32]

    def _link(self, record: ModelRecord) -> None:
        folder = self._link_folder(record.name)
        self._unlink(record.name)
        folder.mkdir(parents=True)
        for file in record.files:
            os.symlink(self.blobs.path(file.digest), folder / check_file_name(file.name))

    def _unlink(self, name: ModelName) -> None:
        folder = self._link_folder(name)
        if folder.is_dir():
            for entry in folder.iterdir():
                entry.unlink()
            folder.rmdir()
