"""``quanta`` command line: ``serve`` and ``generate`` (``bench``, ``record``, ``simulate`` and the MoE tools are registered from their packages).

Every flag may be given once: in the seed study a duplicated flag silently
overrode the intended value and spoiled a whole measurement, so a repeat is
an error (exit code 2) naming the flag. Configuration is validated before
the model loads.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from quanta import __version__

from quanta.bench.cli import add_bench_parser
from quanta.bench import record as record_command
from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.policies import POLICIES
from quanta.moe import commands as moe_commands
from quanta.moe.auto import AUTO_PLACEHOLDER, resolve_auto_from_model
from quanta.server.tools import PARSERS as TOOL_PARSERS
from quanta.server import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("quanta")

#: scheduler knob flags; each maps to a SchedulerConfig knob of the same name.
KNOB_FLAGS = {
    "--prefill-quantum": "tokens per prefill cycle while no sequence decodes (default 2048)",
    "--mixed-prefill-quantum": "tokens per prefill cycle while a sequence decodes (default 2048), or 'auto' (quanta advise's choice for the model)",
    "--prefill-cap": "graph boundary in positions; chunks never cross its multiples (default 4096)",
    "--admit-k": "continuous/chunked: admit only when at least K slots are free (default 1)",
    "--chunk": "chunked: prompt tokens per sequence per prefill call (default 512)",
    "--max-num-batched-tokens": "budget: tokens per fused step, decodes first (default 512)",
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


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


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=sorted(_DTYPE_ALIASES), help="compute dtype (default: bf16 where the CPU has native bf16, else fp32)")
    p.add_argument("--quantization", choices=("auto", "none", "int8", "int4", "fp16"), default="auto",
                   help="weight forms of decode- and chunk-sized matmuls: auto = the GGUF's own 4-/8-bit types (int4 for "
                        "Q4_*, int8 for Q5-Q8) plus fp16 copies on CPUs without native bf16, none = the dequantized "
                        "reference only, int8, int4, fp16 (default: auto)")
    p.add_argument("--max-model-len", type=int, help="tokens per sequence, prompt plus output (default: the model's context length)")
    p.add_argument("--scheduler", default="batched", choices=sorted(POLICIES), help="scheduling policy (default: batched)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="resident sequences / KV slots (default 8)")
    for flag, text in KNOB_FLAGS.items():
        p.add_argument(flag, type=int_or_auto if flag == "--mixed-prefill-quantum" else int, help=text)


def int_or_auto(text: str) -> int | str:
    """``auto`` or an int (argparse reports anything else as an invalid value)."""
    return "auto" if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="quanta", description="LLM serving engine with a tunable prefill quantum")
    root.add_argument("--version", action="version", version=f"quanta {__version__}")
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _register_once(serve)
    _add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-queue", type=int, help="waiting requests before HTTP 429 (default: unbounded)")
    serve.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                       help="model id(s) clients send, as vLLM takes them: --served-model-name ID ALIAS... "
                            "(default: the model file's name; the first is the id responses report)")
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                       help="tool-call format to parse and enforce (default: chosen from the model's chat template)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help=f"request bodies over this many bytes get HTTP 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 16 MiB)")
    serve.add_argument("--no-prefix-cache", action=_OnceTrue,
                       help="compute every prompt whole instead of reusing the K/V a free slot holds for its longest common prefix")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="clients must send 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but /health "
                            "(default: $QUANTA_API_KEY; unset: no key)")
    serve.add_argument("--allowed-hosts", action="append", metavar="H1,H2",
                       help="more Host header names to accept besides localhost, IP literals and --host ('*': any)")
    serve.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                       help="origin(s) web pages may call this server from (repeatable or a comma list; default: none)")
    gen = sub.add_parser("generate", help="generate a completion offline")
    _register_once(gen)
    _add_engine_flags(gen)
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_bench_parser(sub)
    record_command.add_parser(sub, _register_once)
    moe_commands.add_commands(sub, _register_once)
    from quanta.sim import cli as sim_commands

    sim_commands.add_commands(sub, _register_once)
    return root


def _register_once(p: argparse.ArgumentParser) -> None:
    """Make every plain ``store`` option of ``p`` refuse repeats."""
    p.register("action", None, _Once)
    p.register("action", "store", _Once)


def parse_serve_flags(flags: list[str]) -> argparse.Namespace:
    """``quanta serve FLAGS`` parsed without exiting (for sweeps and replays of other commands).

    Raises:
        ValueError: flags the serve parser rejects, with argparse's own message.
    """
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(["serve", *flags])
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        raise ValueError(lines[-1] if lines else "invalid serve flags") from exc


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, SchedulerConfig]:
    """Validated configs; raises ``ValueError`` with a flag-level message."""
    knobs = {}
    for flag in KNOB_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            knobs[flag[2:].replace("-", "_")] = value
    if knobs.get("mixed_prefill_quantum") == "auto":  # validated with a placeholder, resolved in main()
        knobs["mixed_prefill_quantum"] = AUTO_PLACEHOLDER
    sched = SchedulerConfig(args.scheduler, args.max_num_seqs, knobs)
    engine = EngineConfig(
        model=args.model, dtype=_DTYPE_ALIASES.get(args.dtype) if args.dtype else None,
        max_model_len=args.max_model_len, max_queue=getattr(args, "max_queue", None),
        served_model_name=(getattr(args, "served_model_name", None) or [None])[0],
        prefix_cache=not getattr(args, "no_prefix_cache", False),
        quantization=getattr(args, "quantization", "auto"),
    )
    _check_command_args(args)
    return engine, sched


def _check_command_args(args: argparse.Namespace) -> None:
    """The command's own flags that need no model to validate (else they fail after the load)."""
    if getattr(args, "model", None) and not Path(args.model).exists():
        raise ValueError(f"--model {args.model}: no such file or directory")
    if args.command == "serve" and not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    if args.command == "serve" and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be a positive integer, got {args.max_request_bytes}")
    if args.command == "serve" and args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if args.command == "generate":
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be a positive integer, got {args.max_tokens}")
        if not 0.0 <= args.temperature <= 2.0:
            raise ValueError(f"--temperature must be between 0 and 2, got {args.temperature}")


def _access_policy(args: argparse.Namespace):
    """``--api-key`` (else ``$QUANTA_API_KEY``), ``--allowed-hosts`` and ``--cors-origin`` as an AccessPolicy."""
    import os

    from quanta.server.access import AccessPolicy, split_list

    key = args.api_key if args.api_key is not None else (os.environ.get("QUANTA_API_KEY") or None)
    return AccessPolicy(key, args.host, split_list(args.allowed_hosts), split_list(args.cors_origin))


def _command_parser(root: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's parser, so that every error reads ``quanta COMMAND: error: ...``
    (argparse's own errors do; errors found after parsing now read the same)."""
    subparsers = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def main(argv: list[str] | None = None) -> int:
    root = build_parser()
    args = root.parse_args(argv)
    parser = _command_parser(root, args.command)
    if args.command == "bench":
        from quanta.bench.cli import run_bench

        return run_bench(args, parser, argv)
    if args.command == "record":
        return record_command.main(args, parser)
    if args.command in moe_commands.COMMANDS:
        return moe_commands.main(args, parser)
    if args.command in ("simulate", "profile-engine"):
        from quanta.sim import cli as sim_commands

        return sim_commands.main(args, parser, argv)
    try:
        engine_cfg, sched_cfg = configs_from_args(args)
    except ValueError as exc:  # a value, not the command's shape: the one line, without the usage text
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.mixed_prefill_quantum == "auto":  # needs the model's config (not its weights)
        try:
            sched_cfg, _ = resolve_auto_from_model(engine_cfg.model, sched_cfg)
        except (OSError, ValueError) as exc:
            parser.error(f"--mixed-prefill-quantum auto: {exc}")
    if args.command == "serve":
        from quanta.server.run import serve

        log.info("loading %s ...", engine_cfg.model or "the embedded SmolLM2-135M-Instruct")
        return serve(engine_cfg, sched_cfg, args.host, args.port, args.max_request_bytes,
                     aliases=tuple(args.served_model_name[1:]), tool_call_parser=args.tool_call_parser,
                     access=_access_policy(args))
    from quanta.generate import generate_cli

    return generate_cli(engine_cfg, sched_cfg, args.prompt, args.max_tokens, args.temperature, args.chat)


if __name__ == "__main__":
    sys.exit(main())
