"""A checkpoint's tokenizer and chat template, without transformers.

- `tokenizer.json` through the `tokenizers` library.
- The chat template from `chat_template.jinja`, else `chat_template` in
  `tokenizer_config.json` (a string, or a list of {name, template}: the one named
  "default"), rendered with jinja2 the way transformers' `apply_chat_template` does (a
  sandboxed environment with trim_blocks, lstrip_blocks and loop controls; `tojson`,
  `raise_exception`, `strftime_now`; the special tokens of tokenizer_config.json as
  variables).
- Special tokens typed in the messages' text (a pasted `<|im_end|>`) encoded as ordinary
  text, as OpenAI takes them (`render_chat`); only the template's own are special.
- EOS ids from `generation_config.json` (`eos_token_id`: an int or a list), else
  config.json's; its `repetition_penalty` (1.0 when absent).
- A llama.cpp GGUF text file: all three from its metadata (runtime/checkpoints/gguf_text.py).
- Decoding as transformers decodes: `tokenizers`, then its space clean-up when
  tokenizer_config.json asks for it (not for BPE models unless forced).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from emitter.text_config import TokenIds
from runtime.checkpoints import gguf_text

SPECIAL_TOKEN_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")
# transformers' clean_up_tokenization, in its order
CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class TokenizerError(ValueError):
    """A checkpoint folder whose tokenizer or template cannot be used; one line naming the file."""


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return value


def check_utf8(text: str, what: str) -> None:
    """TokenizerError unless `text` is valid Unicode (a command-line argument that was not
    valid UTF-8 arrives with its bad bytes as lone surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise TokenizerError(f"{what}: not valid UTF-8 ({bad} at character {e.start}); expected UTF-8 text") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {content: ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: Path, tokenizer_config: dict) -> str:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise TokenizerError(f"{model_dir}: no chat template (expected chat_template.jinja, or 'chat_template' in "
                             "tokenizer_config.json)")
    return template


def compile_template(text: str):
    """The template compiled as transformers compiles chat templates."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None


# NFC (Qwen's normalizer) composes at most 3 characters into one (Hangul's L+V+T), 3x fewer bytes
NORMALIZED_SHRINK = 4


def _encode(tokenizer, text: str, add_special_tokens: bool):
    """`tokenizer.encode`, the same Encoding, through `encode_batch`, which lets go of the GIL
    while it works (a long prompt stalls no other thread: the server's event loop, the
    engine)."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


class ChatTokenizer:
    """tokenizer.json, the chat template and the EOS ids of a checkpoint folder."""

    def __init__(self, model_dir):
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        if gguf_text.is_gguf(self.model_dir):
            self._from_gguf()
            return
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "not a regular file" if path.exists() else "missing"
            raise TokenizerError(f"{path}: {what}; expected the checkpoint's tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises its own exception types
            raise TokenizerError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from None
        config_path = self.model_dir / "tokenizer_config.json"
        self.config = _read_json(config_path) if config_path.is_file() else {}
        self.template_text = load_chat_template(self.model_dir, self.config)
        self.template = compile_template(self.template_text)
        self.eos_ids = self._eos_ids()
        self.repetition_penalty = self._repetition_penalty()

    def _from_gguf(self) -> None:
        """A llama.cpp GGUF text file's tokenizer, template and EOS ids (`gguf_text.tokenizer`,
        `gguf_text.chat_settings`); its generation settings are llama.cpp's defaults."""
        try:
            self.tokenizer = gguf_text.tokenizer(self.model_dir)
            self.template_text, self.eos_ids, self.config = gguf_text.chat_settings(self.model_dir)
        except gguf_text.CheckpointError as e:
            raise TokenizerError(str(e)) from None
        self.template = compile_template(self.template_text)
        self.repetition_penalty = 1.0

    def _eos_ids(self) -> tuple[int, ...]:
        for name in ("generation_config.json", "config.json"):
            path = self.model_dir / name
            if not path.is_file():
                continue
            config = _read_json(path)
            value = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
            if value is None:
                continue
            ids = value if isinstance(value, list) else [value]
            if not ids or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
                raise TokenizerError(f"{path}: field 'eos_token_id' = {value!r}: expected a token id or a list of them")
            return tuple(ids)
        return ()

    def _repetition_penalty(self) -> float:
        """generation_config.json's repetition_penalty (transformers applies it in greedy
        decoding too), 1.0 when absent."""
        path = self.model_dir / "generation_config.json"
        value = _read_json(path).get("repetition_penalty", 1.0) if path.is_file() else 1.0
        if value is None:
            return 1.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise TokenizerError(f"{path}: field 'repetition_penalty' = {value!r}: expected a positive number")
        return float(value)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat as text; `extra` variables (`tools`, `chat_template_kwargs` such as
        `enable_thinking`) reach the template as transformers passes them."""
        import jinja2

        variables = {k: _token_text(self.config.get(k)) for k in SPECIAL_TOKEN_VARIABLES}
        try:
            return self.template.render(**{k: v for k, v in variables.items() if v is not None},
                                        **extra, messages=messages, add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None

    def encode(self, text: str, typed: dict[str, str] | None = None) -> np.ndarray:
        """Token ids of rendered text, as transformers' processor tokenizes a rendered chat:
        the tokenizer's own special tokens (its post-processor) are added unless the text
        already starts with the BOS token. `typed` (from `render_chat`): markers that stand
        for special-token text the messages hold, encoded as plain text (`_encode_marked`)."""
        check_utf8(text, "the prompt")
        bos = _token_text(self.config.get("bos_token"))
        add = not (bos and text.startswith(bos))
        if typed:
            return self._encode_marked(text, typed, add)
        return np.array(_encode(self.tokenizer, text, add).ids, np.int64)

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token's text spans (byte-level tokens: bytes; at least 1)."""
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=False)), default=1) or 1

    def least_tokens(self, value) -> int:
        """A floor on the tokens the strings in `value` (messages, tools: nested lists and
        dicts) take, from their lengths alone (each token spans at most `longest_token`
        characters of the normalized text, which is at least 1/`NORMALIZED_SHRINK` as long):
        a chat too long for a context is refused from it before it is rendered or tokenized."""
        if isinstance(value, str):
            return len(value) // (self.longest_token * NORMALIZED_SHRINK)
        if isinstance(value, dict):
            return sum(self.least_tokens(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(self.least_tokens(v) for v in value)
        return 0

    @functools.cached_property
    def _specials(self):
        """The special tokens' texts as one pattern, longest first (None: there are none)."""
        import re

        names = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        return re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True)))) if names else None

    @functools.cached_property
    def _plain(self):
        """A copy of the tokenizer that reads special-token text as ordinary text
        (transformers' `split_special_tokens=True`); a copy, so that no other encode,
        on any thread, sees the switch."""
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(self.tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **extra) -> tuple[str, dict[str, str]]:
        """`render`, with every special token that the messages' strings (and `extra`'s:
        `tools`) hold replaced by a marker first, so that the template's own tokens are
        the only special ones in the text: (text, {marker: the token's text}) for
        `encode`. A user pasting `<|im_end|>` writes text, as OpenAI takes it, not a turn's
        end (nor, for `<|image_pad|>`, an image's place)."""
        typed: dict[str, str] = {}
        if self._specials is not None:
            import uuid

            nonce = uuid.uuid4().hex

            def mark(found) -> str:
                marker = f"\ue000{nonce}.{len(typed)}\ue001"
                typed[marker] = found.group()
                return marker

            def walk(value):
                if isinstance(value, str):
                    return self._specials.sub(mark, value)
                if isinstance(value, dict):
                    return {k: walk(v) for k, v in value.items()}
                if isinstance(value, (list, tuple)):
                    return [walk(v) for v in value]
                return value

            messages, extra = walk(messages), {k: walk(v) for k, v in extra.items()}
        return self.render(messages, add_generation_prompt, **extra), typed

    def _encode_marked(self, text: str, typed: dict[str, str], add: bool) -> np.ndarray:
        """`text` split at its special tokens (the template's: the typed ones are markers),
        each token its id, each stretch between them with its markers put back and
        encoded by `_plain`: the ids `encode` gives when nothing was typed (the tokenizer
        splits at special tokens too), the typed tokens as ordinary text."""
        import re

        from tokenizers import Encoding

        markers = re.compile("|".join(map(re.escape, typed)))
        pieces, at = [], 0
        for found in [*self._specials.finditer(text), None]:
            end = found.start() if found else len(text)
            if end > at:
                stretch = markers.sub(lambda m: typed[m.group()], text[at:end])
                pieces.append(_encode(self._plain, stretch, False))
            if found:
                pieces.append(self.tokenizer.encode(found.group(), add_special_tokens=False))
                at = found.end()
        if not pieces:
            pieces = [self.tokenizer.encode("", add_special_tokens=False)]
        merged = Encoding.merge(pieces, growing_offsets=True)
        return np.array(self.tokenizer.post_process(merged, None, add).ids, np.int64)

    def prompt_ids(self, prompt: str, token_ids: TokenIds, image_tokens=(), videos=()) -> np.ndarray:
        """Token ids of one user turn as Qwen3VLProcessor makes them: the images (each
        `image_tokens[i]` pads), then the videos, then `prompt`, rendered with the chat
        template. `videos`: per video, (timestamps of its temporal groups, merged tokens
        per group); each video becomes its timestamped groups (`video_placeholder`).
        `token_ids`: the checkpoint's special tokens (config.json)."""
        return self.messages_ids(user_message(prompt, len(image_tokens), len(videos)), token_ids, image_tokens,
                                 videos)

    def messages_ids(self, messages: list[dict], token_ids: TokenIds, image_tokens=(), videos=(),
                     template_kwargs: dict | None = None) -> np.ndarray:
        """Token ids of a whole chat (`messages` as the template takes them, parts
        {"type": "image"}, {"type": "video"}, {"type": "text", "text": ...}), rendered with
        the generation prompt (and `template_kwargs`, see `render`); images and videos
        counted as in `prompt_ids`, each kind in its order of appearance. Special tokens
        typed in the messages' text are plain text (`render_chat`)."""
        text, typed = self.render_chat(messages, **(template_kwargs or {}))
        strings = self.video_strings(token_ids)
        text = expand_video_text(text, [video_placeholder(times, tokens, strings) for times, tokens in videos],
                                 strings.pad)
        return expand_pads(self.encode(text, typed), token_ids.image_token_id, list(image_tokens))

    def video_strings(self, token_ids: TokenIds) -> VideoStrings:
        """The text of the video pad, vision start and vision end tokens: the tokenizer's
        own tokens for the checkpoint's ids."""
        def text(name: str) -> str:
            token = self.tokenizer.id_to_token(getattr(token_ids, name))
            if token is None:
                raise TokenizerError(f"{self.model_dir / 'tokenizer.json'}: has no token {getattr(token_ids, name)} "
                                     f"(config.json's {name}); expected the checkpoint's tokenizer")
            return token

        return VideoStrings(text("vision_start_token_id"), text("video_token_id"), text("vision_end_token_id"))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`): a byte-level BPE
        token maps its characters back through GPT-2's byte table, so a token holding part
        of a character gives that part, not U+FFFD; an added (special) token its text."""
        token = self.tokenizer.id_to_token(int(token_id))
        if token is None:
            return b""
        table = _byte_decoder() if type(self.tokenizer.decoder).__name__ == "ByteLevel" else {}
        if int(token_id) in self.tokenizer.get_added_tokens_decoder() or any(c not in table for c in token):
            return token.encode("utf-8")
        return bytes(table[c] for c in token)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special (control) tokens: the ones `decode` leaves out of the text."""
        return frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """As transformers decodes: tokenizers' decode, then its space clean-up when
        tokenizer_config.json asks for it (which transformers skips for BPE models unless
        forced)."""
        text = self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        forced = self.config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        if self.config.get("clean_up_tokenization_spaces") and (type(self.tokenizer.model).__name__ != "BPE" or forced):
            for before, after in CLEAN_UP:
                text = text.replace(before, after)
        return text


def user_message(prompt: str, image_count: int, video_count: int = 0) -> list[dict]:
    """One user turn: the images in order, then the videos, then the text (as the
    processor's chat input)."""
    return [{"role": "user", "content": [{"type": "image"} for _ in range(image_count)] +
             [{"type": "video"} for _ in range(video_count)] + [{"type": "text", "text": prompt}]}]


@dataclass(frozen=True)
class VideoStrings:
    """The text of the tokens a video's placeholder is made of (`ChatTokenizer.video_strings`)."""
    start: str  # <|vision_start|> in Qwen's tokenizer
    pad: str  # <|video_pad|>
    end: str  # <|vision_end|>


def video_placeholder(timestamps, group_tokens: int, strings: VideoStrings) -> str:
    """What Qwen3VLProcessor writes in place of a video's pad token
    (`replace_video_token`): per temporal group, its time as `<{t:.1f} seconds>`, then
    the vision start token, the group's merged-token count of video pads, the vision end."""
    return "".join(f"<{t:.1f} seconds>{strings.start}{strings.pad * group_tokens}{strings.end}" for t in timestamps)


def expand_video_text(text: str, placeholders: list[str], pad: str) -> str:
    """Each video pad (`pad`, its text) of the rendered chat replaced by its video's
    placeholder, videos in order (the processor's text replacement, before tokenizing)."""
    pieces = text.split(pad)
    if len(pieces) - 1 != len(placeholders):
        raise TokenizerError(f"the rendered prompt holds {len(pieces) - 1} video pad token(s) but "
                             f"{len(placeholders)} video(s) were given; does the chat template write one per video?")
    out = [pieces[0]]
    for placeholder, piece in zip(placeholders, pieces[1:]):
        out += [placeholder, piece]
    return "".join(out)


def expand_pads(ids: np.ndarray, image_token_id: int, counts: list[int]) -> np.ndarray:
    """Each image's single pad token repeated to its merged-patch count, images in order."""
    ids = np.asarray(ids, np.int64)
    pads = np.flatnonzero(ids == image_token_id)
    if len(pads) != len(counts):
        raise TokenizerError(f"the rendered prompt holds {len(pads)} image pad token(s) (id {image_token_id}) but "
                             f"{len(counts)} image(s) were given; does the chat template write one per image?")
    pieces, prev = [], 0
    for i, count in zip(pads.tolist(), counts):
        pieces += [ids[prev:i], np.full(count, image_token_id, np.int64)]
        prev = i + 1
    pieces.append(ids[prev:])
    return np.concatenate(pieces)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel uses): each of the 256 bytes
    as one printable character, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(extra))]
    return {chr(c): b for c, b in zip(chars, printable + extra)}
