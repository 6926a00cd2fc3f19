"""``GET /metrics`` of a cluster: every replica's Prometheus text with a ``replica`` label.

As vLLM labels each data-parallel engine's series (``engine="0"``), each
replica's samples keep their names and labels and gain ``replica="I"``; one
``# HELP`` / ``# TYPE`` pair per family. Totals over replicas are the
query's business (``sum without (replica) (...)``), as with vLLM.
"""

from __future__ import annotations

import re

#: a sample line: name, optional {labels}, the rest (value and optional timestamp)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?(\s.*)$")


def labelled(text: str, replica: int) -> tuple[list[str], list[str]]:
    """``text``'s comment lines and its sample lines with ``replica="I"`` added to each sample's labels."""
    comments, samples = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            comments.append(line)
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, _, labels, rest = match.groups()
        tag = f'replica="{replica}"'
        samples.append(f"{name}{{{labels},{tag}}}{rest}" if labels else f"{name}{{{tag}}}{rest}")
    return comments, samples


def merge(texts: dict[int, str]) -> str:
    """One exposition of every replica's text (``texts``: replica index -> its ``/metrics`` body).

    Families keep the order they first appear in; each family's samples are grouped, replica by replica.
    """
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in sorted(texts.items()):
        comments, samples = labelled(text, replica)
        for line in comments:
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                head = families.setdefault(parts[2], ([], []))[0]
                if line not in head:
                    head.append(line)
        for line in samples:
            families.setdefault(_family_of(line, families), ([], []))[1].append(line)
    return "".join(line + "\n" for head, lines in families.values() for line in (*head, *lines))


def _family_of(sample: str, families: dict) -> str:
    """The declared family a sample belongs to (``x_total``, ``x_bucket``... to ``x``), else its own name."""
    name = _SAMPLE.match(sample).group(1)
    if name in families:
        return name
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
        if name.endswith(suffix) and name.removesuffix(suffix) in families:
            return name.removesuffix(suffix)
    return name
