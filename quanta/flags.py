"""The flag pieces the ``quanta`` subcommands share; a leaf: it imports no command module.

- every flag may be given once (:func:`register_once`): in the seed study a
  duplicated flag silently overrode the intended value and spoiled a whole
  measurement, so a repeat is an error (exit code 2) naming the flag;
- argparse types for sizes and URLs, ``--dtype`` aliases, an ``--out`` prefix check;
- the scheduler flag group, derived from the policies' knob declarations
  (:class:`~quanta.engine.policies.knobs.Knob`);
- ``quanta serve`` / ``generate`` flags and their configs, validated before any
  model loads, and :func:`parse_serve_flags` for sweeps and replays;
- :func:`command_line`, the ``quanta ...`` line that reports record.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shlex
import sys
from pathlib import Path

from quanta.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_POLICY,
    PROMPT_WEIGHTS,
    QUANTIZATION_CHOICES,
    EngineConfig,
    SchedulerConfig,
)
from quanta.engine.policies import KNOBS, POLICIES, takers
from quanta.logs import LOG_FORMATS, LOG_LEVELS
from quanta.preflight import check_model_path
from quanta.server import ADMIN_KEY_ENV, API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES
from quanta.server.defaults import DEFAULT_MAX_TOKENS
from quanta.server.keepalive import DEFAULT_KEEPALIVE_S
from quanta.server.live_log import DEFAULT_STATS_INTERVAL_S

#: ``--dtype`` spellings -> the :class:`~quanta.config.EngineConfig` dtype.
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
#: ``--kv-cache-dtype`` spellings -> the :class:`~quanta.config.EngineConfig` value.
KV_DTYPE_ALIASES = {**DTYPE_ALIASES, "fp16": "float16", "float16": "float16", "q8_0": "q8_0", "auto": "auto"}
#: the scheduler flag group: policy, slots and every policy's knobs.
SCHEDULER_FLAGS = ("--scheduler", "--max-num-seqs", *(k.flag for k in KNOBS.values()))


class _Once(argparse.Action):
    """``store`` that refuses a second occurrence of the same option."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_seen_flags", set())
        if self.dest in seen:
            parser.error(f"{option_string} was given more than once; give each flag once")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


class _OnceTrue(_Once):
    """A switch (no value) that, like every other flag, may be given once."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, True, option_string)


def register_once(p: argparse.ArgumentParser) -> None:
    """Make every plain ``store`` option of ``p`` refuse repeats."""
    p.register("action", None, _Once)
    p.register("action", "store", _Once)


def number_type(parse, accept, what: str):
    """An argparse ``type``: ``parse`` the text, keep values where ``accept(v)``, else say ``expected {what}``."""

    def convert(s: str):
        try:
            v = parse(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not accept(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v

    return convert


positive_int = number_type(int, lambda v: v >= 1, "a positive integer")
nonneg_int = number_type(int, lambda v: v >= 0, "an integer >= 0")
positive_float = number_type(float, lambda v: v > 0 and not math.isinf(v), "a positive number")  # NaN fails v > 0
nonneg_float = number_type(float, lambda v: v >= 0 and not math.isinf(v), "a number >= 0")
#: a keep-alive interval: 0 (none) or at least 0.1 s (shorter would flood every stream with comments)
keepalive_seconds = number_type(float, lambda v: v == 0 or 0.1 <= v < math.inf, "0 (none) or a number >= 0.1")


def kv_bytes(text: str) -> int:
    """``--kv-cache-memory``: a size with an optional unit (:func:`quanta.engine.kv_budget.parse_bytes`)."""
    from quanta.engine.kv_budget import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def int_or_auto(text: str) -> int | str:
    """``auto`` or an int (argparse reports anything else as an invalid value)."""
    return "auto" if text == "auto" else int(text)


def base_url(s: str) -> str:
    """``http://HOST:PORT`` with any trailing ``/`` and ``/v1`` dropped (an argparse ``type``)."""
    if not s.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {s!r}")
    return s.rstrip("/").removesuffix("/v1")


def add_dtype_flag(p, text: str) -> None:
    """``--dtype`` with its aliases and the help ``text``; :func:`dtype_name` reads it."""
    p.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), help=text)


def dtype_name(alias: str | None) -> str | None:
    """``bf16`` -> ``bfloat16``, ``fp32`` -> ``float32``; None stays None (the engine's choice)."""
    return DTYPE_ALIASES[alias] if alias else None


def writable_prefix(prefix: str, parser, flag: str = "--out") -> Path:
    """``prefix`` as a Path whose directory exists (created) and is writable, else exit 2 before any work."""
    out = Path(prefix)
    if not out.name:
        parser.error(f"{flag} needs a file name prefix, got {prefix!r}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"{flag}: cannot create {out.parent}: {exc.strerror or exc}")
    if not os.access(out.parent, os.W_OK):
        parser.error(f"{flag}: {out.parent} is not writable")
    return out


def command_line(argv: list[str] | None) -> str:
    """``quanta ARGS`` as typed (``argv``, else this process's arguments), for reports."""
    return "quanta " + shlex.join(argv if argv is not None else sys.argv[1:])


def add_scheduler_flags(p, auto_help: str) -> None:
    """``--scheduler``, ``--max-num-seqs`` and one flag per knob (help and default from its declaration);
    ``auto_help`` says what ``auto`` picks, for knobs that take it."""
    p.add_argument("--scheduler", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help=f"scheduling policy (default: {DEFAULT_POLICY})")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help=f"resident sequences / KV slots (default {DEFAULT_MAX_NUM_SEQS})")
    for k in KNOBS.values():
        text = f"{'/'.join(takers(k))}: {k.help} (default {k.default})" + (f", or 'auto' ({auto_help})" if k.auto else "")
        p.add_argument(k.flag, type=int_or_auto if k.auto else int, help=text)


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The validated config of the scheduler flags; a knob given as ``auto`` holds
    :data:`quanta.moe.auto.AUTO_PLACEHOLDER` until the caller resolves it.

    Raises:
        ValueError: a value :class:`SchedulerConfig` rejects, naming the flag.
    """
    knobs = {name: getattr(args, name) for name in KNOBS if getattr(args, name) is not None}
    if "auto" in knobs.values():
        from quanta.moe.auto import AUTO_PLACEHOLDER

        knobs = {name: AUTO_PLACEHOLDER if v == "auto" else v for name, v in knobs.items()}
    return SchedulerConfig(args.scheduler, args.max_num_seqs, knobs)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """What ``serve`` and ``generate`` load, and how they schedule it."""
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    add_dtype_flag(p, "compute dtype (default: bf16 where the CPU has native bf16, else fp32)")
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                   help="weight forms of decode- and chunk-sized matmuls: auto = the GGUF's own 4-/8-bit types (q4_1 for "
                        "Q4_*, q8_0 for Q5-Q8 with quanta's C kernels, else int4 / int8) plus fp16 copies on CPUs without "
                        "native bf16, none = the dequantized reference only, int8, int4, fp16, q4_1, q8_0 (default: auto)")
    p.add_argument("--prompt-weights", choices=PROMPT_WEIGHTS, default="auto",
                   help="what the weights are kept as: blocks = a GGUF's own quantized blocks, converted tensor by "
                        "tensor into quanta's C forms that compute every row (least memory, fastest load), reference "
                        "= the dequantized weights, kept packed for oneDNN, for prompt rows beside the decode forms, "
                        "form = the dequantized path keeping only the q4_1 / q8_0 forms (rebuilt per prompt call), "
                        "auto = blocks for a dense GGUF with --quantization auto where the C kernels build, else "
                        "reference (default: auto)")
    p.add_argument("--native-decode", choices=("on", "off"), default="on",
                   help="run decode steps with quanta's C code between the matmuls (norms, RoPE, attention, SwiGLU) "
                        "where the model allows; off = PyTorch ops throughout (default: on)")
    p.add_argument("--max-model-len", type=int, help="tokens per sequence, prompt plus output (default: the model's context length)")
    add_kv_cache_flags(p, "at most half the machine's memory")
    add_scheduler_flags(p, "quanta advise's choice for the model")


def add_kv_cache_flags(p, default_cap: str) -> None:
    """``--block-size`` and the KV pool's budget and dtype (``serve``, ``generate``, ``simulate``);
    ``default_cap`` says what limits the default budget besides the sequences it holds."""
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"KV cache positions per block, a multiple of 8 (default: {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--kv-cache-memory", type=kv_bytes, metavar="BYTES",
                   help="the KV block pool's size, e.g. 2GiB, 512MiB or bytes (default: what --max-num-seqs sequences of "
                        f"--max-model-len tokens need, {default_cap})")
    p.add_argument("--kv-cache-tokens", type=int, metavar="N", help="the KV block pool's size in tokens (instead of --kv-cache-memory)")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPE_ALIASES), default="auto",
                   help="the KV cache's elements: auto = bf16 where the model runs in bf16, fp16 where it runs in fp32; "
                        "fp32, bf16, fp16, or q8_0 (llama.cpp's 8-bit blocks: 34 bytes per 32 values, ~0.53x fp16) (default: auto)")


def name_type(check):
    """An argparse type that spells a name as ``check`` does; its ValueError is the one-line error."""
    def parse(value: str) -> str:
        try:
            return check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """Every ``quanta serve`` flag (repeats refused)."""
    from quanta.server.tool_formats.registry import REASONING, TOOL_PARSERS, reasoning_name, tool_parser_name

    register_once(serve)
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--max-queue", type=int, help="waiting requests before HTTP 429 (default: unbounded)")
    serve.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                       help="model id(s) clients send, as vLLM takes them: --served-model-name ID ALIAS... "
                            "(default: the model file's name; the first is the id responses report)")
    serve.add_argument("--chat-template", metavar="FILE",
                       help="Jinja chat template to render chat prompts with instead of the model's own "
                            "(a file, or the template text itself)")
    serve.add_argument("--tool-call-parser", type=name_type(tool_parser_name), metavar="NAME",
                       help=f"tool-call format to parse and enforce, vLLM's names: {', '.join(sorted(TOOL_PARSERS))} "
                            "(default: chosen from the model's chat template)")
    serve.add_argument("--reasoning-parser", type=name_type(reasoning_name), metavar="NAME",
                       help=f"reasoning format split from the answer: {', '.join(sorted(REASONING))}, openai "
                            "(gpt-oss), none (default: chosen from the model's chat template)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help=f"request bodies over this many bytes get HTTP 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 16 MiB)")
    serve.add_argument("--max-connections", type=int, default=None, metavar="N",
                       help="open connections at most; past it, the one waiting longest for its request head is closed "
                            "(default 8192, lowered to the open-file limit less 256)")
    serve.add_argument("--max-tokens-default", type=nonneg_int, default=DEFAULT_MAX_TOKENS, metavar="N",
                       help="output tokens for a request that sets no max_tokens / max_completion_tokens / "
                            f"max_output_tokens, within the room its prompt leaves; 0: the room left (default {DEFAULT_MAX_TOKENS})")
    serve.add_argument("--temperature", type=number_type(float, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
                       help="temperature for requests that send none (default: the model's generation_config.json, else 1.0)")
    serve.add_argument("--top-p", type=number_type(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                       help="top_p for requests that send none (default: the model's generation_config.json, else 1.0)")
    serve.add_argument("--top-k", type=number_type(int, lambda v: v >= -1, "an integer >= -1"),
                       help="top_k for requests that send none; 0 or -1: off (default: the model's generation_config.json, else off)")
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")
    serve.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                       help="text, or json: one JSON object per line, stats and request lines with their values as fields "
                            "(default text)")
    serve.add_argument("--stats-interval", type=nonneg_float, default=DEFAULT_STATS_INTERVAL_S, metavar="SECONDS",
                       help="seconds between stats lines (throughput, running, waiting, KV slots, prefix-cache hits) while "
                            f"requests run or wait; 0: none (default {DEFAULT_STATS_INTERVAL_S:g})")
    serve.add_argument("--stream-keepalive", type=keepalive_seconds, default=DEFAULT_KEEPALIVE_S, metavar="SECONDS",
                       help="streamed responses send a keep-alive (an empty chunk, Responses' in_progress, Anthropic's ping) after this "
                            "many seconds without an event, e.g. while a long prompt is computed; 0: none "
                            f"(default {DEFAULT_KEEPALIVE_S:g})")
    serve.add_argument("--no-prefix-cache", action=_OnceTrue,
                       help="compute every prompt whole instead of sharing the KV blocks of its longest cached prefix")
    serve.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="clients must send 'Authorization: Bearer KEY' or 'x-api-key: KEY' with one of these keys "
                            "on every route but /health; each key is a tenant, and prefix-cache reuse stays within a key "
                            "(--api-key K1 K2...; default: $QUANTA_API_KEY, a comma list; unset: no key)")
    serve.add_argument("--admin-key", nargs="+", default=None, metavar="KEY",
                       help="keys for /metrics, /v1/trace and /v1/config, which show every tenant's traffic: with any key "
                            "set they need one of these (a tenant's key gets 403; none given: closed) "
                            "(default: $QUANTA_ADMIN_KEY, a comma list)")
    serve.add_argument("--allowed-hosts", action="append", metavar="H1,H2",
                       help="more Host header names to accept besides localhost, IP literals and --host ('*': any)")
    serve.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                       help="origin(s) web pages may call this server from (repeatable or a comma list; default: none)")
    add_cluster_flags(serve)


def add_cluster_flags(serve: argparse.ArgumentParser) -> None:
    """``quanta serve --replicas N`` and its companions (:mod:`quanta.cluster`; docs/CLUSTER.md)."""
    from quanta.cluster.routing import POLICIES

    serve.add_argument("--replicas", type=positive_int, metavar="N",
                       help="serve N engine replicas behind this one endpoint as Ray Serve deployments "
                            "(default: one server, no Ray)")
    serve.add_argument("--ray-address", metavar="ADDR",
                       help="with --replicas: the Ray cluster to deploy on, as ray.init takes it (default: start Ray on this machine)")
    serve.add_argument("--routing", choices=POLICIES, default=None, metavar="POLICY",
                       help="with --replicas: which replica a request goes to: prefix (the one that holds the longest "
                            "prefix of its prompt, weighed against its queue), least-loaded, round-robin (default: prefix)")
    serve.add_argument("--routing-max-waiting", type=nonneg_int, default=None, metavar="N",
                       help="with --routing prefix: past N waiting requests on the preferred replica, the least-loaded "
                            "one gets the request (default 4)")
    serve.add_argument("--routing-load-tokens", type=nonneg_int, default=None, metavar="N",
                       help="with --routing prefix: the prompt tokens one request in flight on a replica is worth when the "
                            "router weighs computing a prompt's uncached part against a replica's queue; 0: the longest "
                            "cached prefix always wins (default: the mean length of the prompts routed so far)"),
    serve.add_argument("--replica-cpus", type=positive_float, default=None, metavar="N",
                       help="with --replicas: CPUs Ray reserves for each replica, and its threads (default 1)")


def add_generate_flags(gen: argparse.ArgumentParser) -> None:
    """Every ``quanta generate`` flag (repeats refused)."""
    register_once(gen)
    add_engine_flags(gen)
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def parse_serve_flags(flags: list[str]) -> argparse.Namespace:
    """``quanta serve FLAGS`` parsed without exiting (for sweeps and replays of other commands).

    Raises:
        ValueError: flags the serve parser rejects, with argparse's own message.
    """
    serve = argparse.ArgumentParser(prog="quanta serve", allow_abbrev=False)
    add_serve_flags(serve)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return serve.parse_args(flags, argparse.Namespace(command="serve"))
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        raise ValueError(lines[-1] if lines else "invalid serve flags") from exc


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, SchedulerConfig]:
    """Validated configs of ``serve`` / ``generate`` flags; raises ``ValueError`` with a flag-level message."""
    sched = scheduler_config(args)
    engine = EngineConfig(
        model=args.model, dtype=dtype_name(args.dtype),
        max_model_len=args.max_model_len, max_queue=getattr(args, "max_queue", None),
        served_model_name=(getattr(args, "served_model_name", None) or [None])[0],
        prefix_cache=not getattr(args, "no_prefix_cache", False),
        quantization=getattr(args, "quantization", "auto"),
        native_decode=getattr(args, "native_decode", "on") == "on",
        prompt_weights=getattr(args, "prompt_weights", "auto"),
        block_size=getattr(args, "block_size", DEFAULT_BLOCK_SIZE),
        kv_cache_memory=getattr(args, "kv_cache_memory", None), kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
        kv_cache_dtype=KV_DTYPE_ALIASES[getattr(args, "kv_cache_dtype", "auto")],
    )
    _check_command_args(args)
    return engine, sched


def _check_command_args(args: argparse.Namespace) -> None:
    """The command's own flags that need no model to validate (else they fail after the load)."""
    if getattr(args, "model", None):
        check_model_path(args.model)
    if args.command == "serve" and not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    if args.command == "serve" and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be a positive integer, got {args.max_request_bytes}")
    if args.command == "serve" and args.max_connections is not None and args.max_connections < 1:
        raise ValueError(f"--max-connections must be a positive integer, got {args.max_connections}")
    if args.command == "serve":
        api_keys(args)
        admin_keys(args)
        _check_cluster_args(args)
    if args.command == "generate":
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be a positive integer, got {args.max_tokens}")
        if not 0.0 <= args.temperature <= 2.0:
            raise ValueError(f"--temperature must be between 0 and 2, got {args.temperature}")


#: the cluster flags' defaults, set once --replicas is given (None before: a flag given without it is refused)
CLUSTER_DEFAULTS = {"routing": "prefix", "routing_max_waiting": 4, "routing_load_tokens": None,
                    "replica_cpus": 1.0}


def _check_cluster_args(args: argparse.Namespace) -> None:
    """Cluster flags only with ``--replicas``; their defaults filled in when it is given."""
    given = [f"--{name.replace('_', '-')}" for name in ("ray_address", *CLUSTER_DEFAULTS) if getattr(args, name) is not None]
    if args.replicas is None:
        if given:
            raise ValueError(f"{given[0]} needs --replicas")
        return
    for name, default in CLUSTER_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The serve keys: ``--api-key K1 K2...`` as given, else ``$QUANTA_API_KEY`` split at commas; () when neither.

    Raises:
        ValueError: an empty (or all-blank) key in either, naming where it came from.
    """
    return _keys(args.api_key, "--api-key", API_KEY_ENV)


def admin_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """``--admin-key`` as given, else ``$QUANTA_ADMIN_KEY`` split at commas (ValueError as :func:`api_keys`)."""
    return _keys(args.admin_key, "--admin-key", ADMIN_KEY_ENV)


def _keys(given: list[str] | None, flag: str, env_name: str) -> tuple[str, ...]:
    if given is not None:
        keys, where = tuple(given), flag
    else:
        env = os.environ.get(env_name) or ""
        keys, where = (tuple(part.strip() for part in env.split(",")) if env else ()), f"${env_name}"
    if any(not key.strip() for key in keys):
        raise ValueError(f"{where}: every key must be non-empty, got {len(keys)} key(s) with an empty one")
    return keys


def server_options(args: argparse.Namespace, chat_template: str | None) -> dict:
    """``quanta serve``'s flags as :func:`quanta.server.run.build_server`'s keyword arguments (less ``host``)."""
    return {"max_request_bytes": args.max_request_bytes, "aliases": tuple(args.served_model_name[1:]),
            "tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser,
            "access": access_policy(args),
            "max_connections": args.max_connections, "max_tokens_default": args.max_tokens_default,
            "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
            "chat_template": chat_template, "stream_keepalive": args.stream_keepalive}


def access_policy(args: argparse.Namespace):
    """``--api-key`` (else ``$QUANTA_API_KEY``), ``--allowed-hosts``, ``--cors-origin`` and
    ``--admin-key`` (else ``$QUANTA_ADMIN_KEY``) as an AccessPolicy."""
    from quanta.server.access import AccessPolicy, split_list

    return AccessPolicy(api_keys(args), args.host, split_list(args.allowed_hosts), split_list(args.cors_origin),
                        admin_keys(args))
