"""Reading columnar dataset files a record batch at a time, through pyarrow: parquet, CSV / TSV, an Arrow IPC file or
stream, and a Hugging Face ``datasets`` ``save_to_disk`` folder.

Each yields ``(where, row)``: ``row`` a dict of column name -> value (a ``messages`` column of lists of structs comes
as lists of dicts, as a JSON record would), ``where`` names the file and the row (``FILE, row N``, 1-based, the
header not counted).  Rows are converted one record batch at a time (``iter_batches`` / the CSV streaming reader /
the IPC readers), so a file larger than memory is read in bounded memory.

A ``save_to_disk`` folder holds ``state.json`` (its ``_data_files``: the Arrow *stream* files,
``data-00000-of-0000N.arrow``, in order), ``dataset_info.json`` (the features) and the data files.  A
``DatasetDict`` folder holds ``dataset_dict.json`` (``{"splits": [...]}``) and a folder a split: its ``train`` split
is read (the only one a run trains on; ``--eval-data`` may name another split's folder).  ``datasets`` itself is
not needed to read them.

Every failure is a ``DataError`` naming the file (and the row where pyarrow says it).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from .kinds import FILE_FORMATS, DataError

#: rows converted to Python at a time: bounded memory whatever the file's row groups
BATCH_ROWS = 1024


def pyarrow_modules():
    """pyarrow, or a one-line error naming the pip extra."""
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401 - the submodules are used as attributes
    except ImportError:
        raise DataError("reading parquet, CSV, TSV, Arrow files and datasets folders needs pyarrow: "
                        "pip install pyarrow (lazytrain's 'data' extra)") from None
    return pyarrow


def read_table_rows(path: Path, kind: str, digest=None) -> Iterator[tuple[str, dict]]:
    """The rows of ``path``, a file (or folder) of ``kind`` (parquet | csv | tsv | arrow | datasets).  ``digest``
    (a ``hashlib`` object), if given, is updated with the bytes of the files read."""
    pa = pyarrow_modules()
    batches = {"parquet": _parquet, "csv": _csv, "tsv": _csv, "arrow": _arrow, "datasets": _datasets}[kind]
    n = 0
    for where, batch in batches(pa, path, kind, digest):
        try:
            rows = batch.to_pylist()
        except pa.ArrowException as e:
            raise DataError(f"{where}, rows {n + 1} to {n + batch.num_rows}: cannot read them ({_first(e)})") from None
        for row in rows:
            n += 1
            yield f"{where}, row {n}", row
    if n == 0:
        raise DataError(f"{path}: no examples (no rows)")


def _first(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _guarded(pa, path: Path, what: str, make: Callable[[], Iterator]) -> Iterator:
    """``make()``'s batches, any pyarrow or OS error as one ``DataError`` naming ``path`` and the formats."""
    try:
        it = make()
        while True:
            try:
                yield next(it)
            except StopIteration:
                return
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as {what} ({_first(e)}); accepted formats: "
                        f"{', '.join(FILE_FORMATS)}") from None


def hash_file(path: Path, digest) -> None:
    """Update ``digest`` with ``path``'s bytes (a file pyarrow reads by seeking: hashed in a pass of its own)."""
    if digest is None:
        return
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None


def _parquet(pa, path: Path, kind: str, digest):
    hash_file(path, digest)

    def make():
        # pre_buffer=False: with pyarrow's default the buffers of every row group read stay allocated (measured:
        # 875 MB held after 1 M rows of a 1 GB file, 14 MB without; benchmarks/results/issue43_data/)
        f = pa.parquet.ParquetFile(path, pre_buffer=False)
        yield from f.iter_batches(batch_size=BATCH_ROWS)
    for batch in _guarded(pa, path, "parquet", make):
        yield str(path), batch


class _Hashing:
    """A file object that replays ``head`` and then reads on, updating ``digest`` with every byte read from
    ``f`` (a CSV from a FIFO is read once)."""

    def __init__(self, f, digest, head: bytes = b""):
        self.f, self.digest, self.head, self.closed = f, digest, head, False

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = (self.head, b"") if n < 0 or n >= len(self.head) else (self.head[:n], self.head[n:])
            return out
        data = self.f.read(n)
        if self.digest is not None:
            self.digest.update(data)
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def _header(raw, digest, delimiter: str) -> tuple[bytes, list[str]]:
    """(the bytes read, the column names of the first line)."""
    head = raw.read(1 << 20)
    while b"\n" not in head and (more := raw.read(1 << 20)):
        head += more
    if digest is not None:
        digest.update(head)
    line = head.split(b"\n", 1)[0].removeprefix(b"\xef\xbb\xbf").decode("utf-8", "replace")
    return head, next(csv.reader(io.StringIO(line), delimiter=delimiter), [])


def _csv(pa, path: Path, kind: str, digest):
    delimiter = "\t" if kind == "tsv" else ","
    bad: list = []

    def invalid(row) -> str:
        bad.append(row)
        return "error"

    def make():
        with open(path, "rb") as raw:
            head, names = _header(raw, digest, delimiter)
            # every column read as text (a "1.50" stays "1.50", an empty cell "")
            yield from pa.csv.open_csv(
                _Hashing(raw, digest, head), read_options=pa.csv.ReadOptions(use_threads=False, block_size=1 << 20),
                parse_options=pa.csv.ParseOptions(delimiter=delimiter, invalid_row_handler=invalid),
                convert_options=pa.csv.ConvertOptions(column_types={n: pa.string() for n in names}))
    try:
        for batch in _guarded(pa, path, kind.upper(), make):
            yield str(path), batch
    except DataError:
        if bad:
            r = bad[0]
            row = f"row {r.number - 1}" if r.number else "a row"       # pyarrow counts the header as row 1
            raise DataError(f"{path}, {row}: {r.actual_columns} fields where the header has {r.expected_columns} "
                            f"(a {kind.upper()} row has one a column; quote a cell that holds the delimiter)") from None
        raise


def _arrow(pa, path: Path, kind: str, digest):
    hash_file(path, digest)

    def make():
        with pa.memory_map(str(path)) as src:
            try:
                reader = pa.ipc.open_file(src)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
                return
            except pa.ArrowInvalid:
                src.seek(0)
            yield from pa.ipc.open_stream(src)
    for batch in _guarded(pa, path, "an Arrow file (IPC file or stream)", make):
        yield str(path), batch


def datasets_files(folder: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder in order (a ``DatasetDict`` folder: its ``train`` split's)."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{folder}/dataset_dict.json: not a datasets DatasetDict index ({_first(e)})") from None
        if "train" not in splits:
            raise DataError(f"{folder}: a DatasetDict folder without a train split (splits: {', '.join(splits)}); "
                            f"name a split's folder, e.g. {folder / splits[0]}" if splits else
                            f"{folder}: a DatasetDict folder without splits")
        folder = folder / "train"
    state = folder / "state.json"
    if not state.is_file():
        raise DataError(f"{folder}: a folder, but not one `datasets` save_to_disk wrote (no state.json or "
                        f"dataset_dict.json); accepted formats: {', '.join(FILE_FORMATS)}")
    try:
        names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: not a datasets state.json ({_first(e)})") from None
    files = [folder / n for n in names]
    missing = [str(f.name) for f in files if not f.is_file()]
    if missing or not files:
        listed = ", ".join(missing) or "none listed"
        raise DataError(f"{folder}: its state.json lists data files that are missing ({listed}); copy the whole "
                        f"save_to_disk folder")
    return files


def _datasets(pa, path: Path, kind: str, digest):
    for f in datasets_files(path):
        for _, batch in _arrow(pa, f, "arrow", digest):
            yield str(path), batch
