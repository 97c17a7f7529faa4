"""llama.cpp's slot files (`--slot-save-path DIR`; POST /slots/ID?action=save|restore|erase):
an idle slot's KV written to, or read back from, a file the client names in DIR, in the
conversation files' format (kv_file.py), checked against the model and KV format on restore.
Run on the engine thread (EngineWorker.call)."""
from __future__ import annotations

import time
from pathlib import Path

from strata.engine.conversation_disk import kv_format, model_fingerprint
from strata.engine.conversations import ParkedConversation
from strata.engine.kv_file import KVFileError, read_kv_file, read_kv_header, write_kv_file
from strata.errors import ConfigError, RequestError, StrataError

# a file system's longest name, less the ".partial" a save writes first (a longer name was
# a 500 "File name too long")
MAX_NAME_BYTES = 255 - len(".partial")


def check_filename(name) -> str:
    """`name` when it is a plain file name (no folder, no '..', no control characters), else
    RequestError saying what is wrong."""
    if not isinstance(name, str) or not name:
        raise RequestError(f"'filename' must be a non-empty string, got {name!r}")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise RequestError(f"'filename' is longer than {MAX_NAME_BYTES} bytes")
    if name in (".", "..") or any(c in name for c in "/\\") \
            or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise RequestError(f"'filename' {name!r} must be a plain file name, without a folder, "
                           "'..' or control characters")
    if name != name.strip() or name.endswith("."):
        raise RequestError(f"'filename' {name!r} must not start or end with a space or end "
                           "with a dot")
    return name


def _differences(saved, ours: str) -> str:
    """The fields of two KV formats (conversation_disk.kv_format) that differ."""
    theirs, mine = str(saved).split(";"), ours.split(";")
    if len(theirs) != len(mine):
        return f"{str(saved)!r} in the file, {ours!r} here"
    return ", ".join(f"{a} in the file, {b} here" for a, b in zip(theirs, mine) if a != b)


class SlotFiles:
    """The slot files of one engine, in `folder`."""

    def __init__(self, folder, engine):
        self.folder = Path(folder).expanduser()
        if not self.folder.is_dir():
            raise ConfigError(f"--slot-save-path {str(self.folder)!r} is not a folder; create "
                              "it or give another")
        self.engine = engine
        self._meta: dict | None = None

    def meta(self) -> dict:
        """The model's fingerprint and name, and the slots' KV format (computed once)."""
        if self._meta is None:
            gguf = self.engine.gguf
            self._meta = {"model": model_fingerprint(gguf),
                          "model_name": f"{Path(gguf.path).name} ({gguf.spec.arch})",
                          "kv_format": kv_format(self.engine.scheduler.kvs[0])}
        return self._meta

    def _check_header(self, filename: str, header: dict) -> None:
        """RequestError naming what keeps the file's KV out of this server's slots: another
        model, another KV format, or more tokens than a slot's context (a prefix of them
        was restored without a word, none at all for a hybrid model's)."""
        meta = self.meta()
        if header.get("model") != meta["model"]:
            saved_by = header.get("model_name")
            raise RequestError(
                f"slot file {filename!r} holds the KV of another model"
                f"{f' ({saved_by})' if isinstance(saved_by, str) else ''}, not of this "
                f"server's {meta['model_name']}; it restores only into a server of the model "
                "that saved it")
        if header.get("kv_format") != meta["kv_format"]:
            raise RequestError(
                f"slot file {filename!r} holds KV cells of another KV format "
                f"({_differences(header.get('kv_format'), meta['kv_format'])}); it restores "
                "only into a server with the KV cells that saved it (--kv)")
        num_tokens, n_ctx = int(header["num_tokens"]), self.engine.n_ctx
        if num_tokens > n_ctx:
            raise RequestError(
                f"slot file {filename!r} holds {num_tokens} tokens, more than this server's "
                f"context of {n_ctx} tokens (--ctx-size); restore it into a server whose "
                "context holds them")

    def _path(self, filename) -> Path:
        """The file `filename` names in the folder; a link leading out of it (the operator's
        doing: a client cannot make one) is refused, so a request reads and writes only there."""
        path = self.folder / check_filename(filename)
        if path.resolve().parent != self.folder.resolve():
            raise RequestError(f"'filename' {filename!r} is a link out of --slot-save-path; "
                               "name a file in the folder")
        return path

    def save(self, index: int, filename: str) -> dict:
        path = self._path(filename)
        started = time.perf_counter()
        tokens, value, points, nbytes = self.engine.scheduler.export_slot(index)
        try:
            size = write_kv_file(path, tokens, value,
                                 {**self.meta(), "reuse_points": points, "kv_nbytes": nbytes})
        except IsADirectoryError:
            raise RequestError(f"'filename' {filename!r} is a folder in --slot-save-path; give "
                               "the name of a file") from None
        except OSError as e:
            raise StrataError(f"slot file {filename!r} could not be written in --slot-save-path"
                              f": {e.strerror or type(e).__name__} (is the folder still there, "
                              "writable, with room?)") from e
        return {"id_slot": index, "filename": filename, "n_saved": len(tokens),
                "n_written": size,
                "timings": {"save_ms": 1000 * (time.perf_counter() - started)}}

    def restore(self, index: int, filename: str) -> dict:
        path = self._path(filename)
        if not path.is_file():
            raise RequestError(f"no slot file {filename!r} in --slot-save-path")
        started = time.perf_counter()
        try:
            header = read_kv_header(path)
            self._check_header(filename, header)
            tokens, value = read_kv_file(path, header)
        except KVFileError as e:
            reason = str(e).replace(str(path), repr(filename))
            raise RequestError(f"slot file {filename!r} cannot be read: {reason}") from e
        points = header.get("reuse_points")
        parked = ParkedConversation(0, tokens, value, int(header.get("kv_nbytes", 0)),
                                    None if points is None else tuple(points))
        n = self.engine.scheduler.install_slot(index, parked)
        return {"id_slot": index, "filename": filename, "n_restored": n,
                "n_read": path.stat().st_size,
                "timings": {"restore_ms": 1000 * (time.perf_counter() - started)}}
