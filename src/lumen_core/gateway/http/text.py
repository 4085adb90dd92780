"""Text through a local ``transformers`` tokenizer: prompts to token ids, chat messages through
the chat template, and output token ids back to text incrementally.

``IncrementalDetokenizer`` follows vLLM's offsets scheme: it decodes a short window of tokens
and emits text only once the window no longer ends in an incomplete character (U+FFFD), so a
character split over several byte-level tokens comes out whole, once. The concatenation of its
pieces and ``flush`` equals ``tokenizer.decode`` of all the tokens (tests/gateway). It works
per client stream, over the token ids the coordinator keeps, so a failover (which re-sends no
token) cannot change the text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_INCOMPLETE = "\ufffd"


class Tokenizer:
    """A tokenizer saved with ``save_pretrained`` in ``directory`` (read offline; never the hub).
    Raises ValueError when ``directory`` is not a directory or holds no tokenizer."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        path = Path(directory)
        if not path.is_dir():
            raise ValueError(f"`tokenizer` must be a directory written by save_pretrained, got {str(path)!r}")
        from transformers import AutoTokenizer  # heavy: only a gateway that serves text loads it

        try:
            self._tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"`tokenizer` must hold a saved tokenizer, got {str(path)!r}: {exc}") from exc
        self.vocab_size: int = len(self._tokenizer)
        self.eos_token_id: int | None = self._tokenizer.eos_token_id
        self.has_chat_template = bool(getattr(self._tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text)["input_ids"])

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The chat template applied to ``messages`` with the assistant's turn opened, as ids
        (the template writes any special tokens itself, so none are added around it)."""
        text = self._tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))


class IncrementalDetokenizer:
    """Text of a growing list of output token ids, piece by piece (module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens whose text has been emitted

    def add(self, token_id: int) -> str:
        """The text the new token completes (often empty mid-character)."""
        self._token_ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._token_ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._token_ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith(_INCOMPLETE):
            self._prefix, self._read = self._read, len(self._token_ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """At the end of the output: the text still held back (an incomplete character)."""
        prefix_text = self._tokenizer.decode(self._token_ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._token_ids[self._prefix :])
        self._prefix = self._read = len(self._token_ids)
        return text[len(prefix_text) :]


def write_byte_tokenizer(directory: str | os.PathLike[str]) -> Path:
    """Save a byte-level tokenizer (token id = byte value, 256 tokens, GPT-2's byte alphabet)
    with a plain chat template in ``directory``: the tokenizer of the tiny reference model
    (vocabulary 256), whose outputs are arbitrary bytes, so its text exercises characters split
    over tokens. Returns the directory."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's printable stand-in for each byte (pre_tokenizers.ByteLevel's alphabet, in byte order).
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    stand_in = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    raw = RawTokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw)  # type: ignore[no-untyped-call]
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = Path(directory)
    tokenizer.save_pretrained(path)
    return path
