"""Redaction: the values of TaskBridge's own secrets kept out of what it stores and shows.

Role: know those values (read at call time) and replace every occurrence in a text with a label
such as ``[redacted: bearer token]``. A second line behind the box that keeps them from the agent:
whatever a run prints, the task log, the receipt, the task's error and everything the board, the
MCP tools and the CLI show of them never carry one.

The secrets: the HTTP bearer token (``MCP_BEARER_TOKEN`` and the token file), the OAuth store's
client secrets (``oauth.json`` beside the token file; its access and refresh tokens are signed,
never stored), the reverse bridge's ``ANTHROPIC_API_KEY`` / ``ANTHROPIC_AUTH_TOKEN``, the queue
database's password (in ``TASK_DB_URL``, ``PGPASSWORD``, the password file: the URL's
``passfile``, ``PGPASSFILE`` or ``~/.pgpass``), ``OPENCODE_SERVER_PASSWORD``, and the model
providers' keys the worker's OpenCode may use (``*_API_KEY`` / ``*_AUTH_TOKEN`` variables,
``apiKey`` in its config, its ``auth.json``), and what this process holds (``hold``: the
passwords of the kept servers it runs, and of the last ones it stopped). Values shorter than MIN_SECRET_CHARS are not
matched (they would hit ordinary words). Each value is matched as written and in its
JSON-escaped form (the task log is OpenCode's JSON event stream).

Cost: files are re-read only when their (inode, mtime, size) changes; the matcher is one
precompiled alternation (longest value first), one pass over a text that holds no secret.

Not run on its own; nothing happens at import time. Env: the variables above, ``MCP_TOKEN_FILE``.
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import connectors
import opencode_runner as oc
import task_store

MIN_SECRET_CHARS = 8
HOLD_MAX = 1 << 20     # bytes a long line's redaction may hold back for a chain of overlapping values
ENV_SECRETS = (("MCP_BEARER_TOKEN", "bearer token"), ("ANTHROPIC_API_KEY", "anthropic api key"),
               ("ANTHROPIC_AUTH_TOKEN", "anthropic auth token"), ("PGPASSWORD", "database password"),
               ("OPENCODE_SERVER_PASSWORD", "opencode server password"))

_files: dict[str, tuple[Any, list[str]]] = {}      # path -> (stamp, values read from it)
_held: dict[str, str] = {}                       # values this process holds now (hold): value -> label
_released: dict[str, str] = {}                   # the newest RELEASED_KEPT let go (release), oldest first
_held_lock = threading.Lock()
RELEASED_KEPT = 32   # a run's receipt is stored after its server has stopped: its password stays counted
_built: dict[tuple, Redactor] = {}               # the secret set -> its compiled matcher


def hold(value: str, label: str) -> None:
    """Count ``value`` (its ``label``) among this process's secrets until ``release``: a secret
    TaskBridge makes itself and keeps in no variable or file, such as a kept OpenCode server's
    password (engine.py), which that server's non-shell children (MCP servers, LSPs) inherit."""
    with _held_lock:
        _held[value] = label


def release(value: str) -> None:
    """``value`` is no longer in use (its server stopped); it stays counted while it is among the
    RELEASED_KEPT newest released (what that server's run printed is stored after its stop)."""
    with _held_lock:
        label = _held.pop(value, None)
        if label is not None:
            _released.pop(value, None)
            _released[value] = label
            while len(_released) > RELEASED_KEPT:
                del _released[next(iter(_released))]


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _from_file(path: Path, parse: Callable[[str], list[str]]) -> list[str]:
    """The values ``parse`` finds in ``path``, re-read only when the file changed; [] when it
    cannot be read (a missing file holds no secret)."""
    stamp = _stamp(path)
    cached = _files.get(str(path))
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        values = parse(path.read_text(errors="replace")) if stamp else []
    except (OSError, ValueError):
        values = []
    _files[str(path)] = (stamp, values)
    return values


def _token_values(text: str) -> list[str]:
    return [text.strip()]


def _oauth_values(text: str) -> list[str]:
    clients = json.loads(text).get("clients") or {}
    return [str(c.get("client_secret")) for c in clients.values() if isinstance(c, dict) and c.get("client_secret")]


def _pgpass_values(text: str) -> list[str]:
    """The password field of each ``host:port:db:user:password`` line (``\\:`` and ``\\\\`` escaped)."""
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            fields = re.split(r"(?<!\\):", line.rstrip("\n"), maxsplit=4)
            if len(fields) == 5:
                found.append(re.sub(r"\\(.)", r"\1", fields[4]))
    return found


def _provider_key_values(text: str) -> list[str]:
    """The model providers' keys an OpenCode config (``provider.<id>.options.apiKey``) or its
    credentials file (``auth.json``: ``{<provider>: {"key"|"access"|"refresh": ...}}``) holds;
    ``{env:…}`` / ``{file:…}`` references are not secrets themselves. Raises ValueError for a
    file that is not JSON (a JSONC config with comments is skipped: the env form still counts)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        return []
    found = []
    providers = data.get("provider")
    for entry in providers.values() if isinstance(providers, dict) else []:
        options = entry.get("options") if isinstance(entry, dict) else None
        if isinstance(options, dict):
            found.append(options.get("apiKey"))
    found += [entry.get(name) for entry in data.values() if isinstance(entry, dict) and "type" in entry
              for name in ("key", "access", "refresh")]
    return [v for v in found if isinstance(v, str) and not v.startswith(("{env:", "{file:"))]


def _provider_keys() -> list[tuple[str, str]]:
    """(value, label) of the model providers' keys the worker's OpenCode can use: the environment's
    ``*_API_KEY`` / ``*_AUTH_TOKEN`` variables (OPENAI_API_KEY, …), OPENCODE_CONFIG_CONTENT and the
    files of ``opencode_runner.user_config_files``. A provider's error quoting its key (a 401 "Incorrect API key
    provided: sk-…") is then stored and shown without it."""
    found = [(value, f"api key ({name})") for name, value in os.environ.items()
             if name.endswith(("_API_KEY", "_AUTH_TOKEN")) and name not in dict(ENV_SECRETS)]
    try:
        inline = _provider_key_values(os.environ.get("OPENCODE_CONFIG_CONTENT") or "{}")
    except ValueError:
        inline = []
    found += [(value, "provider api key") for value in inline]
    for path in oc.user_config_files():
        found += [(value, "provider api key") for value in _from_file(path, _provider_key_values)]
    return found


def secret_values() -> dict[str, str]:
    """Every secret value TaskBridge holds now, read at call time: ``{value: label}`` (labels like
    ``"bearer token"``), values of at least MIN_SECRET_CHARS characters only. Never raises: an
    unreadable source holds no value."""
    found: list[tuple[str, str]] = [(os.environ.get(name) or "", label) for name, label in ENV_SECRETS]
    url = task_store.database_url()
    found += [(value, "database password") for value in (task_store.url_secrets(url) if url else [])]
    token_file = connectors.token_file()
    found += [(value, "bearer token") for value in _from_file(token_file, _token_values)]
    found += [(value, "oauth client secret") for value in _from_file(token_file.parent / "oauth.json", _oauth_values)]
    pgpass = Path(task_store.pgpass_file(url)).expanduser()
    found += [(value, "database password") for value in _from_file(pgpass, _pgpass_values)]
    found += _provider_keys()
    with _held_lock:
        found += [*_held.items(), *_released.items()]
    values: dict[str, str] = {}
    for value, label in found:
        value = value.strip()
        if len(value) >= MIN_SECRET_CHARS:
            values.setdefault(value, label)
    return values


def _forms(values: dict[str, str]) -> dict[str, str]:
    """Each value as written and JSON-escaped (how it stands inside the event stream's strings)."""
    forms: dict[str, str] = {}
    for value, label in values.items():
        for form in (value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]):
            forms.setdefault(form, label)
    return forms


class Redactor:
    """One compiled matcher for a set of secret values (``{value: label}``): ``redact`` for a
    text, ``spans`` for where the values stand. Overlapping values are both covered: the spans of
    all values found are merged, and a merged span gets one label naming each."""

    def __init__(self, values: dict[str, str]) -> None:
        self.labels = _forms(values)
        ordered = sorted(self.labels, key=len, reverse=True)
        self.longest = max((len(f.encode()) for f in ordered), default=0)   # bytes
        alternation = "|".join(re.escape(f) for f in ordered)
        self._str = re.compile(alternation) if ordered else None
        self._bytes = re.compile(alternation.encode()) if ordered else None
        # Zero-width at every position where a value starts: finds values that overlap.
        self._str_at = re.compile(f"(?=({alternation}))") if ordered else None
        self._bytes_at = re.compile(f"(?=({alternation}))".encode()) if ordered else None

    def spans(self, data: str | bytes | bytearray) -> list[tuple[int, int, list[str]]]:
        """Merged ``(start, end, labels)`` of every secret value in ``data``, in order."""
        merged: list[tuple[int, int, list[str]]] = []
        for start, end, label in self._hits(data):
            if merged and start < merged[-1][1]:
                last = merged[-1]
                merged[-1] = (last[0], max(last[1], end), last[2] + [label] * (label not in last[2]))
            else:
                merged.append((start, end, [label]))
        return merged

    def _hits(self, data: str | bytes | bytearray) -> Iterator[tuple[int, int, str]]:
        """``(start, end, label)`` of each value where it starts in ``data``, overlapping ones too; the
        plain search first, so a text without any value costs one pass."""
        if isinstance(data, (bytes, bytearray)):
            if self._bytes is not None and self._bytes_at is not None and (hit := self._bytes.search(data)):
                for found in self._bytes_at.finditer(data, hit.start()):
                    yield found.start(), found.start() + len(found.group(1)), self.labels[found.group(1).decode()]
        elif self._str is not None and self._str_at is not None and (hit_str := self._str.search(data)):
            for found_str in self._str_at.finditer(data, hit_str.start()):
                yield found_str.start(), found_str.start() + len(found_str.group(1)), self.labels[found_str.group(1)]

    def redact(self, data: Any) -> Any:
        """``data`` (str or bytes) with every secret value replaced by its label; anything else
        is returned as it is."""
        if not isinstance(data, (str, bytes, bytearray)) or not self.labels:
            return data
        return replace(data, self.spans(data))


def replace(data: Any, spans: list[tuple[int, int, list[str]]]) -> Any:
    """``data`` with each span (as ``Redactor.spans`` gives them) replaced by its label."""
    if not spans:
        return data
    binary = isinstance(data, (bytes, bytearray))
    parts: list[Any] = []
    at = 0
    for start, end, labels in spans:
        label = f"[redacted: {', '.join(labels)}]"
        parts += [data[at:start], label.encode() if binary else label]
        at = end
    parts.append(data[at:])
    if binary:
        return b"".join(bytes(p) for p in parts)
    return "".join(parts)


def current() -> Redactor:
    """The matcher for the secrets held now (``secret_values``), compiled once per set."""
    values = secret_values()
    key = tuple(sorted(values.items()))
    if key not in _built:
        _built.clear()   # a rotated token: the old matcher is not needed again
        _built[key] = Redactor(values)
    return _built[key]


def redact(data: Any) -> Any:
    """``data`` (str or bytes) with the values of TaskBridge's secrets replaced by labels such as
    ``[redacted: bearer token]``; other types are returned unchanged. Never raises."""
    return current().redact(data)


def redact_deep(value: Any, redactor: Redactor | None = None) -> Any:
    """``value`` with every str and bytes inside it (dict values and keys, list and tuple items)
    redacted; the shape is kept."""
    redactor = redactor or current()
    if not redactor.labels:
        return value
    if isinstance(value, dict):
        return {redactor.redact(k): redact_deep(v, redactor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_deep(v, redactor) for v in value)
    return redactor.redact(value)


class LongLine:
    """A line too long to hold (the worker's oversized-line path) redacted as it is written in
    pieces: ``feed`` returns what can be written now, holding back the last ``longest - 1``
    bytes (a value may go on in the next piece) and any values that reach into them (up to
    HOLD_MAX bytes); ``end`` returns the rest."""

    def __init__(self, redactor: Redactor) -> None:
        self.redactor, self.held = redactor, b""

    def feed(self, piece: bytes) -> bytes:
        """The redacted bytes of ``held + piece`` that no later piece can change."""
        data = self.held + piece
        cut = len(data) - max(self.redactor.longest - 1, 0)
        if cut <= 0:
            self.held = data
            return b""
        spans = self.redactor.spans(data)
        for start, end, _ in spans:
            if start < cut < end:   # keep values reaching past the cut whole, to be read again
                cut = start if start > 0 or len(data) < HOLD_MAX else end
        self.held = data[cut:]
        return replace(data[:cut], [s for s in spans if s[1] <= cut])

    def end(self) -> bytes:
        """What is held, redacted; the line is over."""
        rest, self.held = self.held, b""
        return self.redactor.redact(rest)
