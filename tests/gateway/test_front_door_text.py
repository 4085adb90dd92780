"""Text in the front door: incremental detokenization (whole characters, once) and the end of a
choice at EOS or a stop sequence, with no piece sent that belongs to a stop."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core.gateway.http.output import Output
from lumen_core.gateway.http.text import IncrementalDetokenizer, Tokenizer, write_byte_tokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def test_byte_tokenizer_round_trips_and_applies_its_chat_template(tokenizer: Tokenizer) -> None:
    text = "héllo €, 𝄞!"
    assert tokenizer.encode(text) == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert tokenizer.vocab_size == 256 and tokenizer.has_chat_template
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert bytes(ids) == b"<|user|>hi\n<|assistant|>"


def test_tokenizer_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`tokenizer` must be a directory written by save_pretrained, got"):
        Tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="`tokenizer` must hold a saved tokenizer, got"):
        Tokenizer(tmp_path)


def test_a_character_split_over_tokens_comes_out_whole_once(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(b) for b in "a€b".encode()]  # € is 3 bytes: e2 82 ac
    assert pieces == ["a", "", "", "€", "b"]
    assert detokenizer.flush() == ""


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40))
def test_incremental_text_equals_the_whole_decode(tokenizer: Tokenizer, data: bytes) -> None:
    # arbitrary bytes: invalid and truncated UTF-8 too, as the tiny model emits
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(b) for b in data]
    assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(list(data))


def test_output_without_a_tokenizer_is_token_ids_only() -> None:
    output = Output(None)
    assert output.add([5, 6]) == ([5, 6], "")
    assert output.finish() == "" and output.finish_reason == "length" and output.token_ids == [5, 6]
    with pytest.raises(ValueError, match="`stop` needs a tokenizer"):
        Output(None, ["x"])


def test_a_stop_sequence_ends_the_choice_and_is_never_sent(tokenizer: Tokenizer) -> None:
    output = Output(tokenizer, ["STOP"])
    sent = []
    for chunk in (b"ab", b"cS", b"TO", b"xS", b"TOP", b"more"):
        sent.append(output.add(list(chunk))[1])
        if output.finish_reason is not None:
            break
    assert "".join(sent) == "abcSTOx" == output.text
    assert output.finish_reason == "stop"
    assert bytes(output.token_ids) == b"abcSTOxSTOP"  # the tokens up to the stop count as output
    assert not any("STOP" in s for s in sent)
    assert output.add([1]) == ([], "")  # nothing after the end


def test_a_stop_sequence_completed_by_the_last_token_and_eos(tokenizer: Tokenizer, tmp_path: Path) -> None:
    output = Output(tokenizer, ["€"])
    taken, text = output.add(list("a€b".encode()))
    assert (bytes(taken), text, output.finish_reason) == ("a€".encode(), "a", "stop")
    output = Output(tokenizer, ["zz"])
    assert output.add(list(b"az")) == (list(b"az"), "a")  # "z" held back: it may start "zz"
    assert output.finish() == "z" and output.finish_reason == "length"
    with_eos = Tokenizer(write_byte_tokenizer(tmp_path))
    with_eos.eos_token_id = ord("!")  # the byte tokenizer has no EOS: give it one
    output = Output(with_eos)
    assert output.add(list(b"hi!there")) == (list(b"hi!"), "hi") and output.finish_reason == "stop"
