import random

import pytest

from river_gguf.text_stream import StopStringFilter, Utf8Decoder, truncate_at_stop


def _random_split(text, rng, max_piece=6):
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(0, max_piece)  # empty pieces included
        pieces.append(text[i:i + n])
        i += n
    return pieces


def _stream(stop, pieces):
    f = StopStringFilter(stop)
    out, stopped = [], False
    for p in pieces:
        emit, stopped = f.push(p)
        out.append(emit)
        if stopped:
            break
    out.append(f.flush())
    assert stopped <= f.stopped
    return "".join(out), f.stopped


def _reference(text, stops):
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return (text, False) if best is None else (text[:best], True)


CASES = [
    ("Hello world<|im_end|>trailing", ["<|im_end|>"]),
    ("no stop here at all <|im", ["<|im_end|>"]),
    ("aaab", ["aab"]),
    ("abababc", ["ababc"]),
    ("xx\n\nUser: hi", ["\n\nUser:", "User"]),
    ("xx\n\nUser", ["\n\nUser:", "User"]),
    ("xx\n\nUserX", ["\n\nUser:", "User"]),
    ("one two three", ["three", "two"]),
    ("prefix <|im_en <|im_end|>", ["<|im_end|>"]),
    ("ünïcødé ✓ stop✓here", ["✓here"]),
    ("", ["x"]),
    ("abc", []),
]


@pytest.mark.parametrize("text,stops", CASES)
def test_random_splits_match_reference(text, stops):
    rng = random.Random(hash(text) & 0xFFFF)
    expect = _reference(text, stops)
    assert truncate_at_stop(text, stops) == expect
    for _ in range(300):
        got = _stream(stops, _random_split(text, rng))
        assert got == expect, (text, stops)


@pytest.mark.parametrize("alphabet", ["ab<|>\n", "ab", "abc"])
def test_random_texts_and_stops_fuzz(alphabet):
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 3))]
        expect = _reference(text, stops)
        got = _stream(stops, _random_split(text, rng))
        assert got == expect, (text, stops)


def test_stop_spanning_chunk_boundary():
    f = StopStringFilter(["<|im_end|>"])
    assert f.push("Hi <|im") == ("Hi ", False)
    assert f.pending == "<|im"
    assert f.push("_en") == ("", False)
    assert f.push("d|> more") == ("", True)
    assert f.stopped and f.matched == "<|im_end|>"
    assert f.push("x") == ("", True)
    assert f.flush() == ""


def test_short_stop_inside_pending_long_stop():
    f = StopStringFilter(["\n\nUser:", "User"])
    assert f.push("xx\n\nUs") == ("xx", False)
    assert f.push("er") == ("", False)  # could still become "\n\nUser:"
    assert f.flush() == "\n\n"  # ends: "User" is the first complete stop
    assert f.stopped and f.matched == "User"


def test_false_partial_is_released():
    f = StopStringFilter(["STOP"])
    assert f.push("ST") == ("", False)
    assert f.push("ART") == ("START", False)
    assert f.push("S") == ("", False)
    assert f.flush() == "S"


def test_emits_immediately_when_no_possible_match():
    f = StopStringFilter(["</s>"])
    assert f.push("hello") == ("hello", False)
    assert f.push(" world") == (" world", False)


def test_no_stops_passthrough():
    f = StopStringFilter(None)
    assert f.push("abc") == ("abc", False)
    assert f.flush() == ""
    f = StopStringFilter("x")  # single string accepted
    assert f.push("abxc") == ("ab", True)


def test_invalid_stop_type():
    with pytest.raises(ValueError):
        StopStringFilter([1])


def test_utf8_split_multibyte():
    text = "héllo ✓ 😀 日本語"
    data = text.encode("utf-8")
    for split in range(len(data) + 1):
        d = Utf8Decoder()
        out = d.push(data[:split]) + d.push(data[split:]) + d.flush()
        assert out == text
    # byte by byte: never emits a replacement char for valid input
    d = Utf8Decoder()
    pieces = [d.push(bytes([b])) for b in data]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + d.flush() == text


def test_utf8_partial_char_held_back():
    d = Utf8Decoder()
    emoji = "😀".encode("utf-8")
    assert d.push(b"a" + emoji[:2]) == "a"
    assert d.push(emoji[2:]) == "😀"


def test_utf8_invalid_replaced():
    d = Utf8Decoder()
    out = d.push(b"a\xffb") + d.flush()
    assert out == "a\ufffdb"
    d = Utf8Decoder()
    # truncated multibyte char at the very end -> replacement on flush
    assert d.push("x✓".encode()[:-1]) == "x"
    assert d.flush() == "\ufffd"


def test_utf8_random_token_splits_with_stop_filter():
    rng = random.Random(5)
    text = "Ответ: 42 ✓ готово<|im_end|>лишнее"
    data = text.encode("utf-8")
    expect = text.split("<|im_end|>")[0]
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), 8))
        chunks = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
        dec, flt = Utf8Decoder(), StopStringFilter(["<|im_end|>"])
        out = []
        for c in chunks:
            emit, stopped = flt.push(dec.push(c))
            out.append(emit)
            if stopped:
                break
        else:
            out.append(flt.push(dec.flush())[0])
        out.append(flt.flush())
        assert "".join(out) == expect
