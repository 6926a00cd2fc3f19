"""The MoE subcommands of ``quanta``: ``make-model``, ``profile`` and ``advise``
(``make-model --shape`` writes GGUFs of real model shapes, dense and Qwen3-MoE, :mod:`quanta.tools.make_model`).

Kept out of :mod:`quanta.cli` so the main command line stays small; the
flags follow its rules (:mod:`quanta.flags`: each given once, errors exit 2 before any model loads).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("quanta")

#: the subcommands this module adds
COMMANDS = ("make-model", "profile", "advise")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Validate (exit 2 via ``parser.error``) and run one of :data:`COMMANDS`."""
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (OSError, ValueError) as exc:
        print(f"quanta {args.command}: error: {exc}", file=sys.stderr)
        return 2


class _PresetNames:
    """``--preset``'s argparse choices, read when used: the presets module imports torch,
    which ``quanta --help`` and ``quanta --version`` must not wait for."""

    @staticmethod
    def _names() -> list[str]:
        from quanta.model.presets import PRESETS

        return sorted(PRESETS)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


def add_commands(sub, register_once) -> None:
    """Add the three subparsers to ``sub`` (``register_once`` makes their flags refuse repeats)."""
    from quanta.config import DEFAULT_BLOCK_SIZE
    from quanta.engine.policies.knobs import PREFILL_CAP
    from quanta.flags import add_dtype_flag
    from quanta.tools import make_model as make_gguf

    make = sub.add_parser("make-model", help="write a synthetic random-weight model: an HF directory of a preset, "
                          "or a GGUF of a real model's shape")
    register_once(make)
    what = make.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", choices=_PresetNames(), metavar="PRESET", help="HF directory of a preset: %(choices)s")
    what.add_argument("--shape", choices=make_gguf.SHAPES, metavar="SHAPE", help="GGUF of a real model's shape: %(choices)s")
    make.add_argument("--out", required=True, help="--preset: directory to create (must not exist or be empty); "
                      "--shape: the .gguf file to write (must not exist)")
    make.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    make_gguf.add_arguments(make)

    prof = sub.add_parser("profile", help="measure pure prefill cost per token against the quantum")
    register_once(prof)
    prof.add_argument("what", choices=["moe", "prefill"], help="moe: an MoE model (expert statistics included); prefill: any model")
    prof.add_argument("--model", help="model directory or GGUF "
                      "(default: moe: made from --preset in a temporary directory; prefill: the embedded model)")
    prof.add_argument("--preset", default="seed-moe-mini", help="synthetic preset used when --model is not given (default seed-moe-mini)")
    prof.add_argument("--out", default="benchmarks/results", help="report directory (default benchmarks/results)")
    prof.add_argument("--quanta", default="128,256,512,1024,2048,4096,8192", help="comma-separated quanta (tokens)")
    prof.add_argument("--prompt-tokens", type=int, default=8192, help="prompt length (default 8192)")
    prof.add_argument("--repeats", type=int, default=3, help="runs per quantum (default 3)")
    prof.add_argument("--frag-quantum", type=int, default=2048, help="fragmentation study quantum (0: skip; default 2048)")
    prof.add_argument("--frag-caps", default="3072,2560", help="lowered prefill caps of the fragmentation study")
    prof.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is steadier on a shared machine)")
    add_dtype_flag(prof, "compute dtype (default as serve)")

    adv = sub.add_parser("advise", help="recommend the mixed prefill quantum from the expert shape, "
                         "and the KV budget for max-num-seqs sequences")
    register_once(adv)
    adv.add_argument("--model", help="model directory or GGUF (its config only is read)")
    adv.add_argument("--num-experts", type=int, help="E, routed experts (instead of --model)")
    adv.add_argument("--top-k", type=int, help="K, experts per token (instead of --model)")
    adv.add_argument("--target", type=float, help="tokens per expert to reach (default: the profile's saturation point, else 48)")
    adv.add_argument(PREFILL_CAP.flag, type=int, default=PREFILL_CAP.default,
                     help=f"the scheduler's prefill cap (default {PREFILL_CAP.default})")
    adv.add_argument("--profile", help="a profile JSON from quanta profile (default: this machine's cached profile of --model)")
    pool = adv.add_argument_group("KV block pool: the budget max-num-seqs sequences of a context need")
    pool.add_argument("--max-num-seqs", type=int, help="resident sequences to hold at full context")
    pool.add_argument("--context", type=int, metavar="TOKENS", help="tokens per sequence, prompt plus output "
                      "(e.g. quanta serve's --max-model-len)")
    pool.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                      help="tokens every sequence's prompt starts with (held once by the prefix cache; default 0)")
    pool.add_argument("--kv-cache-tokens", type=int, metavar="N", help="the budget to check (quanta serve's flag)")
    pool.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                      help=f"KV positions per block (default {DEFAULT_BLOCK_SIZE})")


def check_args(args: argparse.Namespace) -> None:
    """Validate a subcommand's flags without loading anything; raises ValueError."""
    if args.command == "make-model" and args.preset and (args.type or args.layers is not None):
        raise ValueError("--type and --layers go with --shape")
    if args.command == "make-model" and args.shape:
        from quanta.tools import make_model

        make_model.shape_config(args.shape, args.layers)
    if args.command == "profile":
        quanta = _ints(args.quanta, "--quanta")
        if args.prompt_tokens < max(quanta):
            raise ValueError(f"--prompt-tokens ({args.prompt_tokens}) must be at least the largest quantum ({max(quanta)})")
        if args.repeats < 1 or (args.threads is not None and args.threads < 1) or args.frag_quantum < 0:
            raise ValueError("--repeats and --threads must be positive, --frag-quantum >= 0")
        _ints(args.frag_caps, "--frag-caps") if args.frag_quantum else None
    if args.command == "advise":
        given = (args.num_experts is not None) + (args.top_k is not None)
        if args.model and given:
            raise ValueError("give --model or --num-experts/--top-k, not both")
        _check_pool_args(args)
        if not args.model and given != 2 and not (given == 0 and args.max_num_seqs is not None):
            raise ValueError("give --model, or both --num-experts and --top-k (or only the KV pool flags)")
        if given and not 1 <= args.top_k <= args.num_experts:
            raise ValueError(f"need 1 <= --top-k <= --num-experts, got --top-k {args.top_k} --num-experts {args.num_experts}")
        if args.prefill_cap < 1 or (args.target is not None and args.target <= 0):
            raise ValueError("--prefill-cap and --target must be positive")


def _check_pool_args(args: argparse.Namespace) -> None:
    """``advise``'s KV pool flags: --max-num-seqs and --context together, positive; raises ValueError."""
    pool = [args.max_num_seqs, args.context, args.kv_cache_tokens]
    if any(v is not None for v in pool) and (args.max_num_seqs is None or args.context is None):
        raise ValueError("the KV pool advice needs --max-num-seqs and --context")
    if any(v is not None and v < 1 for v in pool):
        raise ValueError("--max-num-seqs, --context and --kv-cache-tokens must be positive integers")
    if args.block_size < 8 or args.block_size % 8:
        raise ValueError(f"--block-size must be a positive multiple of 8, got {args.block_size}")
    if args.context is not None and not 0 <= args.shared_prefix <= args.context:
        raise ValueError(f"--shared-prefix must be between 0 and --context ({args.context}), got {args.shared_prefix}")


def run(args: argparse.Namespace) -> int:
    """Run ``make-model``, ``profile`` or ``advise``; returns the exit code."""
    if args.command == "make-model" and args.shape:
        from quanta.tools.make_model import main as make_gguf

        return make_gguf(args)
    if args.command == "make-model":
        from quanta.model.presets import make_model, parameter_count

        try:
            out = make_model(args.preset, args.out, args.seed)
        except ValueError as exc:
            print(f"quanta make-model: error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {out}: preset {args.preset}, {parameter_count(args.preset) / 1e6:.0f} M parameters, random weights "
              "(synthetic: for cost experiments only)")
        return 0
    if args.command == "advise":
        return _advise(args)
    return _profile(args)


def _advise(args: argparse.Namespace) -> int:
    from quanta.moe.advisor import advise, cached_cost_report, format_advice, load_cost_report

    name, cfg = None, None
    if args.model:
        from quanta.model.loader import load_config

        path = Path(args.model)
        cfg = load_config(path)
        name = path.stem if path.is_file() else path.name
        e, k = (cfg.num_experts, cfg.num_experts_per_tok) if cfg.is_moe else (None, None)
    else:
        e, k = args.num_experts, args.top_k
    if cfg is not None or e is not None:
        report = load_cost_report(args.profile) if args.profile else (cached_cost_report(name) if name else None)
        print(format_advice(advise(e, k, args.prefill_cap, args.target, report, name)))
    if args.max_num_seqs is not None:
        from quanta.moe.advisor import advise_pool, format_pool_advice

        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 if cfg is not None else None
        pool = advise_pool(args.max_num_seqs, args.context, args.block_size, args.kv_cache_tokens, args.shared_prefix)
        print(("\n" if cfg is not None or e is not None else "") + format_pool_advice(pool, args.max_num_seqs, per_token))
    return 0


def _profile(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from quanta.flags import dtype_name
    from quanta.launch import load_model, resolve_dtype
    from quanta.model.presets import make_model
    from quanta.moe.prefill_cost import measure_prefill_cost
    from quanta.moe.report import format_report, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(dtype_name(args.dtype))
    with tempfile.TemporaryDirectory(prefix="quanta-profile-") as tmp:
        path = args.model
        if path is None and args.what == "prefill":
            from quanta.model.loader import embedded_model_path

            path = embedded_model_path()
        elif path is None:
            path = Path(tmp) / args.preset
            log.info("making synthetic preset %s in %s", args.preset, path)
            make_model(args.preset, path)
        loaded = load_model(str(path), dtype, "auto", True, "auto")  # as `quanta serve` loads it by default
        if args.what == "moe" and not loaded.config.is_moe:
            print(f"quanta profile: error: {path} is a dense model; use quanta profile prefill", file=sys.stderr)
            return 2
        frag = args.frag_quantum or None
        report = measure_prefill_cost(loaded, _ints(args.quanta, "--quanta"), args.prompt_tokens, args.repeats, frag,
                                      _ints(args.frag_caps, "--frag-caps") if frag else ())
    print(format_report(report))
    for p in write_report(report, args.out):
        print(f"wrote {p}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values
