"""Build a Hugging Face ``tokenizers.Tokenizer`` from GGUF vocabulary metadata.

llama.cpp writes two kinds of vocabulary that matter here:

* ``gpt2``: byte-level BPE with explicit merges. How text is split into words
  before BPE depends on ``tokenizer.ggml.pre``; llama.cpp applies a list of
  regexes one after another, each splitting the pieces the previous one made,
  which is what a ``Sequence`` of isolating ``Split`` pre-tokenizers does.
* ``llama``: SentencePiece BPE with per-piece scores, ``▁`` for spaces and
  ``<0xXX>`` byte-fallback pieces. There are no merges in the file; they are
  derived from the scores (a higher-scoring piece merges first).

Control, user-defined and unknown tokens become added tokens, so they are
matched atomically in text just as llama.cpp's special-token partition does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

# llama.cpp token types (gguf TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_BAILINGMOE = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_MINICPM5 = [
    r"\p{N}{1,3}",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_TINY_AYA = [r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O]
_EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}\r\n]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreSpec:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file does not say


def _spec(regexes, **kw) -> _PreSpec:
    return _PreSpec(tuple([regexes] if isinstance(regexes, str) else regexes), **kw)


_GPT2_SPEC = _spec(_GPT2)
_LLAMA3_SPEC = _spec(_LLAMA3, ignore_merges=True, add_bos=True)
_DIGITS_THEN_GPT2 = _spec([r"\p{N}", _GPT2])
_QWEN2_SPEC = _spec(_QWEN2)

# tokenizer.ggml.pre value -> regexes, following llama.cpp's llama-vocab.cpp.
PRE_TOKENIZERS: dict[str, _PreSpec] = {
    "default": _spec([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
         "midm-2.0", "lfm2"],
        _LLAMA3_SPEC,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], _spec(_LLAMA3)),
    "falcon": _spec([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
         "minerva-7b"],
        _DIGITS_THEN_GPT2,
    ),
    **dict.fromkeys(
        ["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion",
         "granite-docling", "exaone4", "jina-es", "jina-de", "jina-v2-es",
         "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat",
         "a.x-4.0", "mellum"],
        _GPT2_SPEC,
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan",
         "solar-open"],
        _QWEN2_SPEC,
    ),
    "qwen35": _spec(_QWEN35),
    "tekken": _spec(_TEKKEN, ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _spec(_GPT4O)),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense"], _spec(_DEEPSEEK3)),
    "seed-coder": _spec(_SEED_CODER),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], _spec(_BAILINGMOE)),
    "grok-2": _spec(_QWEN2),
    "minicpm5": _spec(_MINICPM5, ignore_merges=True),
    **dict.fromkeys(["tiny_aya", "cohere2moe"], _spec(_TINY_AYA)),
    "exaone-moe": _spec(_EXAONE_MOE),
    "laguna": _spec([r"[^\n]+|[\n]+", _QWEN2]),
    "mellum2": _DIGITS_THEN_GPT2,
    "viking": _spec([r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"]),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _spec(r" ?[^(\s|.,!?…。，、।۔،)]+")),
}


@dataclass
class GGUFVocab:
    """A tokenizer built from GGUF metadata plus the facts around it."""

    tokenizer: Tokenizer
    kind: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    tokens: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    add_eos: bool
    extra_eos_ids: set[int]  # eot / eom ids the file names
    chat_template: str | None


def _value(meta: dict, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python object (0-d arrays become scalars)."""
    v = meta.get(key, default)
    if v is None:
        return default
    if hasattr(v, "tolist"):
        v = v.tolist()
    return v


def _token_id(meta: dict, key: str, n_vocab: int) -> int | None:
    v = _value(meta, key)
    if v is None:
        return None
    v = int(v)
    if not 0 <= v < n_vocab:
        # llama.cpp writes -1 / UINT32_MAX for "none"; anything else is corrupt.
        if v in (-1, 0xFFFFFFFF):
            return None
        raise ValueError(f"GGUF {key}={v} is outside the vocabulary (size {n_vocab})")
    return v


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    out = []
    for text, t in zip(tokens, types):
        if t in (CONTROL, USER_DEFINED, UNKNOWN) and text:
            out.append(AddedToken(text, special=t != USER_DEFINED, normalized=False))
    return out


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    # Later duplicates win, as in llama.cpp's token_to_id map.
    return {t: i for i, t in enumerate(tokens)}


def _gpt2_model(meta: dict, tokens: list[str], pre: str) -> tuple[Tokenizer, _PreSpec]:
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {known}")
    raw_merges = _value(meta, "tokenizer.ggml.merges")
    if not raw_merges:
        raise ValueError("GGUF gpt2 vocabulary has no tokenizer.ggml.merges")
    merges = []
    for m in raw_merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed GGUF merge {m!r}")
        merges.append((left, right))
    tok = Tokenizer(
        models.BPE(
            vocab=_vocab_dict(tokens),
            merges=merges,
            ignore_merges=spec.ignore_merges,
        )
    )
    splits = [
        pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
        for r in spec.regexes
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, spec


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]):
    """Merges implied by SentencePiece scores: a higher-scoring piece merges first."""
    vocab = _vocab_dict(tokens)
    ranked = []
    for i, (piece, t) in enumerate(zip(tokens, types)):
        if t not in (NORMAL, USER_DEFINED) or len(piece) < 2 or vocab.get(piece) != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_model(meta: dict, tokens: list[str], types: list[int], add_space_prefix: bool):
    scores = _value(meta, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("GGUF llama vocabulary needs one tokenizer.ggml.scores entry per token")
    unk_id = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    tok = Tokenizer(
        models.BPE(
            vocab=_vocab_dict(tokens),
            merges=_spm_merges(tokens, [float(s) for s in scores], types),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp prefixes a space to every text fragment that starts the input or
    # follows a special token; a normalizer runs once per such fragment.
    norm = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _post_processor(tokens, bos_id, eos_id, add_bos, add_eos):
    single, pair, specials = "$A", "$A $B:1", []
    if add_bos and bos_id is not None:
        single, pair = f"{tokens[bos_id]}:0 {single}", f"{tokens[bos_id]}:0 $A {tokens[bos_id]}:1 $B:1"
        specials.append((tokens[bos_id], bos_id))
    if add_eos and eos_id is not None:
        single, pair = f"{single} {tokens[eos_id]}:0", f"{pair} {tokens[eos_id]}:1"
        if eos_id != bos_id or not add_bos:
            specials.append((tokens[eos_id], eos_id))
    if not specials:
        return None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def vocab_from_gguf_metadata(meta: dict) -> GGUFVocab:
    """Build the tokenizer described by GGUF ``tokenizer.ggml.*`` metadata."""
    model = _value(meta, "tokenizer.ggml.model")
    tokens = _value(meta, "tokenizer.ggml.tokens")
    if not model or not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.model / tokenizer.ggml.tokens")
    tokens = list(tokens)
    n = len(tokens)
    types = _value(meta, "tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [NORMAL] * n
    if len(types) != n:
        raise ValueError(f"GGUF token_type has {len(types)} entries for {n} tokens")

    if model == "gpt2":
        pre = _value(meta, "tokenizer.ggml.pre") or "default"
        tok, spec = _gpt2_model(meta, tokens, pre)
        default_bos = spec.add_bos
    elif model == "llama":
        default_bos = True
        add_space_prefix = bool(_value(meta, "tokenizer.ggml.add_space_prefix", True))
        tok = _spm_model(meta, tokens, types, add_space_prefix)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (expected 'gpt2' or 'llama')")

    tok.add_tokens(_added_tokens(tokens, types))
    bos = _token_id(meta, "tokenizer.ggml.bos_token_id", n)
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", n)
    add_bos = bool(_value(meta, "tokenizer.ggml.add_bos_token", default_bos)) and bos is not None
    add_eos = bool(_value(meta, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    post = _post_processor(tokens, bos, eos, add_bos, add_eos)
    if post is not None:
        tok.post_processor = post
    extra = {
        i
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (i := _token_id(meta, key, n)) is not None
    }
    return GGUFVocab(
        tokenizer=tok,
        kind=model,
        tokens=tokens,
        bos_token_id=bos,
        eos_token_id=eos,
        unk_token_id=_token_id(meta, "tokenizer.ggml.unknown_token_id", n),
        pad_token_id=_token_id(meta, "tokenizer.ggml.padding_token_id", n),
        add_bos=add_bos,
        add_eos=add_eos,
        extra_eos_ids=extra,
        chat_template=_value(meta, "tokenizer.chat_template"),
    )
