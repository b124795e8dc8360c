"""Reading a dataset file: JSONL (one example a line) or JSON (a list), in the common formats.

The format of each record is told by its keys (other keys are ignored)::

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}   chat
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}       sharegpt
    {"prompt": ..., "completion": ...}                                                     completion
    {"instruction": ..., "input": ..., "output": ...}     alpaca ("input" may be missing or empty)
    {"text": ...}                                                                          plain text

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

FORMATS = ("messages (role/content)", "conversations (from/value)", "prompt/completion",
           "instruction/input/output (alpaca)", "text")
ROLES = ("system", "user", "assistant", "tool")
#: sharegpt speaker names -> chat roles
_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
             "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
             "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool"}


class DataError(ValueError):
    """A dataset file that cannot be read as examples; the message names the file and the line."""


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


def read_records(path: str | Path, digest=None) -> list[Record]:
    """Every example of a JSONL or JSON file, in file order.  The file is read once, as a stream (a FIFO or
    ``<(zcat ...)`` can be read only once): ``digest`` (a ``hashlib`` object), if given, is updated with its
    bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _read(_chunks(f, digest), path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None


def _chunks(f, digest) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        if digest is not None:
            digest.update(chunk)
        yield chunk


def _read(chunks: Iterator[bytes], path: Path) -> list[Record]:
    head = b""
    for chunk in chunks:                   # up to the first byte that is not blank: a JSON list or JSONL?
        head += chunk
        if head.strip() or len(head) > MAX_RECORD_BYTES:
            break
    head = head.removeprefix(codecs.BOM_UTF8)          # (a Windows editor's mark, which json.loads refuses)
    rest = itertools.chain([head], chunks)
    rows = _json_list(rest, path) if head.lstrip().startswith(b"[") else _jsonl(rest, path)
    if not rows:
        raise DataError(f"{path}: no examples (an empty file)")
    return [_sized(parse_record(obj, where)) for where, obj in rows]


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


def _jsonl(chunks: Iterator[bytes], path: Path) -> list[tuple[str, object]]:
    rows = []
    for n, raw in _lines(chunks, path):
        if not raw.strip():
            continue
        try:
            rows.append((f"{path}:{n}", json.loads(raw.decode("utf-8"))))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: cannot read it (not UTF-8: {e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); a JSONL file holds "
                            f"one JSON object a line") from None
        except (RecursionError, ValueError) as e:
            raise DataError(f"{path}:{n}: not valid JSON ({_why(e)})") from None
    return rows


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
    raise DataError(f"{where}: no known format (keys: {keys}); accepted formats: {', '.join(FORMATS)}")


def _text(v, where: str, key: str) -> str:
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
