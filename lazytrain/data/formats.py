"""Reading a dataset file, a record at a time: JSONL (one example a line) or JSON (a list) here; parquet, CSV / TSV,
an Arrow file and a ``datasets`` ``save_to_disk`` folder through pyarrow (``tables.py``), told by the extension.

The format of each record is told by its keys (other keys are ignored)::

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}   chat
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}       sharegpt
    {"prompt": ..., "completion": ...}                                                     completion
    {"instruction": ..., "input": ..., "output": ...}     alpaca ("input" may be missing or empty)
    {"text": ...}                                                                          plain text

A row of a table is a record with its columns as keys.  ``columns`` (``--columns question=prompt,answer=completion``)
renames keys (columns) to these before the format is told, for every file kind.

Every record becomes a ``Record``: a chat (``messages``: sharegpt's roles mapped to user /
assistant / system / tool, and an alpaca record as one user turn, instruction then input, and one
assistant turn), or a ``prompt`` and ``completion`` (plain text: the prompt is empty).  Which
tokens carry a loss, and how a chat is rendered, is ``encode.py``'s business.  Anything else is one
error naming the file, the line and the accepted formats.
"""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .kinds import DataError, kind_of

FORMATS = ("messages (role/content)", "conversations (from/value)", "prompt/completion",
           "instruction/input/output (alpaca)", "text")
#: the keys a record's format is told by: what ``--columns`` may map a column to
KEYS = ("messages", "conversations", "prompt", "completion", "instruction", "input", "output", "text")
#: column names that usually hold a prompt, or an answer: the mapping an error suggests
_PROMPT_LIKE = ("question", "query", "input", "instruction", "prompt", "problem", "source", "context", "user")
_ANSWER_LIKE = ("answer", "response", "output", "completion", "target", "solution", "reply", "label", "assistant")
ROLES = ("system", "user", "assistant", "tool")
#: sharegpt speaker names -> chat roles
_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
             "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
             "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool"}


@dataclass(frozen=True, slots=True)
class Record:
    """One example: a chat (``messages``, tuples of (role, content)) or a prompt and its completion."""

    where: str                                   # "FILE:LINE" (JSONL) or "FILE[INDEX]" (JSON list)
    format: str                                  # messages | conversations | completion | alpaca | text
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    completion: str = ""

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    def key(self) -> str:
        """The example's content, canonical: what the held-out split hashes."""
        return json.dumps([self.messages, self.prompt, self.completion], ensure_ascii=False)


#: the longest record: a JSONL line, or a record's text in a JSON list.  Tokenizing text takes some 440 bytes of
#: memory a byte of it (a 5 MB record: 2.2 GB, a 50 MB one aborts the process in the tokenizer: issue #42), and a
#: record this long is a million tokens, beyond what a run trains on; a longer one is an error naming it, before
#: it is tokenized (and a file without line breaks, as /dev/zero, is refused after this many bytes, not read whole)
MAX_RECORD_BYTES = 4 << 20
#: the largest JSON list file: one JSON value, parsed whole (several times its size in memory); JSONL has no bound
MAX_JSON_LIST_BYTES = 1 << 30
_CHUNK = 1 << 20


def read_records(path: str | Path, digest=None, columns: dict[str, str] | None = None) -> list[Record]:
    """Every example of a dataset file, in file order (``iter_records``, as a list)."""
    return list(iter_records(path, digest, columns))


def iter_records(path: str | Path, digest=None, columns: dict[str, str] | None = None) -> Iterator[Record]:
    """The examples of a dataset file in file order, read as a stream: a table a record batch at a time, JSONL a
    line at a time (a FIFO or ``<(zcat ...)`` can be read only once).  ``digest`` (a ``hashlib`` object), if
    given, is updated with the file's bytes; ``columns`` renames keys before the format is told."""
    path = Path(path)
    kind = kind_of(path)
    if kind == "json":
        rows = _json_rows(path, digest)
    else:
        from .tables import read_table_rows  # pyarrow: imported where used
        rows = read_table_rows(path, kind, digest)
    seen: set[str] = set()
    for where, obj in rows:
        if columns and isinstance(obj, dict):
            if kind != "json" and not seen:
                _check_mapped(path, obj, columns)
            seen.update(k for k in columns if k in obj)
            obj = rename(obj, columns)
        yield _sized(parse_record(obj, where))
    missing = [k for k in (columns or {}) if k not in seen]
    if missing:
        raise DataError(f"{path}: --columns names {', '.join(map(repr, missing))}, which no record has")


def _check_mapped(path: Path, row: dict, columns: dict[str, str]) -> None:
    """A table's columns are in every row: a mapped column not in its first row is in none."""
    missing = [k for k in columns if k not in row]
    if not missing:
        return
    keys = ", ".join(map(str, row)) or "none"
    raise DataError(f"{path}: --columns names {', '.join(map(repr, missing))}, not a column of it (its "
                    f"columns: {keys})")


def rename(obj: dict, columns: dict[str, str]) -> dict:
    """``obj`` with the keys ``columns`` maps renamed (a renamed key wins over one already of that name)."""
    out = {k: v for k, v in obj.items() if k not in columns}
    out.update({columns[k]: v for k, v in obj.items() if k in columns})
    return out


def parse_columns(text: str) -> dict[str, str]:
    """``question=prompt,answer=completion`` as a mapping, each target one of ``KEYS``."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        src, eq, dst = part.partition("=")
        if not eq or not src.strip() or not dst.strip():
            raise ValueError(f"{part!r}: write COLUMN=KEY pairs, e.g. question=prompt,answer=completion")
        out[src.strip()] = dst.strip()
    return check_columns(out)


def check_columns(columns) -> dict[str, str]:
    """``columns`` (from a flag or a config file) checked: strings to a known key, each key once."""
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in columns.items()):
        raise ValueError(f"columns must map column names to keys ({', '.join(KEYS)}), got {columns!r}")
    for src, dst in columns.items():
        if dst not in KEYS:
            raise ValueError(f"columns: {src}={dst}: {dst!r} is not a key we read; map to one of {', '.join(KEYS)}")
    doubled = sorted({v for v in columns.values() if list(columns.values()).count(v) > 1})
    if doubled:
        raise ValueError(f"columns: several columns map to {', '.join(doubled)}")
    return dict(columns)


def suggest_columns(keys) -> str:
    """A ``--columns`` mapping for a record with ``keys`` and no known format."""
    names = [str(k) for k in keys]
    prompt = next((k for like in _PROMPT_LIKE for k in names if k.lower() == like), None)
    answer = next((k for like in _ANSWER_LIKE for k in names if k.lower() == like and k != prompt), None)
    if prompt and answer:
        return f"--columns {prompt}=prompt,{answer}=completion"
    return "--columns YOUR_PROMPT_COLUMN=prompt,YOUR_ANSWER_COLUMN=completion (or COLUMN=text, COLUMN=messages)"


def _json_rows(path: Path, digest) -> Iterator[tuple[str, object]]:
    try:
        with open(path, "rb") as f:
            yield from _read(_chunks(f, digest), path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None


def _chunks(f, digest) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        if digest is not None:
            digest.update(chunk)
        yield chunk


def _read(chunks: Iterator[bytes], path: Path) -> Iterator[tuple[str, object]]:
    head = b""
    for chunk in chunks:                   # up to the first byte that is not blank: a JSON list or JSONL?
        head += chunk
        if head.strip() or len(head) > MAX_RECORD_BYTES:
            break
    head = head.removeprefix(codecs.BOM_UTF8)          # (a Windows editor's mark, which json.loads refuses)
    rest = itertools.chain([head], chunks)
    rows = _json_list(rest, path) if head.lstrip().startswith(b"[") else _jsonl(rest, path)
    empty = True
    for row in rows:
        empty = False
        yield row
    if empty:
        raise DataError(f"{path}: no examples (an empty file)")


def _json_list(chunks: Iterator[bytes], path: Path) -> list[tuple[str, object]]:
    data, size = [], 0
    for chunk in chunks:
        data.append(chunk)
        size += len(chunk)
        if size > MAX_JSON_LIST_BYTES:
            raise DataError(f"{path}: a JSON list of more than {MAX_JSON_LIST_BYTES >> 30} GiB is parsed whole; "
                            f"write it as JSONL (one record a line), which is read a line at a time")
    try:
        items = json.loads(b"".join(data).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: cannot read it (not UTF-8: {e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (RecursionError, ValueError) as e:
        raise DataError(f"{path}: not valid JSON ({_why(e)})") from None
    return [(f"{path}[{i}]", obj) for i, obj in enumerate(items)]


def _jsonl(chunks: Iterator[bytes], path: Path) -> Iterator[tuple[str, object]]:
    for n, raw in _lines(chunks, path):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: cannot read it (not UTF-8: {e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); a JSONL file holds "
                            f"one JSON object a line") from None
        except (RecursionError, ValueError) as e:
            raise DataError(f"{path}:{n}: not valid JSON ({_why(e)})") from None
        yield f"{path}:{n}", obj


def _lines(chunks: Iterator[bytes], path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a byte stream, each line at most ``MAX_RECORD_BYTES``."""
    n, part = 0, b""
    for chunk in chunks:
        *lines, part = (part + chunk).split(b"\n")
        for line in lines:
            n += 1
            yield n, _bounded(line, path, n)
        _bounded(part, path, n + 1)
    if part:
        yield n + 1, part


def _bounded(line: bytes, path: Path, n: int) -> bytes:
    if len(line) > MAX_RECORD_BYTES:
        raise DataError(f"{path}:{n}: a line of more than {MAX_RECORD_BYTES >> 20} MiB; a record this long is "
                        f"refused before it is tokenized (a JSONL file holds one record a line)")
    return line


def _why(e: Exception) -> str:
    """What Python's JSON reader refused beyond the grammar: too deep a nesting, or too long an integer."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e).split(":")[0]       # "Exceeds the limit (4300 digits) for integer string conversion"


def _sized(rec: Record) -> Record:
    n = len(rec.prompt) + len(rec.completion) + sum(len(c) for _, c in rec.messages)
    if n > MAX_RECORD_BYTES:
        raise DataError(f"{rec.where}: a record of {n:,} characters, more than {MAX_RECORD_BYTES >> 20} Mi; a "
                        f"record this long is refused before it is tokenized")
    return rec


def parse_record(obj, where: str) -> Record:
    """One JSON value as a ``Record``, its format told by its keys."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: an example must be a JSON object, got {type(obj).__name__}; accepted formats: "
                        f"{', '.join(FORMATS)}")
    if "messages" in obj:
        return Record(where, "messages", messages=_with_answer(_chat(obj["messages"], where, "messages"), where,
                                                               "messages"))
    if "conversations" in obj:
        turns = _chat(obj["conversations"], where, "conversations")
        return Record(where, "conversations", messages=_with_answer(turns, where, "conversations"))
    if "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, list) and isinstance(c, list):       # the conversational prompt/completion form
            turns = _chat(p, where, "prompt") + _chat(c, where, "completion")
            return Record(where, "completion", messages=_with_answer(turns, where, "completion"))
        return Record(where, "completion", prompt=_text(p, where, "prompt"), completion=_text(c, where, "completion"))
    if "instruction" in obj and "output" in obj:
        ask = _text(obj["instruction"], where, "instruction")
        extra = _text(obj.get("input") or "", where, "input")
        user = f"{ask}\n\n{extra}" if extra.strip() else ask
        return Record(where, "alpaca", messages=(("user", user), ("assistant", _text(obj["output"], where, "output"))))
    if "text" in obj:
        return Record(where, "text", completion=_text(obj["text"], where, "text"))
    keys = ", ".join(sorted(map(str, obj))) or "none"
    raise DataError(f"{where}: no known format (keys: {keys}); accepted formats: {', '.join(FORMATS)}; to read "
                    f"other columns map them: {suggest_columns(obj)}")


def _text(v, where: str, key: str) -> str:
    if v is None:
        raise DataError(f"{where}: {key!r} is null (an empty cell); every example needs it")
    if not isinstance(v, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(v).__name__}")
    return v


def _chat(turns, where: str, key: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: {key!r} must be a non-empty list of turns")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise DataError(f"{where}: {key}[{i}] must be an object with role/content (or from/value)")
        if "role" in t:
            role, content = t["role"], t.get("content")
        elif "from" in t:
            role, content = _SPEAKERS.get(str(t["from"]).lower(), t["from"]), t.get("value")
        else:
            raise DataError(f"{where}: {key}[{i}] has neither role/content nor from/value")
        if role not in ROLES:
            raise DataError(f"{where}: {key}[{i}] has role {role!r}; accepted: {', '.join(ROLES)} (sharegpt: "
                            f"human, gpt, system, ...)")
        out.append((role, _text(content, where, f"{key}[{i}] content")))
    return tuple(out)


def _with_answer(turns: tuple[tuple[str, str], ...], where: str, key: str) -> tuple[tuple[str, str], ...]:
    if not any(r == "assistant" for r, _ in turns):
        raise DataError(f"{where}: {key!r} has no assistant turn, so nothing to learn")
    return turns
