"""The word-splitting rules of byte-level BPE vocabularies, by the GGUF's ``tokenizer.ggml.pre`` name.

A GGUF names its pre-tokenizer (``llama-bpe``, ``qwen2``, ``deepseek-coder``, ...) instead of
carrying the regular expressions. :func:`split_patterns` gives them for a name, in the order
they apply: each pattern splits every piece the previous ones left, and the text between two
matches stays a piece of its own (the ``isolated`` behaviour of ``tokenizers``' ``Split``).
The patterns are those of the models' own ``tokenizer.json`` files; they run in ``tokenizers``
(Oniguruma), which reads ``(?i:...)``, ``\\p{..}`` classes and look-aheads as written.
"""

from __future__ import annotations

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_WORD_START = r"[^\r\n\p{L}\p{N}]?"


def _cased_words(suffix: str) -> str:
    """Words of lower-case letters after optional capitals, or capitals then lower-case, each with ``suffix``."""
    return f"{_WORD_START}{_UPPER}*{_LOWER}+{suffix}|{_WORD_START}{_UPPER}+{_LOWER}*{suffix}"



_GPT4O = (_cased_words(_CONTRACTIONS + "?")
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370"
    "-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-"
    "\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
    "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-"
    "\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a"
    "-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-"
    "\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-"
    "\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-"
    "\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
    "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK3 = (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_STARCODER = (r"\p{N}", _GPT2)
_BLOOM = (r" ?[^(\s|.,!?…。，、।۔،)]+",)

#: pattern lists by llama.cpp's pre-tokenizer family
_FAMILIES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "jais2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}",),
    "deepseek-llm": ("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", "\\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                     _CJK_HANGUL, r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "deepseek-v3": _DEEPSEEK3,
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "starcoder": _STARCODER,
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "bloom": _BLOOM,
    "chatglm4": (_LLAMA3,),
    "viking": (*_BLOOM, r"\p{N}"),
    "tekken": (_TEKKEN,),
    "gpt4o": (_GPT4O,),
    "tiny-aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O),
    "seed-coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "bailingmoe": (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]|\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL,),
    "exaone-moe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+" + _TAIL),
    "laguna": ("[^\\n]+|[\\n]+", _QWEN2),
    "spark2_5": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                 r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"),
}

#: ``tokenizer.ggml.pre`` names -> family, as llama.cpp groups them
_NAMES: dict[str, tuple[str, ...]] = {
    "default": ("default",),
    "llama3": ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
               "jina-v5-nano", "dbrx", "smaug-bpe"),
    "jais2": ("jais-2",),
    "deepseek-llm": ("deepseek-llm",),
    "deepseek-coder": ("deepseek-coder",),
    "deepseek-v3": ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
    "falcon": ("falcon",),
    "starcoder": ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
    "gpt2": ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
             "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais",
             "trillion", "granite-docling"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
              "grok-2"),
    "qwen35": ("qwen35",),
    "bloom": ("bloom", "poro-chat", "gpt3-finnish"),
    "chatglm4": ("chatglm-bpe", "glm4", "glm5"),
    "viking": ("viking",),
    "tekken": ("tekken",),
    "gpt4o": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    "tiny-aya": ("tiny_aya", "cohere2moe"),
    "seed-coder": ("seed-coder",),
    "bailingmoe": ("bailingmoe", "bailingmoe2", "llada-moe"),
    "ufakzeka": ("ufakzeka",),
    "exaone-moe": ("exaone-moe",),
    "minicpm5": ("minicpm5",),
    "laguna": ("laguna",),
    "spark2_5": ("spark2_5",),
}
_FAMILY_OF = {name: family for family, names in _NAMES.items() for name in names}

#: names whose merges are skipped for a piece that is a token already (llama.cpp's ``ignore_merges``)
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                           "lfm2", "jina-v5-nano", "minicpm5", "youtu", "tekken", "glm5",
                           "granite-embed-multi-97m"})
#: names whose files add BOS unless they say otherwise
ADD_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "tekken", "chameleon"})
#: names that have no BOS token whatever the file's ids say
NO_BOS = frozenset({"chatglm-bpe", "glm4", "glm5"})


def split_patterns(pre: str) -> tuple[str, ...]:
    """The split patterns of pre-tokenizer ``pre`` (a missing name reads as ``default``).

    Raises:
        ValueError: a name llama.cpp splits with its own code rather than a pattern, or one
            it does not know.
    """
    family = _FAMILY_OF.get(pre or "default")
    if family is None:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    return _FAMILIES[family]
