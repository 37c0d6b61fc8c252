"""serving.text: deltas released only when whole (no partial UTF-8 character), in the context of
the prompt, each exactly once; stop strings cut the text before them and nothing that may start
one is released early."""

from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.serving.text import IncrementalDetokenizer, StopMatcher, TextStream


class ByteTokenizer:
    """One token per byte: a multi-byte character spans several tokens."""

    vocab_size = 256

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode(self, text):
        return list(text.encode())


class PieceTokenizer:
    """SentencePiece-like: '_' marks a word start; decode drops the text's leading space."""

    def __init__(self, pieces):
        self.pieces = pieces
        self.vocab_size = len(pieces)

    def decode(self, ids):
        return "".join(self.pieces[int(i)] for i in ids).replace("_", " ").lstrip(" ")


def test_multibyte_characters_are_released_whole():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本語 🙂!"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.feed(t) for t in tok.encode(text)] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # A 4-byte character is held for three tokens, then released at once.
    emoji = text.index("🙂")
    assert "🙂" in deltas[len(text[:emoji].encode()) + 3]


def test_deltas_read_in_the_prompts_context():
    tok = PieceTokenizer(["_the", "_cat", "s", "_sat", "_on", "_mat"])
    prompt, new = [0, 1], [2, 3, 4, 0, 5]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.feed(t) for t in new] + [detok.flush()]
    # The new tokens' text as it continues the prompt: leading spaces kept.
    assert "".join(deltas) == tok.decode(prompt + new)[len(tok.decode(prompt)):]
    assert deltas[:2] == ["s", " sat"]


def test_skipped_ids_add_no_text():
    tok = PieceTokenizer(["_a", "</s>", "_b"])
    detok = IncrementalDetokenizer(tok, [0], skip_ids=[1])
    assert [detok.feed(2), detok.feed(1), detok.flush()] == [" b", "", ""]


def _reference(text, cuts, stops):
    """The released text an independent scan gives: the first chunk boundary at which the
    text so far contains a stop string, cut at the earliest such occurrence."""
    for end in [*cuts, len(text)]:
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], True
    return text, False


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_equals_a_scan_and_releases_only_what_stays(text, stops, cuts):
    cuts = sorted({c for c in cuts if c <= len(text)})
    want = _reference(text, cuts, stops)
    matcher = StopMatcher(stops)
    released, stopped = "", False
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        out, stopped = matcher.feed(text[a:b])
        released += out
        if stopped:
            break
        # Nothing released is taken back: no stop string completed later starts in it.
        assert want[0].startswith(released)
    if not stopped:
        released += matcher.flush()
    assert (released, stopped) == want


def test_text_stream_stops_inside_a_token_and_drops_the_stop_string():
    tok = PieceTokenizer(["_hello", "_wor", "ld", "_end", "!"])
    stream = TextStream(tok, [0], stops=["d!", "world?"])
    assert stream.feed(1) == (" ", False)  # "wor" may start "world?"
    assert stream.feed(2) == ("", False)  # nor may "world"
    assert stream.feed(4) == ("worl", True)  # "world!": "d!" matched, dropped
    assert stream.full_text == " worl"


def test_text_stream_flushes_held_text_at_the_end():
    tok = ByteTokenizer()
    stream = TextStream(tok, [], stops=["xyz"])
    got = [stream.feed(t)[0] for t in tok.encode("abxy")]
    assert "".join(got) == "ab"
    assert stream.finish() == "xy"
    assert stream.full_text == "abxy"
    assert not stream.stopped
