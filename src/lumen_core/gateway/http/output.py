"""One choice's output as the client sees it: token ids in, text pieces and the finish out.

``Output`` is fed the request's tokens in position order (each exactly once: the coordinator
de-duplicates by position, across failovers too) and ends the choice at the tokenizer's EOS
token or at a stop sequence (``finish_reason`` "stop", the stop text itself left out, as
OpenAI does), or when the workers finish ``max_tokens`` ("length"). While stop sequences are
set, the last ``len(longest stop) - 1`` characters are held back, so no piece a client was sent
is ever part of a stop sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from lumen_core.gateway.http.text import IncrementalDetokenizer, Tokenizer


class Output:
    """``tokenizer`` None: token ids only (text stays empty; no EOS, no stop sequences)."""

    def __init__(self, tokenizer: Tokenizer | None, stops: Sequence[str] = ()) -> None:
        if stops and tokenizer is None:
            raise ValueError(
                "`stop` needs a tokenizer (start the gateway with --tokenizer), got stop sequences"
            )
        self._detokenizer = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
        self._eos_token_id = None if tokenizer is None else tokenizer.eos_token_id
        self._stops = tuple(stops)
        self._hold_chars = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._sent_chars = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def add(self, token_ids: Sequence[int]) -> tuple[list[int], str]:
        """Feed new tokens; returns (the token ids this piece accounts for, its text). Tokens
        after the choice ended (a stop inside this batch) are dropped."""
        taken: list[int] = []
        for token_id in token_ids:
            if self.finish_reason is not None:
                break
            taken.append(token_id)
            self.token_ids.append(token_id)
            if token_id == self._eos_token_id:
                self.finish_reason = "stop"
                break
            if self._detokenizer is not None:
                self._text += self._detokenizer.add(token_id)
                self._check_stops()
        return taken, self._take_text()

    def finish(self) -> str:
        """The workers finished ``max_tokens`` (unless a stop came first): the rest of the text."""
        if self.finish_reason is None:
            if self._detokenizer is not None:
                self._text += self._detokenizer.flush()
                self._check_stops()
            if self.finish_reason is None:
                self.finish_reason = "length"
        return self._take_text()

    def _check_stops(self) -> None:
        # Text before _sent_chars - hold was searched already; a stop can only end in new text.
        start = max(0, self._sent_chars - self._hold_chars)
        found = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self._text = self._text[: min(found)]
            self.finish_reason = "stop"

    def _take_text(self) -> str:
        end = len(self._text) if self.finish_reason is not None else len(self._text) - self._hold_chars
        if end <= self._sent_chars:
            return ""
        piece = self._text[self._sent_chars : end]
        self._sent_chars = end
        return piece

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._text[: self._sent_chars]
