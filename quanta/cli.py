"""``quanta`` command line: composes the subcommands (``serve`` and ``generate`` here; ``bench``, ``record``,
``simulate`` and the MoE tools from their packages) and dispatches to them.

Only the entry points import this module (``python -m quanta``, the ``quanta``
script); the flag pieces the subcommands share live in :mod:`quanta.flags`.
Configuration is validated before the model loads.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import logging
import signal
import sys
import threading

from quanta import __version__, flags
from quanta.bench import record as record_command
from quanta.bench.cli import add_bench_parser
from quanta.moe import commands as moe_commands

log = logging.getLogger("quanta")


class Parser(argparse.ArgumentParser):
    """quanta's parsers (subcommands inherit the class): no abbreviated flags (``--max-tokens``
    must not quietly set ``--max-tokens-default``), and a parse error is one line naming the
    command and pointing at its ``--help``, exit status 2, instead of the whole usage text."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The root parser with every subcommand."""
    from quanta.sim import cli as sim_commands

    root = Parser(prog="quanta", description="LLM serving engine with a tunable prefill quantum")
    root.add_argument("--version", action="version", version=f"quanta {__version__}")
    sub = root.add_subparsers(dest="command", required=True)
    flags.add_serve_flags(sub.add_parser("serve", help="HTTP server: OpenAI, Anthropic, Responses and Ollama APIs"))
    flags.add_generate_flags(sub.add_parser("generate", help="generate a completion offline"))
    add_bench_parser(sub)
    record_command.add_parser(sub, flags.register_once)
    moe_commands.add_commands(sub, flags.register_once)
    sim_commands.add_commands(sub, flags.register_once)
    return root


def _command_parser(root: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's parser, so that every error reads ``quanta COMMAND: error: ...``
    (argparse's own errors do; errors found after parsing now read the same)."""
    subparsers = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def _deepest_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that ``args`` chose (``quanta bench run``'s, not ``quanta bench``'s)."""
    while True:
        subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, subparsers.dest, None) if subparsers is not None else None
        if chosen not in (subparsers.choices if subparsers is not None else {}):
            return parser
        parser = subparsers.choices[chosen]


def unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """The error for flags ``parser`` does not know, with the closest flag it does know for each
    misspelled one (``--max-num-seq`` -> ``did you mean --max-num-seqs?``)."""
    known = list(parser._option_string_actions)
    guesses = []
    for arg in unknown:
        if arg.startswith("-") and len(arg) > 2:
            guesses += difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.75)
    hint = f"; did you mean {' or '.join(dict.fromkeys(guesses))}?" if guesses else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


def main(argv: list[str] | None = None) -> int:
    """Run the command; Ctrl-C (or SIGINT) ends it with one line and status 130, not a traceback,
    and so does any error that follows it (an import the interrupt cut short leaves a module half
    made, which the tokenizer's thread then fails on)."""
    interrupted = threading.Event()
    previous = _watch_interrupts(interrupted)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("quanta: interrupted", file=sys.stderr)
        return 130
    except Exception:
        if not interrupted.is_set():
            raise
        print("quanta: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _watch_interrupts(interrupted: threading.Event):
    """SIGINT as it is handled now (Python's own handler raises KeyboardInterrupt), noting that it
    came; returns the handler to restore, or None where there is none to wrap (not the main thread,
    SIGINT ignored or left to the system)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        return None

    def on_interrupt(signum, frame):
        interrupted.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_interrupt)
    return previous


def _main(argv: list[str] | None) -> int:
    root = build_parser()
    args, unknown = root.parse_known_args(argv)
    parser = _command_parser(root, args.command)
    if unknown:  # the subcommand's error, not the root's: its flags are what --help should show
        deepest = _deepest_parser(root, args)
        deepest.error(unrecognized(deepest, unknown))
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
    gc.disable()  # until the modules are imported (_collect_from_here)
    try:
        return _model_command(args, parser)
    finally:  # the collector as it was, for a caller in the same process (tests)
        gc.unfreeze()
        gc.enable()


def _collect_from_here() -> None:
    """Turn the garbage collector back on, with every object that exists now (the imported modules:
    ~250k objects that live as long as the process) left out of its collections.

    ``serve`` and ``generate`` import torch, the server and the model's modules with the collector off:
    its passes over those objects cost ~0.3 s of the start and free next to nothing; frozen, they are
    not gone over again by later passes (the full one after the load: ~0.12 s -> ~0.01 s)."""
    gc.freeze()
    gc.enable()


def _model_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``serve`` or ``generate``: configuration checked before the model loads, then :func:`_run`."""
    try:
        engine_cfg, sched_cfg = flags.configs_from_args(args)
        chat_template = None
        if args.command == "serve":  # a busy port is found now, not after the model loads
            from quanta.preflight import check_listen, read_chat_template

            check_listen(args.host, args.port)
            chat_template = read_chat_template(args.chat_template) if args.chat_template else None
        _prefetch_weights(args, engine_cfg)
        from quanta.launch import check_kv_budget

        check_kv_budget(engine_cfg, sched_cfg.max_num_seqs)  # from the file's header, before any weight is read
    except (ValueError, OSError) as exc:  # a value, not the command's shape: the one line, without the usage text
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    from quanta.logs import configure_logging

    configure_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    if args.mixed_prefill_quantum == "auto":  # needs the model's config (not its weights)
        from quanta.moe.auto import resolve_auto_from_model

        try:
            sched_cfg, _ = resolve_auto_from_model(engine_cfg.model, sched_cfg)
        except (OSError, ValueError) as exc:
            parser.error(f"--mixed-prefill-quantum auto: {exc}")
    from quanta.cluster.app import RayStartError
    from quanta.engine.kv_budget import KVBudgetError
    from quanta.launch import ModelLoadError, PromptWeightsError

    try:
        return _run(args, engine_cfg, sched_cfg, chat_template)
    except (KVBudgetError, RayStartError, PromptWeightsError, ModelLoadError) as exc:  # known at or after the load: one line
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def _prefetch_weights(args: argparse.Namespace, engine_cfg) -> None:
    """Start converting a GGUF file's weights into their forms now, beside the imports of torch and the
    server (:mod:`quanta.model.gguf_prefetch`), where this process will load it from its blocks."""
    from quanta.model import gguf_plan, gguf_prefetch

    if getattr(args, "replicas", None) is None and gguf_plan.asks_for_blocks(
            engine_cfg.model, engine_cfg.quantization, engine_cfg.prompt_weights):
        gguf_prefetch.start(engine_cfg.model)


def _run(args, engine_cfg, sched_cfg, chat_template):
    """``serve`` or ``generate`` with validated configs."""
    if args.command == "serve":
        options = flags.server_options(args, chat_template)
        if args.replicas is not None:  # the only path that imports Ray
            from quanta.cluster.app import serve_cluster

            _collect_from_here()
            log.info("starting %d replicas of %s on Ray ...", args.replicas, engine_cfg.model or "the embedded SmolLM2-135M-Instruct")
            return serve_cluster(args, engine_cfg, sched_cfg, options)
        from quanta.server.run import serve

        _collect_from_here()
        log.info("loading %s ...", engine_cfg.model or "the embedded SmolLM2-135M-Instruct")
        return serve(engine_cfg, sched_cfg, args.host, args.port, log_level=args.log_level, log_format=args.log_format,
                     stats_interval=args.stats_interval, **options)
    from quanta.generate import generate_cli

    _collect_from_here()
    return generate_cli(engine_cfg, sched_cfg, args.prompt, args.max_tokens, args.temperature, args.chat)


if __name__ == "__main__":
    sys.exit(main())
