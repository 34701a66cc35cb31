"""Byte tokenizer and incremental decoding (UTF-8 characters never split across pieces)."""

import pytest

from runtime.tokenizer import ByteTokenizer, IncrementalDecoder


def test_round_trip_with_bos():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ☃")
    assert ids[0] == tok.bos_token_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == "héllo ☃"


def test_incremental_decoder_holds_back_partial_characters():
    text = "a☃b€😀"
    ids = list(text.encode())
    dec = IncrementalDecoder()
    pieces = [dec.push([i]) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    # the snowman's 3 bytes produce text only on the last one
    assert pieces[1] == "" and pieces[2] == "" and pieces[3] == "☃"


@pytest.mark.parametrize("pieces, stops, want, stopped", [
    (["Hello wor", "ld. Bye"], ["world"], "Hello ", True),
    (["ab", "c", "STO", "P!"], ["STOP"], "abc", True),
    (["no stop ", "here"], ["STOP"], "no stop here", False),
    (["x</", "s>y"], ["</s>", "y"], "x", True),
    (["plain"], [], "plain", False),
])
def test_stop_strings_cut_before_the_first_stop(pieces, stops, want, stopped):
    from runtime.tokenizer import StopStrings
    f = StopStrings(stops)
    out = "".join(f.push(p) for p in pieces) + f.flush()
    assert out == want and f.stopped == stopped
