"""The tokenizer used everywhere in mlxfast: a thin, typed wrapper over a
Hugging Face ``tokenizers.Tokenizer`` plus the model facts around it (special
ids, chat template, which tokens end a turn)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as HFTokenizer

from . import reasoning, tool_calls
from .chat_template import render_chat_template
from .detokenizer import IncrementalDetokenizer
from .gguf_vocab import vocab_from_gguf_metadata

# Tokens that close a chat turn in common templates; they stop generation when
# they exist in the vocabulary and the template emits them.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
# Other special tokens named like a turn end (<|eot|>, <|end_of_turn|>,
# <|END_OF_TURN_TOKEN|>, ...) count too, again only when the template emits them.
_TURN_END_NAME = re.compile(
    r"<\|(?:end_?of_?turn(?:_token)?|eot(?:_id)?|eom(?:_id)?|im_end|end)\|>|<end_?of_?turn>",
    re.IGNORECASE)
# llama.cpp also ends generation on this one whenever it is a control token.
_END_OF_TEXT = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _decoder_kind(decoder: dict | None) -> str:
    """How token strings map to bytes: "bytelevel", "spm" or "plain"."""
    if not decoder:
        return "plain"
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {d.get("type") for d in parts if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "bytelevel"
    if kinds & {"ByteFallback", "Metaspace"} or any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁" for d in parts
    ):
        return "spm"
    return "plain"


def _token_str(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


_LONG_TEXT = 16 << 10  # characters: above this, encode without holding the GIL


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
    ):
        self._hf = hf
        # The HF call rebuilds the vocabulary map (~180 us at 262k tokens): once.
        self._vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        # Built once: the HF call copies every added token (~2 ms for Gemma's 6k).
        self._added = hf.get_added_tokens_decoder()
        self._special_ids = {i for i, t in self._added.items() if t.special}
        self._hidden_ids: frozenset[int] | None = None
        self._model_eos_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template  # sets eos_token_ids too
        self._kind = _decoder_kind(
            json.loads(hf.decoder.__getstate__()) if hf.decoder is not None else None
        )
        self._bytes_cache: dict[int, bytes] = {}
        self._anchor_id, self._anchor_text = self._find_anchor()

    # ---- construction -------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from the metadata dict ``mx.load(gguf, return_metadata=True)`` returns."""
        v = vocab_from_gguf_metadata(dict(meta))
        eos = [v.eos_token_id] if v.eos_token_id is not None else []
        eos += sorted(v.extra_eos_ids - set(eos))
        return cls(
            v.tokenizer,
            bos_token_id=v.bos_token_id,
            eos_token_ids=eos,
            add_bos=v.add_bos,
            chat_template=v.chat_template,
            unk_token_id=v.unk_token_id,
            pad_token_id=v.pad_token_id,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load an HF-style directory (tokenizer.json + tokenizer_config.json)."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001  (the tokenizers library raises bare Exceptions)
            raise ValueError(f"{tj} is not a tokenizer the tokenizers library reads: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_id(key: str) -> int | None:
            text = _token_str(config.get(key))
            return hf.token_to_id(text) if text is not None else None

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")

        eos = [i for i in [token_id("eos_token")] if i is not None]
        gen_eos = gen.get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(i, int) and i not in eos:
                eos.append(i)

        bos = token_id("bos_token")
        adds_bos = bos is not None and hf.encode("a").ids[:1] == [bos]
        add_bos = config.get("add_bos_token")
        if isinstance(add_bos, bool) and add_bos != adds_bos and bos is not None:
            _set_bos_post_processor(hf, hf.id_to_token(bos), bos, add_bos)
            adds_bos = add_bos
        return cls(
            hf,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos=adds_bos,
            chat_template=template if isinstance(template, str) else None,
            unk_token_id=token_id("unk_token"),
            pad_token_id=token_id("pad_token"),
        )

    # ---- encode / decode ----------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special tokens written in the text are matched
        atomically. ``add_special_tokens`` adds BOS/EOS only where the model does."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}")
        if len(text) > _LONG_TEXT:
            # HF's encode holds the GIL throughout (9 s for 10 MB, the event
            # loop and /health frozen); encode_batch releases it.
            return self._hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token_id = int(token_id)
        tok = self._hf.id_to_token(token_id) if token_id >= 0 else None
        if tok is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        return tok

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    @property
    def hidden_special_ids(self) -> frozenset[int]:
        """What skipping special tokens drops from output text: every special
        token but the tool-call and reasoning markup the output parsers read."""
        if self._hidden_ids is None:
            markup = (*tool_calls.markup(), reasoning.START, reasoning.END)
            kept = {self._hf.token_to_id(m) for m in markup}
            self._hidden_ids = frozenset(self._special_ids - kept)
        return self._hidden_ids

    def is_byte_fallback(self, token_id: int) -> bool:
        """True for SentencePiece ``<0xXX>`` byte tokens under a byte-fallback decoder."""
        return self._kind == "spm" and _byte_piece(self.id_to_token(token_id)) is not None

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes ``token_id`` stands for (special tokens: their text)."""
        token_id = int(token_id)
        b = self._bytes_cache.get(token_id)
        if b is None:
            b = self._compute_token_bytes(token_id)
            self._bytes_cache[token_id] = b
        return b

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- chat -----------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The chat template every chat path renders with: the model's own,
        or the one set here (``mlxfast serve --chat-template``), which
        replaces it. Setting it also sets ``eos_token_ids``: the model's end
        tokens plus the turn-end tokens this template emits."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template or None
        self.eos_token_ids: set[int] = set(self._model_eos_ids) | self._turn_end_ids()

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text (not tokenized). Positional
        ``messages``: a template variable of any other name is a keyword."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(template_kwargs)
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **variables,
        )

    # ---- export ---------------------------------------------------------

    def hf_json(self) -> str:
        """The tokenizer.json text (e.g. for llguidance)."""
        return self._hf.to_str()

    def save_hf(self, out_dir: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json loadable by ``from_dir``,
        mlx-lm and transformers' ``AutoTokenizer``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(out / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        for key, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                       ("unk_token", self.unk_token_id), ("pad_token", self.pad_token_id)):
            if i is not None:
                config[key] = self.id_to_token(i)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(
            json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8"
        )

    # ---- internals --------------------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        n = self.vocab_size
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (size {n})")
        return out

    def _turn_end_ids(self) -> set[int]:
        template = self.chat_template or ""
        ids = set()
        for text in _TURN_END_TOKENS:
            i = self._hf.token_to_id(text)
            if i is not None and text in template:
                ids.add(i)
        for i in self._special_ids:
            text = self._hf.id_to_token(i)
            if text and text in template and _TURN_END_NAME.fullmatch(text):
                ids.add(i)
        eot = self._added
        i = self._hf.token_to_id(_END_OF_TEXT)
        if i is not None and i in eot and eot[i].special:
            ids.add(i)
        return ids

    def _compute_token_bytes(self, token_id: int) -> bytes:
        tok = self.id_to_token(token_id)
        if token_id in self._added:
            return tok.encode("utf-8")
        if self._kind == "bytelevel":
            try:
                return bytes(_BYTE_DECODER[c] for c in tok)
            except KeyError:
                return tok.encode("utf-8")
        if self._kind == "spm":
            b = _byte_piece(tok)
            return bytes([b]) if b is not None else tok.replace("▁", " ").encode("utf-8")
        return tok.encode("utf-8")

    def _find_anchor(self) -> tuple[int | None, str]:
        """A plain token that decodes to itself, used as left context when
        decoding a window (see detokenizer)."""
        for ch in "aeoinstrAEO":
            i = self._hf.token_to_id(ch)
            if i is not None and self._hf.decode([i], skip_special_tokens=False) == ch:
                return i, ch
        return None, ""


def _byte_piece(token: str) -> int | None:
    """The byte a SentencePiece ``<0xXX>`` piece stands for, else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _set_bos_post_processor(hf: HFTokenizer, bos: str, bos_id: int, add: bool) -> None:
    from tokenizers import processors

    if add:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    else:
        hf.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
