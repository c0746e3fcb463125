"""Incremental detokenization: a sequence's text grows by the new characters of each token,
never by decoding its whole text again, and stop strings are looked for in the new part only.

`make_detokenizer` picks one of two ways for a tokenizer:
- a fast tokenizer (a `tokenizers.Tokenizer` behind it: transformers' `PreTrainedTokenizerFast`)
  when the installed `tokenizers` has `DecodeStream`: the library's own stream;
- any other tokenizer with `decode(ids, skip_special_tokens=...)`: prefix and read offsets
  (vLLM's and TGI's algorithm). It decodes the few tokens since the text last grew, without
  and with the new one; the difference is the new text, held back while it ends in an
  incomplete character (U+FFFD: a multi-byte character split across tokens).
```
ids      [ ... printed ... | prefix ..... read | new ]
decode(ids[prefix:read]) = "abc"     decode(ids[prefix:]) = "abcde"   ->  new text "de"
```
Both decode the generated tokens alone (no prompt context), so the text equals
`tokenizer.decode(output_ids, skip_special_tokens=...)` as `LLM` gave it before.

Plain Python (the scheduler calls these): `tokenizers` is imported only for a fast tokenizer.
A tokenizer that raises stops the sequence's text (`text` None, logged once); its tokens go on.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

INCOMPLETE = "\ufffd"  # what a decode gives for bytes that are not a whole UTF-8 character yet


class IncrementalDetokenizer:
    """The text of one sequence's generated tokens, fed one token at a time (`add`)."""

    def __init__(self, skip_special_tokens: bool) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.text: str | None = ""  # None once the tokenizer failed

    def add(self, token_id: int) -> str:
        """Feed the next generated token; returns the text it adds ("" while a character is
        incomplete, or when it decodes to nothing)."""
        if self.text is None:
            return ""
        try:
            piece = self._step(token_id) or ""
        except Exception:  # noqa: BLE001 - a tokenizer bug must not lose the tokens
            logger.warning("vattn: the tokenizer could not decode token %d; this sequence has no text", token_id,
                           exc_info=True)
            self.text = None
            return ""
        self.text += piece
        return piece

    def find_stop(self, stops: tuple[str, ...], num_new_chars: int, include: bool) -> str | None:
        """The stop string that the last `num_new_chars` characters completed, if any (the one
        that starts first); the text is then cut before it (after it with `include`)."""
        text = self.text
        if text is None or not num_new_chars:
            return None
        found: tuple[int, str] | None = None
        for stop in stops:
            # only where the new characters can be part of it: a match found earlier stopped already
            at = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        at, stop = found
        self.text = text[:at + len(stop) if include else at]
        return stop

    def fresh(self) -> IncrementalDetokenizer:
        """A new detokenizer of the same tokenizer (for a sibling sample)."""
        raise NotImplementedError

    def _step(self, token_id: int) -> str | None:
        raise NotImplementedError


class StreamDetokenizer(IncrementalDetokenizer):
    """A fast tokenizer's `tokenizers.decoders.DecodeStream`."""

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(skip_special_tokens)
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def fresh(self) -> StreamDetokenizer:
        return StreamDetokenizer(self.backend, self.skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        return self.stream.step(self.backend, token_id)


class OffsetDetokenizer(IncrementalDetokenizer):
    """Prefix and read offsets over `tokenizer.decode` (see the module docstring)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        super().__init__(skip_special_tokens)
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the tokens decoded again for context

    def fresh(self) -> OffsetDetokenizer:
        return OffsetDetokenizer(self.tokenizer, self.skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=skip) \
            if self.read > self.prefix else ""
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith(INCOMPLETE):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return None


def make_detokenizer(tokenizer: Any, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    """An incremental detokenizer for `tokenizer` (see the module docstring for which kind)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _has_decode_stream(backend):
        return StreamDetokenizer(backend, skip_special_tokens)
    return OffsetDetokenizer(tokenizer, skip_special_tokens)


def _has_decode_stream(backend: Any) -> bool:
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 - tokenizers >= 0.21
    except ImportError:
        return False
    return isinstance(backend, Tokenizer)
