"""Sweeps over any server's flags: ``quanta bench sweep --server-cmd TEMPLATE``.

The template is the server's command line with placeholders: ``{port}``
(a free 127.0.0.1 port, one per condition) and one ``{knob}`` per grid flag
(``--grid "--ubatch-size 64,128"`` fills ``{ubatch_size}``). Each condition
starts the filled command without a shell in its own process group, waits
until the health URL answers 200, then checks every ``--verify`` rule: the
value the server *applied* must equal the requested one, else the condition
is invalid and not measured (a server that silently clamps or ignores a flag
would otherwise be measured under the wrong name). Rules:

- ``KNOB=log:REGEX`` -- the first group of the last match of REGEX in the
  server's output up to health (``n_ubatch\\s*=\\s*(\\d+)`` for llama-server);
- ``KNOB=json:/PATH:FIELD`` -- a dotted field of the JSON that
  ``GET /PATH`` returns (``/v1/config:admit_k`` for quanta,
  ``/props:default_generation_settings.n_ctx`` for llama-server).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quanta.bench import server as srvmod

if TYPE_CHECKING:  # httpx loads when a request is sent: ``quanta --help`` and ``--version`` need none of it
    import httpx

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class TemplateError(ValueError):
    """A server template, health URL or verification rule that cannot be used."""


def knob_name(flag: str) -> str:
    """``--ubatch-size`` -> ``ubatch_size`` (the placeholder a grid flag fills)."""
    return flag.lstrip("-").replace("-", "_")


@dataclass
class Rule:
    """How to read one knob's applied value from a started server."""

    knob: str
    kind: str  # "log" or "json"
    pattern: re.Pattern | None = None
    path: str = ""
    field: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.kind == "log":
            return f"{self.knob}: last match of /{self.pattern.pattern}/ in the startup log"
        return f"{self.knob}: field {'.'.join(self.field)} of GET {self.path}"

    def applied(self, log_text: str, base_url: str, client: httpx.Client) -> tuple[str | None, str | None]:
        """``(value, None)`` or ``(None, why it could not be read)``."""
        if self.kind == "log":
            matches = list(self.pattern.finditer(log_text))
            if not matches:
                return None, f"no match of /{self.pattern.pattern}/ in the startup log"
            return matches[-1].group(1), None
        import httpx

        try:
            r = client.get(base_url + self.path)
            data = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            return None, f"GET {self.path}: {type(exc).__name__}: {exc}"
        if r.status_code != 200:
            return None, f"GET {self.path} answered HTTP {r.status_code}"
        for key in self.field:
            if isinstance(data, list) and key.isdigit() and int(key) < len(data):
                data = data[int(key)]
            elif isinstance(data, dict) and key in data:
                data = data[key]
            else:
                return None, f"GET {self.path} has no field {'.'.join(self.field)}"
        return (json.dumps(data) if isinstance(data, (dict, list)) else str(data)), None


def parse_rule(text: str) -> Rule:
    """``KNOB=log:REGEX`` or ``KNOB=json:/PATH:FIELD.SUBFIELD``.

    Raises:
        TemplateError: any other form, a regex that does not compile or has
            no group, a path that does not start with ``/``.
    """
    knob, eq, rule = text.partition("=")
    kind, colon, rest = rule.partition(":")
    if not eq or not colon or not knob or kind not in ("log", "json") or not rest:
        raise TemplateError(f"--verify {text!r}: expected KNOB=log:REGEX or KNOB=json:/PATH:FIELD")
    knob = knob_name(knob)
    if kind == "log":
        try:
            pattern = re.compile(rest)
        except re.error as exc:
            raise TemplateError(f"--verify {text!r}: bad regex: {exc}") from exc
        if pattern.groups < 1:
            raise TemplateError(f"--verify {text!r}: the regex needs a (group) around the applied value")
        return Rule(knob, "log", pattern=pattern)
    path, colon, fld = rest.rpartition(":")
    if not colon or not path.startswith("/") or not fld or "" in fld.split("."):
        raise TemplateError(f"--verify {text!r}: expected json:/PATH:FIELD, e.g. json:/props:default_generation_settings.n_ctx")
    return Rule(knob, "json", path=path, field=fld.split("."))


@dataclass
class ExternalServer:
    """The ``--server-cmd`` launcher of a sweep (see the module docstring).

    Attributes:
        template: the command line with ``{port}`` and ``{knob}`` placeholders.
        health: a path (``/health``) or a URL with ``{port}``.
        rules: ``--verify`` rules by knob.
        startup_timeout: seconds to wait for health.
    """

    template: str
    health: str = "/health"
    rules: dict[str, Rule] = field(default_factory=dict)
    startup_timeout: float = srvmod.STARTUP_TIMEOUT_S

    @classmethod
    def from_args(cls, template: str, health: str, verify: list[str], startup_timeout: float) -> ExternalServer:
        """Raises TemplateError: no ``{port}`` in the template, a bad rule, a knob verified twice."""
        try:
            shlex.split(template)
        except ValueError as exc:
            raise TemplateError(f"--server-cmd {template!r}: {exc}") from exc
        if "port" not in _PLACEHOLDER.findall(template):
            raise TemplateError(f"--server-cmd {template!r} has no {{port}}: every condition's server gets a fresh port")
        if not health.startswith("/") and not health.startswith(("http://", "https://")):
            raise TemplateError(f"--health-url {health!r}: expected /PATH or http://127.0.0.1:{{port}}/PATH")
        rules: dict[str, Rule] = {}
        for text in verify:
            rule = parse_rule(text)
            if rule.knob in rules:
                raise TemplateError(f"--verify: {rule.knob} has two rules")
            rules[rule.knob] = rule
        return cls(template, health, rules, startup_timeout)

    def knobs(self) -> set[str]:
        return set(_PLACEHOLDER.findall(self.template)) - {"port"}

    def check(self, conds) -> None:
        """Every condition fills every placeholder, every grid flag has one, every rule names a knob.

        Raises:
            TemplateError: naming the first mismatch.
        """
        placeholders = self.knobs()
        swept: set[str] = set()
        for c in conds:
            values = condition_values(c.flags)
            swept |= set(values)
            if set(values) - placeholders:
                extra = ", ".join("{" + k + "}" for k in sorted(set(values) - placeholders))
                raise TemplateError(f"condition {c.name!r}: --server-cmd has no {extra}, so the value would not reach the server")
            if placeholders - set(values):
                missing = ", ".join("--" + k.replace("_", "-") for k in sorted(placeholders - set(values)))
                raise TemplateError(f"condition {c.name!r} gives no {missing} for the template's placeholder")
        unknown = sorted(set(self.rules) - swept)
        if unknown:
            raise TemplateError(f"--verify names {', '.join(unknown)}, which no --grid sweeps")

    def unverified(self) -> list[str]:
        return sorted(self.knobs() - set(self.rules))

    def command(self, values: dict[str, str], port: int | str) -> list[str]:
        """The filled argv (placeholders replaced token by token, no shell)."""
        fill = {**values, "port": str(port)}
        return [_PLACEHOLDER.sub(lambda m: fill[m.group(1)], tok) for tok in shlex.split(self.template)]

    def health_url(self, base_url: str, port: int) -> str:
        return base_url + self.health if self.health.startswith("/") else self.health.replace("{port}", str(port))

    def describe(self) -> str:
        rules = "; ".join(r.describe() for r in self.rules.values()) or "none"
        unverified = f"; unverified (no --verify rule): {', '.join(self.unverified())}" if self.unverified() else ""
        return f"server: `{self.template}`, fresh per condition on a free port; verification: {rules}{unverified}"

    def start(self, cond, log_dir: Path) -> srvmod.ServerProcess:
        """Start ``cond``'s server and wait for health. Raises RuntimeError (see :func:`server.launch`)."""
        port = srvmod.free_port()
        base = f"http://127.0.0.1:{port}"
        argv = self.command(condition_values(cond.flags), port)
        return srvmod.launch(argv, base, self.health_url(base, port), log_dir / f"server-{port}.log",
                             self.startup_timeout, group=True)

    def verify(self, cond, srv: srvmod.ServerProcess) -> tuple[dict, str | None]:
        """``(result fields, reason)``: the applied value of every verified knob; the
        reason names each knob whose applied value differs or cannot be read."""
        requested = condition_values(cond.flags)
        applied: dict[str, str | None] = {}
        bad = []
        log_text = srv.log_tail(4_000_000)
        import httpx

        with httpx.Client(timeout=10.0) as client:
            for knob, rule in self.rules.items():
                value, problem = rule.applied(log_text, srv.base_url, client)
                applied[knob] = value
                if problem:
                    bad.append(f"{knob}: {problem}")
                elif not srvmod.same_value(requested[knob], value):
                    bad.append(f"requested {knob}={requested[knob]}, server applied {knob}={value}")
        fields = {"applied": applied, "server_cmd": srv.command, "unverified": self.unverified()}
        return fields, "; ".join(bad) or None


def condition_values(flags: list[str]) -> dict[str, str]:
    """``["--ubatch-size", "64", "--batch-size", "512"]`` -> ``{"ubatch_size": "64", "batch_size": "512"}``.

    Raises:
        TemplateError: a switch (a flag without a value): a template has no
            way to place it.
    """
    out = {}
    i = 0
    while i < len(flags):
        if i + 1 >= len(flags) or flags[i + 1].startswith("--"):
            raise TemplateError(f"{flags[i]} has no value: with --server-cmd every grid flag fills a {{placeholder}}")
        out[knob_name(flags[i])] = flags[i + 1]
        i += 2
    return out


def add_flags(sweep_parser) -> None:
    """``bench sweep``'s flags for any server (``--server-cmd`` and its companions)."""
    from quanta.flags import positive_float

    ext = sweep_parser.add_argument_group("any server (instead of quanta serve)")
    ext.add_argument("--server-cmd", metavar="TEMPLATE", help="server command line with {port} and one {knob} per grid flag, "
                     "e.g. 'llama-server -m M.gguf --port {port} --ubatch-size {ubatch_size}'")
    ext.add_argument("--health-url", default="/health", help="path, or http://127.0.0.1:{port}/PATH, that answers 200 when ready "
                     "(default /health)")
    ext.add_argument("--verify", action="append", default=[], metavar="KNOB=RULE",
                     help="applied-value check, repeatable: KNOB=log:REGEX (first group of the last match in the startup log) "
                     "or KNOB=json:/PATH:FIELD.SUB; a difference marks the condition invalid")
    ext.add_argument("--startup-timeout", type=positive_float, default=srvmod.STARTUP_TIMEOUT_S,
                     help=f"seconds to wait for health (default {srvmod.STARTUP_TIMEOUT_S:g})")


def from_args(args, conds) -> ExternalServer | None:
    """The ``--server-cmd`` launcher checked against the grid, or None (quanta serve).

    Raises:
        TemplateError: see :class:`ExternalServer`; also ``--verify`` or
            ``--server-flags`` where they do not apply.
    """
    if not args.server_cmd:
        if args.verify:
            raise TemplateError("--verify applies to --server-cmd (quanta servers are verified through /v1/config)")
        return None
    if args.server_flags:
        raise TemplateError("--server-flags are quanta serve flags; with --server-cmd put shared flags into the template")
    server = ExternalServer.from_args(args.server_cmd, args.health_url, args.verify, args.startup_timeout)
    server.check(conds)
    return server


def listing(server: ExternalServer, cond) -> str:
    """The command a condition will run, for ``--dry-run`` and progress lines."""
    return " ".join(server.command(condition_values(cond.flags), "{port}"))
