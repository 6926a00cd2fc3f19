"""Checks ``quanta serve`` / ``generate`` make before the model loads, each failing as one line.

- ``--model``: a GGUF file (its first four bytes are the GGUF magic) or a
  directory with ``config.json``; a missing path that looks like a Hugging Face
  id (``owner/name``) is named as one: quanta loads local paths only;
- ``--host``/``--port``: the address can be listened on (bound and released
  here, so a busy port is reported before a load that may take minutes);
- ``--chat-template``: a readable file (or the template itself, as vLLM takes
  it) that Jinja parses.

Each check raises ``ValueError`` with the message the CLI prints after
``quanta COMMAND: error:`` (exit code 2). Standard library only.
"""

from __future__ import annotations

import errno
import re
import socket
from pathlib import Path

#: The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"

#: ``owner/name`` as the Hugging Face hub spells repository ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def check_model_path(model: str) -> None:
    """Raise ``ValueError`` unless ``model`` is a GGUF file or a directory with ``config.json``."""
    path = Path(model)
    if not path.exists():
        if _HUB_ID.fullmatch(model):
            raise ValueError(f"--model {model}: no such file or directory; if it is a Hugging Face id, quanta loads "
                             f"local paths only (no hub downloads): download it first (huggingface-cli download "
                             f"{model} --local-dir DIR) and pass --model DIR")
        raise ValueError(f"--model {model}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: a directory without config.json; expected a GGUF file "
                             "or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
        return
    try:
        with path.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ValueError(f"--model {model}: cannot read it: {exc.strerror or exc}") from None
    if head != GGUF_MAGIC:
        raise ValueError(f"--model {model}: not a GGUF file (it does not start with the GGUF magic) "
                         "nor a Hugging Face model directory")


def read_chat_template(value: str) -> str:
    """The Jinja text of ``--chat-template``: the file ``value`` names, else ``value`` itself when it holds
    Jinja markup (``{{`` or ``{%``); raises ``ValueError`` when it is neither or does not parse."""
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it: {exc}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value}: no such file (nor a Jinja template: no '{{{{' or '{{%')")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {value}: not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return text


def check_listen(host: str, port: int) -> None:
    """Raise ``ValueError`` unless a TCP socket can listen on ``host:port`` now (port 0 always can)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        sock.bind(address)
        sock.listen(1)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?); "
                             "stop it or choose another --port") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {exc.strerror or exc}") from None
    finally:
        sock.close()
